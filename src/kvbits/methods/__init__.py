"""Quantization methods beyond the KIVI reference: KVQuant, FP8, calibrated Hadamard subsets,
per-layer bit search."""

from __future__ import annotations

import os

from ..checks import is_count

# Tokens per calibration forward (and backward) pass: every method's default, and the window of
# the automatic calibrations that ppl, generate and needle make (whose cache key holds none).
CALIBRATION_WINDOW = 512


def kv_geometry(model_or_config) -> tuple:
    """``(layers, kv_heads, head_dim)`` of a model or config (its decoder's text config), each
    None where the config does not say: what a calibration file's tables are checked against
    before any layer is built."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    attn = getattr(config, "num_attention_heads", None)
    heads = getattr(config, "num_key_value_heads", None) or attn
    head_dim = getattr(config, "head_dim", None)  # as kvquant.model_shape_name takes it
    if head_dim is None and is_count(getattr(config, "hidden_size", None)) and is_count(attn):
        head_dim = config.hidden_size // attn
    return getattr(config, "num_hidden_layers", None), heads, head_dim


def model_dtype(model):
    """The float dtype ``model`` computes in (``model.dtype`` of a transformers model, else its
    first floating parameter's; None without one)."""
    dtype = getattr(model, "dtype", None)
    if dtype is not None:
        return dtype
    params = getattr(model, "parameters", None)
    return next((p.dtype for p in (params() if params else ()) if p.is_floating_point()), None)


def dtype_name(dtype) -> str:
    """``torch.float16`` -> ``"float16"``: how files, logs and cache keys name a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_key(model, dtype=None) -> dict:
    """The model's dtype (or ``dtype``) as a cache key of automatic calibrations: ``{}`` for
    float32 (so the keys made before it was keyed, all float32, still match), else
    ``{"dtype": "float16"}`` (or bfloat16, ...): values measured on a half-precision model, its
    activations and gradients rounded there, are not reused for a float32 run of the same
    weights."""
    import torch

    dtype = model_dtype(model) if dtype is None else dtype
    if dtype is None or dtype == torch.float32:
        return {}
    return {"dtype": dtype_name(dtype)}


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


def made_for(model, spec, fields: tuple[str, ...]) -> dict:
    """What a calibration file (fp8 scales, Hadamard channels) records of the model and spec it
    was measured on: the model's shape, a sample of its weights and the spec ``fields`` the
    values depend on; :func:`check_made_for` compares them when the file is loaded (the layer
    count alone let another model's file of the same depth through)."""
    from .kvquant import model_shape_name, weight_probe

    return {"shape": model_shape_name(model.config), "probe": weight_probe(model),
            "spec": {f: getattr(spec, f) for f in fields}}


def check_made_for(record, model_or_config, spec, what: str, path) -> None:
    """Refuse (ValueError) a calibration file made for another model, another checkpoint of
    its shape (where a model is given) or another spec; files without the record (written
    before session 53, or from lists) are only counted by :func:`per_layer_calibration`."""
    from .kvquant import model_shape_name, probes_match, weight_probe

    if not isinstance(record, dict):
        return
    model = model_or_config if hasattr(model_or_config, "named_parameters") else None
    shape = model_shape_name(model.config if model is not None else model_or_config)
    if record.get("shape") not in (None, shape):
        raise ValueError(f"{what} {str(path)!r} was made for a {record['shape']} model, not "
                         f"this {shape} one: calibrate it for this model")
    probe = weight_probe(model) if model is not None and record.get("probe") else None
    if probe is not None and not probes_match(probe, record["probe"]):
        raise ValueError(f"{what} {str(path)!r} was made for another model of this shape (its "
                         "first key projection's weights differ): calibrate it for this model")
    for field, value in (record.get("spec") or {}).items():
        if getattr(spec, field, value) != value:
            raise ValueError(f"{what} {str(path)!r} was made for {field}={value!r}, this spec "
                             f"has {field}={getattr(spec, field)!r}: calibrate it for this spec")


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


def starts_with_bos(model, input_ids) -> bool:
    """Whether the text ``input_ids`` starts with the model's BOS (``config.bos_token_id``; its
    tokenizer puts one first: Gemma): perplexity then puts it before every later window too
    (:func:`kvbits.eval.perplexity.perplexity`)."""
    bos = getattr(model.config.get_text_config(decoder=True), "bos_token_id", None)
    ids = input_ids.reshape(-1)
    return isinstance(bos, int) and ids.numel() > 0 and int(ids[0]) == bos


def calibration_chunks(input_ids, window: int) -> list:
    """``input_ids [1, T]`` (or ``[T]``) as the ``[1, n]`` windows every calibration runs
    (KVQuant codebooks, Hadamard channels, FP8 scales, ``kvbits tune``), each from position 0
    without a cache: :func:`calibration_windows`.

    A text that starts with a BOS (Gemma) has it in the first window only. Every window
    starting with it was measured in session 56 (``benchmarks/results/calibration_bos.md``):
    Gemma3-270M's perplexity and retrieval were no better (kvquant-3 on news +0.28% over FP16
    with this cut, +0.36% and +0.56% with the two variants; kvquant-3-offline +0.36% against
    +1.72% and +2.68%), so the cut stays as it was.
    """
    ids = input_ids.reshape(-1)
    return [ids[a:b][None] for a, b in calibration_windows(ids.numel(), window)]


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
