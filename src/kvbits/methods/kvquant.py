"""KVQuant on top of the KIVI grouping: non-uniform codebooks, dense-and-sparse outliers.

Quantization (reference, plain PyTorch)
---------------------------------------
Keys keep KIVI's per-channel groups of G tokens and values its per-token groups of Gv channels,
with the same FP16 ``scale``/``zero`` (min/max over the group) and the same packed int32 codes
(:mod:`kvbits.formats.packing`). What changes is what a code *means*:

* **Codebook** (non-uniform quantization). A layer has a sorted table of ``2**bits`` float32
  values per KV head, in *code units* ``[0, 2**bits - 1]`` (where uniform KIVI would use the
  integers ``0 .. 2**bits - 1``). An element normalized to ``u = (x - zero) / scale`` gets the code
  of its nearest codebook entry (``searchsorted`` on the ``2**bits - 1`` thresholds, the midpoints
  of the codebook fitted by k-means), and dequantizes to ``codebook[h, code] * scale + zero``. The
  uniform codebook ``arange(2**bits)`` gives back KIVI's scales, zeros and dequantization exactly,
  and its codes but where an element lies exactly halfway between two levels (the lower code
  here, KIVI's round-half-to-even there), so a fused kernel only swaps ``code`` for one table
  lookup.
* **Outliers** (dense-and-sparse). Each token vector (one token, one KV head, K and V separately)
  keeps a *fixed* number ``n = ceil(outliers * head_dim)`` of its channels outside the dense
  range: they are excluded from the group min/max (so they no longer stretch the step of the
  other elements), still get a dense code, and store ``out_idx`` (uint8 channel index, int16 when
  ``head_dim > 256``) and ``out_val`` (FP16 *correction* ``x - dequant(code)``) in
  ``[B, H, T, n]`` tensors. The dequantized vector is ``dense + scatter(out_idx, out_val)``.

  Why a fixed count and a correction: the sparse part is then a dense, regularly shaped tensor
  read at the token's own row (no CSR offsets, no prefix sums, no variable-length storage to
  grow), and the correction is *added* to the dense dequantization (keys: ``score += q[idx] *
  val``; values: ``out[idx] += p * val``) instead of replacing an element, so the dense tile never
  needs masking. KVQuant's threshold-based selection gives a variable count per vector, which a
  decode kernel would have to gather through offsets.

  Which channels are outliers: a token's ``n`` elements farthest from the median of their own
  quantization group.

  - keys (grouped per *channel* over G tokens): ``|x - median_c|`` in the units of the data,
    with the median of channel ``c`` over the group's valid tokens. That distance is what an
    element adds to its channel's range over the group, and so to the step of every other token
    there: the budget lands on the channels of large magnitude (the massive pre-RoPE ones),
    where shrinking a range buys the most.
  - values (grouped per *token* over Gv channels): the distance from the median of the token's
    own group divided by that group's median absolute deviation, ranked over all its channels.

  Until session 57 the keys' distance was divided by each channel's median absolute deviation
  too (a z-score per channel), which spent the budget on narrow channels. The absolute distance
  measured better perplexity on 10 of 12 rows (three models, 2-4 bits; e.g. SmolLM2 kvquant-2
  +1.49% -> +0.14% on SOTU, +3.47% -> +1.97% on news) and kept more of Gemma3's passkeys (8 lost
  / 5 won against FP16 over two draws, against 17 / 2). For values both ways gave the same
  perplexity, and dividing kept more of the passkeys' margin
  (``benchmarks/results/outlier_rule.md``). The rule is named in the cache key of automatic
  calibrations (:data:`OUTLIER_RULE`). Neither rule needs calibration.

Calibration
-----------
:func:`calibrate` runs the model on calibration text (optionally with a backward pass for the
Fisher weights: squared gradients of the loss w.r.t. the keys (pre-RoPE when ``pre_rope``) and the
values), normalizes K and V exactly as the cache will, and fits one codebook per layer (or per KV
head) by weighted 1-D k-means (:func:`kmeans_1d`: globally optimal dynamic programming on a
histogram, refined by Lloyd steps on the raw data). With ``qnorm`` the codebook is then shifted
and scaled so that the dequantized calibration data has the original mean and standard deviation
(KVQuant's Q-Norm, folded into the table; thresholds stay those of the fitted codebook).

The result is a :class:`Calibration`, saved with :meth:`Calibration.save` as safetensors (tensors
``layers.{i}.{k,v}_{codebook,thresholds}``, metadata: model fingerprint and weight probe, spec
fields, preset, data, date, and in ``extra`` the tokens, window, and the dtype and device the
model ran in) and refused by :meth:`Calibration.check` for another model (in any
float dtype of the same weights it is accepted) or spec.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checks import is_count
from ..formats.layout import check_value_group
from ..formats.packing import pack_bits, packed_length, unpack_bits
from ..reference.quant import (
    FP16_MAX,
    _check_args,
    _check_params,
    channel_groups,
    minmax_qparams,
    top_code_in_fp16,
    ungroup,
)
from ..spec import QuantSpec
from . import (
    CALIBRATION_WINDOW,
    calibration_chunks,
    dtype_key,
    dtype_name,
    kv_geometry,
    model_dtype,
)
from .model_calls import full_attention

__all__ = ["Calibration", "LayerCodebooks", "calibrate", "dequantize_keys", "dequantize_values",
           "kmeans_1d", "model_fingerprint", "outlier_index_dtype", "quantize_keys",
           "quantize_values", "uniform_codebooks"]

# spec fields a calibration depends on (a file is refused when one differs)
CALIBRATION_FIELDS = ("method", "key_bits", "value_bits", "group_size", "pre_rope", "outliers",
                      "codebook", "qnorm", "fisher", "key_scales")
# what a file written before a field existed was made with
_FIELD_DEFAULTS = {"key_scales": "group"}
# key_scales="calibrated": at 2 bits, the fraction of calibration key values left outside each
# channel's offline range (half on each side); the outliers and the codebook's ends take them.
# Session 44's probe (benchmarks/results/kvquant_offline_keys_s44.md): 0.001-0.005 within noise
# of each other on SmolLM2, 0.01-0.02 worse.
OFFLINE_KEY_QUANTILE = 0.002
# At 3 bits and more each channel takes, among the ranges leaving these fractions outside, the
# one of least squared error of uniform quantization with saturation on its calibration keys.
# Session 45 (benchmarks/results/kvquant_offline_range.md, kvquant-N-offline against the fixed
# 0.2%): Gemma3-270M 3 bits +1.53% -> +0.36% over FP16 on news, +1.26% -> +0.84% on SOTU,
# Qwen2.5-0.5B -0.35 points, SmolLM2 -0.03 / +0.08, 4 bits -0.12 to -0.26; at 2 bits it lost
# 2.8 points on SmolLM2 news (narrower ranges throw away too much at 4 levels), so 2 bits keeps
# the fixed fraction.
OFFLINE_KEY_QUANTILES = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
# the rule above, named in the cache key of automatic calibrations (calibration_path): rows fitted
# by an earlier rule are not reused
OFFLINE_KEY_RULE = "q0.002@2,mse-quantiles@3+"
# how a token's outliers are chosen (module docstring), named in the cache key of automatic
# calibrations and kept in a file's ``extra``: codebooks fitted under the earlier rule (``mad``,
# files without the entry) are refitted, and a file that has none is warned about
OUTLIER_RULE = "keys-abs-median"
FORMAT = "kvbits-kvquant-calibration-v1"


# ------------------------------------------------------------------------------------ codebooks
@dataclass
class LayerCodebooks:
    """One layer's tables, float32, sorted along the last axis.

    ``k_codebook [H, 2**key_bits]``, ``k_thresholds [H, 2**key_bits - 1]`` (same for values).
    ``k_scale``, ``k_zero``: with ``key_scales="calibrated"``, the offline float16 ``[H, D]``
    key scale and zero of every channel (None otherwise).
    """

    k_codebook: torch.Tensor
    k_thresholds: torch.Tensor
    v_codebook: torch.Tensor
    v_thresholds: torch.Tensor
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None

    def to(self, device) -> LayerCodebooks:
        return LayerCodebooks(*(None if t is None else t.to(device) for t in (
            self.k_codebook, self.k_thresholds, self.v_codebook, self.v_thresholds,
            self.k_scale, self.k_zero)))


def uniform_codebooks(heads: int, key_bits: int, value_bits: int) -> LayerCodebooks:
    """The codebooks that make kvquant quantize exactly like KIVI (``arange(2**bits)``)."""
    def one(bits):
        cb = torch.arange(1 << bits, dtype=torch.float32).expand(heads, -1).contiguous()
        return cb, thresholds_of(cb)
    return LayerCodebooks(*one(key_bits), *one(value_bits))


def thresholds_of(codebook: torch.Tensor) -> torch.Tensor:
    """Midpoints between consecutive entries of a sorted codebook ``[..., n]`` -> ``[..., n-1]``."""
    return (codebook[..., 1:] + codebook[..., :-1]) / 2


def kmeans_1d(x: torch.Tensor, w: torch.Tensor | None, k: int, bins: int = 512,
              iters: int = 8, ends: tuple[float, float] | None = None) -> torch.Tensor:
    """Weighted 1-D k-means: ``k`` sorted centroids minimizing ``sum w (x - c(x))**2``.

    Exact (dynamic programming over contiguous clusters of the sorted data, which is optimal in
    1-D) on the distinct values when there are at most ``bins`` of them, else on a ``bins``-bin
    histogram; then ``iters`` Lloyd steps on the raw data (which never increase the objective).
    Fewer distinct values than ``k`` give repeated centroids.

    ``ends = (lo, hi)`` pins the first and last centroids there (``k >= 2``) and fits the
    ``k - 2`` others, exactly as above: the first cluster then costs ``sum w (x - lo)**2``
    instead of its variance, and may be empty.
    """
    x = x.detach().flatten().double()
    w = torch.ones_like(x) if w is None else w.detach().flatten().double()
    if x.numel() == 0:
        raise ValueError("kmeans_1d: no data")
    if not is_count(k, 1):  # (0: an IndexError inside)
        raise ValueError(f"kmeans_1d: k must be a positive int (centroids), got {k!r}")
    if ends is not None and k < 2:
        raise ValueError(f"kmeans_1d: ends needs k >= 2 centroids, got k={k}")
    if w.numel() and not bool((w.isfinite() & (w >= 0)).all()):  # (NaN: "expanded size ...
        # (0)" below; inf: the other weights normalized to 0, the fit silently unweighted)
        bad = w[~(w.isfinite() & (w >= 0))]
        raise ValueError(f"kmeans_1d: w (the weights) must be finite and >= 0, got "
                         f"{bad.numel()} that are not (e.g. {float(bad[0])})")
    w = w / w.mean().clamp_min(1e-300) + 1e-9  # no zero-weight cluster
    uniq, inv = torch.unique(x, return_inverse=True)
    if uniq.numel() <= bins:
        ids, n = inv, uniq.numel()
    else:
        lo, hi = float(x.min()), float(x.max())
        ids = ((x - lo) / (hi - lo) * bins).long().clamp_(0, bins - 1)
        n = bins
    W = torch.zeros(n, dtype=torch.float64).index_add_(0, ids, w)
    S = torch.zeros(n, dtype=torch.float64).index_add_(0, ids, w * x)
    Q = torch.zeros(n, dtype=torch.float64).index_add_(0, ids, w * x * x)
    keep = W > 0
    W, S, Q = W[keep], S[keep], Q[keep]
    n = W.numel()
    means = S / W
    if ends is None and n <= k:
        cb = torch.cat([means, means[-1:].expand(k - n)])
        return cb.float()
    if ends is not None and n <= k - 2:  # every value a centroid of its own, between the ends
        cb = torch.cat([torch.tensor(ends, dtype=torch.float64), means,
                        means[-1:].expand(k - 2 - n)])
        return cb.sort().values.float()
    pw, ps, pq = (torch.cat([torch.zeros(1, dtype=torch.float64), t.cumsum(0)]) for t in (W, S, Q))
    i = torch.arange(n + 1)
    dw, ds, dq = (p[None, :] - p[:, None] for p in (pw, ps, pq))  # sums over items i .. j-1
    # cost[i, j]: squared error of one cluster holding items i .. j-1 at its mean (inf: j <= i)
    cost = torch.where(i[None, :] > i[:, None], (dq - ds ** 2 / dw.clamp_min(1e-300)).clamp_min(0),
                       math.inf)

    def at(c):  # the same at a fixed centroid c; an empty cluster (j == i) costs nothing
        return torch.where(i[None, :] >= i[:, None], (dq - 2 * c * ds + c * c * dw).clamp_min(0),
                           math.inf)
    best = cost[0].clone() if ends is None else at(ends[0])[0].clone()  # items 0..j-1
    back = []
    for _ in range(k - 1 if ends is None else k - 2):  # the other free clusters
        best, arg = (best[:, None] + cost).min(dim=0)
        back.append(arg)
    j = n
    if ends is not None:  # the last cluster, items j..n-1, at ends[1]
        j = int((best + at(ends[1])[:, n]).argmin())
    cuts = [n] if ends is None else [n, j]
    for arg in reversed(back):
        j = int(arg[j])
        cuts.append(j)
    cuts = [0, *cuts[::-1]]
    if ends is None:
        cb = torch.stack([(ps[b] - ps[a]) / (pw[b] - pw[a]) for a, b in itertools.pairwise(cuts)])
    else:
        inner = [(ps[b] - ps[a]) / (pw[b] - pw[a]) for a, b in itertools.pairwise(cuts[1:-1])]
        cb = torch.tensor([ends[0], *inner, ends[1]], dtype=torch.float64)
    for _ in range(iters):  # Lloyd on the raw data
        code = torch.bucketize(x, (cb[1:] + cb[:-1]) / 2)
        sw = torch.zeros(k, dtype=torch.float64).index_add_(0, code, w)
        sx = torch.zeros(k, dtype=torch.float64).index_add_(0, code, w * x)
        new = torch.where(sw > 0, sx / sw.clamp_min(1e-300), cb)
        if ends is not None:
            new[0], new[-1] = ends
        cb = new.sort().values
    return cb.float()


def kmeans_objective(x: torch.Tensor, w: torch.Tensor | None, cb: torch.Tensor) -> float:
    """``sum w (x - nearest(cb))**2`` (float64)."""
    x = x.flatten().double()
    w = torch.ones_like(x) if w is None else w.flatten().double()
    cb = cb.double().sort().values
    q = cb[torch.bucketize(x, (cb[1:] + cb[:-1]) / 2)]
    return float((w * (x - q) ** 2).sum())


# ------------------------------------------------------------------------------------ outliers
def outlier_index_dtype(head_dim: int) -> torch.dtype:
    return torch.uint8 if head_dim <= 256 else torch.int16


def _outlier_score(x: torch.Tensor, dim: int, ok: torch.Tensor | None,
                   spread: bool = False) -> torch.Tensor:
    """``|x - median|`` along ``dim`` over the elements where ``ok`` (0 elsewhere): how far each
    element stretches its group's range. ``spread`` (values): divided by the group's median
    absolute deviation (:data:`OUTLIER_RULE`)."""
    xm = x if ok is None else torch.where(ok, x, torch.nan)
    med = torch.nan_to_num(xm.nanmedian(dim=dim, keepdim=True).values, nan=0.0)
    dev = (x - med).abs()
    if spread:
        devm = dev if ok is None else torch.where(ok, dev, torch.nan)
        mad = torch.nan_to_num(devm.nanmedian(dim=dim, keepdim=True).values, nan=0.0)
        eps = 1e-6 + 1e-3 * devm.nan_to_num(0.0).amax(dim=dim, keepdim=True)
        dev = dev / (mad + eps)
    return torch.nan_to_num(dev if ok is None else torch.where(ok, dev, 0.0), nan=0.0)


def _top_mask(score: torch.Tensor, n: int):
    """Bool mask of the ``n`` highest scores along the last axis, and their indices."""
    idx = score.topk(n, dim=-1).indices.sort(dim=-1).values
    mask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)
    return mask, idx


# ---------------------------------------------------------------------------- quantize / dequant
def _check_tables(op: str, bits: int, heads: int, codebook: torch.Tensor,
                  thresholds: torch.Tensor | None = None) -> None:
    """``codebook [heads, 2**bits]`` (and ``thresholds [heads, 2**bits - 1]``), metadata only:
    a table of another width was used silently (codes past ``2**bits - 1`` packed into the
    neighbouring slot, or a lookup read the next head's entries)."""
    n = 1 << bits
    for name, t, want in (("codebook", codebook, (heads, n)),
                          ("thresholds", thresholds, (heads, n - 1))):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{op}: {name} must be [kv_heads, {want[1]}] = {list(want)} for "
                             f"bits={bits}, got {list(t.shape)}")


def _check_n_out(op: str, n_out, head_dim: int) -> None:
    """``n_out``: outliers per token vector, an int in ``[0, head_dim]`` (topk failed deep
    inside with "selected index k out of range" before)."""
    if not is_count(n_out, 0) or n_out > head_dim:
        raise ValueError(f"{op}: n_out must be an int in [0, head_dim={head_dim}], got "
                         f"{n_out!r}")


def _codes(u: torch.Tensor, thresholds: torch.Tensor, head_dim_axis: int = 1) -> torch.Tensor:
    """uint8 code of the nearest codebook entry: ``searchsorted`` per KV head (axis 1)."""
    out = torch.empty(u.shape, dtype=torch.uint8, device=u.device)
    for h in range(u.shape[1]):
        out[:, h] = torch.searchsorted(thresholds[h].contiguous(), u[:, h].contiguous()).to(torch.uint8)
    return out


def _lookup(codebook: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``codebook[h, codes[:, h]]`` for codes ``[B, H, ...]`` (float32)."""
    H = codebook.shape[0]
    flat = codes.long() + (torch.arange(H, device=codes.device) * codebook.shape[1]).view(
        1, H, *([1] * (codes.dim() - 2)))
    return codebook.reshape(-1)[flat]


def _normalize(x, scale, zero):
    s = scale.float()
    return torch.where(s > 0, (x - zero.float()) / torch.where(s > 0, s, 1.0), 0.0)


def _split_keys(k: torch.Tensor, bits: int, group_size: int, n_out: int,
                valid: torch.Tensor | None):
    """Grouping, outlier selection and FP16 scale/zero of keys ``[B, H, T, D]``.

    Returns ``kg [B,H,NG,G,D]`` (float32), ``scale, zero [B,H,NG,1,D]``, the dense mask
    (valid, not outlier) and the outlier indices ``[B,H,NG,G,n]`` (None when n == 0).
    """
    B, H, T, D = k.shape
    G = group_size
    if T % G:
        raise ValueError(f"quantize_keys: token count {T} is not a multiple of group_size {G}")
    kg = k.float().reshape(B, H, T // G, G, D)
    ok = None if valid is None else valid.reshape(B, 1, T // G, G, 1).expand_as(kg)
    idx = None
    dense = ok
    if n_out:
        mask, idx = _top_mask(_outlier_score(kg, 3, ok), n_out)
        dense = ~mask if ok is None else ok & ~mask
    scale, zero = minmax_qparams(kg, bits, dim=3, valid=dense)
    return kg, scale, zero, dense, idx


def _split_values(v: torch.Tensor, bits: int, value_group: int, n_out: int,
                  valid: torch.Tensor | None):
    """Values ``[B, H, T, D]`` -> ``vg [B,H,T,NGv,Gv]`` (:func:`channel_groups`: the last group
    zero-padded when Gv does not divide D), ``scale, zero [B,H,T,NGv,1]``, dense mask (False on
    padding and outliers), outlier indices ``[B,H,T,n]`` over the D channels (None when n == 0)."""
    B, _, T, D = v.shape
    vg, in_range = channel_groups(v.float(), value_group, "quantize_values")
    ok = None if valid is None else valid.reshape(B, 1, T, 1, 1).expand_as(vg)
    if in_range is not None:
        ok = in_range.expand_as(vg) if ok is None else ok & in_range
    idx = None
    dense = ok
    if n_out:
        score = ungroup(_outlier_score(vg, 4, ok, spread=True), D)
        mask, idx = _top_mask(score, n_out)
        mask = channel_groups(mask, value_group)[0]
        dense = ~mask if ok is None else ok & ~mask
    scale, zero = minmax_qparams(vg, bits, dim=4, valid=dense)
    return vg, scale, zero, dense, idx


def _corrections(x: torch.Tensor, deq: torch.Tensor, idx: torch.Tensor, valid_tok, D: int):
    """``(out_idx, out_val)`` of flattened-token tensors ``x, deq [B,H,T,D]``. Like the dense
    scales and zeros, an element past float16's range saturates at +-65504 (BF16/FP32 models
    can hold one): the correction brings the dequantized value to the saturated one, never to
    an infinite float16 that turns attention into NaN."""
    target = x.gather(-1, idx).float().clamp(-FP16_MAX, FP16_MAX)
    dense = deq.gather(-1, idx).float()
    val = (target - dense).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    # A correction rounded away from zero can carry the sum past the range all the same
    # (65504 over a dense 48: 65456 rounds to 65472, dequantized 65520, inf in float16): one
    # float16 step back toward zero (the rounding was at most half a step) keeps it inside.
    over = (dense + val.float()).abs() > FP16_MAX
    val = torch.where(over, torch.nextafter(val, torch.zeros_like(val)), val)
    if valid_tok is not None:
        val = torch.where(valid_tok, val, torch.zeros_like(val))
        idx = torch.where(valid_tok, idx, torch.zeros_like(idx))
    return idx.to(outlier_index_dtype(D)), val


def quantize_keys(k: torch.Tensor, bits: int, group_size: int, codebook: torch.Tensor,
                  thresholds: torch.Tensor, n_out: int = 0, valid: torch.Tensor | None = None,
                  rows: tuple[torch.Tensor, torch.Tensor] | None = None):
    """KVQuant keys: per-channel groups of G tokens, codebook codes, ``n_out`` outliers per token.

    Args:
        k: ``[B, H, T, D]`` (pre-RoPE when the spec says so), T a multiple of G.
        codebook, thresholds: ``[H, 2**bits]`` and ``[H, 2**bits - 1]`` (code units).
        valid: optional ``[B, T]`` bool, False for padding (codes, scale, zero, outliers all 0).
        rows: ``key_scales="calibrated"``: the offline float16 ``(scale, zero) [H, D]`` used
            for every group instead of its min/max; codes saturate at the codebook's ends and
            each token's outliers are its ``n_out`` channels of largest error.

    Returns:
        ``codes [B, H, T // G * Wk, D] int32``, ``scale, zero [B, H, T // G, D] float16``
        (``[B, H, 1, D]``, the rows, with ``rows``), ``out_idx [B, H, T, n_out]`` (uint8 /
        int16) and ``out_val [B, H, T, n_out] float16`` (both None when ``n_out == 0``).
    """
    B, H, T, D = _check_args("quantize_keys", "k", k, bits, group_size, valid)
    _check_tables("quantize_keys", bits, H, codebook, thresholds)
    _check_n_out("quantize_keys", n_out, D)
    if rows is not None:
        # (another shape failed in a reshape naming no argument, or, as [H * D] or [D, H],
        # was taken as the [H, D] rows silently)
        if not (isinstance(rows, (tuple, list)) and len(rows) == 2
                and all(isinstance(r, torch.Tensor) and tuple(r.shape) == (H, D) for r in rows)):
            got = ([list(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
                    for r in rows] if isinstance(rows, (tuple, list)) else type(rows).__name__)
            raise ValueError(f"quantize_keys: rows must be the offline (scale, zero) pair of "
                             f"[kv_heads, head_dim] = [{H}, {D}] tensors, got {got}")
        return _quantize_keys_rows(k, bits, group_size, codebook, thresholds, n_out, valid, rows)
    kg, scale, zero, _, idx = _split_keys(k, bits, group_size, n_out, valid)
    codes = _codes(_normalize(kg, scale, zero), thresholds.to(k.device))
    if valid is not None:
        codes = torch.where(valid.reshape(B, 1, T // group_size, group_size, 1), codes, 0)
    words = pack_bits(codes, bits, dim=3, check=False).reshape(B, H, -1, D)  # < 2**bits
    out_idx = out_val = None
    if n_out:
        deq = _lookup(codebook.to(k.device), codes) * scale.float() + zero.float()
        vt = None if valid is None else valid.reshape(B, 1, T, 1)
        out_idx, out_val = _corrections(kg.reshape(B, H, T, D), deq.reshape(B, H, T, D),
                                        idx.reshape(B, H, T, n_out), vt, D)
    return words, scale.squeeze(3), zero.squeeze(3), out_idx, out_val


def _quantize_keys_rows(k, bits, group_size, codebook, thresholds, n_out, valid, rows):
    """:func:`quantize_keys` with offline per-channel scale and zero rows."""
    B, H, T, D = k.shape
    G = group_size
    if T % G:
        raise ValueError(f"quantize_keys: token count {T} is not a multiple of group_size {G}")
    scale, zero = (r.to(k.device, torch.float16).reshape(1, H, 1, D).expand(B, H, 1, D)
                   for r in rows)
    kf = k.float().reshape(B, H, T, D)
    codes = _codes(_normalize(kf, scale, zero), thresholds.to(k.device))  # [B, H, T, D]
    if valid is not None:
        codes = torch.where(valid.reshape(B, 1, T, 1), codes, 0)
    words = pack_bits(codes.reshape(B, H, T // G, G, D), bits, dim=3,
                      check=False).reshape(B, H, -1, D)  # searchsorted: < 2**bits
    out_idx = out_val = None
    if n_out:
        deq = _lookup(codebook.to(k.device), codes) * scale.float() + zero.float()
        idx = (kf - deq).abs().topk(n_out, dim=-1).indices  # (padding: zeroed by _corrections)
        vt = None if valid is None else valid.reshape(B, 1, T, 1)
        out_idx, out_val = _corrections(kf, deq, idx, vt, D)
    return words, scale.contiguous(), zero.contiguous(), out_idx, out_val


def offline_key_rows(k: torch.Tensor, bits: int, keep: torch.Tensor | None = None,
                     q: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline float16 ``(scale, zero) [H, D]`` of calibration keys ``[H, T, D]`` (``keep``: the
    tokens counted): each channel's range between its ``c / 2`` and ``1 - c / 2`` quantiles,
    with ``c = q`` if given, else ``OFFLINE_KEY_QUANTILE`` at 2 bits and, at 3 bits and more,
    the ``c`` of ``OFFLINE_KEY_QUANTILES`` whose range gives the channel's keys the least squared
    error of uniform ``2**bits``-level quantization with saturation. A constant channel gets
    scale 0 (its keys dequantize to the zero)."""
    if keep is not None:
        k = k[:, keep]
    T = k.shape[1]
    if T == 0:
        raise ValueError("offline key scales need calibration tokens")
    x = k.float()
    srt = x.sort(dim=1).values  # (torch.quantile refuses more than 2**24 elements)

    def quantile_range(c: float):
        return srt[:, int(c / 2 * (T - 1))], srt[:, round((1 - c / 2) * (T - 1))]

    levels = (1 << bits) - 1
    if q is not None or bits < 3:
        lo, hi = quantile_range(OFFLINE_KEY_QUANTILE if q is None else q)
    else:
        best = lo = hi = None
        for c in OFFLINE_KEY_QUANTILES:
            a, b = quantile_range(c)
            step = ((b - a) / levels)[:, None]
            codes = ((x - a[:, None]) / torch.where(step > 0, step, 1.0)).round().clamp(0, levels)
            err = (x - (a[:, None] + codes * step)).square().mean(1)  # [H, D]
            if best is None:
                best, lo, hi = err, a, b
            else:
                better = err < best
                best = torch.where(better, err, best)
                lo, hi = torch.where(better, a, lo), torch.where(better, b, hi)
    lo, hi = lo.clamp(-FP16_MAX, FP16_MAX), hi.clamp(-FP16_MAX, FP16_MAX)
    zero = lo.half()
    scale = ((hi - zero.float()) / levels).clamp(0, FP16_MAX).half()
    return top_code_in_fp16(scale, zero, bits), zero


def quantize_values(v: torch.Tensor, bits: int, value_group: int, group_size: int,
                    codebook: torch.Tensor, thresholds: torch.Tensor, n_out: int = 0,
                    valid: torch.Tensor | None = None):
    """KVQuant values: per-token groups of Gv channels, packed along tokens like the keys.

    Returns ``codes [B, H, T // G * Wv, D] int32``, ``scale, zero [B, H, T, ceil(D / Gv)]
    float16`` (the last group shorter where Gv does not divide D: :func:`channel_groups`),
    ``out_idx, out_val [B, H, T, n_out]`` (None when ``n_out == 0``).
    """
    B, H, T, D = _check_args("quantize_values", "v", v, bits, group_size, valid)
    _check_tables("quantize_values", bits, H, codebook, thresholds)
    _check_n_out("quantize_values", n_out, D)
    G = group_size
    if T % G:
        raise ValueError(f"quantize_values: token count {T} is not a multiple of group_size {G}")
    vg, scale, zero, _, idx = _split_values(v, bits, value_group, n_out, valid)
    codes = _codes(_normalize(vg, scale, zero), thresholds.to(v.device))
    if valid is not None:
        codes = torch.where(valid.reshape(B, 1, T, 1, 1), codes, 0)
    words = pack_bits(ungroup(codes, D).reshape(B, H, T // G, G, D), bits, dim=3,
                      check=False).reshape(B, H, -1, D)  # searchsorted: < 2**bits
    out_idx = out_val = None
    if n_out:
        deq = _lookup(codebook.to(v.device), codes) * scale.float() + zero.float()
        vt = None if valid is None else valid.reshape(B, 1, T, 1)
        out_idx, out_val = _corrections(ungroup(vg, D), ungroup(deq, D), idx, vt, D)
    return words, scale.squeeze(4), zero.squeeze(4), out_idx, out_val


def _add_outliers(x: torch.Tensor, out_idx, out_val) -> torch.Tensor:
    if out_idx is None or out_idx.shape[-1] == 0:
        return x
    return x.scatter_add(-1, out_idx.long(), out_val.to(x.dtype))  # (float64 codebooks too)


def dequantize_keys(codes, scale, zero, bits, group_size, codebook, out_idx=None, out_val=None,
                    dtype=torch.float32, groups: int | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_keys`: ``codebook[h, code] * scale + zero`` plus outliers.
    ``groups``: how many groups ``codes`` holds when ``scale``/``zero`` are the offline
    ``[B, H, 1, D]`` rows that every group shares (else ``scale.shape[2]``)."""
    B, H, _, D = _check_args("dequantize_keys", "codes", codes, bits, group_size)
    _check_tables("dequantize_keys", bits, H, codebook)
    NG = (scale.shape[2] if scale.dim() == 4 else -1) if groups is None else groups
    Wk = packed_length(group_size, bits)
    _check_params("dequantize_keys", codes, scale, zero, (B, H, NG if groups is None else 1, D),
                  NG * Wk)
    q = unpack_bits(codes[:, :, : NG * Wk].reshape(B, H, NG, Wk, D), bits, group_size, dim=3)
    x = _lookup(codebook.to(codes.device), q) * scale.float().unsqueeze(3) + zero.float().unsqueeze(3)
    x = x.reshape(B, H, NG * group_size, D)
    if out_idx is not None:
        x = _add_outliers(x, out_idx[:, :, : NG * group_size], out_val[:, :, : NG * group_size])
    return x.to(dtype)


def dequantize_values(codes, scale, zero, bits, value_group, group_size, codebook, out_idx=None,
                      out_val=None, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_values`."""
    B, H, _, D = _check_args("dequantize_values", "codes", codes, bits, group_size)
    _check_tables("dequantize_values", bits, H, codebook)
    check_value_group("dequantize_values", value_group, D)
    T = scale.shape[2] if scale.dim() == 4 else -1
    NG = T // group_size
    Wv = packed_length(group_size, bits)
    if T % group_size:
        raise ValueError(f"dequantize_values: scale holds {T} tokens, not whole groups of "
                         f"group_size {group_size}")
    _check_params("dequantize_values", codes, scale, zero, (B, H, T, -(-D // value_group)),
                  NG * Wv)
    q = unpack_bits(codes[:, :, : NG * Wv].reshape(B, H, NG, Wv, D), bits, group_size, dim=3)
    q = channel_groups(q.reshape(B, H, T, D), value_group)[0]
    x = _lookup(codebook.to(codes.device), q) * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    x = ungroup(x, D)
    if out_idx is not None:
        x = _add_outliers(x, out_idx[:, :, :T], out_val[:, :, :T])
    return x.to(dtype)


# ---------------------------------------------------------------------------------- calibration
# The weight a calibration is tied to: the first key projection, else the first fused QKV one
# (Phi-3, GPT-NeoX, GPT-2, MPT, Baichuan), else any attention weight.
KEY_WEIGHTS = ("k_proj.weight", "qkv_proj.weight", "query_key_value.weight", "c_attn.weight",
               "Wqkv.weight", "W_pack.weight")
PROBE_VALUES = 64  # weights sampled into a calibration's metadata (see weight_probe)
PROBE_RTOL = 2.0 ** -7  # bfloat16 rounds to 2**-8: a model in any float dtype still matches


def _key_weight(model):
    params = dict(model.named_parameters())
    for suffix in KEY_WEIGHTS:
        w = next((p for n, p in params.items() if n.endswith(suffix)), None)
        if w is not None:
            return w
    return next((p for n, p in params.items()
                 if n.endswith("weight") and ("attn" in n or "attention" in n)), None)


def weight_probe(model) -> list[float] | None:
    """``PROBE_VALUES`` weights of the model's first key (or fused QKV) projection at fixed,
    evenly spaced positions, as floats: which weights a calibration was measured on, compared
    with a tolerance (:meth:`Calibration.check`) so that the same model converted to float16
    or bfloat16 (a calibration made on the CPU in float32, used on a GPU) still matches."""
    w = _key_weight(model)
    if w is None:
        return None
    flat = w.detach().reshape(-1)
    pos = torch.linspace(0, flat.numel() - 1, PROBE_VALUES).round().long().to(flat.device)
    return flat[pos].float().cpu().tolist()


def model_fingerprint(model, probe: list[float] | None = None) -> str:
    """``{model_type}-L{layers}-H{kv_heads}-D{head_dim}-{hash}``, the hash of the signs and
    binary exponents of :func:`weight_probe` (the same in any float dtype but for values at a
    power of two; it names cached calibrations, :meth:`Calibration.check` compares the probe
    itself). ``probe``: the model's probe when the caller has it already."""
    probe = weight_probe(model) if probe is None else probe
    h = "noweights"
    if probe is not None:
        mant, exp = torch.frexp(torch.tensor(probe, dtype=torch.float64))
        coarse = (torch.sign(mant) * (exp + 1000)).long()
        h = hashlib.sha1(coarse.numpy().tobytes()).hexdigest()[:12]
    return f"{model_shape_name(model.config)}-{h}"


def model_shape_name(config) -> str:
    """``{model_type}-L{layers}-H{kv_heads}-D{head_dim}`` of a model's config."""
    config = config.get_text_config(decoder=True)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return f"{config.model_type}-L{config.num_hidden_layers}-H{kv}-D{hd}"


def _legacy_fingerprint(model) -> str:
    """The fingerprint files written before the probe carried (sha1 of the whole first K
    projection in float32): still accepted for those files, exactly as then."""
    w = next((p for n, p in model.named_parameters() if n.endswith("k_proj.weight")), None)
    h = "noweights"
    if w is not None:
        h = hashlib.sha1(w.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]
    return f"{model_shape_name(model.config)}-{h}"


def probes_match(a: list[float], b: list[float]) -> bool:
    """Two :func:`weight_probe` samples of the same weights, up to float rounding."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return x.shape == y.shape and bool(
        ((x - y).abs() <= PROBE_RTOL * torch.maximum(x.abs(), y.abs()) + 1e-12).all())


_LAYER_TENSORS = ("k_codebook", "k_thresholds", "v_codebook", "v_thresholds", "k_scale", "k_zero")
_OFFLINE_ROWS = ("k_scale", "k_zero")


def spec_fields(spec: QuantSpec) -> dict:
    return {f: getattr(spec, f) for f in CALIBRATION_FIELDS}


@dataclass
class Calibration:
    """Per-layer codebooks of one model under one spec, and where they came from."""

    layers: list[LayerCodebooks]
    spec: dict  # spec_fields of the spec it was fitted for
    fingerprint: str
    model: str = ""
    preset: str = ""
    data: str = ""
    date: str = ""
    extra: dict = field(default_factory=dict)
    probe: list[float] | None = None  # weight_probe of the model it was made for
    path: str = field(default="", compare=False)  # the file it was loaded from (for errors)

    def _name(self) -> str:
        """How errors name it: its file, else its preset."""
        return (f"calibration {self.path!r}" if self.path
                else f"calibration (preset {self.preset or '?'})")

    def check(self, model, spec: QuantSpec) -> None:
        """Refuse a calibration made for another model or another spec (ValueError). The model
        must have the same shape (fingerprint prefix) and, where the file carries a weight
        probe, the same weights up to float rounding (any dtype); older files without one
        compare their exact fingerprint."""
        if not (hasattr(model, "named_parameters") or hasattr(model, "get_text_config")):
            # anything else (None, a name) was compared with nothing and passed
            raise TypeError(f"Calibration.check: model must be a transformers model or its "
                            f"config, got {type(model).__name__}")
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"Calibration.check: spec must be a QuantSpec, got "
                            f"{type(spec).__name__}")
        probe = weight_probe(model) if hasattr(model, "named_parameters") else None
        fp = model_fingerprint(model, probe) if hasattr(model, "named_parameters") else None
        if fp is None:
            same = True
        elif self.probe is not None:
            same = (model_shape_name(model.config) == self.fingerprint.rsplit("-", 1)[0]
                    and probe is not None and probes_match(probe, self.probe))
        else:
            legacy = _legacy_fingerprint(model)
            same = legacy == self.fingerprint
            if not same and self.fingerprint == fp:  # (was "made for model ? (F), not for this
                # model (F)": the probe's fingerprint, which only files with a probe carry)
                raise ValueError(
                    f"{self._name()} has no weight probe ('probe' metadata) but a fingerprint "
                    f"of the form written with one ({fp}): the file is damaged (or was saved "
                    "from a Calibration without its probe), and the weights it was made for "
                    "cannot be checked against this model; calibrate it again: kvbits "
                    f"calibrate --model ... --preset {self.preset or '...'}")
            fp = legacy  # the form the file's fingerprint is compared in
        if fp is None and hasattr(model, "get_text_config"):  # a config: its shape at least
            fp = model_shape_name(model)
            same = fp == self.fingerprint.rsplit("-", 1)[0]
        if not same:
            old = (" (the file has no weight probe: written by an old kvbits, or damaged)"
                   if self.probe is None else "")
            raise ValueError(
                f"calibration was made for model {self.model or '?'} ({self.fingerprint}), not "
                f"for this model ({fp}){old}; calibrate it: kvbits calibrate --model ... "
                f"--preset {self.preset or '...'}")
        want = spec_fields(spec)
        have = {k: self.spec.get(k, _FIELD_DEFAULTS.get(k)) for k in CALIBRATION_FIELDS}
        bad = [f"{k}={have[k]!r} (spec has {want[k]!r})" for k in CALIBRATION_FIELDS
               if have[k] != want[k]]
        if bad:
            raise ValueError(f"calibration (preset {self.preset or '?'}) does not match the "
                             f"spec: {', '.join(bad)}; calibrate again with this preset")
        layers, heads, _ = kv_geometry(model)
        n = layers if fp else len(self.layers)
        if len(self.layers) != n:
            raise ValueError(f"{self._name()} has {len(self.layers)} layers, the model {n}")
        # (a file whose fingerprint matched but whose tables are of another head count was
        # refused only at the first forward, inside the cache store, naming no file)
        for i, layer in enumerate(self.layers):
            got = layer.k_codebook.shape[0], layer.v_codebook.shape[0]
            if got != (heads, heads):
                raise ValueError(f"{self._name()} holds codebooks for {'/'.join(map(str, got))} "
                                 f"KV heads (keys/values) at layer {i}, the model has {heads} "
                                 "KV heads: it was made for another model, or is damaged; "
                                 "calibrate it for this model")
        rule = self.extra.get("outlier_rule", "mad")
        if _outlier_rule_applies(spec) and rule != OUTLIER_RULE:  # usable, fitted otherwise
            warnings.warn(f"calibration (preset {self.preset or '?'}) was fitted with outliers "
                          f"chosen by the {rule!r} rule, not this kvbits' {OUTLIER_RULE!r}: its "
                          "codebooks serve, a new calibration fits them better (kvbits "
                          "calibrate)", stacklevel=3)

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save as safetensors_bytes
        from safetensors.torch import save_file

        from ..files import write_file_atomic

        tensors = {}
        for i, layer in enumerate(self.layers):
            for name in _LAYER_TENSORS:
                if getattr(layer, name) is not None:  # (offline key rows: float16 as used)
                    t = getattr(layer, name)
                    t = t if name in _OFFLINE_ROWS else t.float()
                    tensors[f"layers.{i}.{name}"] = t.contiguous().cpu()
        meta = {"format": FORMAT, "model": self.model, "fingerprint": self.fingerprint,
                "preset": self.preset, "data": self.data, "date": self.date,
                "spec": json.dumps(self.spec), "extra": json.dumps(self.extra)}
        if self.probe is not None:
            meta["probe"] = json.dumps(self.probe)
        path = Path(path)
        if path.is_dir():  # (the file was written, then its rename failed, naming a temporary)
            raise IsADirectoryError(f"Calibration.save: path {str(path)!r} is a folder; give a "
                                    f"file name, e.g. {str(path / 'calibration.safetensors')!r}")
        # beside and renamed (no partial file), through links, into /dev/null as a device, with
        # the umask's mode (safetensors' 0600 kept the calibration cache from other users)
        write_file_atomic(path, lambda target: save_file(tensors, str(target), metadata=meta),
                          lambda: safetensors_bytes(tensors, metadata=meta))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        from safetensors import safe_open

        if Path(path).is_dir():  # (safetensors said "No such device (os error 19)")
            raise ValueError(f"cannot read a kvquant calibration from {str(path)!r}: it is a "
                             "folder; give the .safetensors file written by `kvbits calibrate`")
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as exc:  # noqa: BLE001 (missing file, not safetensors, ...)
            raise ValueError(f"cannot read a kvquant calibration from {str(path)!r}: {exc} "
                             "(calibration= takes a file written by `kvbits calibrate`, 'auto' "
                             "or 'uniform')") from None
        with f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not a kvbits kvquant calibration "
                                 f"(format {meta.get('format')!r}, expected {FORMAT!r})")
            damaged = f"{str(path)!r} is a damaged kvquant calibration"
            names = set(f.keys())
            # (a tensor of another name was an IndexError, or taken as a layer of its own)
            stray = sorted(k for k in names if not (
                len(parts := k.split(".")) == 3 and parts[0] == "layers"
                and parts[1].isdigit() and parts[2] in _LAYER_TENSORS))
            if stray:
                raise ValueError(f"{damaged}: it holds tensors {stray[:3]} that are not "
                                 "layers.{i}.{" + ",".join(_LAYER_TENSORS) + "}")
            n = len({k.split(".")[1] for k in names})
            layers = [LayerCodebooks(*(f.get_tensor(f"layers.{i}.{name}")
                                       if f"layers.{i}.{name}" in names else None
                                       for name in _LAYER_TENSORS)) for i in range(n)]
        try:
            fields = {k: json.loads(meta[k]) for k in ("spec", "extra", "probe") if k in meta}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{damaged}: its metadata is not JSON ({exc})") from None
        missing = [k for k in ("spec", "fingerprint") if k not in meta]
        if missing or not isinstance(fields["spec"], dict):
            raise ValueError(f"{damaged}: its metadata lacks {missing or ['a spec object']}")
        # (an 'extra' that is not an object was an AttributeError in check, a 'probe' that is
        # not a list of numbers a TypeError there)
        probe = fields.get("probe")
        bad = ([f"'extra' {meta['extra'][:40]!r} is not a JSON object"]
               if not isinstance(fields.get("extra", {}), dict) else []) + (
            [f"'probe' {meta['probe'][:40]!r} is not a list of numbers"]
            if probe is not None and not (isinstance(probe, list) and all(
                type(x) in (int, float) for x in probe)) else [])
        if bad:
            raise ValueError(f"{damaged}: its metadata's {' and '.join(bad)}")
        for i, layer in enumerate(layers):  # every table, of consistent lengths
            for side in ("k", "v"):
                cb, th = getattr(layer, f"{side}_codebook"), getattr(layer, f"{side}_thresholds")
                if cb is None or th is None or cb.dim() != 2 or tuple(th.shape) != (
                        cb.shape[0], cb.shape[1] - 1):
                    raise ValueError(f"{damaged}: layer {i}'s {side}_codebook / {side}_thresholds "
                                     "are missing or of inconsistent shapes ([heads, 2**bits] and "
                                     "[heads, 2**bits - 1])")
                # searchsorted needs ascending thresholds (it coded against unsorted ones
                # silently), and a non-finite entry dequantizes to inf / NaN
                # (a codebook out of order, against ordered thresholds, gave codes the wrong
                # entries silently)
                if not (cb.isfinite().all() and th.isfinite().all()
                        and (th[:, 1:] >= th[:, :-1]).all() and (cb[:, 1:] >= cb[:, :-1]).all()):
                    raise ValueError(f"{damaged}: layer {i}'s {side}_codebook / {side}_thresholds "
                                     "hold a non-finite entry or thresholds out of ascending "
                                     "order (or codebook entries)")
                bits = fields["spec"].get(f"{'key' if side == 'k' else 'value'}_bits")
                if isinstance(bits, int) and cb.shape[1] != 1 << bits:  # (refused later by
                    # the cache, naming no file)
                    raise ValueError(f"{damaged}: layer {i}'s {side}_codebook holds "
                                     f"{cb.shape[1]} entries per head, its spec's "
                                     f"{'key' if side == 'k' else 'value'}_bits={bits} needs "
                                     f"{1 << bits}")
            # the offline key rows (key_scales="calibrated"): a NaN / inf one loaded silently
            scale, zero = layer.k_scale, layer.k_zero
            if fields["spec"].get("key_scales") == "calibrated" or (scale is None) != (
                    zero is None):
                for name in _OFFLINE_ROWS:
                    if getattr(layer, name) is None:
                        raise ValueError(f"{damaged}: layer {i}'s {name} (offline key rows, "
                                         "key_scales='calibrated') is missing")
            if scale is not None:
                if scale.dim() != 2 or scale.shape != zero.shape or (
                        scale.shape[0] != layer.k_codebook.shape[0]):
                    raise ValueError(f"{damaged}: layer {i}'s k_scale {list(scale.shape)} and "
                                     f"k_zero {list(zero.shape)} must both be [heads, head_dim], "
                                     f"with the codebook's {layer.k_codebook.shape[0]} heads")
                for name, t in (("k_scale", scale), ("k_zero", zero)):
                    if not (t.isfinite().all() and (name == "k_zero" or (t >= 0).all())):
                        raise ValueError(f"{damaged}: layer {i}'s {name} holds a non-finite"
                                         + (" or negative" if name == "k_scale" else "")
                                         + " entry")
        return cls(layers, fields["spec"], meta["fingerprint"], meta.get("model", ""),
                   meta.get("preset", ""), meta.get("data", ""), meta.get("date", ""),
                   fields.get("extra", {}), fields.get("probe"), str(path))


def _capture_attention(store: dict, grad: bool):
    """An attention function recording each layer's (post-RoPE) K and V, then running SDPA, or
    with an attention-logit cap (Gemma2; SDPA has none) the capped eager form
    (:func:`kvbits.methods.model_calls.full_attention`; the model's own eager attention, given
    the SDPA mask, let every token see the ones after it)."""
    def fn(module, query, key, value, attention_mask, **kwargs):
        if grad:
            key.retain_grad()
            value.retain_grad()
        store.setdefault(module.layer_idx, []).append((key, value))
        return full_attention(module, query, key, value, attention_mask, **kwargs)
    return fn


def collect_kv(model, input_ids: torch.Tensor, window: int = CALIBRATION_WINDOW,
               fisher: bool = True, pre_rope: bool = True, log=None):
    """Per layer ``(K, V, gK2, gV2)`` of shape ``[H, T, D]`` over the calibration tokens.

    The text is cut into windows of ``window`` tokens, each run from position 0 without a cache
    (:func:`kvbits.methods.calibration_chunks`).
    ``K`` is pre-RoPE when ``pre_rope`` (the gradient is rotated the same way: the rotation is
    orthogonal). ``gK2``/``gV2`` are squared gradients of the mean next-token loss (None without
    ``fisher``).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from ..reference.rope import model_inv_freqs, partial_rotary_layout, unrotate

    inv_freqs = model_inv_freqs(model) if pre_rope else None
    name = "kvbits_calibrate"
    config = model.config
    old_impl = config._attn_implementation
    params = [p for p in model.parameters() if p.requires_grad]
    out: dict[int, list] = {}
    chunks = calibration_chunks(input_ids, window)
    try:
        for p in params:
            p.requires_grad_(False)
        for w, chunk in enumerate(chunks):
            chunk = chunk.to(model.device)
            rec: dict[int, list] = {}
            AttentionInterface.register(name, _capture_attention(rec, fisher))
            AttentionMaskInterface.register(name, sdpa_mask)
            model.set_attn_implementation(name)
            with torch.set_grad_enabled(fisher):
                embeds = model.get_input_embeddings()(chunk)
                if fisher:
                    embeds.requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits
                if fisher:
                    loss = torch.nn.functional.cross_entropy(
                        logits[0, :-1].float(), chunk[0, 1:], reduction="mean")
                    loss.backward()
            T = chunk.shape[1]
            pos = torch.arange(T)[None]
            for i, ((k, v),) in sorted(rec.items()):
                kk, vv = k.detach()[0].float().cpu(), v.detach()[0].float().cpu()
                gk = gv = None
                if fisher:
                    gk, gv = k.grad[0].float().cpu(), v.grad[0].float().cpu() ** 2
                if pre_rope and inv_freqs[i] is not None:  # (None: the model has no RoPE)
                    # the rotation is orthogonal: dL/dk_pre = R^T dL/dk_post
                    # (a partial rotary embedding: in the store's channel order, LayerStore)
                    order, inv = partial_rotary_layout(inv_freqs[i], kk.shape[-1])
                    if order is not None:
                        kk = kk.index_select(-1, order)
                        gk = gk.index_select(-1, order) if fisher else gk
                    kk = unrotate(kk[None], pos, inv)[0]
                    if fisher:
                        gk = unrotate(gk[None], pos, inv)[0]
                if fisher:
                    gk = gk ** 2
                out.setdefault(i, []).append((kk, vv, gk, gv))
            if log:
                log(f"calibration window {w + 1}/{len(chunks)}: {T} tokens")
    finally:
        model.set_attn_implementation(old_impl)
        for p in params:
            p.requires_grad_(True)
    result = []
    for i in sorted(out):
        parts = out[i]
        cat = [torch.cat([p[j] for p in parts], dim=1) if parts[0][j] is not None else None
               for j in range(4)]
        result.append(tuple(cat))
    return result


# a group narrower than this fraction of its zero's magnitude is not fitted on (_resolved)
FIT_MIN_RANGE = 2.0 ** -8


def _resolved(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Bool mask of the groups whose FP16 ``scale`` resolves them, the only ones whose elements
    a codebook fit learns from. A group with scale 0 (a constant channel: a repeated calibration
    token makes every pre-RoPE key channel of the first layer one) dequantizes to its zero
    whatever the codebook, and one whose range is within a few float16 steps of its zero
    (``scale * (2**bits - 1) < FIT_MIN_RANGE * |zero|``) normalizes to rounding artifacts, up to
    several code units outside ``[0, 2**bits - 1]``. Fitted on, they pulled a repeated-token
    text's codebooks onto 0 and ~``2**bits - 1`` (SmolLM2 layer 0 keys: 50x the error of the
    uniform codebook on other text). No real text's groups are that narrow (SmolLM2,
    Qwen2.5-0.5B: none; Gemma3-270M: 1.3% of key groups with scale 0, whose exclusion changed
    its codebooks by < 1e-3)."""
    s, z = scale.float(), zero.float()
    return (s > 0) & (s * ((1 << bits) - 1) >= FIT_MIN_RANGE * z.abs())


def _fit_one(u: torch.Tensor, w: torch.Tensor | None, bits: int, qnorm: bool):
    """Codebook and thresholds ``[2**bits]``, ``[2**bits - 1]`` for normalized data ``u``; the
    uniform codebook (KIVI's levels) when ``u`` is empty (no group the fit can learn from:
    :func:`_resolved`).

    The ends are fitted like the other entries, although every group's min and max normalize
    to exactly ``0`` and ``2**bits - 1``: pinning them there (``kmeans_1d(ends=...)``, as
    uniform min-max does) measured better on one text and worse on others
    (``benchmarks/results/codebook_ends.md``)."""
    if u.numel() == 0:
        cb = torch.arange(1 << bits, dtype=torch.float32)
        return cb, thresholds_of(cb)
    cb = kmeans_1d(u, w, 1 << bits)
    th = thresholds_of(cb)
    if qnorm:
        q = cb[torch.bucketize(u.float(), th)]
        mu, su = u.float().mean(), u.float().std()
        mq, sq = q.mean(), q.std()
        if sq > 0:
            cb = (cb - mq) * (su / sq) + mu
    return cb, th


def fit_layer(k, v, gk, gv, spec: QuantSpec, window: int | None = None) -> LayerCodebooks:
    """Codebooks of one layer from its calibration ``K, V [H, T, D]`` (and Fisher weights).
    ``window``: the calibration's window length (each window's first token, an attention sink
    of the model, is left out of offline key ranges)."""
    H, T, D = k.shape
    G = spec.group_size
    n_out = spec.n_outliers(D)
    S = 0  # independent of sink_tokens: the same file serves every S
    t1 = T // G * G
    if t1 <= S:
        raise ValueError(f"calibration needs at least {G} tokens of text in all (one group, "
                         f"group_size {G}), got {T}: give more --tokens (or a longer text)")
    kb, vb = spec.key_bits, spec.value_bits
    if not spec.fisher:
        gk = gv = None
    vg, vs, vz, vd, _ = _split_values(v[None, :, S:t1], vb, spec.value_group(D), n_out, None)
    vu = _normalize(vg, vs, vz)[0]
    vw = None if gv is None else channel_groups(gv[:, S:t1], spec.value_group(D))[0]
    vd = torch.ones_like(vu, dtype=torch.bool) if vd is None else vd[0]
    vd = vd & _resolved(vs, vz, vb)[0]

    def fit(u, w, dense, bits):
        if spec.codebook == "layer":
            cb, th = _fit_one(u[dense], None if w is None else w[dense], bits, spec.qnorm)
            return cb.expand(H, -1).contiguous(), th.expand(H, -1).contiguous()
        cbs, ths = zip(*(_fit_one(u[h][dense[h]], None if w is None else w[h][dense[h]], bits,
                                  spec.qnorm) for h in range(H)))
        return torch.stack(cbs), torch.stack(ths)

    if spec.key_scales == "calibrated":
        keep = torch.ones(T, dtype=torch.bool)
        keep[::window or T] = False
        k_scale, k_zero = offline_key_rows(k, kb, keep)
        return LayerCodebooks(*_fit_offline_keys(k[:, keep], None if gk is None else gk[:, keep],
                                                 k_scale, k_zero, n_out, fit, kb),
                              *fit(vu, vw, vd, vb), k_scale, k_zero)
    kg, ks, kz, kd, _ = _split_keys(k[None, :, S:t1], kb, G, n_out, None)
    ku = _normalize(kg, ks, kz)[0]  # [H, NG, G, D]
    kw = None if gk is None else gk[:, S:t1].reshape(ku.shape)
    kd = torch.ones_like(ku, dtype=torch.bool) if kd is None else kd[0]
    kd = kd & _resolved(ks, kz, kb)[0]
    return LayerCodebooks(*fit(ku, kw, kd, kb), *fit(vu, vw, vd, vb))


def _fit_offline_keys(k, w, scale, zero, n_out: int, fit, bits: int):
    """Key codebook of a layer with offline rows: fitted on the keys normalized by them, each
    token's ``n_out`` largest-error channels left out (as the cache will make them outliers),
    twice: with the uniform codebook's errors, then with the first fit's."""
    H, _, D = k.shape
    s, z = scale.float().view(H, 1, D), zero.float().view(H, 1, D)
    u = _normalize(k, s, z)
    cb = torch.arange(1 << bits, dtype=torch.float32).expand(H, -1).contiguous()
    for _ in range(2):
        codes = _codes(u[None], thresholds_of(cb))[0]
        err = (k - (_lookup(cb, codes[None])[0] * s + z)).abs()
        dense = torch.ones_like(u, dtype=torch.bool)
        if n_out:
            dense.scatter_(-1, err.topk(n_out, dim=-1).indices, False)
        dense &= _resolved(s, z, bits)
        cb, th = fit(u, w, dense, bits)
    return cb, th


def calibration_path(model, spec: QuantSpec, text: str, tokens: int,
                     dtype: torch.dtype | None = None) -> Path:
    """Where :func:`auto_calibration` caches the calibration of ``model`` for ``spec``. The key
    holds the model's dtype (or ``dtype``) where it is not float32
    (:func:`kvbits.methods.dtype_key`): a calibration made on a float16 model (``kvbits ppl
    --device cuda``) is not reused for a float32 one; float32 keys are those made before the
    dtype was keyed."""
    from ..checks import is_count
    from ..data import cache_dir

    # (tokens="4096" or 0 made a path, then failed inside the tokenizer or the fit; a text that
    # is not a string was a TypeError in pathlib)
    if not isinstance(text, str):
        raise TypeError(f"calibration text must be a text name or a file path (str), got "
                        f"{type(text).__name__}")
    if not is_count(tokens, 2):
        raise ValueError(f"calibration tokens must be an integer >= 2, got {tokens!r}")
    tokens = int(tokens)
    fields = {k: v for k, v in spec_fields(spec).items()  # (the digests made before a field
              if k not in _FIELD_DEFAULTS or v != _FIELD_DEFAULTS[k]}  # existed still hold)
    if spec.key_scales == "calibrated":
        fields["offline_key_rule"] = OFFLINE_KEY_RULE
    if _outlier_rule_applies(spec):
        fields["outlier_rule"] = OUTLIER_RULE
    key = json.dumps({**fields, "text": text, "tokens": tokens, **_text_file_key(text),
                      **dtype_key(model, dtype)}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return cache_dir() / "calibrations" / f"{model_fingerprint(model)}-{digest}.safetensors"


def _outlier_rule_applies(spec: QuantSpec) -> bool:
    """Whether :data:`OUTLIER_RULE` shaped a calibration for ``spec``: only where there are
    outliers and the keys take their group's min/max (with offline key rows a token's key
    outliers are its largest errors, and the values' rule did not change)."""
    return bool(spec.outliers) and spec.key_scales == "group"


def _text_file_key(text: str) -> dict:
    """A calibration text that is a file, not a named text: its contents' digest, for the cache
    key (keyed on the path alone, a file edited since, or another file of the same relative
    path, reused a calibration made on other text). Named texts add nothing (their keys and
    cached files stay as they were)."""
    from ..data import TEXTS, read_text_file

    path = Path(text).expanduser()
    if text in TEXTS or not path.is_file():
        return {}
    return {"text_sha1": hashlib.sha1(read_text_file(path).encode()).hexdigest()}


def auto_calibration(model, spec: QuantSpec, *, model_name: str = "", preset: str = "",
                     text: str = "sotu-pre-2000", tokens: int = 4096, log=None) -> Calibration:
    """The cached calibration of ``model`` for ``spec``, made on ``text`` (SOTU 1900-1999 by
    default: disjoint from the 2010-2016 evaluation text) the first time.

    Cached per model dtype (:func:`calibration_path`). A model in half precision takes the
    float32 calibration of the same weights where one is cached (``kvbits calibrate --device
    cuda`` makes one on a GPU): its Fisher weights did not underflow; else it calibrates in its
    own dtype, cached under that. A float32 model never takes a half-precision calibration."""
    path = calibration_path(model, spec, text, tokens)
    if dtype_key(model):
        f32 = calibration_path(model, spec, text, tokens, dtype=torch.float32)
        if f32.exists():
            if log:
                log(f"{spec.describe()}: the float32 calibration cached at {f32} serves this "
                    f"{dtype_name(model_dtype(model))} model")
            return Calibration.load(f32)
    if path.exists():
        return Calibration.load(path)
    from ..data import load_text, tokenize_text

    if log:
        log(f"calibrating {model_name or model_fingerprint(model)} for {spec.describe()} on "
            f"{tokens} tokens of {text!r} (cached at {path})")
    tok = _tokenizer_of(model)
    ids = tokenize_text(tok, load_text(text, log=log), tokens)
    cal = calibrate(model, ids, spec, model_name=model_name, preset=preset,
                    data=f"{text}:{ids.shape[1]} tokens", log=log)
    cal.save(path)
    return cal


def _check_calibration_ids(model, input_ids) -> None:
    """``input_ids`` as :func:`calibrate` takes them: a float tensor or a list failed inside the
    embedding (or on ``.reshape``), ids past the vocabulary were an IndexError there, and a
    batch of several sequences was silently run as one text across their boundaries."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"calibrate: input_ids must be a torch.Tensor of token ids [1, T], got "
                        f"{type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex \
            or input_ids.dtype == torch.bool:
        raise TypeError(f"calibrate: input_ids must be integer token ids, got {input_ids.dtype}")
    if not (input_ids.dim() == 1 or (input_ids.dim() == 2 and input_ids.shape[0] == 1)):
        raise ValueError(f"calibrate: input_ids must have shape [1, T] or [T] (one text), got "
                         f"{list(input_ids.shape)}")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if input_ids.numel() and isinstance(vocab, int) and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(f"calibrate: input_ids must be in [0, {vocab}) (the model's input "
                         f"embedding rows), got ids from {int(input_ids.min())} to "
                         f"{int(input_ids.max())}")


def _tokenizer_of(model):
    tok = getattr(model, "_kvbits_tokenizer", None)
    if tok is None:
        raise ValueError("auto calibration needs the model's tokenizer: set "
                         "model._kvbits_tokenizer = tokenizer (kvbits.data.load_model does), or "
                         "pass calibration=PATH made with `kvbits calibrate`")
    return tok


def calibrate(model, input_ids: torch.Tensor, spec: QuantSpec, *, model_name: str = "",
              preset: str = "", data: str = "", window: int = CALIBRATION_WINDOW,
              log=None) -> Calibration:
    """Fit the codebooks of every layer of ``model`` for ``spec`` on ``input_ids [1, T]``."""
    from ..checks import is_count
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"calibrate: spec must be a QuantSpec, got {type(spec).__name__}")
    _check_calibration_ids(model, input_ids)
    if spec.method != "kvquant":
        raise ValueError(f"calibrate: QuantSpec.method must be 'kvquant', got {spec.method!r}")
    if not is_count(window, 2):  # (a float or a string was a TypeError inside, naming nothing)
        raise ValueError(f"calibrate: window must be an integer >= 2 (tokens per window, its "
                         f"first only context), got {window!r}")
    window = int(window)
    input_ids = input_ids.long()  # (int32 ids failed in the Fisher loss: "expected ... Long")
    kv = collect_kv(model, input_ids, window=window, fisher=spec.fisher, pre_rope=spec.pre_rope,
                    log=log)
    for i, (_, _, gk, gv) in enumerate(kv):  # (k-means failed on them naming nothing)
        for side, g in (("keys", gk), ("values", gv)):
            if g is not None and not bool(g.isfinite().all()):
                raise ValueError(
                    f"calibrate: the Fisher weights (squared gradients of the loss) of layer "
                    f"{i}'s {side} are not finite: the loss or its gradients overflowed in the "
                    f"model's {dtype_name(model_dtype(model))}; calibrate in float32 "
                    "(model.float(), or `kvbits calibrate --dtype float32`, its default), or "
                    "with fisher=False")
    layers = [fit_layer(*layer, spec, window=window) for layer in kv]
    probe = weight_probe(model)
    return Calibration(layers, spec_fields(spec), model_fingerprint(model, probe), model_name,
                       preset, data,
                       datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                       {"tokens": int(input_ids.numel()), "window": window,
                        "dtype": dtype_name(model_dtype(model)),
                        "device": str(model.device),
                        **({"outlier_rule": OUTLIER_RULE} if _outlier_rule_applies(spec)
                           else {})}, probe)
