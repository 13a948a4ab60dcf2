"""Fused quantize + pack on CUDA with the register layouts stated (Gluon, sm_80+).

Same contract and the same bits as :mod:`kvbits.kernels.quantize_pack` (bit-exact with
:mod:`kvbits.reference.quant`); that module dispatches here on CUDA when :func:`keys_plan` /
:func:`values_plan` accept the shape. Why a second kernel: packing ORs the codes of one word's
``SLOTS`` tokens, and the Triton kernel cannot choose where those tokens live. Its layout follows
memory order (channels over lanes, then tokens over lanes and warps), so every word and every
per-channel min/max is a cross-warp reduction through shared memory with barriers: on the H200
its key kernel moved 5-9% of the copy bandwidth, its value kernel 24-36%
(``benchmarks/results/decode_attention_quantize_pack.md``). Here:

* **keys** (per-channel min/max over G tokens): one layout ``[SLOTS, W, BLOCK_D]`` whose slot
  axis lies entirely in each thread. Min/max over the slots and the packing OR are in-thread;
  only the ``W`` word columns cross lanes (a shuffle or two).
* **values** (per-token min/max over GV channels): statistics in a layout where each thread holds
  up to 32 channels of one token (``[SLOTS, W, NGB, GV]``, in-thread min/max), then the codes,
  one byte each, change layout once (``convert_layout``) into the slot-in-thread layout of the
  packing.

Division: ``code = round((x - zero) / scale)`` must use the correctly rounded quotient. Per
element this is ``q = a * y`` with ``y = RN(1 / scale)`` (one IEEE division per channel or
token), then two residual corrections ``q += (a - q * scale) * y`` with FMAs: the first brings
``q`` within one ulp, after which the second is correctly rounded (Markstein's theorem; the
residual ``a - q * scale`` is exact in an FMA). Rounding to an integer adds ``1.5 * 2**23``
(round-half-to-even by the adder itself); the clamped sum's low bits are the code.
"""

from __future__ import annotations

import functools

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves everything.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None


def _compile_time(fn):
    """Host helpers the kernels also call while compiling (Gluon allows only
    ``constexpr_function``s there); plain functions without Gluon."""
    return fn if gluon is None else gluon.constexpr_function(fn)


@_compile_time
def _slots(bits: int) -> int:
    """:func:`kvbits.formats.packing.slots_per_column` (bits already checked by the caller)."""
    return 32 if bits == 3 else 32 // bits

# Elements of x one program holds (32 per thread at 4 warps); enough bytes in flight per SM.
TILE = 4096


@_compile_time
def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@_compile_time
def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@_compile_time
def _fill(shape, per_thread, lane_order, warp_order, num_warps):
    """A blocked layout's ``(size_per_thread, threads_per_warp, warps_per_cta)`` over ``shape``
    (powers of two): lanes then warps go to the axes in the given orders, each axis taking what it
    still has room for; the rest of each axis repeats in registers. ``None`` when the lanes or the
    warps cannot all be placed without two threads holding the same element."""
    rest = [n // p for n, p in zip(shape, per_thread)]
    if any(n % p for n, p in zip(shape, per_thread)):
        return None
    placed = []
    for order, count in ((lane_order, 32), (warp_order, num_warps)):
        split = [1] * len(shape)
        for axis in order:
            take = min(count, rest[axis])
            split[axis], rest[axis], count = take, rest[axis] // take, count // take
        if count > 1:
            return None
        placed.append(split)
    return list(per_thread), placed[0], placed[1]


@_compile_time
def _shape_ok(bits: int, G: int) -> tuple[int, int] | None:
    """``(SLOTS, W)`` when groups of G tokens fill whole packed words (powers of two), else None."""
    slots = _slots(bits)
    if not _pow2(G) or G % slots:
        return None
    return slots, G // slots


@_compile_time
def _keys_plan(bits: int, G: int, D: int):
    """Launch plan for the key kernel: ``dict(block_d, num_warps, layout)`` or None (the Triton
    kernel then serves). A program holds one group of G tokens x ``block_d`` channels, each
    thread all slots x ``wt`` word columns x ``vec`` channels (32 elements; 64 at 3 bits). Lanes
    go first to channels until a warp reads 32 bytes of each token row (whole sectors), then to
    the word columns (a shuffle per lane bit, per channel: cheap next to the slots' in-thread
    work), then to channels; warps to channels, then columns."""
    sw = _shape_ok(bits, G)
    if sw is None:
        return None
    slots, W = sw
    vec = min(4, max(2, 32 // slots))  # 3 bits: 32 slots x 2 channels (4-byte loads)
    wt = min(W, max(1, 32 // (slots * vec)))
    block_d = min(_next_pow2(D), max(vec, TILE // G))
    lanes_d = min(block_d // vec, max(1, 16 // vec))
    lanes_w = min(32 // lanes_d, W // wt)
    lanes_d *= min(32 // (lanes_d * lanes_w), block_d // (vec * lanes_d))
    if lanes_d * lanes_w != 32:
        return None
    warps_d = min(4, block_d // (vec * lanes_d))
    warps_w = min(4 // warps_d, W // (wt * lanes_w))
    layout = ([slots, wt, vec], [1, lanes_w, lanes_d], [1, warps_w, warps_d])
    return {"block_d": block_d, "num_warps": warps_d * warps_w, "layout": layout}


@_compile_time
def _values_plan(bits: int, G: int, GV: int, D: int):
    """Launch plan for the value kernel: ``dict(ngb, num_warps, stats, pack)`` or None. A program
    holds one group of G tokens x ``ngb`` value groups of GV channels; ``stats`` puts up to 32
    channels of one token in each thread, ``pack`` all slots of a word."""
    sw = _shape_ok(bits, G)
    if sw is None or not _pow2(GV) or D % GV:
        return None
    slots, W = sw
    ngb = min(_next_pow2(D // GV), max(1, TILE // (G * GV)))
    shape = [slots, W, ngb, GV]
    num_warps = max(1, min(8, G * ngb * GV // 1024))
    stats = _fill(shape, [1, 1, 1, min(GV, 32)], (3, 1, 0, 2), (0, 2, 1), num_warps)
    pack = _fill(shape, [slots, 1, 1, min(GV, max(1, 32 // slots))], (3, 2, 1), (2, 1, 3),
                 num_warps)
    if stats is None or pack is None:
        return None
    return {"ngb": ngb, "num_warps": num_warps, "stats": stats, "pack": pack}


# Host calls of the plans (a constexpr_function call costs ~20-50 us; the launchers run on every
# decode-step flush), cached; the kernels call the uncached ones while compiling.
@functools.cache
def keys_plan(bits: int, G: int, D: int):
    return _keys_plan(bits, G, D)


@functools.cache
def values_plan(bits: int, G: int, GV: int, D: int):
    return _values_plan(bits, G, GV, D)


keys_plan.__doc__, values_plan.__doc__ = _keys_plan.__doc__, _values_plan.__doc__

if gluon is not None:
    _MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2**23: x + _MAGIC rounds x to an integer (ties to even)
    _MAGIC_BITS = gl.constexpr(0x4B400000)  # its bit pattern; the low 22 bits then hold the integer

    @gluon.constexpr_function
    def _blocked(kind, bits, G, GV, D):
        """The plan's layout ``kind`` ("keys", "stats", "pack") as a Gluon ``BlockedLayout``."""
        kind, bits, G, GV, D = (getattr(x, "value", x) for x in (kind, bits, G, GV, D))
        plan = _keys_plan(bits, G, D) if kind == "keys" else _values_plan(bits, G, GV, D)
        spt, lanes, warps = plan["layout" if kind == "keys" else kind]
        return gl.BlockedLayout(spt, lanes, warps, list(range(len(spt) - 1, -1, -1)))

    @gluon.constexpr_function
    def _axis(layout, axis, rank):
        """The 1-D layout of ``layout``'s axis ``axis``: every other axis sliced away, highest
        first, so that ``x[None, :, None]``-style indexing expands it back."""
        axis, rank = int(getattr(axis, "value", axis)), int(getattr(rank, "value", rank))
        for dim in range(rank - 1, -1, -1):
            if dim != axis:
                layout = gl.SliceLayout(dim, layout)
        return layout

    @gluon.jit
    def _program(BLOCKS: gl.constexpr, H):
        """Where a program of the grid ``(NG * BLOCKS, H, B)`` works: token group, block within
        the group, sequence, head, and the (sequence, head) slice index (int64 offsets)."""
        pid = gl.program_id(0)
        g = (pid // BLOCKS).to(gl.int64)
        block = pid % BLOCKS
        h = gl.program_id(1).to(gl.int64)
        b = gl.program_id(2).to(gl.int64)
        return g, block, b, h, b * H + h

    @gluon.jit
    def _over_tokens(v):
        """``[BLOCK_D]`` (a reduction over both token axes) back to ``[1, 1, BLOCK_D]``."""
        return gl.expand_dims(gl.expand_dims(v, 0), 0)

    @gluon.jit
    def _qparams(lo, hi, MAXQ: gl.constexpr):
        """FP16 zero and scale from float32 min/max as the reference rounds them, and the
        correctly rounded float32 reciprocal of the scale (0 where the scale is 0); min/max
        saturated at the FP16 range first, as the reference does."""
        lo = gl.minimum(gl.maximum(lo, -65504.0), 65504.0)
        hi = gl.minimum(gl.maximum(hi, -65504.0), 65504.0)
        zero = lo.to(gl.float16)
        scale = gl.div_rn(hi - zero.to(gl.float32), gl.full_like(hi, MAXQ)).to(gl.float16)
        # the reference's step down where the top code would pass 65504 (the next float16
        # toward zero: a positive float16's bits minus one)
        top = zero.to(gl.float32) + scale.to(gl.float32) * MAXQ
        down = (scale.to(gl.int16, bitcast=True) - 1).to(gl.float16, bitcast=True)
        scale = gl.where(top > 65504.0, down, scale)
        s = scale.to(gl.float32)
        inv = gl.where(s > 0, gl.div_rn(gl.full_like(s, 1.0), gl.where(s > 0, s, 1.0)), 0.0)
        return zero, scale, inv

    @gluon.jit
    def _codes(x, zero, scale, inv, MAXQ: gl.constexpr):
        """int32 ``clamp(round_half_even((x - zero) / scale), 0, MAXQ)`` for float32 ``x`` and
        broadcast float32 ``zero``/``scale``/``inv``; 0 where ``inv`` is 0 (scale 0). ``x - zero``
        is clamped to +-4 x 65504 (a group's range is at most 2 x 65504): an infinite element
        then codes as the reference's (the end it clamps to), where the refinement's
        ``inf - inf`` made NaN, which ``maximum`` turned into code 0 (H200, session 41)."""
        a = gl.minimum(gl.maximum(x - zero, -262016.0), 262016.0)
        q = a * inv
        q = gl.fma(gl.fma(-q, scale, a), inv, q)
        q = gl.fma(gl.fma(-q, scale, a), inv, q)
        r = gl.minimum(gl.maximum(q + _MAGIC, _MAGIC), _MAGIC + MAXQ)
        return r.to(gl.int32, bitcast=True) - _MAGIC_BITS

    @gluon.jit
    def _bit_or(a, b):
        return a | b

    @gluon.jit
    def _store_words(ptrs, code, slot, mask, plane_stride, BITS: gl.constexpr,
                     MASKED: gl.constexpr):
        """Pack int32 codes ``[SLOTS, ...]`` (slot axis in-thread) over axis 0 and store."""
        if BITS == 3:
            # Bit j of slot s goes to bit s of plane j. Shifting each code once by s puts its bit
            # j at s + j, so the slots with s + j < 32 take one AND-OR (lop3) per plane into an
            # accumulator shifted right by j at the end; the top j slots, whose bit would leave
            # the word, are placed directly.
            u = code.to(gl.uint32)
            sl = slot.to(gl.uint32)
            y = u << sl
            for j in gl.static_range(3):
                low = gl.reduce(gl.where(sl + j < 32, y & (gl.full_like(y, 1) << (sl + j)), 0),
                                0, _bit_or) >> j
                high = gl.reduce(gl.where(sl + j >= 32, ((u >> j) & 1) << sl, 0), 0, _bit_or)
                plane = (low | high).to(gl.int32, bitcast=True)
                if MASKED:
                    gl.store(ptrs + j * plane_stride, plane, mask=mask)
                else:
                    gl.store(ptrs + j * plane_stride, plane)
        else:
            words = gl.sum(code << (slot * BITS), axis=0)
            if MASKED:
                gl.store(ptrs, words, mask=mask)
            else:
                gl.store(ptrs, words)

    @gluon.jit
    def _quantize_keys_kernel(
        k_ptr, valid_ptr, codes_ptr, scale_ptr, zero_ptr,
        H, NG, stride_b, stride_h, stride_t, valid_sb, valid_st,
        D: gl.constexpr, G: gl.constexpr, BITS: gl.constexpr, SLOTS: gl.constexpr,
        W: gl.constexpr, BLOCK_D: gl.constexpr, HAS_VALID: gl.constexpr,
    ):
        # k: [B, H, NG * G, D] (channel stride 1); codes [B, H, NG * WORDS, D]; scale/zero
        # [B, H, NG, D]. Grid (NG * D_BLOCKS, H, B).
        L: gl.constexpr = _blocked("keys", BITS, G, 0, D)
        MAXQ: gl.constexpr = (1 << BITS) - 1
        D_BLOCKS: gl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
        WORDS: gl.constexpr = 3 * W if BITS == 3 else W
        MASK_D: gl.constexpr = D % BLOCK_D != 0
        MASKED: gl.constexpr = MASK_D or HAS_VALID
        g, block, b, h, bh = _program(D_BLOCKS, H)

        s = gl.arange(0, SLOTS, layout=_axis(gl.SliceLayout(2, L), 0, 2))
        w = gl.arange(0, W, layout=_axis(gl.SliceLayout(2, L), 1, 2))
        # channels in the layout of a reduction over both token axes (scales, words' rows)
        d = block * BLOCK_D + gl.arange(
            0, BLOCK_D, layout=gl.SliceLayout(0, gl.SliceLayout(0, L)))
        d3 = _over_tokens(d)
        t = g * G + s[:, None] * W + w[None, :]  # [SLOTS, W]: token of each slot
        ptrs = k_ptr + b * stride_b + h * stride_h + t[:, :, None] * stride_t + d3
        if MASKED:
            ok = t >= 0
            if HAS_VALID:
                ok = ok & (gl.load(valid_ptr + b * valid_sb + t * valid_st) != 0)
            m = ok[:, :, None] & (d3 < D)
            x = gl.load(ptrs, mask=m, other=0.0).to(gl.float32)
            lo = gl.min(gl.min(gl.where(m, x, float("inf")), axis=0), axis=0)
            hi = gl.max(gl.max(gl.where(m, x, float("-inf")), axis=0), axis=0)
            if HAS_VALID:  # a group of padding only: scale 0, zero 0
                empty = gl.max(gl.max(ok.to(gl.int32), axis=1), axis=0) == 0
                lo = gl.where(empty, 0.0, lo)
                hi = gl.where(empty, 0.0, hi)
        else:
            x = gl.load(ptrs).to(gl.float32)
            lo = gl.min(gl.min(x, axis=0), axis=0)
            hi = gl.max(gl.max(x, axis=0), axis=0)
        zero, scale, inv = _qparams(lo, hi, MAXQ)
        qp = (bh * NG + g) * D + d
        gl.store(scale_ptr + qp, scale, mask=d < D)
        gl.store(zero_ptr + qp, zero, mask=d < D)

        code = _codes(x, _over_tokens(zero.to(gl.float32)), _over_tokens(scale.to(gl.float32)),
                      _over_tokens(inv), MAXQ)
        if MASKED:
            code = gl.where(m, code, 0)
        ww = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(0, L)))[:, None]
        words = codes_ptr + ((bh * NG + g) * WORDS + ww) * D + d[None, :]  # [W, BLOCK_D]
        _store_words(words, code, s[:, None, None], (d < D)[None, :] & (ww >= 0), W * D, BITS,
                     MASK_D)

    @gluon.jit
    def _quantize_values_kernel(
        v_ptr, valid_ptr, codes_ptr, scale_ptr, zero_ptr,
        H, NG, stride_b, stride_h, stride_t, valid_sb, valid_st,
        D: gl.constexpr, G: gl.constexpr, GV: gl.constexpr, BITS: gl.constexpr,
        SLOTS: gl.constexpr, W: gl.constexpr, NGB: gl.constexpr, HAS_VALID: gl.constexpr,
    ):
        # v: [B, H, NG * G, D] (channel stride 1); codes [B, H, NG * WORDS, D]; scale/zero
        # [B, H, T, NGV]. Grid (NG * C_BLOCKS, H, B); tiles [SLOTS, W, NGB, GV].
        A: gl.constexpr = _blocked("stats", BITS, G, GV, D)
        P: gl.constexpr = _blocked("pack", BITS, G, GV, D)
        MAXQ: gl.constexpr = (1 << BITS) - 1
        NGV: gl.constexpr = D // GV
        C_BLOCKS: gl.constexpr = (NGV + NGB - 1) // NGB
        WORDS: gl.constexpr = 3 * W if BITS == 3 else W
        MASK_C: gl.constexpr = NGV % NGB != 0
        MASKED: gl.constexpr = MASK_C or HAS_VALID
        g, block, b, h, bh = _program(C_BLOCKS, H)
        n0 = block * NGB

        # statistics layout: token of (slot, column), value group, channel in group
        A3: gl.constexpr = gl.SliceLayout(3, A)
        s = gl.arange(0, SLOTS, layout=_axis(A3, 0, 3))
        w = gl.arange(0, W, layout=_axis(A3, 1, 3))
        n = n0 + gl.arange(0, NGB, layout=_axis(A3, 2, 3))
        c = gl.arange(0, GV, layout=_axis(A, 3, 4))
        t = g * G + s[:, None, None] * W + w[None, :, None]  # [SLOTS, W, 1]
        ch = n[None, None, :, None] * GV + c[None, None, None, :]  # [1, 1, NGB, GV]
        ptrs = v_ptr + b * stride_b + h * stride_h + t[:, :, :, None] * stride_t + ch
        if MASKED:
            ok = (t >= 0) & (n < NGV)[None, None, :]  # [SLOTS, W, NGB]
            if HAS_VALID:
                ok = ok & (gl.load(valid_ptr + b * valid_sb + t * valid_st) != 0)
            m = ok[:, :, :, None] & (c >= 0)[None, None, None, :]
            x = gl.load(ptrs, mask=m, other=0.0).to(gl.float32)
            lo = gl.where(ok, gl.min(gl.where(m, x, float("inf")), axis=3), 0.0)
            hi = gl.where(ok, gl.max(gl.where(m, x, float("-inf")), axis=3), 0.0)
        else:
            x = gl.load(ptrs).to(gl.float32)
            lo = gl.min(x, axis=3)
            hi = gl.max(x, axis=3)
        zero, scale, inv = _qparams(lo, hi, MAXQ)  # [SLOTS, W, NGB]
        qp = (bh * NG * G + t) * NGV + n[None, None, :]
        if MASK_C:  # padding tokens keep their (0, 0); only channel groups past D are skipped
            keep = (n < NGV)[None, None, :] & (t >= 0)
            gl.store(scale_ptr + qp, scale, mask=keep)
            gl.store(zero_ptr + qp, zero, mask=keep)
        else:
            gl.store(scale_ptr + qp, scale)
            gl.store(zero_ptr + qp, zero)

        code = _codes(x, zero.to(gl.float32)[:, :, :, None], scale.to(gl.float32)[:, :, :, None],
                      inv[:, :, :, None], MAXQ)
        if MASKED:
            code = gl.where(m, code, 0)
        code = gl.convert_layout(code.to(gl.uint8), P).to(gl.int32)

        PW: gl.constexpr = gl.SliceLayout(0, P)  # words [W, NGB, GV]
        sp = gl.arange(0, SLOTS, layout=_axis(P, 0, 4))
        wp = gl.arange(0, W, layout=_axis(PW, 0, 3))
        np_ = n0 + gl.arange(0, NGB, layout=_axis(PW, 1, 3))
        cp = gl.arange(0, GV, layout=_axis(PW, 2, 3))
        chp = np_[None, :, None] * GV + cp[None, None, :]  # [1, NGB, GV]
        words = codes_ptr + ((bh * NG + g) * WORDS + wp[:, None, None]) * D + chp
        _store_words(words, code, sp[:, None, None, None], (np_ < NGV)[None, :, None]
                     & (wp >= 0)[:, None, None] & (cp >= 0)[None, None, :], W * D, BITS, MASK_C)


@functools.cache
def _capability_ok(device) -> bool:
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 8


def eligible(x, bits: int, G: int, GV: int | None = None) -> bool:
    """Whether these kernels serve ``x`` (keys if ``GV`` is None, else values): Gluon importable,
    a CUDA tensor (compute capability 8.0+) with unit channel stride, and a plan for the shape."""
    if gluon is None or not x.is_cuda or x.stride(-1) != 1 or not _capability_ok(x.device):
        return False
    D = x.shape[-1]
    return (keys_plan(bits, G, D) if GV is None else values_plan(bits, G, GV, D)) is not None


def quantize_keys(k, bits, G, NG, codes, scale, zero, valid_args, has_valid: bool) -> None:
    """Launch the key kernel into the given outputs (shapes as in ``quantize_pack``)."""
    B, H, _, D = k.shape
    plan = keys_plan(bits, G, D)
    slots = _slots(bits)
    grid = (NG * -(-D // plan["block_d"]), H, B)
    _quantize_keys_kernel[grid](
        k, valid_args[0], codes, scale, zero, H, NG, k.stride(0), k.stride(1), k.stride(2),
        valid_args[1], valid_args[2], D=D, G=G, BITS=bits, SLOTS=slots, W=G // slots,
        BLOCK_D=plan["block_d"], HAS_VALID=has_valid, num_warps=plan["num_warps"])


def quantize_values(v, bits, GV, G, NG, codes, scale, zero, valid_args, has_valid: bool) -> None:
    """Launch the value kernel into the given outputs (shapes as in ``quantize_pack``)."""
    B, H, _, D = v.shape
    plan = values_plan(bits, G, GV, D)
    slots = _slots(bits)
    grid = (NG * -(-(D // GV) // plan["ngb"]), H, B)
    _quantize_values_kernel[grid](
        v, valid_args[0], codes, scale, zero, H, NG, v.stride(0), v.stride(1), v.stride(2),
        valid_args[1], valid_args[2], D=D, G=G, GV=GV, BITS=bits, SLOTS=slots, W=G // slots,
        NGB=plan["ngb"], HAS_VALID=has_valid, num_warps=plan["num_warps"])
