"""Quantization methods beyond the KIVI reference: KVQuant, FP8, calibrated Hadamard subsets,
per-layer bit search."""

from __future__ import annotations

import os


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
    elif isinstance(calibration, (str, os.PathLike)):
        values = load(calibration)
    else:
        raise ValueError(f"{what}: calibration= must be 'auto', a list of per-layer values or "
                         f"the path of a file; got {type(calibration).__name__}")
    if len(values) != n_layers:
        raise ValueError(f"{what} has {len(values)} layers, the model {n_layers}")
    return values


def calibration_ids(model, text: str, tokens: int, what: str, log=None):
    """``[1, tokens]`` ids of the named ``text`` for a ``calibration='auto'`` run, tokenized with
    the tokenizer :func:`kvbits.data.load_model` attaches to the model (``what``: what the caller
    calibrates, for the error that asks for it instead)."""
    from ..data import load_text, tokenize_text

    tok = getattr(model, "_kvbits_tokenizer", None)
    if tok is None:
        raise ValueError("calibration='auto' needs the model's tokenizer: set "
                         "model._kvbits_tokenizer (kvbits.data.load_model does) or pass the "
                         f"{what}")
    return tokenize_text(tok, load_text(text, log=log), tokens)


def calibration_windows(n_tokens: int, window: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each calibration window: every token is used, the last window may
    be shorter (one of fewer than 2 tokens is dropped: it has no next token to score).

    >>> calibration_windows(1100, 512)
    [(0, 512), (512, 1024), (1024, 1100)]
    """
    if window < 2:  # every window was dropped: "needs at least 2 tokens of text, got 256"
        raise ValueError(f"calibration window must be at least 2 tokens (its first token is "
                         f"only context), got window={window}")
    out = [(a, min(a + window, n_tokens)) for a in range(0, n_tokens, window)]
    out = [(a, b) for a, b in out if b - a >= 2]
    if not out:
        raise ValueError(f"calibration needs at least 2 tokens of text, got {n_tokens}")
    return out
