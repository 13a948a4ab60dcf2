"""Quantization methods beyond the KIVI reference: KVQuant, FP8, calibrated Hadamard subsets,
per-layer bit search."""

from __future__ import annotations


def per_layer_calibration(calibration, model_or_config, auto, load, what: str,
                          n_layers: int) -> list:
    """One calibrated value per layer, from ``calibration`` given as ``"auto"`` (computed from
    the model by ``auto(model)``), a list, or a file (read by ``load(path)``); refuses a count
    that is not the model's layer count (``what`` names it in the error)."""
    if isinstance(calibration, str) and calibration == "auto":
        if not hasattr(model_or_config, "named_parameters"):
            raise ValueError("calibration='auto' needs the model, not its config")
        values = auto(model_or_config)
    elif isinstance(calibration, (list, tuple)):
        values = list(calibration)
    else:
        values = load(calibration)
    if len(values) != n_layers:
        raise ValueError(f"{what} has {len(values)} layers, the model {n_layers}")
    return values
