"""KIVI quantization in plain PyTorch: the oracle for the ``quantize_pack`` kernel.

Asymmetric min-max over a group: ``scale = (max - min) / (2**bits - 1)``, ``zero = min``,
``code = clamp(round((x - zero) / scale), 0, 2**bits - 1)``. Scale and zero are rounded to FP16
*before* the codes are computed, so ``code * scale + zero`` with the stored FP16 parameters is the
value the rounding aimed at. A constant group has scale 0: its codes are 0 and it dequantizes to
exactly ``zero``, never NaN. Tokens marked invalid (padding) are excluded from min and max, get
code 0, and are never attended to.

Float16 scales and zeros bound what a group holds, in both directions:

* Range: a BF16/FP32 group beyond +-65504 saturates there (:func:`minmax_qparams`): its elements
  beyond dequantize to +-65504, the rest of the group with a step of its clipped range.
  :meth:`kvbits.cache.store.LayerStore._check_range` warns at each layer's first flush.
* Resolution: a scale below float16's smallest normal, ``2**-14`` (a group range below
  ``(2**bits - 1) * 2**-14``: 1.8e-4 at 2 bits, 9.2e-4 at 4, 1.6e-2 at 8), is subnormal, in
  absolute steps of ``2**-24``. Rounded to nearest it can lose up to ``2**-25``, and the codes
  near the top then clamp at ``2**bits - 1``: up to ``(2**bits - 1) * 2**-25`` more error at the
  group's max. Worst error over the ideal half step ``range / (2 (2**bits - 1))`` (measured on
  uniform random groups): 8 bits 2.1x at a range of 2e-3, 24x at 2e-4, 120x at
  2e-5 (about two bits' worth); 4 bits 1.02x at 2e-5, 3.4x at 2e-6, 35x at 2e-7; 2 bits 1.05x
  at 2e-6, 1.3x at 2e-7. SmolLM2-135M's K/V had no such group at any width. Rounding the
  scale *up* to float16 instead (every code then fits) brings 8 bits to 1.08x at 2e-4 and 2x at
  2e-5; it changes the format's rounding, so the kernels (``quantize_pack``, Triton and Gluon)
  would have to change with this oracle. FP8 scales are float32 and unaffected.
* NaN: a NaN element makes its group's min / max NaN: the whole group (``group_size`` tokens of
  one key channel, or one token's ``value_group`` channels) dequantizes to NaN, in its own
  sequence and head only; FP16 attention over that head is NaN either way.

Shapes follow :mod:`kvbits.formats.layout`.
"""

from __future__ import annotations

import torch

from ..checks import is_count
from ..formats.layout import check_value_group
from ..formats.packing import PACK_BITS, pack_bits, packed_length, unpack_bits


def _check_args(op: str, name: str, x: torch.Tensor, bits: int, group_size: int,
                valid: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """The kernels' argument checks (bits, ``[B, H, T, D]``, group size, mask): ``(B, H, T, D)``."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in PACK_BITS:
        raise ValueError(f"{op}: bits must be one of {PACK_BITS}, got {bits!r}")
    if x.dim() != 4:
        raise ValueError(f"{op}: {name} must be [B, H, T, D], got shape {tuple(x.shape)}")
    if not is_count(group_size, 1):
        raise ValueError(f"{op}: group_size must be a positive int, got {group_size!r}")
    B, H, T, D = x.shape
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (B, T)):
        raise ValueError(f"{op}: valid must be a bool [B, T] = [{B}, {T}] tensor, got "
                         f"{valid.dtype} {tuple(valid.shape)}")
    return B, H, T, D


def _check_params(op: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  want: tuple, words: int) -> None:
    """``scale`` and ``zero`` of shape ``want`` and ``codes`` holding at least ``words`` rows
    (more: a buffer's capacity). A zero of another shape broadcast silently (one group's zero
    for every group; a value scale of another channel grouping likewise), and a short
    ``codes`` or a token count that is not whole groups failed in a reshape."""
    for name, t in (("scale", scale), ("zero", zero)):
        if tuple(t.shape) != want:
            shown = ", ".join("n" if w < 0 else str(w) for w in want)
            raise ValueError(f"{op}: {name} must be [{shown}] for codes "
                             f"{list(codes.shape)}, got {list(t.shape)}")
    if codes.shape[2] < words:
        raise ValueError(f"{op}: codes hold {codes.shape[2]} rows of words, the {want[2]} "
                         f"scale rows need {words}")


FP16_MAX = 65504.0  # the largest finite float16


def minmax_qparams(x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None):
    """FP16 ``(scale, zero)`` of asymmetric min-max quantization reducing over ``dim``.

    ``valid`` (bool, broadcastable to ``x``) excludes elements; a group with no valid element gets
    scale 0 and zero 0.
    """
    xf = x.float()
    if valid is None:
        lo = xf.amin(dim, keepdim=True)
        hi = xf.amax(dim, keepdim=True)
    else:
        valid = valid.expand_as(xf)
        lo = torch.where(valid, xf, torch.inf).amin(dim, keepdim=True)
        hi = torch.where(valid, xf, -torch.inf).amax(dim, keepdim=True)
        empty = ~valid.any(dim, keepdim=True)
        lo = torch.where(empty, 0.0, lo)
        hi = torch.where(empty, 0.0, hi)
    # Scales and zeros are FP16: a BF16/FP32 group beyond its range saturates at +-65504 (its
    # codes clamp to the ends) instead of storing an infinite zero or scale (NaN on dequant).
    lo = lo.clamp(-FP16_MAX, FP16_MAX)
    hi = hi.clamp(-FP16_MAX, FP16_MAX)
    zero = lo.to(torch.float16)
    # The range is measured from the FP16 zero so codes cover [zero, hi] after rounding.
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a scalar divisor, which is
    # not the correctly rounded quotient (and differs from CPU and the kernel in the last bit).
    scale = ((hi - zero.float()) / torch.full_like(hi, (1 << bits) - 1)).to(torch.float16)
    scale = top_code_in_fp16(scale, zero, bits)
    return scale, zero


def top_code_in_fp16(scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``scale`` one float16 step down where the top code ``zero + scale * (2**bits - 1)`` would
    pass 65504: a scale rounded up to float16 can put it there, and the kernels dequantize with
    one float16 rounding (inf, then NaN in attention). The top code then dequantizes at or below
    the group's max (its values clamp to that code)."""
    top = zero.float() + scale.float() * ((1 << bits) - 1)
    return torch.where(top > FP16_MAX, torch.nextafter(scale, torch.zeros_like(scale)), scale)


def quantize_with(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes of ``x`` for given FP16 ``scale``/``zero`` (broadcast); invalid -> 0."""
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round((x.float() - zero.float()) / safe)
    q = torch.where(s > 0, q, torch.zeros_like(q)).clamp_(0, (1 << bits) - 1)
    if valid is not None:
        q = torch.where(valid.expand_as(q), q, torch.zeros_like(q))
    return q.to(torch.uint8)


def dequantize_with(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale + zero`` in float32, cast to ``dtype``."""
    return (codes.float() * scale.float() + zero.float()).to(dtype)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int,
                  valid: torch.Tensor | None = None):
    """Per-channel key quantization over groups of ``group_size`` tokens.

    Args:
        k: ``[B, H, T, D]`` with T a multiple of ``group_size``.
        valid: optional ``[B, T]`` bool, False for padding tokens.

    Returns:
        ``codes [B, H, T // G * Wk, D] int32``, ``scale, zero [B, H, T // G, D] float16``.
    """
    B, H, T, D = _check_args("quantize_keys", "k", k, bits, group_size, valid)
    G = group_size
    if T % G:
        raise ValueError(f"quantize_keys: token count {T} is not a multiple of group_size {G}")
    kg = k.reshape(B, H, T // G, G, D)  # [B, H, NG, G, D]
    vg = None if valid is None else valid.reshape(B, 1, T // G, G, 1)
    scale, zero = minmax_qparams(kg, bits, dim=3, valid=vg)  # [B, H, NG, 1, D]
    codes = quantize_with(kg, scale, zero, bits, vg)
    words = pack_bits(codes, bits, dim=3, check=False)  # [B, H, NG, Wk, D]; clamped codes
    return (words.reshape(B, H, -1, D), scale.squeeze(3), zero.squeeze(3))


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_keys`: ``[B, H, NG * Wk, D]`` words -> ``[B, H, NG * G, D]``."""
    B, H, _, D = _check_args("dequantize_keys", "codes", codes, bits, group_size)
    NG = scale.shape[2] if scale.dim() == 4 else -1
    Wk = packed_length(group_size, bits)
    _check_params("dequantize_keys", codes, scale, zero, (B, H, NG, D), NG * Wk)
    words = codes[:, :, : NG * Wk].reshape(B, H, NG, Wk, D)
    q = unpack_bits(words, bits, group_size, dim=3)  # [B, H, NG, G, D]
    x = dequantize_with(q, scale.unsqueeze(3), zero.unsqueeze(3), dtype)
    return x.reshape(B, H, NG * group_size, D)


def channel_groups(x: torch.Tensor, group: int, op: str = "channel_groups"):
    """``[..., D]`` -> ``([..., NGv, Gv], in_range)`` with ``NGv = ceil(D / Gv)``: per-token
    groups of ``group`` channels, the last one shorter when ``group`` does not divide D (KIVI's
    groups of G channels at head_dim 80 or 100). The short group is padded with zeros and
    ``in_range`` (bool ``[NGv, Gv]``, None when nothing is padded) marks the real channels, which
    alone set a group's min / max. ``op`` names the caller in a bad ``group``'s error."""
    D = x.shape[-1]
    check_value_group(op, group, D)
    pad = -D % group
    if not pad:
        return x.reshape(*x.shape[:-1], D // group, group), None
    x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], -1)
    in_range = (torch.arange(D + pad, device=x.device) < D).view(-1, group)
    return x.reshape(*x.shape[:-1], (D + pad) // group, group), in_range  # (no -1: see ungroup)


def ungroup(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`channel_groups`: ``[..., NGv, Gv]`` -> ``[..., D]`` (padding dropped;
    the size spelled out: a -1 is ambiguous when another axis is 0, as with no tokens)."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])[..., :head_dim]


def quantize_values(v: torch.Tensor, bits: int, value_group: int, group_size: int,
                    valid: torch.Tensor | None = None):
    """Per-token value quantization over groups of ``value_group`` channels (the last group
    shorter when it does not divide D, see :func:`channel_groups`).

    The codes are packed along *tokens*, within blocks of ``group_size`` tokens, exactly like the
    keys: a decode kernel then unpacks matching K and V tiles with the same shifts, and the
    per-token scales fold into the attention probabilities.

    Args:
        v: ``[B, H, T, D]`` with T a multiple of ``group_size``.
        valid: optional ``[B, T]`` bool, False for padding tokens (codes, scale, zero all 0).

    Returns:
        ``codes [B, H, T // G * Wv, D] int32`` (``Wv = packed_length(G, bits)``),
        ``scale, zero [B, H, T, ceil(D / Gv)] float16``.
    """
    B, H, T, D = _check_args("quantize_values", "v", v, bits, group_size, valid)
    G = group_size
    if T % G:
        raise ValueError(f"quantize_values: token count {T} is not a multiple of group_size {G}")
    vg, in_range = channel_groups(v, value_group, "quantize_values")
    ok = None if valid is None else valid.reshape(B, 1, T, 1, 1)
    if in_range is not None:
        ok = in_range if ok is None else ok & in_range
    scale, zero = minmax_qparams(vg, bits, dim=4, valid=ok)  # [B, H, T, NGv, 1]
    codes = ungroup(quantize_with(vg, scale, zero, bits, ok), D).reshape(B, H, T // G, G, D)
    words = pack_bits(codes, bits, dim=3, check=False)  # [B, H, NG, Wv, D]; clamped codes
    return words.reshape(B, H, -1, D), scale.squeeze(4), zero.squeeze(4)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                      value_group: int, group_size: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_values`: ``[B, H, NG * Wv, D]`` words -> ``[B, H, T, D]``."""
    B, H, _, D = _check_args("dequantize_values", "codes", codes, bits, group_size)
    check_value_group("dequantize_values", value_group, D)
    T = scale.shape[2] if scale.dim() == 4 else -1
    NG = T // group_size
    Wv = packed_length(group_size, bits)
    if T % group_size:
        raise ValueError(f"dequantize_values: scale holds {T} tokens, not whole groups of "
                         f"group_size {group_size}")
    _check_params("dequantize_values", codes, scale, zero, (B, H, T, -(-D // value_group)),
                  NG * Wv)
    words = codes[:, :, : NG * Wv].reshape(B, H, NG, Wv, D)
    q = unpack_bits(words, bits, group_size, dim=3).reshape(B, H, T, D)
    qg, _ = channel_groups(q, value_group, "dequantize_values")
    return ungroup(dequantize_with(qg, scale.unsqueeze(-1), zero.unsqueeze(-1), dtype), D)


# ------------------------------------------------------------------------------------------ fp8
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Scales are set from an amax (the prompt's, or calibration text's) times this headroom, so
# later tokens up to twice as large are still represented; e4m3's relative precision is the same
# over its normal range, so the headroom costs only the smallest (subnormal) values.
FP8_HEADROOM = 2.0


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 dequant multiplier for an absolute maximum: ``amax * headroom / 448`` (1 when
    the amax is 0, or so small that the product underflows to 0: a float32 subnormal amax,
    whose zeros then quantized as 0 / 0 = NaN). The amax saturates at FP16's +-65504 as the
    integer methods' ranges do: an infinite K/V element made the scale infinite and the whole
    head NaN (``0 * inf``)."""
    scale = amax.float().clamp(max=FP16_MAX) * FP8_HEADROOM / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
    """float8_e4m3fn codes of ``x / scale`` (``scale`` broadcast, e.g. ``[B, H, 1, 1]``),
    saturated to +-448 (a cast would give NaN beyond it); invalid tokens -> 0.

    ``valid``: optional ``[B, T]`` bool for ``x [B, H, T, D]``."""
    y = (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX)
    if valid is not None:
        y = torch.where(valid[:, None, :, None], y, torch.zeros_like(y))
    return y.to(FP8_DTYPE)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(code) * scale`` in float32, cast to ``dtype``."""
    return (codes.float() * scale.float()).to(dtype)


def fp8_amax(x: torch.Tensor, valid: torch.Tensor | None = None,
             granularity: str = "head") -> torch.Tensor:
    """``|x|`` max of ``x [B, H, T, D]`` per sequence and head (``[B, H, 1, 1]``), or over all
    heads too (``granularity="tensor"``, still ``[B, H, 1, 1]``); invalid tokens excluded, and
    so are NaN and +-inf elements: the scale describes the finite ones (a NaN made the amax
    NaN, hence scale 1, and an inf made it 65504 x 2 / 448, for the head, or with "tensor" every
    head of the sequence, for the whole generation). The element itself still quantizes to NaN
    or to +-448 (saturated)."""
    if granularity not in ("head", "tensor"):  # (another string was taken as "head" silently)
        raise ValueError(f"fp8_amax: granularity must be 'head' or 'tensor', got "
                         f"{granularity!r}")
    a = x.float().abs()
    keep = torch.isfinite(a)
    if valid is not None:
        keep &= valid[:, None, :, None]
    a = torch.where(keep, a, torch.zeros_like(a))
    amax = a.amax(dim=(2, 3), keepdim=True)
    if granularity == "tensor":
        amax = amax.amax(dim=1, keepdim=True).expand_as(amax).contiguous()
    return amax
