"""Per-layer mixed precision: sensitivity of each layer's keys and values, then bit allocation.

``kvbits tune --model smollm2 --avg-bits 3`` runs :func:`tune`:

1. **Sensitivity.** On calibration text (SOTU 1900-1999 by default, disjoint from the 2010-2016
   evaluation text) the model runs once at full precision, then once per (layer, K or V, bits)
   with only that tensor of that layer quantized by the base method (through a
   :class:`~kvbits.cache.store.LayerStore` with no residual, so exactly the cache's quantizer).
   The sensitivity is the mean KL divergence of the next-token distributions from the
   full-precision ones. It is measured at 2 and 4 bits; 3 bits is estimated as their geometric
   mean (quantization noise falls by a constant factor per bit) and 8 bits by extrapolating the
   same factor.
2. **Allocation.** Assuming the sensitivities add up, the bits of every (layer, K/V) are chosen
   among 2, 3, 4, 8 to minimise the total under ``avg_bits * 2 * layers`` bits, exactly (a
   knapsack dynamic program over integer bits).

A base with ``skip_layers`` (a spec file) keeps those layers in FP16: they are not measured, and
they count 16 bits per element in the average, as in :meth:`~kvbits.spec.QuantSpec.average_bits`
(the budget is the memory's), so the other layers share what is left of it.

The result is a :class:`~kvbits.spec.QuantSpec` with one ``layer_bits`` entry per tuned layer, saved as
a spec file that ``KVBitsCache(model, path)`` and ``kvbits ppl --presets path`` read.

A base with calibrated Hadamard subsets (``kivi-3-hadc``) is measured with its rotation: the
channel subsets (chosen once, independent of the bits) rotate the keys of every trial, and the
tuned spec keeps ``hadamard_calibrated`` (load it with ``calibration='auto'`` or the same file).
A pre-RoPE base (``kivi-3:P=1``) is measured as the cache stores it: keys turned back to before
RoPE with the model's frequencies, quantized, and turned again for attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..checks import is_count
from ..spec import QuantSpec
from . import CALIBRATION_WINDOW, calibration_chunks
from .model_calls import full_attention

__all__ = ["TuneResult", "allocate", "check_tune_args", "layer_sensitivity", "tune"]

CHOICES = (2, 3, 4, 8)
_ATTN = "kvbits_tune"
_STATE: dict = {"layer": None, "kind": None, "spec": None, "channels": None, "inv_freqs": None}


@dataclass
class TuneResult:
    spec: QuantSpec
    sensitivity: dict  # {"k": [[s2, s3, s4, s8] per layer (None: kept in FP16)], "v": ...}
    avg_bits: float
    predicted_kl: float
    info: dict = field(default_factory=dict)


def _fake_quantize(key: torch.Tensor, value: torch.Tensor, spec: QuantSpec, kind: str,
                   hadamard_channels=None, inv_freq=None):
    """K or V of one layer through the cache quantizer (no residual); the other one untouched.
    ``inv_freq``: the layer's RoPE frequencies, for a ``pre_rope`` spec (keys at positions
    0, 1, ...: each window runs from position 0; None: a layer without RoPE stores its keys as
    they come, as in KVBitsCache)."""
    from ..cache.store import LayerStore
    from ..reference.attention import dequantize_layer

    B, H, _, D = key.shape
    plain = spec.replace(residual_length=0, sink_tokens=0, layer_bits=(), skip_layers=(),
                         pre_rope=spec.pre_rope and inv_freq is not None)
    store = LayerStore(plain, B, H, D, torch.float32, key.device,
                       hadamard_channels=hadamard_channels, inv_freq=inv_freq)
    store.append(key.float(), value.float())
    k, v = dequantize_layer(store.view())
    if kind == "k":
        return store.model_keys(k).to(key.dtype), value
    return key, v.to(value.dtype)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA (or with Gemma2's logit cap, which SDPA refuses, the capped eager form:
    :func:`kvbits.methods.model_calls.full_attention`), one layer's K or V quantized in a trial."""
    layer = _STATE["layer"]
    if layer is not None and getattr(module, "layer_idx", None) == layer:
        channels = _STATE["channels"][layer] if _STATE["channels"] else None
        inv_freq = _STATE["inv_freqs"][layer] if _STATE["inv_freqs"] else None
        key, value = _fake_quantize(key, value, _STATE["spec"], _STATE["kind"], channels,
                                    inv_freq)
    return full_attention(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_ATTN, _attention)
    AttentionMaskInterface.register(_ATTN, sdpa_mask)


@torch.no_grad()
def layer_sensitivity(model, input_ids: torch.Tensor, base: QuantSpec, bits=(2, 4),
                      window: int = CALIBRATION_WINDOW, log=None, calibration="auto") -> dict:
    """``{"k": tensor [layers, len(bits)], "v": ...}``: mean KL (nats per token) of the model
    with one layer's K (or V) quantized at each of ``bits`` by ``base``'s method, vs FP (0 for
    the layers ``base`` keeps in FP16, which are not run).
    ``calibration``: the Hadamard channel subsets of a ``hadamard_calibrated`` base (as for
    ``KVBitsCache``: ``"auto"``, the per-layer lists or a file); ignored otherwise."""
    from ..reference.rope import model_inv_freqs
    from .hadamard import layer_channels

    _check_windows(input_ids, window, base)
    _register()
    config = model.config.get_text_config(decoder=True)
    n_layers = config.num_hidden_layers
    base.check_layers(n_layers)
    skip = {i % n_layers for i in base.skip_layers}  # FP16 layers: nothing to measure
    channels = (layer_channels(model, base, calibration, n_layers)
                if base.hadamard_calibrated else None)
    # a pre-RoPE base: the trials' stores turn the keys back as the cache's do
    inv_freqs = model_inv_freqs(model) if base.pre_rope else None
    before = model.config._attn_implementation
    model.set_attn_implementation(_ATTN)
    windows = [w.to(model.device) for w in calibration_chunks(input_ids, window)]

    def logprobs():
        return [torch.log_softmax(model(w, use_cache=False).logits.float(), -1) for w in windows]

    try:
        _STATE.update(layer=None, channels=channels, inv_freqs=inv_freqs)
        ref = logprobs()
        out = {"k": torch.zeros(n_layers, len(bits)), "v": torch.zeros(n_layers, len(bits))}
        for layer in (i for i in range(n_layers) if i not in skip):
            for kind in ("k", "v"):
                for j, b in enumerate(bits):
                    spec = base.replace(key_bits=b, value_bits=b)
                    _STATE.update(layer=layer, kind=kind, spec=spec)
                    # terms where p == 0 are 0 (a logit at -inf: 0 * (-inf - -inf) was NaN)
                    kl = sum(torch.where(r.exp() > 0, r.exp() * (r - q), 0.0).sum(-1).sum().item()
                             for r, q in zip(ref, logprobs()))
                    out[kind][layer, j] = kl / sum(w.shape[1] for w in windows)
            if log:
                log(f"layer {layer}: K " + " ".join(f"{b}b {out['k'][layer, j]:.4f}"
                                                    for j, b in enumerate(bits))
                    + " | V " + " ".join(f"{b}b {out['v'][layer, j]:.4f}"
                                         for j, b in enumerate(bits)))
    finally:
        _STATE.update(layer=None, kind=None, spec=None, channels=None, inv_freqs=None)
        model.set_attn_implementation(before)
    return out


def _check_windows(input_ids: torch.Tensor, window: int, base: QuantSpec) -> None:
    """The trials quantize whole groups of G tokens per window (the rest stays FP16): with no
    window of a group, every sensitivity would be 0 and the allocation arbitrary."""
    tokens, G = input_ids.shape[-1], base.group_size
    if not is_count(window, G):
        raise ValueError(f"tune: window={window!r} tokens is shorter than the base's group_size "
                         f"{G}: no token would be quantized (give a window >= {G}, best a "
                         "multiple of it)")
    if tokens < G:
        raise ValueError(f"tune: {tokens} tokens of calibration text is fewer than the base's "
                         f"group_size {G}: no token would be quantized (give more text)")


def _table(s2: float, s4: float) -> list[float]:
    """Estimated sensitivity at 2, 3, 4, 8 bits from the measured 2- and 4-bit ones."""
    s2, s4 = max(s2, 1e-12), max(s4, 1e-12)
    s4 = min(s4, s2)
    per_bit = math.sqrt(s4 / s2)  # noise factor per extra bit
    return [s2, s2 * per_bit, s4, s4 * per_bit ** 4]


def allocate(costs: list[list[float]], budget_bits: int, choices=CHOICES) -> list[int]:
    """Bits per item minimising ``sum(costs[i][choice])`` with ``sum(bits) <= budget_bits``
    (exact: dynamic program over the integer bit budget)."""
    n = len(costs)
    lo = min(choices) * n
    if budget_bits < lo:
        raise ValueError(f"avg bits too low: {n} tensors need at least {lo} bits "
                         f"(all at {min(choices)}), the budget is {budget_bits}")
    extra = min(budget_bits - lo, (max(choices) - min(choices)) * n)
    inf = float("inf")
    best = [0.0] + [inf] * extra  # best[e]: min cost using exactly e extra bits so far
    picks = []
    for c in costs:
        new, pick = [inf] * (extra + 1), [0] * (extra + 1)
        for e in range(extra + 1):
            if best[e] == inf:
                continue
            for j, b in enumerate(choices):
                e2 = e + b - min(choices)
                if e2 <= extra and best[e] + c[j] < new[e2]:
                    new[e2], pick[e2] = best[e] + c[j], j
        best = new
        picks.append(pick)
    # ties (a tensor whose 4-bit KL was no lower than its 2-bit one costs the same at every
    # width) go to the most bits: the budget asked for is spent, not left as a lower average
    e = min(range(extra + 1), key=lambda i: (best[i], -i))
    out = []
    for pick in reversed(picks):
        j = pick[e]
        out.append(choices[j])
        e -= choices[j] - min(choices)
    return out[::-1]


def check_tune_args(base: QuantSpec, avg_bits: float, base_name: str, avg_name: str) -> None:
    """What :func:`tune` can allocate, checked before any model work (``kvbits tune`` calls it
    before loading; the names say which argument or option is wrong)."""
    # FP16 layers (skip_layers) count 16 bits in the average: the range for the model's depth
    # is checked by tune (an average above 8 was refused here, one below it there, so a base
    # with one FP16 layer of two could not be tuned at all)
    hi = 16 if base.skip_layers else max(CHOICES)
    if not (math.isfinite(avg_bits) and min(CHOICES) <= avg_bits <= hi):
        raise ValueError(f"{avg_name} must be in [{min(CHOICES)}, {hi}] (code bits per K/V "
                         "element, averaged over the layers"
                         + (", FP16 layers at 16" if base.skip_layers else "")
                         + f"), got {avg_bits}")
    if base.method not in ("kivi", "uniform"):
        raise ValueError(f"{base_name} is method {base.method!r}; tune allocates the bits of "
                         "method 'kivi' or 'uniform' (e.g. kivi-3, kivi-3-had, uniform-int4)")
    if base.layer_bits:  # the allocation would replace them, silently
        raise ValueError(f"{base_name} already sets per-layer bits (layer_bits), which tune "
                         "would replace with its own: give a spec with one width for all layers "
                         "(e.g. kivi-3; FP16 layers, skip_layers, are kept)")


def tune(model, input_ids: torch.Tensor, base: QuantSpec, avg_bits: float,
         window: int = CALIBRATION_WINDOW, log=None, calibration="auto") -> TuneResult:
    """Sensitivities on ``input_ids`` and the allocation for ``avg_bits`` (per element, over
    every layer's K and V, FP16 layers at 16); ``base`` gives the method, the grouping and the
    layers kept in FP16 (e.g. kivi-3, or kivi-3-hadc
    with its ``calibration``, see :func:`layer_sensitivity`)."""
    check_tune_args(base, avg_bits, "tune: the base spec", "tune: avg_bits")
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    base.check_layers(n)
    tuned = [i for i in range(n) if i not in {j % n for j in base.skip_layers}]
    budget = math.floor(avg_bits * 2 * n + 1e-9) - 32 * (n - len(tuned))  # FP16 layers: 16 + 16
    lo, hi = ((16 * (n - len(tuned)) + b * len(tuned)) / n for b in (min(CHOICES), max(CHOICES)))
    if not tuned or budget < 2 * min(CHOICES) * len(tuned):
        raise ValueError(f"tune: avg_bits={avg_bits} over {n} layers cannot be met with "
                         f"{n - len(tuned)} of them kept in FP16 (skip_layers, 16 bits each): "
                         f"the other {len(tuned)} would need fewer than {min(CHOICES)} bits; "
                         + (f"give avg_bits in [{lo:g}, {hi:g}] or keep fewer layers in FP16"
                            if tuned else "keep fewer layers in FP16"))
    if avg_bits > hi + 1e-9:  # (every tuned layer at 8 bits would average less than asked)
        raise ValueError(f"tune: avg_bits={avg_bits} over {n} layers with {n - len(tuned)} kept "
                         f"in FP16 (skip_layers) is above the most they can average, {hi:g} "
                         f"(the others at {max(CHOICES)} bits): give avg_bits in [{lo:g}, "
                         f"{hi:g}]")
    sens = layer_sensitivity(model, input_ids, base, (2, 4), window, log, calibration)
    costs = ([_table(*map(float, sens["k"][i])) for i in tuned]
             + [_table(*map(float, sens["v"][i])) for i in tuned])
    bits = allocate(costs, budget)
    m = len(tuned)
    layer_bits = tuple((i, bits[j], bits[m + j]) for j, i in enumerate(tuned))
    spec = base.replace(layer_bits=layer_bits, model_layers=n)
    predicted = sum(c[CHOICES.index(b)] for c, b in zip(costs, bits))
    table = {kind: [_table(*map(float, sens[kind][i])) if i in tuned else None
                    for i in range(n)] for kind in ("k", "v")}
    return TuneResult(spec, table, spec.average_bits(n), predicted,
                      {"measured_bits": [2, 4], "choices": list(CHOICES)})
