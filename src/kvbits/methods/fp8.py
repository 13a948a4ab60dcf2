"""FP8 (e4m3) KV cache: per-head float32 scales, dynamic or calibrated.

* dynamic (``QuantSpec.fp8_scale="dynamic"``): the store sets the scale of each sequence and KV
  head from the amax of the first tokens it quantizes (the prompt), see
  :meth:`kvbits.cache.store.LayerStore.flush`.
* calibrated (``"calibrated"``): one scale per layer and KV head (or per layer,
  ``fp8_granularity="tensor"``) from the amax of K and V over calibration text, fixed for the
  model. :func:`calibrate_fp8` measures it; :func:`save_fp8_scales` / :func:`load_fp8_scales`
  keep it in a safetensors file.

A scale is ``amax * FP8_HEADROOM / 448`` (:func:`kvbits.reference.quant.fp8_scale_from_amax`);
elements beyond ``448 * scale`` saturate. Edge cases of the dynamic scales:

* the amax leaves NaN and +-inf elements out (:func:`kvbits.reference.quant.fp8_amax`): one bad
  element no longer sets its head's scale (with ``fp8_granularity="tensor"``, every head's of
  its sequence) for the whole generation; it stays NaN, or saturates at ``+-448 * scale``;
* the amax saturates at 65504, so a BF16/FP32 head beyond it saturates at 131008;
* a head whose prompt is all 0 gets scale 1: its later elements below ``2**-9`` quantize to 0;
* later tokens beyond twice the prompt's amax (calibrated scales: the calibration text's)
  saturate. Only each layer's first flush is checked: the store warns where its elements pass
  ``448 * scale`` (:meth:`kvbits.cache.store.LayerStore._check_range`); a decode step is not
  read back.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ..reference import hadamard as ref_hadamard
from ..reference import quant as ref_quant
from ..spec import CALIBRATION_USES, QuantSpec
from . import (
    CALIBRATION_WINDOW,
    calibration_chunks,
    calibration_ids,
    check_made_for,
    kv_geometry,
    made_for,
    model_dtype,
    per_layer_calibration,
)

__all__ = ["auto_fp8_scales", "calibrate_fp8", "layer_scales", "load_fp8_scales",
           "save_fp8_scales"]

# model -> {(dtype, granularity, hadamard, text, tokens): scales}; weakly keyed, not by
# id(model): a model built where a freed one was took the freed one's scales
_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def calibrate_fp8(model, input_ids: torch.Tensor, spec: QuantSpec,
                  window: int = CALIBRATION_WINDOW) -> list:
    """Per layer ``(k_scale, v_scale)``, float32 ``[kv_heads]``: the amax of the model's K and V
    on ``input_ids [1, T]`` (in windows of ``window`` tokens), per head or per layer."""
    from transformers import DynamicCache

    from .model_calls import cache_kwargs

    amax, bad = None, set()
    for chunk in calibration_chunks(input_ids, window):
        cache = DynamicCache()  # full layers: a sliding one would keep only its window
        model(chunk.to(model.device), use_cache=True,
              **cache_kwargs(model, cache))
        cur = []
        for i, layer in enumerate(cache.layers):
            k, v = layer.keys, layer.values
            if spec.hadamard:
                k = ref_hadamard.rotate(k.float(), ref_hadamard.hadamard_matrix(k.shape[-1],
                                                                                k.device))
            if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
                bad.add(i)
            # per head over the finite elements, as the dynamic scales take it
            cur.append(tuple(ref_quant.fp8_amax(x).amax(dim=(0, 2, 3)) for x in (k, v)))
        amax = cur if amax is None else [(torch.maximum(a, c), torch.maximum(b, d))
                                         for (a, b), (c, d) in zip(amax, cur)]
    if bad:  # (a NaN amax had made the head's scale 1 without a word, an inf one 292)
        warnings.warn(f"calibrate_fp8: the model's K/V on the calibration text hold NaN or inf "
                      f"in layer(s) {sorted(bad)}; the scales there come from the finite "
                      "elements", stacklevel=2)
    out = []
    for ka, va in amax:
        if spec.fp8_granularity == "tensor":
            ka, va = ka.max().expand_as(ka), va.max().expand_as(va)
        out.append((ref_quant.fp8_scale_from_amax(ka).cpu().contiguous(),
                    ref_quant.fp8_scale_from_amax(va).cpu().contiguous()))
    return out


FP8_FIELDS = ("fp8_granularity", "hadamard")  # the spec fields calibrated scales depend on


def save_fp8_scales(path, scales: list, model=None, spec: QuantSpec | None = None,
                    **metadata) -> None:
    """Write per-layer ``(k_scale, v_scale)`` to ``path`` (safetensors; ``metadata`` kept as
    strings). With the ``model`` and ``spec`` they were calibrated for, the file records both
    and :func:`load_fp8_scales` refuses it for another model or spec."""
    import json

    from safetensors.torch import save_file

    tensors = {}
    for i, (k, v) in enumerate(scales):
        tensors[f"layer.{i}.k_scale"] = k.float().contiguous()
        tensors[f"layer.{i}.v_scale"] = v.float().contiguous()
    meta = {k: str(v) for k, v in metadata.items()}
    if model is not None and spec is not None:
        meta["made_for"] = json.dumps(made_for(model, spec, FP8_FIELDS))
    save_file(tensors, str(path), metadata=meta)


def load_fp8_scales(path, model_or_config=None, spec: QuantSpec | None = None) -> list:
    """The scales of a :func:`save_fp8_scales` file; given the model (or config) and spec that
    will use them, a file that records another is refused."""
    import json

    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"cannot read fp8 scales from {str(path)!r}: {exc}") from None
    if model_or_config is not None and spec is not None and "made_for" in meta:
        try:
            record = json.loads(meta["made_for"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"{str(path)!r}: its 'made_for' metadata is not JSON ({exc})") \
                from None
        check_made_for(record, model_or_config, spec, "fp8 scale file", path)
    n = len([k for k in t if k.endswith(".k_scale")])
    if not n:  # (a kvquant calibration said "fp8 calibration has 0 layers, the model 2")
        raise ValueError(f"{str(path)!r} is not an fp8 scale file (no layer.{{i}}.k_scale "
                         "tensors; kvbits.methods.fp8.save_fp8_scales writes one)")
    try:
        return [(t[f"layer.{i}.k_scale"], t[f"layer.{i}.v_scale"]) for i in range(n)]
    except KeyError as exc:
        raise ValueError(f"{str(path)!r} is not an fp8 scale file (missing {exc})") from None


def auto_fp8_scales(model, spec: QuantSpec, text: str = "sotu-pre-2000",
                    tokens: int = 2048, log=None) -> list:
    """Scales calibrated on ``text`` (SOTU 1900-1999 by default, disjoint from the evaluation
    text), computed once per model (and dtype: a model converted in place is measured again)
    and kept in memory."""
    key = (model_dtype(model), spec.fp8_granularity, spec.hadamard, text, tokens)
    entries = _AUTO.setdefault(model, {})
    if key not in entries:
        ids = calibration_ids(model, text, tokens, "scales", log)
        entries[key] = calibrate_fp8(model, ids, spec)
    return entries[key]


def layer_scales(model_or_config, spec: QuantSpec, calibration, n_layers: int) -> list:
    """Per layer: the ``(k_scale, v_scale)`` the stores of an fp8 cache start from (None for
    dynamic scales)."""
    if spec.fp8_scale == "dynamic":
        if calibration is not None:
            raise ValueError(f"{CALIBRATION_USES}; this spec has dynamic fp8 scales")
        return [None] * n_layers
    if calibration is None:
        preset = "fp8-tensor" if spec.fp8_granularity == "tensor" else "fp8"
        raise ValueError(f"fp8_scale='calibrated' needs scales: KVBitsCache(model, '{preset}', "
                         "calibration='auto') (amax on SOTU 1900-1999), a file from "
                         "kvbits.methods.fp8.save_fp8_scales, or use preset 'fp8-dynamic' "
                         "(dynamic per-head scales)")
    scales = per_layer_calibration(calibration, model_or_config,
                                   lambda model: auto_fp8_scales(model, spec),
                                   lambda path: load_fp8_scales(path, model_or_config, spec),
                                   "fp8 calibration", n_layers)
    heads = kv_geometry(model_or_config)[1]
    for i, pair in enumerate(scales):  # checked here, before any layer is built or attended
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"fp8 calibration: layer {i} must be a (k_scale, v_scale) pair of "
                             f"float [kv_heads] tensors, got {type(pair).__name__}")
        for name, sc in zip(("k_scale", "v_scale"), pair):
            if not (isinstance(sc, torch.Tensor) and sc.dim() == 1
                    and sc.dtype.is_floating_point):
                raise ValueError(f"fp8 calibration: layer {i} {name} must be a float [kv_heads] "
                                 f"tensor, got {getattr(sc, 'shape', type(sc).__name__)}")
            if isinstance(heads, int) and sc.numel() != heads:  # (refused only at the first
                # update before: after the cache was built and the prompt's forward begun)
                raise ValueError(f"fp8 calibration: layer {i} {name} holds {sc.numel()} scales, "
                                 f"the model has {heads} KV heads (one scale per KV head)")
            if not (torch.isfinite(sc).all() and (sc > 0).all()):
                raise ValueError(f"fp8 calibration: layer {i} {name} must be finite and > 0 "
                                 f"(dequant multipliers), got {sc.tolist()}")
            # a per-head calibration (made for 'fp8') would be used per head as it is
            if spec.fp8_granularity == "tensor" and not (sc == sc[:1]).all():
                raise ValueError(f"fp8 calibration: layer {i} {name} holds per-head scales "
                                 f"{sc.tolist()}, but fp8_granularity='tensor' takes one per "
                                 "layer (the same value for every KV head): calibrate for this "
                                 "spec (calibration='auto') or use fp8_granularity='head'")
    return scales
