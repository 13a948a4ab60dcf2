"""Fused KIVI quantize + pack: one launch reads K or V once and writes codes, FP16 scales and zeros.

Bit-exact with :mod:`kvbits.reference.quant` (codes, scales and zeros compare with ``torch.equal``):

* min/max in float32 over the valid elements of a group (an empty group gets min = max = 0);
* ``zero = fp16(min)``, ``scale = fp16((max - float(zero)) / (2**bits - 1))`` with an IEEE
  (correctly rounded) division, as torch does;
* ``code = clamp(round((x - zero) / scale), 0, 2**bits - 1)`` with an IEEE division and
  round-half-to-even (``torch.round``), 0 where ``scale <= 0`` and for invalid tokens;
* the slot-major int32 layout of :mod:`kvbits.formats.packing`, along *tokens* within each group
  of G tokens for both K and V: token ``e`` of a group sits in column ``w = e % W``, slot
  ``s = e // W``; 2/4/8 bits put slot ``s`` in bits ``[s * bits, (s + 1) * bits)`` of word ``w``
  (the top slot may set the sign bit, as ``pack_bits`` does in two's complement); 3 bits store
  bit ``j`` of slot ``s`` at bit ``s`` of word ``j * W + w``.

Every program loads its tokens directly in packed order, as a ``[SLOTS, W, ...]`` tile (token
``s * W + w``), so packing is an OR of shifted codes over the leading axis: no reshape, any G.

* Keys (per-channel groups of G tokens), grid ``(n_groups * d_blocks, H, B)``: a program holds
  a whole group x ``BLOCK_D`` channels, ``[SLOTS, W, BLOCK_D]``, and reduces over both token axes.
* Values (per-token groups of Gv channels), grid ``(n_groups * w_blocks * c_blocks, H, B)``: a
  program holds ``BLOCK_W`` columns of a group x ``BLOCK_NG`` channel groups,
  ``[SLOTS, BLOCK_W, BLOCK_NG, Gv]``, and reduces over the last axis.

Inputs are any-strided ``[B, H, T, D]`` fp16/bf16/fp32 (not copied, but for a channel stride so
large that ``(D - 1) * stride`` passes int32: :func:`_channels_in_int32`), assumed finite and
within FP16 range (scale and zero are FP16; beyond it the reference's codes are undefined too).
Offsets are int64 (the channel's, ``d * stride_d``, int32). The launchers do no host synchronisation, so they are safe to call every
decode step and to capture in a CUDA graph. ``TRITON_INTERPRET=1`` runs them on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.layout import check_value_group
from ..formats.packing import PACK_BITS, packed_length, slots_per_column
from . import quantize_pack_gluon as _gluon

# On CUDA, shapes with a Gluon plan go to quantize_pack_gluon (the slot axis in-thread; H200:
# benchmarks/results/decode_attention_quantize_pack.md). False keeps every call on the Triton
# kernels below (a switch for comparisons).
GLUON = True

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NUM_WARPS = 4
# (elements of x one program holds, channels a value program reads per token row), per device.
# GPU: 4096 fp32 = 32 registers per thread at 4 warps, enough bytes in flight per program while a
# key-group flush in decode (T = G) still spreads over several programs; 128 channels = 256 B
# of fp16 per token row, whole 32 B sectors. The interpreter (CPU) pays per program, not per
# element, so it takes whole groups.
_TILES = {"cuda": (4096, 128), "cpu": (1 << 16, 1 << 10)}


@triton.jit
def _div(a, b):
    """IEEE division (``/`` may lower to an approximate one on GPU), broadcasting like ``/``."""
    a, b = tl.broadcast(a, b)
    return tl.div_rn(a, b)


@triton.jit
def _round_half_even(y):
    """``torch.round`` for float32: adding 1.5 * 2**23 leaves no fraction bits, so the add's own
    round-to-nearest-even rounds ``y`` to an integer, ties to even, for ``|y| < 2**22``;
    subtracting it back is exact. Larger ``|y|`` stays beyond [0, 255] and is clamped anyway."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _qparams(lo, hi, MAXQ: tl.constexpr):
    """FP16 (scale, zero) from float32 min/max, rounded exactly as the reference rounds them
    (min/max saturated at the FP16 range first, as the reference does)."""
    lo = tl.minimum(tl.maximum(lo, -65504.0), 65504.0)
    hi = tl.minimum(tl.maximum(hi, -65504.0), 65504.0)
    zero = lo.to(tl.float16)
    scale = _div(hi - zero.to(tl.float32), tl.full(hi.shape, MAXQ, tl.float32)).to(tl.float16)
    # the reference's step down where the top code would pass 65504 (a positive float16's
    # bits minus one are the next float16 toward zero)
    top = zero.to(tl.float32) + scale.to(tl.float32) * MAXQ
    down = (scale.to(tl.int16, bitcast=True) - 1).to(tl.float16, bitcast=True)
    scale = tl.where(top > 65504.0, down, scale)
    return scale, zero


@triton.jit
def _codes(x, scale, zero, ok, MAXQ: tl.constexpr):
    """int32 codes of float32 ``x`` for broadcast FP16 ``scale``/``zero``; 0 where not ``ok``."""
    s = scale.to(tl.float32)
    q = _round_half_even(_div(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0)))
    q = tl.minimum(tl.maximum(tl.where(s > 0, q, 0.0), 0.0), MAXQ)
    return tl.where(ok, q, 0.0).to(tl.int32)


@triton.jit
def _group_tokens(g, w, valid_ptr, b, valid_sb, valid_st, G: tl.constexpr, W: tl.constexpr,
                  SLOTS: tl.constexpr, HAS_VALID: tl.constexpr):
    """Tokens of group ``g`` in packed order, for columns ``w``: ``(t, in_group, ok)``, each
    ``[SLOTS, len(w)]``: absolute token ``t = g * G + s * W + w``, whether it exists, whether it
    is also valid (not padding)."""
    e = tl.arange(0, SLOTS)[:, None] * W + w[None, :]
    in_group = (w[None, :] < W) & (e < G)
    t = g * G + e
    ok = in_group
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + b * valid_sb + t * valid_st, mask=in_group, other=0) != 0)
    return t, in_group, ok


@triton.jit
def _store_packed(ptrs, q, slot, mask, plane_stride, BITS: tl.constexpr):
    """Pack int32 codes ``q [SLOTS, ...]`` over axis 0 and store the words at ``ptrs``.

    ``slot`` is ``arange(SLOTS)`` shaped to broadcast against ``q``. Fields (2/4/8 bits): slot
    ``s`` in bits ``[s * BITS, (s + 1) * BITS)``. The shifted codes have disjoint bits, so their
    int32 sum has no carries and equals their OR (``tl.sum`` is also a native reduction in the
    interpreter, unlike a custom OR combine); only the top slot can set the sign bit, which
    ``<<`` does in two's complement exactly like ``pack_bits``. 3 bits: three bit-plane words
    ``plane_stride`` apart, bit ``j`` of slot ``s`` at bit ``s``.
    """
    if BITS == 3:
        for j in tl.static_range(3):
            plane = tl.sum(((q >> j) & 1) << slot, axis=0)
            tl.store(ptrs + j * plane_stride, plane, mask=mask)
    else:
        tl.store(ptrs, tl.sum(q << (slot * BITS), axis=0), mask=mask)


@triton.jit
def _quantize_keys_kernel(
    k_ptr, valid_ptr, codes_ptr, scale_ptr, zero_ptr,
    H, NG, stride_b, stride_h, stride_t, stride_d, valid_sb, valid_st,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, SLOTS: tl.constexpr, W: tl.constexpr,
    W_PAD: tl.constexpr, WORDS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_VALID: tl.constexpr,
):
    # k: [B, H, NG * G, D] any strides; codes: [B, H, NG * WORDS, D]; scale, zero: [B, H, NG, D].
    MAXQ: tl.constexpr = (1 << BITS) - 1
    D_BLOCKS: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    g = (pid // D_BLOCKS).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    bh = b * H + h

    w = tl.arange(0, W_PAD)
    t, _, ok = _group_tokens(g, w, valid_ptr, b, valid_sb, valid_st, G, W, SLOTS, HAS_VALID)
    d = (pid % D_BLOCKS) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    m = ok[:, :, None] & d_ok[None, None, :]
    ptrs = k_ptr + b * stride_b + h * stride_h + t[:, :, None] * stride_t + d * stride_d
    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)  # [SLOTS, W_PAD, BLOCK_D]

    lo = tl.min(tl.min(tl.where(m, x, float("inf")), axis=0), axis=0)  # [BLOCK_D]
    hi = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=0), axis=0)
    empty = tl.max(tl.max(ok.to(tl.int32), axis=1), axis=0) == 0  # all padding: scale 0, zero 0
    scale, zero = _qparams(tl.where(empty, 0.0, lo), tl.where(empty, 0.0, hi), MAXQ)
    qp = (bh * NG + g) * D + d
    tl.store(scale_ptr + qp, scale, mask=d_ok)
    tl.store(zero_ptr + qp, zero, mask=d_ok)

    q = _codes(x, scale[None, None, :], zero[None, None, :], m, MAXQ)
    words = codes_ptr + ((bh * NG + g) * WORDS + w[:, None]) * D + d[None, :]  # [W_PAD, BLOCK_D]
    slot = tl.arange(0, SLOTS)[:, None, None]
    _store_packed(words, q, slot, (w[:, None] < W) & d_ok[None, :], W * D, BITS)


@triton.jit
def _quantize_values_kernel(
    v_ptr, valid_ptr, codes_ptr, scale_ptr, zero_ptr,
    H, NG, stride_b, stride_h, stride_t, stride_d, valid_sb, valid_st,
    D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, GV_PAD: tl.constexpr,
    NGV: tl.constexpr, BITS: tl.constexpr, SLOTS: tl.constexpr, W: tl.constexpr,
    WORDS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_NG: tl.constexpr, HAS_VALID: tl.constexpr,
):
    # v: [B, H, NG * G, D] any strides; codes: [B, H, NG * WORDS, D]; scale, zero: [B, H, T, NGV].
    MAXQ: tl.constexpr = (1 << BITS) - 1
    W_BLOCKS: tl.constexpr = (W + BLOCK_W - 1) // BLOCK_W
    C_BLOCKS: tl.constexpr = (NGV + BLOCK_NG - 1) // BLOCK_NG
    pid = tl.program_id(0)
    g = (pid // (W_BLOCKS * C_BLOCKS)).to(tl.int64)
    wb = pid // C_BLOCKS % W_BLOCKS
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    bh = b * H + h

    w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    t, in_group, ok = _group_tokens(g, w, valid_ptr, b, valid_sb, valid_st, G, W, SLOTS,
                                    HAS_VALID)
    j = (pid % C_BLOCKS) * BLOCK_NG + tl.arange(0, BLOCK_NG)
    i = tl.arange(0, GV_PAD)
    c = j[:, None] * GV + i[None, :]  # [BLOCK_NG, GV_PAD]: channel
    c_ok = (j[:, None] < NGV) & (i[None, :] < GV) & (c < D)  # the last group may be shorter
    m = ok[:, :, None, None] & c_ok[None, None]
    ptrs = v_ptr + b * stride_b + h * stride_h + t[:, :, None, None] * stride_t + c * stride_d
    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)  # [SLOTS, BLOCK_W, BLOCK_NG, GV_PAD]

    lo = tl.min(tl.where(m, x, float("inf")), axis=3)  # [SLOTS, BLOCK_W, BLOCK_NG]
    hi = tl.max(tl.where(m, x, float("-inf")), axis=3)
    pad = ~ok[:, :, None]  # padding tokens: scale 0, zero 0
    scale, zero = _qparams(tl.where(pad, 0.0, lo), tl.where(pad, 0.0, hi), MAXQ)
    qp = (bh * NG * G + t)[:, :, None] * NGV + j
    qp_ok = in_group[:, :, None] & (j < NGV)
    tl.store(scale_ptr + qp, scale, mask=qp_ok)
    tl.store(zero_ptr + qp, zero, mask=qp_ok)

    q = _codes(x, scale[:, :, :, None], zero[:, :, :, None], m, MAXQ)
    # words: [BLOCK_W, BLOCK_NG, GV_PAD]
    words = codes_ptr + ((bh * NG + g) * WORDS + w[:, None, None]) * D + c
    slot = tl.arange(0, SLOTS)[:, None, None, None]
    _store_packed(words, q, slot, (w[:, None, None] < W) & c_ok, W * D, BITS)


def _packed_outputs(x: torch.Tensor, bits: int, G: int, NG: int, param_shape: tuple):
    """Empty ``codes [B, H, NG * Wg, D] int32`` (packed along tokens in groups of G) and FP16
    ``scale``, ``zero`` of ``[B, H, *param_shape]``, on ``x``'s device."""
    B, H, _, D = x.shape
    codes = torch.empty(B, H, NG * packed_length(G, bits), D, dtype=torch.int32, device=x.device)
    scale = torch.empty(B, H, *param_shape, dtype=torch.float16, device=x.device)
    return codes, scale, torch.empty_like(scale)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int,
                  valid: torch.Tensor | None = None):
    """Per-channel key quantization over groups of ``group_size`` tokens, in one Triton launch.

    Same contract as :func:`kvbits.reference.quant.quantize_keys`.

    Args:
        k: ``[B, H, T, D]`` float16/bfloat16/float32, any strides, T a multiple of ``group_size``.
        bits: 2, 3, 4 or 8.
        group_size: G, tokens per group (any G >= 1; powers of two are the fast case).
        valid: optional ``[B, T]`` bool, False for padding tokens.

    Returns:
        ``codes [B, H, T // G * Wk, D] int32`` with ``Wk = packed_length(G, bits)``,
        ``scale, zero [B, H, T // G, D] float16``; all contiguous.

    >>> codes, scale, zero = quantize_keys(k, 2, 32)  # k: [1, 8, 4096, 128] fp16 on CUDA
    """
    B, H, T, D = _check_input("quantize_keys", "k", k, bits, group_size, valid)
    k = _channels_in_int32(k)
    G, NG = group_size, T // group_size
    slots, W = slots_per_column(bits), -(-G // slots_per_column(bits))
    codes, scale, zero = _packed_outputs(k, bits, G, NG, (NG, D))
    if codes.numel() == 0:
        return codes, scale, zero
    vptr, vsb, vst = _valid_args(valid, k)
    if GLUON and _gluon.eligible(k, bits, G):
        _gluon.quantize_keys(k, bits, G, NG, codes, scale, zero, (vptr, vsb, vst),
                             valid is not None)
        return codes, scale, zero
    w_pad = _next_pow2(W)
    tile, _ = _TILES["cuda" if k.is_cuda else "cpu"]
    # Stats span the whole group, so a program takes every token and splits the channels.
    block_d = max(1, min(_next_pow2(D), tile // (slots * w_pad)))
    grid = (NG * _cdiv(D, block_d), H, B)
    _quantize_keys_kernel[grid](
        k, vptr, codes, scale, zero, H, NG, *k.stride(), vsb, vst,
        D=D, G=G, BITS=bits, SLOTS=slots, W=W, W_PAD=w_pad, WORDS=packed_length(G, bits),
        BLOCK_D=block_d, HAS_VALID=valid is not None, num_warps=_NUM_WARPS,
    )
    return codes, scale, zero


def quantize_values(v: torch.Tensor, bits: int, value_group: int, group_size: int,
                    valid: torch.Tensor | None = None):
    """Per-token value quantization over groups of ``value_group`` channels, in one Triton launch,
    packed along tokens within blocks of ``group_size`` tokens like the keys.

    Same contract as :func:`kvbits.reference.quant.quantize_values`.

    Args:
        v: ``[B, H, T, D]`` float16/bfloat16/float32, any strides, T a multiple of
            ``group_size``.
        bits: 2, 3, 4 or 8.
        value_group: Gv, channels per (scale, zero); the last group is shorter when Gv does
            not divide D.
        group_size: G, tokens per packed block.
        valid: optional ``[B, T]`` bool, False for padding tokens (codes, scale, zero all 0).

    Returns:
        ``codes [B, H, T // G * Wv, D] int32`` with ``Wv = packed_length(G, bits)``,
        ``scale, zero [B, H, T, ceil(D / Gv)] float16``; all contiguous.

    >>> codes, scale, zero = quantize_values(v, 2, 32, 32)  # v: [1, 8, 4096, 128] fp16 on CUDA
    """
    B, H, T, D = _check_input("quantize_values", "v", v, bits, group_size, valid)
    check_value_group("quantize_values", value_group, D)
    v = _channels_in_int32(v)
    G, NG, NGV = group_size, T // group_size, _cdiv(D, value_group)
    slots, W = slots_per_column(bits), -(-G // slots_per_column(bits))
    codes, scale, zero = _packed_outputs(v, bits, G, NG, (T, NGV))
    if codes.numel() == 0:
        return codes, scale, zero
    vptr, vsb, vst = _valid_args(valid, v)
    if GLUON and _gluon.eligible(v, bits, G, value_group):
        _gluon.quantize_values(v, bits, value_group, G, NG, codes, scale, zero, (vptr, vsb, vst),
                               valid is not None)
        return codes, scale, zero
    gv_pad = _next_pow2(value_group)
    tile, channels = _TILES["cuda" if v.is_cuda else "cpu"]
    # Stats are per token, so a program takes whole channel groups and splits the columns.
    block_ng = max(1, min(_next_pow2(NGV), channels // gv_pad))
    block_w = max(1, min(_next_pow2(W), tile // (slots * block_ng * gv_pad)))
    grid = (NG * _cdiv(W, block_w) * _cdiv(NGV, block_ng), H, B)
    _quantize_values_kernel[grid](
        v, vptr, codes, scale, zero, H, NG, *v.stride(), vsb, vst,
        D=D, G=G, GV=value_group, GV_PAD=gv_pad, NGV=NGV, BITS=bits, SLOTS=slots, W=W,
        WORDS=packed_length(G, bits), BLOCK_W=block_w, BLOCK_NG=block_ng,
        HAS_VALID=valid is not None, num_warps=_NUM_WARPS,
    )
    return codes, scale, zero


def _check_input(op: str, name: str, x: torch.Tensor, bits: int, group_size: int,
                 valid: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Validate shapes and dtypes (metadata only: no host sync); return ``(B, H, T, D)``."""
    if type(bits) is not int or bits not in PACK_BITS:  # (2.0 == 2 and True == 1 pass "in")
        raise ValueError(f"{op}: bits must be one of {PACK_BITS}, got {bits!r}")
    if x.dim() != 4:
        raise ValueError(f"{op}: {name} must be [B, H, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32, got {x.dtype}")
    B, H, T, D = x.shape
    if type(group_size) is not int or group_size < 1 or T % group_size:
        raise ValueError(f"{op}: group_size must be a positive int dividing the token count {T}, "
                         f"got {group_size!r}")
    if valid is not None:
        if valid.dtype != torch.bool or tuple(valid.shape) != (B, T):
            raise ValueError(f"{op}: valid must be a bool [B, T] = [{B}, {T}] tensor, got "
                             f"{valid.dtype} {tuple(valid.shape)}")
        if valid.device != x.device:
            raise ValueError(f"{op}: valid is on {valid.device} but {name} is on {x.device}")
    return B, H, T, D


def _channels_in_int32(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where its channel offsets ``d * stride(3)`` pass int32: the
    kernels compute them in int32 (a ``[B, H, T, D]`` view of a ``[B, H, D, T]`` buffer of 2**24
    tokens read out of bounds: a crash, or other memory's values). Such a view is the only case
    copied."""
    if (x.shape[3] - 1) * x.stride(3) >= 2**31:
        return x.contiguous()
    return x


def _valid_args(valid: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """``(pointer, stride_b, stride_t)`` of the validity mask; ``x`` stands in, never read."""
    if valid is None:
        return x, 0, 0
    return valid, valid.stride(0), valid.stride(1)


# Host-side integer helpers: triton.cdiv / triton.next_power_of_2 are JIT-wrapped functions whose
# host calls cost microseconds each, which adds up on small decode steps.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
