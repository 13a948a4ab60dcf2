"""Fused KIVI quantize + pack: one launch reads K or V once and writes codes, FP16 scales and zeros.

Bit-exact with :mod:`kvbits.reference.quant` (codes, scales and zeros compare with ``torch.equal``):

* min/max in float32 over the valid elements of a group (an empty group gets min = max = 0);
* ``zero = fp16(min)``, ``scale = fp16((max - float(zero)) / (2**bits - 1))`` with an IEEE
  (correctly rounded) division, as torch does;
* ``code = clamp(round((x - zero) / scale), 0, 2**bits - 1)`` with an IEEE division and
  round-half-to-even (``torch.round``), 0 where ``scale <= 0`` and for invalid tokens;
* the slot-major int32 layout of :mod:`kvbits.formats.packing`: element ``e`` of a packed axis sits
  in column ``w = e % W``, slot ``s = e // W``; 2/4/8 bits put slot ``s`` in bits
  ``[s * bits, (s + 1) * bits)`` of word ``w`` (the top slot may set the sign bit, as ``pack_bits``
  does in two's complement); 3 bits store bit ``j`` of slot ``s`` at bit ``s`` of word ``j * W + w``.

Keys, grid ``(n_groups * d_blocks, H, B)``: a program loads one group of G tokens x ``BLOCK_D``
channels directly as a ``[SLOTS, W, BLOCK_D]`` tile (token ``s * W + w``), reduces min/max over
the two token axes, and ORs the shifted codes over the slot axis: no reshape, any G.

Values, grid ``(t_blocks, H, B)``: a program loads ``[BLOCK_T, D]`` as ``[BLOCK_T, NGV, GV]``
(contiguous channel groups), reduces over the last axis, and moves the codes into the packed
order ``[BLOCK_T, SLOTS, W]`` (channel ``s * W + w``) with a reshape when that order is the
natural one (power-of-two D and group) and with one in-register ``tl.gather`` otherwise (D = 80).

Inputs are any-strided ``[B, H, T, D]`` fp16/bf16/fp32 (no copy is made) and assumed finite.
Offsets are int64. The launchers do no host synchronisation, so they are safe to call every
decode step and to capture in a CUDA graph. ``TRITON_INTERPRET=1`` runs them on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats.packing import PACK_BITS, packed_length, slots_per_column

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements of x one program holds (fp32, 4 warps -> 32 per thread): big enough to hide latency,
# small enough that a key-group flush in decode (T = G) still spreads over several programs.
_TILE_ELEMENTS = 4096
_NUM_WARPS = 4


@triton.jit
def _bit_or(a, b):
    return a | b


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
    """FP16 (scale, zero) from float32 min/max, rounded exactly as the reference rounds them."""
    zero = lo.to(tl.float16)
    scale = _div(hi - zero.to(tl.float32), tl.full(hi.shape, MAXQ, tl.float32)).to(tl.float16)
    return scale, zero


@triton.jit
def _codes(x, scale, zero, ok, MAXQ: tl.constexpr):
    """int32 codes of float32 ``x`` for broadcast FP16 ``scale``/``zero``; 0 where not ``ok``."""
    s = scale.to(tl.float32)
    q = _round_half_even(_div(x - zero.to(tl.float32), tl.where(s > 0, s, 1.0)))
    q = tl.minimum(tl.maximum(tl.where(s > 0, q, 0.0), 0.0), MAXQ)
    return tl.where(ok, q, 0.0).to(tl.int32)


@triton.jit
def _pack_fields(q, slot, BITS: tl.constexpr, AXIS: tl.constexpr):
    """OR ``q << slot * BITS`` over the slot ``AXIS`` (``slot`` broadcasts against ``q``)."""
    return tl.reduce(q << (slot * BITS), AXIS, _bit_or)


@triton.jit
def _pack_plane(q, slot, J: tl.constexpr, AXIS: tl.constexpr):
    """3-bit plane ``J``: bit ``J`` of the code in slot ``s`` goes to bit ``s``."""
    return tl.reduce(((q >> J) & 1) << slot, AXIS, _bit_or)


@triton.jit
def _quantize_keys_kernel(
    k_ptr, valid_ptr, codes_ptr, scale_ptr, zero_ptr,
    H, NG, stride_b, stride_h, stride_t, stride_d, valid_sb, valid_st,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, SLOTS: tl.constexpr,
    W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_VALID: tl.constexpr,
):
    # k: [B, H, T, D] any strides; codes: [B, H, NG * WORDS, D]; scale, zero: [B, H, NG, D].
    MAXQ: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = 3 * W if BITS == 3 else W
    D_BLOCKS: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    g = (pid // D_BLOCKS).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)

    slot = tl.arange(0, SLOTS)
    w = tl.arange(0, W_PAD)
    d = (pid % D_BLOCKS) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok = slot[:, None] * W + w[None, :]  # [SLOTS, W_PAD]: token of the group in (slot, column)
    ok = (w[None, :] < W) & (tok < G)
    t = g * G + tok
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + b * valid_sb + t * valid_st, mask=ok, other=0) != 0)
    d_ok = d < D
    ptrs = k_ptr + b * stride_b + h * stride_h + t[:, :, None] * stride_t + d[None, None, :] * stride_d
    m = ok[:, :, None] & d_ok[None, None, :]
    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)  # [SLOTS, W_PAD, BLOCK_D]

    lo = tl.min(tl.min(tl.where(m, x, float("inf")), axis=0), axis=0)  # [BLOCK_D]
    hi = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=0), axis=0)
    empty = tl.max(tl.max(ok.to(tl.int32), axis=1), axis=0) == 0
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    scale, zero = _qparams(lo, hi, MAXQ)
    bh = b * H + h
    qp = (bh * NG + g) * D + d
    tl.store(scale_ptr + qp, scale, mask=d_ok)
    tl.store(zero_ptr + qp, zero, mask=d_ok)

    q = _codes(x, scale[None, None, :], zero[None, None, :], m, MAXQ)
    rows = codes_ptr + (bh * NG + g) * (WORDS * D) + w[:, None] * D + d[None, :]  # [W_PAD, BLOCK_D]
    st_ok = (w[:, None] < W) & d_ok[None, :]
    if BITS == 3:
        for j in tl.static_range(3):
            tl.store(rows + j * W * D, _pack_plane(q, slot[:, None, None], j, 0), mask=st_ok)
    else:
        tl.store(rows, _pack_fields(q, slot[:, None, None], BITS, 0), mask=st_ok)


@triton.jit
def _quantize_values_kernel(
    v_ptr, valid_ptr, codes_ptr, scale_ptr, zero_ptr,
    H, T, stride_b, stride_h, stride_t, stride_d, valid_sb, valid_st,
    D: tl.constexpr, GV: tl.constexpr, GV_PAD: tl.constexpr, NGV: tl.constexpr,
    NGV_PAD: tl.constexpr, BITS: tl.constexpr, SLOTS: tl.constexpr, W: tl.constexpr,
    W_PAD: tl.constexpr, BLOCK_T: tl.constexpr, NATURAL: tl.constexpr, HAS_VALID: tl.constexpr,
):
    # v: [B, H, T, D] any strides; codes: [B, H, T, WORDS]; scale, zero: [B, H, T, NGV].
    MAXQ: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = 3 * W if BITS == 3 else W
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)

    in_range = t < T
    ok = in_range
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + b * valid_sb + t * valid_st, mask=ok, other=0) != 0)
    grp = tl.arange(0, NGV_PAD)
    i = tl.arange(0, GV_PAD)
    c = grp[:, None] * GV + i[None, :]  # [NGV_PAD, GV_PAD] channel
    c_ok = (grp[:, None] < NGV) & (i[None, :] < GV)
    ptrs = v_ptr + b * stride_b + h * stride_h + t[:, None, None] * stride_t + c[None] * stride_d
    m = ok[:, None, None] & c_ok[None]
    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)  # [BLOCK_T, NGV_PAD, GV_PAD]

    lo = tl.min(tl.where(m, x, float("inf")), axis=2)  # [BLOCK_T, NGV_PAD]
    hi = tl.max(tl.where(m, x, float("-inf")), axis=2)
    lo = tl.where(ok[:, None], lo, 0.0)  # padding tokens: scale 0, zero 0
    hi = tl.where(ok[:, None], hi, 0.0)
    scale, zero = _qparams(lo, hi, MAXQ)
    row = (b * H + h) * T + t  # [BLOCK_T]
    qp = row[:, None] * NGV + grp[None, :]
    qp_ok = in_range[:, None] & (grp[None, :] < NGV)
    tl.store(scale_ptr + qp, scale, mask=qp_ok)
    tl.store(zero_ptr + qp, zero, mask=qp_ok)

    q = _codes(x, scale[:, :, None], zero[:, :, None], m, MAXQ)
    q = tl.reshape(q, (BLOCK_T, NGV_PAD * GV_PAD))
    slot = tl.arange(0, SLOTS)
    w = tl.arange(0, W_PAD)
    if NATURAL:
        q = tl.reshape(q, (BLOCK_T, SLOTS, W_PAD))
    else:
        e = slot[:, None] * W + w[None, :]  # [SLOTS, W_PAD]: channel in (slot, column)
        e_ok = (w[None, :] < W) & (e < D)
        src = tl.where(e_ok, (e // GV) * GV_PAD + e % GV, 0)  # its index in the natural tile
        idx = tl.broadcast_to(tl.reshape(src, (1, SLOTS * W_PAD)), (BLOCK_T, SLOTS * W_PAD))
        q = tl.reshape(tl.gather(q, idx, axis=1), (BLOCK_T, SLOTS, W_PAD))
        q = tl.where(e_ok[None], q, 0)
    rows = codes_ptr + row[:, None] * WORDS + w[None, :]  # [BLOCK_T, W_PAD]
    st_ok = in_range[:, None] & (w[None, :] < W)
    if BITS == 3:
        for j in tl.static_range(3):
            tl.store(rows + j * W, _pack_plane(q, slot[None, :, None], j, 1), mask=st_ok)
    else:
        tl.store(rows, _pack_fields(q, slot[None, :, None], BITS, 1), mask=st_ok)


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
    B, H, T, D = _check_input("quantize_keys", "k", k, bits, valid)
    if not isinstance(group_size, int) or group_size < 1 or T % group_size:
        raise ValueError(f"quantize_keys: group_size must be a positive int dividing the token "
                         f"count {T}, got {group_size!r}")
    G, NG = group_size, T // group_size
    W, slots = -(-G // slots_per_column(bits)), slots_per_column(bits)
    codes = torch.empty(B, H, NG * packed_length(G, bits), D, dtype=torch.int32, device=k.device)
    scale = torch.empty(B, H, NG, D, dtype=torch.float16, device=k.device)
    zero = torch.empty_like(scale)
    if codes.numel() == 0:
        return codes, scale, zero
    w_pad = triton.next_power_of_2(W)
    block_d = max(1, min(triton.next_power_of_2(D), _TILE_ELEMENTS // (slots * w_pad)))
    grid = (NG * triton.cdiv(D, block_d), H, B)
    vptr, vsb, vst = _valid_args(valid, k)
    _quantize_keys_kernel[grid](
        k, vptr, codes, scale, zero, H, NG, *k.stride(), vsb, vst,
        D=D, G=G, BITS=bits, SLOTS=slots, W=W, W_PAD=w_pad, BLOCK_D=block_d,
        HAS_VALID=valid is not None, num_warps=_NUM_WARPS,
    )
    return codes, scale, zero


def quantize_values(v: torch.Tensor, bits: int, value_group: int,
                    valid: torch.Tensor | None = None):
    """Per-token value quantization over groups of ``value_group`` channels, in one Triton launch.

    Same contract as :func:`kvbits.reference.quant.quantize_values`.

    Args:
        v: ``[B, H, T, D]`` float16/bfloat16/float32, any strides, D a multiple of ``value_group``.
        bits: 2, 3, 4 or 8.
        value_group: Gv, channels per group.
        valid: optional ``[B, T]`` bool, False for padding tokens (codes, scale, zero all 0).

    Returns:
        ``codes [B, H, T, Wv] int32`` with ``Wv = packed_length(D, bits)``,
        ``scale, zero [B, H, T, D // Gv] float16``; all contiguous.

    >>> codes, scale, zero = quantize_values(v, 2, 32)  # v: [1, 8, 1, 128] fp16: one decode token
    """
    B, H, T, D = _check_input("quantize_values", "v", v, bits, valid)
    if not isinstance(value_group, int) or value_group < 1 or D % value_group:
        raise ValueError(f"quantize_values: value_group must be a positive int dividing head_dim "
                         f"{D}, got {value_group!r}")
    NGV = D // value_group
    W, slots = -(-D // slots_per_column(bits)), slots_per_column(bits)
    codes = torch.empty(B, H, T, packed_length(D, bits), dtype=torch.int32, device=v.device)
    scale = torch.empty(B, H, T, NGV, dtype=torch.float16, device=v.device)
    zero = torch.empty_like(scale)
    if codes.numel() == 0:
        return codes, scale, zero
    gv_pad, ngv_pad = triton.next_power_of_2(value_group), triton.next_power_of_2(NGV)
    block_t = max(1, min(triton.next_power_of_2(T), _TILE_ELEMENTS // (gv_pad * ngv_pad)))
    w_pad = triton.next_power_of_2(W)
    # The packed order (channel s * W + w) is the natural one when both tiles are exact.
    natural = W == w_pad and slots * W == D and gv_pad == value_group and ngv_pad == NGV
    grid = (triton.cdiv(T, block_t), H, B)
    vptr, vsb, vst = _valid_args(valid, v)
    _quantize_values_kernel[grid](
        v, vptr, codes, scale, zero, H, T, *v.stride(), vsb, vst,
        D=D, GV=value_group, GV_PAD=gv_pad, NGV=NGV, NGV_PAD=ngv_pad, BITS=bits, SLOTS=slots,
        W=W, W_PAD=w_pad, BLOCK_T=block_t, NATURAL=natural, HAS_VALID=valid is not None,
        num_warps=_NUM_WARPS,
    )
    return codes, scale, zero


def _check_input(op: str, name: str, x: torch.Tensor, bits: int,
                 valid: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Validate shapes and dtypes (metadata only: no host sync); return ``(B, H, T, D)``."""
    if bits not in PACK_BITS:
        raise ValueError(f"{op}: bits must be one of {PACK_BITS}, got {bits!r}")
    if x.dim() != 4:
        raise ValueError(f"{op}: {name} must be [B, H, T, D], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} must be float16, bfloat16 or float32, got {x.dtype}")
    B, H, T, D = x.shape
    if valid is not None:
        if valid.dtype != torch.bool or tuple(valid.shape) != (B, T):
            raise ValueError(f"{op}: valid must be a bool [B, T] = [{B}, {T}] tensor, got "
                             f"{valid.dtype} {tuple(valid.shape)}")
        if valid.device != x.device:
            raise ValueError(f"{op}: valid is on {valid.device} but {name} is on {x.device}")
    return B, H, T, D


def _valid_args(valid: torch.Tensor | None, x: torch.Tensor):
    """Pointer and strides of the validity mask; ``x`` stands in (never read) when it is None."""
    if valid is None:
        return x, 0, 0
    return valid, valid.stride(0), valid.stride(1)
