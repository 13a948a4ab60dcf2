"""Flash-decoding over a packed layer: sink (FP16) + packed body + residual (FP16) in one launch.

Stage 1, grid ``(B * Hkv * m_tiles, body_splits + fp_splits)``: each program owns one KV head of
one sequence and a contiguous range of tokens. A body program loads whole key groups of packed
codes as contiguous word rows, unpacks every slot with one shift (the slot-major layout of
:mod:`kvbits.formats.packing` makes the unpacked slots contiguous token ranges, so the tile
``[tokens, D]`` is a reshape that merges leading dims), dequantizes K and V in registers (scales
on either axis, FP8, or KVQuant codebooks, outliers and pre-RoPE keys), and computes the scores
of *all* query rows of the GQA group with one ``tl.dot``, then ``P V`` with another. An FP16
program does the same over the sink and residual. Each program writes its normalised partial
output and log-sum-exp (base 2).

Stage 2, the finish kernel, merges the splits with the usual log-sum-exp weights; in eager calls
it also attends a short FP16 part itself (``FINISH_FP_TOKENS``), so that stage 1 needs no FP16
splits (one launch fewer); captured calls keep the splits, on a side stream beside a Gluon body
(``SIDE_STREAM``). On Hopper it can start as a programmatic dependent of the body kernel
(``PDL_ENABLED``, off). An eager call that stage 1 serves alone skips stage 2: the last of its
programs to finish an m-tile merges it (``MERGE_IN_SPLITS``, a ticket per m-tile).

The history is never written back to memory in full precision: the only HBM traffic is the
packed codes, the scales and zeros, the FP16 windows, Q, and the small per-split partials.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..formats.layout import WINDOW_NONE, PackedKV, check_query, pre_rope_kernel_ok
from . import decode_gluon, decode_gluon_tma
from .launch import FastLaunch, device_index, keyword_maker
from .switches import env_choice, env_switch

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(s, m_i, l_i, softcap, SOFTCAP: tl.constexpr):
    """Online-softmax bookkeeping for base-2 scores ``s [M, N]`` (-inf where masked).

    Returns the probabilities, the factor that rescales earlier partial sums, and the new max
    and sum. A row that has seen nothing keeps max -inf and sum 0 (no NaN). With ``SOFTCAP``
    the scores are first capped (Gemma2): ``softcap * tanh(score / softcap)`` in natural units,
    i.e. ``softcap * log2(e) * tanh(s / (softcap * log2(e)))`` here, with ``tanh(u) = 1 - 2 /
    (1 + e^(2u))`` (exact at both infinities; masked scores stay -inf)."""
    if SOFTCAP:
        t = 1.0 - 2.0 / (1.0 + tl.exp2(tl.minimum(s * (2.0 / softcap), 64.0)))  # no overflow
        s = tl.where(s == float("-inf"), s, (softcap * 1.4426950408889634) * t)  # log2(e)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _visible(t, pos, start, length, window, HAS_WINDOW: tl.constexpr):
    """[M, N] bool: token positions ``t [N]`` visible to query rows at positions ``pos [M]``."""
    ok = (t[None, :] <= pos[:, None]) & (t[None, :] >= start) & (t[None, :] < length)
    if HAS_WINDOW:
        ok = ok & (t[None, :] > pos[:, None] - window)
    return ok


@triton.jit
def _group_codes(base, g0, g_end, offs_d, d_ok, BITS: tl.constexpr, G: tl.constexpr,
                 GPT: tl.constexpr, D: tl.constexpr, EVEN_D: tl.constexpr):
    """Codes of ``GPT`` groups from group ``g0`` as int8 ``[GPT * G, BLOCK_D]`` in token order.

    Slot-major packing makes slot ``s`` of the W words of a group the tokens ``[s * W, (s + 1) *
    W)``, so unpacking is one broadcast shift and a reshape that merges leading dims, done while
    the codes are int8 (a quarter of the register bytes of int32). The word rows of the step are
    contiguous, so the loads vectorize; rows of groups at or past ``g_end`` are masked. Offsets
    are int32 within one (sequence, head) slice whose base the caller made int64."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    if BITS == 3:
        W3: tl.constexpr = G // 32  # words per plane per group
        rows = (g0 + tl.arange(0, GPT))[:, None] * (3 * W3) + tl.arange(0, W3)[None, :]
        mask = (rows < g_end * (3 * W3))[:, :, None]
        if not EVEN_D:
            mask = mask & d_ok[None, None, :]
        ptrs = base + rows[:, :, None] * D + offs_d[None, None, :]
        slot = tl.arange(0, 32)[None, :, None, None]
        p0 = tl.load(ptrs, mask=mask, other=0)[:, None, :, :]
        p1 = tl.load(ptrs + W3 * D, mask=mask, other=0)[:, None, :, :]
        p2 = tl.load(ptrs + 2 * W3 * D, mask=mask, other=0)[:, None, :, :]
        codes = ((p0 >> slot) & 1) | (((p1 >> slot) & 1) << 1) | (((p2 >> slot) & 1) << 2)
    else:
        W: tl.constexpr = G * BITS // 32
        SLOTS: tl.constexpr = 32 // BITS
        rows = g0 * W + tl.arange(0, GPT * W)  # contiguous rows: vector loads
        mask = (rows < g_end * W)[:, None]
        if not EVEN_D:
            mask = mask & d_ok[None, :]
        words = tl.load(base + rows[:, None] * D + offs_d[None, :], mask=mask, other=0)
        words = tl.reshape(words, [GPT, 1, W, BLOCK_D])
        shift = (tl.arange(0, SLOTS) * BITS)[None, :, None, None]
        codes = (words >> shift) & ((1 << BITS) - 1)  # [GPT, SLOTS, W, D]
    return tl.reshape(codes.to(tl.int8), [GPT * G, BLOCK_D])


@triton.jit
def _scale_tile(s_base, z_base, g0, g_hi, offs_t, offs_d, d_ok, PER_TOKEN: tl.constexpr,
                G: tl.constexpr, GPT: tl.constexpr, D: tl.constexpr, GS: tl.constexpr,
                EVEN_D: tl.constexpr, D0: tl.constexpr = 0, FIXED: tl.constexpr = False):
    """FP16 scale and zero of every element of a ``[GPT * G, BLOCK_D]`` body tile.

    ``PER_TOKEN``: one pair per (token, ``GS`` channels), stored ``[tokens, ceil(D / GS)]``
    (KIVI values, per-token keys; ``GS`` a power of two or all of D, the last group shorter
    when it does not divide D); else one pair per (group of G tokens, channel), stored
    ``[groups, D]`` (KIVI keys, per-channel values). Either way the pair is broadcast with a
    reshape that merges or splits dims, never gathered per element. ``D0``: the first channel
    of ``offs_d`` (``offs_d = D0 + arange``: half tiles of pre-RoPE keys). ``FIXED`` (per
    channel only): one ``[1, D]`` row for every group (KVQuant's offline key scales)."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    N: tl.constexpr = GPT * G
    if PER_TOKEN:
        NGS: tl.constexpr = (D + GS - 1) // GS
        NGS_PAD: tl.constexpr = BLOCK_D // GS if BLOCK_D >= GS else 1  # 1: a wider group
        offs_j = D0 // GS + tl.arange(0, NGS_PAD)
        mask = (offs_t < g_hi * G)[:, None]
        if NGS != NGS_PAD:
            mask = mask & (offs_j < NGS)[None, :]
        ptr = (offs_t * NGS)[:, None] + offs_j[None, :]
        sc = tl.load(s_base + ptr, mask=mask, other=0.0)
        ze = tl.load(z_base + ptr, mask=mask, other=0.0)
        W: tl.constexpr = BLOCK_D // NGS_PAD
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [N, NGS_PAD, W]), [N, BLOCK_D])
        ze = tl.reshape(tl.broadcast_to(ze[:, :, None], [N, NGS_PAD, W]), [N, BLOCK_D])
    else:
        grp = g0 + tl.arange(0, GPT)
        mask = (grp < g_hi)[:, None]
        if not EVEN_D:
            mask = mask & d_ok[None, :]
        ptr = ((grp * 0 if FIXED else grp) * D)[:, None] + offs_d[None, :]
        sc = tl.load(s_base + ptr, mask=mask, other=0.0)
        ze = tl.load(z_base + ptr, mask=mask, other=0.0)
        sc = tl.reshape(tl.broadcast_to(sc[:, None, :], [GPT, G, BLOCK_D]), [N, BLOCK_D])
        ze = tl.reshape(tl.broadcast_to(ze[:, None, :], [GPT, G, BLOCK_D]), [N, BLOCK_D])
    return sc, ze


@triton.jit
def _fp8_tile(base, offs_t, g_hi, offs_d, d_ok, G: tl.constexpr, D: tl.constexpr,
              EVEN_D: tl.constexpr):
    """FP8 (e4m3) body rows ``offs_t`` as float16 ``[N, BLOCK_D]``: the body is stored token by
    token, unpacked, so the tile is one load and one conversion (native on sm_89+)."""
    mask = (offs_t < g_hi * G)[:, None]
    if not EVEN_D:
        mask = mask & d_ok[None, :]
    x = tl.load(base + offs_t[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    return x.to(tl.float16)


@triton.jit
def _cb_word(cb_ptr, j0: tl.constexpr, B: tl.constexpr, SHIFT: tl.constexpr):
    """A ``prmt`` pool register: the ``B``-bit field at ``SHIFT`` (16, 0: a whole entry; 8, 0 or
    8, 8: its low or high byte) of the float16 bits of codebook entries ``j0, j0 + 1, ...``,
    packed from the low end of an int32 (2 or 4 entries).

    The value is the same in every thread; the ``%laneid >> 5`` (always 0) added in PTX hides that
    from ptxas, which otherwise keeps the table in uniform registers and copies it back into a
    vector register before nearly every ``prmt`` (~240 extra instructions per 3-bit loop step)."""
    offs = tl.arange(0, 32 // B)
    e = tl.load(cb_ptr + j0 + offs).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    w = tl.sum(((e >> SHIFT) & ((1 << B) - 1)) << (B * offs), axis=0)
    return tl.inline_asm_elementwise(
        "{.reg .u32 l; mov.u32 l, %laneid; shr.u32 l, l, 5; add.u32 $0, $1, l;}", "=r,r", [w],
        dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _lookup(c, cb_ptr, NC: tl.constexpr, USE_PRMT: tl.constexpr, F32: tl.constexpr = False):
    """int8 codes ``c`` (0 .. NC - 1) -> float16 codebook entries ``cb_ptr[code]`` (KVQuant's
    non-uniform levels in code units, float32 in memory, rounded to float16 here; ``F32``:
    kept in float32, for float32 queries, without ``USE_PRMT``).

    ``USE_PRMT`` (PTX, GPU only): the table lives in registers and a byte permute indexes it,
    four codes (one int32 of packed int8 codes) per asm instance:

    * 2 bits: the four entries are the eight bytes of two registers ``A | B``; the selector
      nibbles ``(2c, 2c + 1)`` of each code (``c * 0x22 + 0x10`` per byte, one ``mad`` for four
      codes) pick an entry's two bytes, so one ``prmt`` yields a half2: 4 instructions per four
      codes, as many as the uniform ``_codes_to_f16``.
    * 3 bits: the low bytes of the eight entries fill two registers and the high bytes two
      more; selector nibbles ``(c, c)`` (``c * 0x11``) give ``[lo, lo, lo', lo']`` and
      ``[hi, hi, hi', hi']``, one more ``prmt`` interleaves them: 8 instructions per four codes.
    * 4 bits: the same for entries 0-7 and 8-15 (``c & 7``), then a ``lop3`` picks per code by
      its bit 3, expanded to a 16-bit mask by ``prmt``'s sign-replicate mode: 20 per four.

    Larger tables (8-bit codes, 256 entries) are gathered from memory (an L1 hit), with or
    without ``USE_PRMT``; otherwise (the interpreter, CPU tests): a select per entry."""
    if NC > 16:
        DT_G: tl.constexpr = tl.float32 if F32 else tl.float16
        val = tl.load(cb_ptr + (c.to(tl.int32) & 0xFF)).to(DT_G)
    elif USE_PRMT:
        z = tl.zeros(c.shape, dtype=tl.int32)
        if NC == 4:
            a = z + _cb_word(cb_ptr, 0, 16, 0)
            b = z + _cb_word(cb_ptr, 2, 16, 0)
            # $2: four codes; $3, $7: A, B (each int32 operand is passed once per packed element)
            val = tl.inline_asm_elementwise(
                "{.reg .b32 s;\n"
                "mad.lo.u32 s, $2, 0x22, 0x10101010;\n"
                "prmt.b32 $0, $3, $7, s;\n"
                "shr.u32 s, s, 16;\n"
                "prmt.b32 $1, $3, $7, s;}",
                "=r,=r,r" + ",r" * 8, [c, a, b], dtype=tl.float16, is_pure=True, pack=4)
        elif NC == 8:
            l0 = z + _cb_word(cb_ptr, 0, 8, 0)
            l1 = z + _cb_word(cb_ptr, 4, 8, 0)
            h0 = z + _cb_word(cb_ptr, 0, 8, 8)
            h1 = z + _cb_word(cb_ptr, 4, 8, 8)
            # $3 $7: low bytes of entries 0-3, 4-7; $11 $15: high bytes.
            val = tl.inline_asm_elementwise(
                "{.reg .b32 s, lo, hi;\n"
                "mul.lo.u32 s, $2, 0x11;\n"
                "prmt.b32 lo, $3, $7, s;\n"
                "prmt.b32 hi, $11, $15, s;\n"
                "prmt.b32 $0, lo, hi, 0x7250;\n"
                "shr.u32 s, s, 16;\n"
                "prmt.b32 lo, $3, $7, s;\n"
                "prmt.b32 hi, $11, $15, s;\n"
                "prmt.b32 $1, lo, hi, 0x7250;}",
                "=r,=r,r" + ",r" * 16, [c, l0, l1, h0, h1], dtype=tl.float16, is_pure=True,
                pack=4)
        else:
            tl.static_assert(NC == 16, "codebooks of 2, 3 or 4 bits")
            l0 = z + _cb_word(cb_ptr, 0, 8, 0)
            l1 = z + _cb_word(cb_ptr, 4, 8, 0)
            l2 = z + _cb_word(cb_ptr, 8, 8, 0)
            l3 = z + _cb_word(cb_ptr, 12, 8, 0)
            h0 = z + _cb_word(cb_ptr, 0, 8, 8)
            h1 = z + _cb_word(cb_ptr, 4, 8, 8)
            h2 = z + _cb_word(cb_ptr, 8, 8, 8)
            h3 = z + _cb_word(cb_ptr, 12, 8, 8)
            # $3 $7 $11 $15: low bytes of entries 0-3 .. 12-15; $19 $23 $27 $31: high bytes.
            # m: 0xFFFF per half where the code's bit 3 is set (bit 3 moved to each byte's sign).
            val = tl.inline_asm_elementwise(
                "{.reg .b32 s, c4, lo, hi, e0, e1, m;\n"
                "and.b32 s, $2, 0x07070707;\n"
                "mul.lo.u32 s, s, 0x11;\n"
                "shl.b32 c4, $2, 4;\n"
                "prmt.b32 lo, $3, $7, s;\n"
                "prmt.b32 hi, $19, $23, s;\n"
                "prmt.b32 e0, lo, hi, 0x7250;\n"
                "prmt.b32 lo, $11, $15, s;\n"
                "prmt.b32 hi, $27, $31, s;\n"
                "prmt.b32 e1, lo, hi, 0x7250;\n"
                "prmt.b32 m, c4, 0, 0x9988;\n"
                "lop3.b32 $0, e0, e1, m, 0xD8;\n"
                "shr.u32 s, s, 16;\n"
                "prmt.b32 lo, $3, $7, s;\n"
                "prmt.b32 hi, $19, $23, s;\n"
                "prmt.b32 e0, lo, hi, 0x7250;\n"
                "prmt.b32 lo, $11, $15, s;\n"
                "prmt.b32 hi, $27, $31, s;\n"
                "prmt.b32 e1, lo, hi, 0x7250;\n"
                "prmt.b32 m, c4, 0, 0xBBAA;\n"
                "lop3.b32 $1, e0, e1, m, 0xD8;}",
                "=r,=r,r" + ",r" * 32, [c, l0, l1, l2, l3, h0, h1, h2, h3], dtype=tl.float16,
                is_pure=True, pack=4)
    else:
        DT: tl.constexpr = tl.float32 if F32 else tl.float16
        ci = c.to(tl.int32) & 0xFF
        val = tl.zeros(c.shape, dtype=DT) + tl.load(cb_ptr).to(DT)
        for j in tl.static_range(1, NC):
            val = tl.where(ci == j, tl.load(cb_ptr + j).to(DT), val)
    return val


@triton.jit
def _add_outliers(x, idx_base, val_base, offs_t, t_end, offs_d, NOUT: tl.constexpr,
                  USE_PTX: tl.constexpr):
    """Dense-and-sparse: add the ``NOUT`` FP16 corrections of each token (``x - dequant`` at the
    channel in ``idx``) to the dequantized tile ``x [N, BLOCK_D]`` (values; key outliers go to
    the scores, ``_score_outliers``).

    ``USE_PTX`` (GPU only): index and channel compared as float16 pairs: one ``prmt`` turns two
    uint8 indices into the float16 ``1024 + idx`` (bytes ``idx, 0x64``), ``set.eq.u32.f16x2``
    against ``1024 + channel`` gives a 0xFFFF mask per half, ``and`` keeps the correction where
    it matches, ``add.f16x2`` adds it: four instructions per pair of elements where the integer
    compare, select and conversions took ~6 per element. The mask (not a 1.0/0.0 factor) keeps
    an infinite correction out of the other channels. Exact for channels < 1024."""
    t_ok = offs_t < t_end
    if USE_PTX:  # 1024 + channel: the float16 that (0x6400 | idx) reads as
        dch = tl.broadcast_to((offs_d + 1024).to(tl.float16)[None, :], x.shape)
    for j in tl.static_range(NOUT):
        idx = tl.load(idx_base + offs_t * NOUT + j, mask=t_ok, other=0)
        val = tl.load(val_base + offs_t * NOUT + j, mask=t_ok, other=0.0)
        if USE_PTX:
            # $4: four uint8 indices; $2 $3: x; $5 $6: 1024 + channel; $7 $8: corrections.
            x = tl.inline_asm_elementwise(
                "{.reg .b32 i, m;\n"
                "prmt.b32 i, $4, 0x64646464, 0x4140;\n"
                "set.eq.u32.f16x2 m, i, $5;\n"
                "and.b32 m, m, $7;\n"
                "add.rn.f16x2 $0, $2, m;\n"
                "prmt.b32 i, $4, 0x64646464, 0x4342;\n"
                "set.eq.u32.f16x2 m, i, $6;\n"
                "and.b32 m, m, $8;\n"
                "add.rn.f16x2 $1, $3, m;}",
                "=r,=r,r,r,r,r,r,r,r",
                [x, tl.broadcast_to(idx.to(tl.uint8)[:, None], x.shape), dch,
                 tl.broadcast_to(val.to(tl.float16)[:, None], x.shape)],
                dtype=tl.float16, is_pure=True, pack=4)
        else:
            idx = idx.to(tl.int32)
            x = x + tl.where(offs_d[None, :] == idx[:, None], val[:, None], 0.0).to(x.dtype)
    return x


@triton.jit
def _cos_sin(a, USE_PTX: tl.constexpr):
    """``cos(a), sin(a)`` of float32 angles. ``USE_PTX`` (GPU only): reduced to ``[-pi, pi]``
    (Cody-Waite: ``a - k * 2pi`` with 2pi in two float32 parts, FMA) and the MUFU
    ``cos/sin.approx`` (absolute error ~2**-21 there): ~6 instructions, where libdevice's
    ``cosf/sinf`` take ~40 each with a branch to a slow path for large angles. The angle
    itself (position times frequency, float32) carries the larger error at large positions."""
    if USE_PTX:
        k = tl.floor(a * 0.15915494309189535 + 0.5)
        r = a - k * 6.2831854820251465
        r = r - k * -1.7484556000744883e-07
        c, s = tl.inline_asm_elementwise(
            "cos.approx.f32 $0, $2; sin.approx.f32 $1, $2;", "=r,=r,r", [r],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        c = tl.cos(a)
        s = tl.sin(a)
    return c, s


@triton.jit
def _rope_query(qa, qb, pos0, inv_freq, USE_PTX: tl.constexpr):
    """``R(pos0)^T q`` for a tile of pre-RoPE keys at positions ``pos0 + j`` (transformers'
    rotate-half convention: channel ``i`` pairs with ``i + D/2`` at angle ``pos * inv_freq[i]``).

    ``q . R(pos0 + j) k = (R(pos0)^T q) . (R(j) k)``, so the per-tile angle goes to the query
    (``[M, D]`` float32, two sines and cosines per frequency) and the keys only take the fixed
    ``R(j)`` of their offset in the tile (``_rope_keys``). ``qa, qb``: the two halves of ``q``
    (float32 ``[M, D/2]``); returns the halves of the rotated query, float32."""
    c0, s0 = _cos_sin(pos0.to(tl.float32) * inv_freq, USE_PTX)
    c0 = c0[None, :]
    s0 = s0[None, :]
    return qa * c0 + qb * s0, qb * c0 - qa * s0


@triton.jit
def _rope_keys(ka, kb, table_ptr, N: tl.constexpr, HALF: tl.constexpr):
    """``R(j) k`` of the halves ``ka, kb [N, BLOCK_H]`` (float16; ``BLOCK_H`` the power of two
    >= D/2, the lanes past D/2 zero) of a key tile, row ``j`` rotated by the angles ``j *
    inv_freq``: the fixed ``cos/sin`` table ``[2, N, D/2]`` (float16, L1-resident; the same for
    every tile, see ``_rope_query``). Float16 arithmetic: two roundings of 2**-11 on the order
    of the dequantization's one (float32 keys and table for float32 queries)."""
    BLOCK_H: tl.constexpr = ka.shape[1]
    offs_h = tl.arange(0, BLOCK_H)
    tj = (tl.arange(0, N) * HALF)[:, None] + offs_h[None, :]
    if BLOCK_H == HALF:
        cj = tl.load(table_ptr + tj)
        sj = tl.load(table_ptr + N * HALF + tj)
    else:  # head_dim 80, 96, ...: the padded lanes stay zero
        h_ok = (offs_h < HALF)[None, :]
        cj = tl.load(table_ptr + tj, mask=h_ok, other=0.0)
        sj = tl.load(table_ptr + N * HALF + tj, mask=h_ok, other=0.0)
    return ka * cj - kb * sj, kb * cj + ka * sj


@triton.jit
def _score_outliers(sc, qa, qb, idx_base, val_base, offs_t, t_end, table_ptr,
                    NOUT: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr = 0):
    """Key outliers applied on the score side: ``S[m, t] += val[t] * q'[m, idx[t]]`` for the
    ``NOUT`` FP16 corrections of each token, instead of adding them to the key tile (a compare
    per element of ``[N, D]``, ``[M, N]`` here: the query rows are few).

    Without ``ROPE``, ``qa`` is the whole (scaled) query ``[M, D]`` and ``q' = q``. With it,
    ``qa, qb`` are the halves of ``R(pos0)^T q`` (``_rope_query``), and the key of row ``j`` is
    ``R(j) (k + val e_idx)``: ``R(j) e_idx`` has two non-zeros, so with ``i = idx mod D/2``,
    ``c, s = cos, sin(j * inv_freq[i])`` (the table of ``_rope_keys``):
    ``q'[idx] = qa[i] c + qb[i] s`` for ``idx < D/2``, ``qb[i] c - qa[i] s`` above. ``HALF``:
    D/2 (the halves' lanes may be padded to a power of two)."""
    M: tl.constexpr = sc.shape[0]
    N: tl.constexpr = sc.shape[1]
    t_ok = offs_t < t_end
    for j in tl.static_range(NOUT):
        idx = tl.load(idx_base + offs_t * NOUT + j, mask=t_ok, other=0).to(tl.int32)
        val = tl.load(val_base + offs_t * NOUT + j, mask=t_ok, other=0.0).to(tl.float32)
        if ROPE:
            i = tl.where(idx >= HALF, idx - HALF, idx)
            ib = tl.broadcast_to(i[None, :], [M, N])
            ga = tl.gather(qa, ib, axis=1)
            gb = tl.gather(qb, ib, axis=1)
            row = tl.arange(0, N) * HALF + i
            c = tl.load(table_ptr + row).to(tl.float32)[None, :]
            s = tl.load(table_ptr + N * HALF + row).to(tl.float32)[None, :]
            hi = (idx >= HALF)[None, :]
            qv = tl.where(hi, gb, ga) * c + tl.where(hi, -ga, gb) * s
        else:
            qv = tl.gather(qa, tl.broadcast_to(idx[None, :], [M, N]), axis=1).to(tl.float32)
        sc = sc + qv * val[None, :]
    return sc


@triton.jit
def _dot(a, b, acc=None):
    """``tl.dot``, in full float32 for float32 operands: the tensor cores' default would round
    them to TF32 (float16's 10-bit mantissa), the error float32 dequantization avoids."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _codes_to_f16(c, USE_PRMT: tl.constexpr):
    """int8 codes (0..255 read as unsigned) -> float16, exactly: ``(code | 0x6400)`` read as
    float16 is ``1024 + code``, so an OR (or one byte permute per pair, ``USE_PRMT``: PTX,
    GPU only) and one subtraction replace a slow int->float conversion."""
    if USE_PRMT:
        # Bytes [c0, 0x64, c1, 0x64] and [c2, 0x64, c3, 0x64]: two half2 of 1024 + code.
        f = tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0x64646464, 0x4140; prmt.b32 $1, $2, 0x64646464, 0x4342;",
            "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    else:
        f = ((c.to(tl.int16) & 0xFF) | 0x6400).to(tl.float16, bitcast=True)
    return f - 1024.0


@triton.jit
def _attend_fp16(q, k_base, v_base, lo, hi, pos0, pos, start, length, window, m_i, l_i, acc,
                 offs_d, d_ok, softcap, D: tl.constexpr, BLOCK_FP: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online-softmax attention over FP16 rows ``[lo, hi)`` of one (sequence, head) slice whose
    first row sits at position ``pos0`` (sink: the sequence's start; residual: after the body),
    visible from position ``start``."""
    for i0 in range(lo, hi, BLOCK_FP):
        offs_i = i0 + tl.arange(0, BLOCK_FP)
        i_ok = offs_i < hi
        kT = tl.load(k_base + offs_i[None, :] * D + offs_d[:, None],
                     mask=d_ok[:, None] & i_ok[None, :], other=0.0)
        sc = _dot(q, kT.to(q.dtype))  # [M, BLOCK_FP]
        vis = _visible(pos0 + offs_i, pos, start, length, window, HAS_WINDOW)
        sc = tl.where(vis & i_ok[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i, softcap, SOFTCAP)
        v = tl.load(v_base + offs_i[:, None] * D + offs_d[None, :],
                    mask=i_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype))
    return m_i, l_i, acc


@triton.jit
def _attend_sink_residual(q, SinkK, SinkV, ResK, ResV, bh64, i_lo, i_hi, sink_len, body_len,
                          sink_cap, res_cap, start, pos, length, window, m_i, l_i, acc, offs_d,
                          d_ok, softcap, D: tl.constexpr, BLOCK_FP: tl.constexpr,
                          HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """FP16 tokens ``[i_lo, i_hi)`` of one (sequence, KV head): index ``i < sink_len`` is sink
    token ``i`` (the sequence's own i-th token, at position ``start + i``), else residual token
    ``i - sink_len`` (after the body)."""
    m_i, l_i, acc = _attend_fp16(q, SinkK + bh64 * sink_cap * D, SinkV + bh64 * sink_cap * D,
                                 i_lo, tl.minimum(i_hi, sink_len), start, pos, start, length,
                                 window, m_i, l_i, acc, offs_d, d_ok, softcap, D, BLOCK_FP,
                                 HAS_WINDOW, SOFTCAP)
    return _attend_fp16(q, ResK + bh64 * res_cap * D, ResV + bh64 * res_cap * D,
                        tl.maximum(i_lo, sink_len) - sink_len, i_hi - sink_len,
                        sink_len + body_len, pos, start + sink_len, length, window,
                        m_i, l_i, acc, offs_d, d_ok, softcap, D, BLOCK_FP, HAS_WINDOW, SOFTCAP)


@triton.jit
def _body_tile(c_base, s_base, z_base, cb_ptr, oi_base, ov_base, g0, g_hi, offs_t, offs_d, d_ok,
               PER_TOKEN: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, GPT: tl.constexpr,
               D: tl.constexpr, GS: tl.constexpr, EVEN_D: tl.constexpr, USE_PRMT: tl.constexpr,
               CB: tl.constexpr, NOUT: tl.constexpr, D0: tl.constexpr = 0,
               F32: tl.constexpr = False, FIXED: tl.constexpr = False):
    """Dequantized float16 body tile ``[GPT * G, BLOCK_D]`` of keys or values: ``code * scale +
    zero`` (with ``CB``, the head's codebook entry in place of the code), plus ``NOUT`` outlier
    corrections per token. ``D0``: the first channel of ``offs_d`` (see ``_scale_tile``).
    ``F32`` (float32 queries): the tile in float32 arithmetic, as the reference computes it;
    float16's rounding of ``code * scale + zero`` cancels badly where an output's norm is small
    against its values'. ``FIXED``: one scale row for every group (see ``_scale_tile``)."""
    sc, ze = _scale_tile(s_base, z_base, g0, g_hi, offs_t, offs_d, d_ok, PER_TOKEN, G, GPT, D, GS,
                         EVEN_D, D0, FIXED)
    codes = _group_codes(c_base, g0, g_hi, offs_d, d_ok, BITS, G, GPT, D, EVEN_D)
    if CB:  # KVQuant: codes index the head's codebook (in code units)
        e = _lookup(codes, cb_ptr, 1 << BITS, USE_PRMT, F32)
    else:
        e = _codes_to_f16(codes, USE_PRMT)
    if F32:
        x = e.to(tl.float32) * sc.to(tl.float32) + ze.to(tl.float32)
    else:  # one rounding: a group may span past 65504 where no value does
        x = tl.fma(e, sc, ze)
    if NOUT > 0:
        x = _add_outliers(x, oi_base, ov_base, offs_t, g_hi * G, offs_d, NOUT, USE_PRMT)
    return x


@triton.jit
def _query_tile(Q, Starts, Lens, pid, m_tiles, Hkv, Lq, qk_scale, total_len, HG: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
                HAS_STARTS: tl.constexpr, HAS_LENS: tl.constexpr):
    """The query rows of program ``pid`` (one m-tile of one (sequence, KV head)): row ``m`` is
    head ``h*HG + m // Lq``, query index ``m % Lq``; its position, its row of ``q`` and the
    scaled query tile ``[BLOCK_M, BLOCK_D]`` (``scale * log2(e)``)."""
    mt = pid % m_tiles
    bh = pid // m_tiles
    h = bh % Hkv
    b = bh // Hkv
    start = 0
    length = total_len
    if HAS_STARTS:
        start = tl.load(Starts + b)
    if HAS_LENS:
        length = tl.load(Lens + b)
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < HG * Lq
    head = h * HG + offs_m // Lq
    qi = offs_m % Lq
    pos = length - Lq + qi  # [M] position of each query row
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_row = (b.to(tl.int64) * Hkv * HG + head) * Lq + qi  # row of q in [B*Hq*Lq, D]
    q = tl.load(Q + q_row[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(Q.dtype.element_ty)
    return mt, h, bh.to(tl.int64), start, length, offs_m, m_ok, pos, offs_d, d_ok, q_row, q


@triton.jit
def _store_partial(Out, Lse, o_row, acc, m_i, l_i, offs_d, m_ok, d_ok, D: tl.constexpr):
    """A split's normalised partial output and base-2 log-sum-exp (-inf if it saw nothing)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(Out + o_row[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
             mask=m_ok[:, None] & d_ok[None, :])
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(Lse + o_row, lse, mask=m_ok)


@triton.jit
def _merge_rows(Out, Lse, O, bh64, mt, first, step, n_out, offs_d, d_ok, HG: tl.constexpr, Lq,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                ROWS: tl.constexpr):
    """Merge the ``n_out`` partial columns of one m-tile's query rows into ``O``, ``ROWS`` rows
    at a time (their rows of Out are contiguous per (sequence, KV head)), starting at the
    ``first``-th group of rows and taking every ``step``-th: weights ``exp2(lse_s - max)``.
    The loads bypass L1 (``.cg``): in the stage-1 kernel's merge (``MERGE``) other SMs wrote
    the columns while this program ran."""
    n_rows = tl.minimum(HG * Lq - mt * BLOCK_M, BLOCK_M)
    row0 = bh64 * (HG * Lq) + mt * BLOCK_M
    offs_r = tl.arange(0, ROWS)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_out
    for r0 in range(first * ROWS, n_rows, ROWS * step):
        r_ok = r0 + offs_r < n_rows
        row = row0 + r0 + offs_r
        lse = tl.load(Lse + row[:, None] * n_out + offs_s[None, :],
                      mask=r_ok[:, None] & s_ok[None, :], other=float("-inf"),
                      cache_modifier=".cg")
        mx = tl.max(lse, axis=1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mx[:, None])  # [ROWS, BLOCK_S]
        o = tl.load(Out + (row[:, None, None] * n_out + offs_s[None, :, None]) * D
                    + offs_d[None, None, :],
                    mask=(r_ok[:, None] & s_ok[None, :])[:, :, None] & d_ok[None, None, :],
                    other=0.0, cache_modifier=".cg")
        total = tl.sum(w, axis=1)
        res = tl.sum(o * w[:, :, None], axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(O + row[:, None] * D + offs_d[None, :], res.to(O.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])


# Integers that change from one decode step to the next (lengths, split geometry) are not
# specialized: Triton would compile a new variant (~1 s) whenever one crosses a divisibility
# class (== 1, % 16), i.e. again and again during a generation. None of them is a stride; the
# strides (capacities) stay specialized, and the cache keeps them multiples of 16.
_STEP_VARYING = ("sink_len", "res_len", "n_body_splits", "groups_per_split", "fp_per_split",
                 "split0", "n_out")


@triton.jit(do_not_specialize=_STEP_VARYING)
def _decode_kernel(
    Q, Out, Lse, O, Counts,
    SinkK, SinkV, ResK, ResV,
    KC, KS, KZ, VC, VS, VZ,
    KCB, VCB, KOI, KOV, VOI, VOV, InvFreq, RopeTable,
    Starts, Lens, LenTab,
    qk_scale, window, softcap,
    sink_len, body_len, res_len,
    sink_cap, res_cap, kc_cap, ks_slice, vc_cap, vs_slice, kout_cap, vout_cap,
    Hkv, Lq, m_tiles, n_body_splits, groups_per_split, fp_per_split, split0, n_out,
    HG: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr, G: tl.constexpr, GPT: tl.constexpr,
    GK: tl.constexpr, GV: tl.constexpr, K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr,
    BLOCK_FP: tl.constexpr, HAS_WINDOW: tl.constexpr, EVEN_D: tl.constexpr,
    USE_PRMT: tl.constexpr, FP8: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_LENS: tl.constexpr,
    K_CB: tl.constexpr, V_CB: tl.constexpr, K_OUT: tl.constexpr, V_OUT: tl.constexpr,
    PRE_ROPE: tl.constexpr, LENS_DEV: tl.constexpr, SOFTCAP: tl.constexpr = False,
    PDL: tl.constexpr = False, MERGE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
    ROWS: tl.constexpr = 1, K_FIXED: tl.constexpr = False,
):
    """Stage 1 (module docstring). With ``MERGE`` the program that finishes its m-tile's
    columns last (a ticket per m-tile in ``Counts``, taken after its partial is stored, with
    release / acquire order at GPU scope) also merges every column into ``O`` and puts the
    ticket back to zero: no finish launch. The columns written by another kernel (a Gluon
    body, ``split0``) must be complete when this one starts (stream order)."""
    pid = tl.program_id(0)
    if LENS_DEV:  # (sink, body, residual) lengths on the device; the ints are only bounds
        sink_len = tl.load(LenTab)
        body_len = tl.load(LenTab + 1)
        res_len = tl.load(LenTab + 2)
    split = tl.program_id(1) + split0  # columns [0, split0) are written by another kernel
    n_splits = n_out
    mt, h, bh64, start, length, _offs_m, m_ok, pos, offs_d, d_ok, q_row, q = _query_tile(
        Q, Starts, Lens, pid, m_tiles, Hkv, Lq, qk_scale, sink_len + body_len + res_len, HG,
        BLOCK_M, BLOCK_D, D, HAS_STARTS, HAS_LENS)
    if PDL:  # the finish kernel may start while this one runs (it waits before merging)
        tl.extra.cuda.gdc_launch_dependents()
    o_row = q_row * n_splits + split  # Out is [B*Hq*Lq, n_splits, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    F32: tl.constexpr = Q.dtype.element_ty == tl.float32  # dequantize in float32 too
    if split < n_body_splits:
        N: tl.constexpr = GPT * G  # body tokens per loop step
        n_groups = body_len // G
        g_lo = split * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
        # skip groups outside this sequence's visible range (its body starts at index
        # start + sink_len: before it, padding and the copies of its own sink) and window
        first = start
        if HAS_WINDOW:
            first = tl.maximum(first, length - Lq - window + 1 - sink_len)
        g_lo = tl.maximum(g_lo, tl.maximum(first, 0) // G)
        g_hi = tl.minimum(g_hi, (length - sink_len + G - 1) // G)
        kc_base = KC + bh64 * kc_cap * D  # int64 bases; int32 offsets inside one slice
        vc_base = VC + bh64 * vc_cap * D
        ks_base = KS + bh64 * ks_slice  # scale/zero elements per (sequence, head) slice
        kz_base = KZ + bh64 * ks_slice
        vs_base = VS + bh64 * vs_slice
        vz_base = VZ + bh64 * vs_slice
        pos_min = length - Lq
        if FP8:
            k_mult = tl.load(ks_base)
        if PRE_ROPE:  # the query in halves, float32, rotated per tile (_rope_query)
            HALF: tl.constexpr = D // 2
            offs_h = tl.arange(0, BLOCK_D // 2)  # lanes past HALF (head_dim 80, 96) masked
            h_ok = offs_h < HALF
            q_h = Q + q_row[:, None] * D + offs_h[None, :]
            mh = m_ok[:, None] & h_ok[None, :]
            qa = tl.load(q_h, mask=mh, other=0.0).to(tl.float32) * qk_scale
            qb = tl.load(q_h + HALF, mask=mh, other=0.0).to(tl.float32) * qk_scale
            inv_freq = tl.load(InvFreq + offs_h, mask=h_ok, other=0.0)
        for g0 in range(g_lo, g_hi, GPT):
            offs_t = g0 * G + tl.arange(0, N)  # body token index of each tile row
            if FP8:  # e4m3 body: one multiplier per (sequence, head), applied to the scores
                k = _fp8_tile(kc_base, offs_t, g_hi, offs_d, d_ok, G, D, EVEN_D)
                sc = _dot(q, tl.trans(k.to(Q.dtype.element_ty))) * k_mult
            elif PRE_ROPE:  # keys stored before RoPE, in halves: q takes R(pos0), keys R(j)
                xa, xb = _rope_query(qa, qb, sink_len + g0 * G - start, inv_freq, USE_PRMT)
                ka = _body_tile(kc_base, ks_base, kz_base, KCB + h * (1 << KBITS), KOI, KOV,
                                g0, g_hi, offs_t, offs_h, h_ok, K_PER_TOKEN, KBITS, G, GPT, D,
                                GK, EVEN_D, USE_PRMT, K_CB, 0, 0, F32, K_FIXED)
                kb = _body_tile(kc_base, ks_base, kz_base, KCB + h * (1 << KBITS), KOI, KOV,
                                g0, g_hi, offs_t, HALF + offs_h, h_ok, K_PER_TOKEN, KBITS, G,
                                GPT, D, GK, EVEN_D, USE_PRMT, K_CB, 0, HALF, F32, K_FIXED)
                ka, kb = _rope_keys(ka, kb, RopeTable, N, HALF)
                sc = _dot(xa.to(Q.dtype.element_ty), tl.trans(ka.to(Q.dtype.element_ty)))
                sc = _dot(xb.to(Q.dtype.element_ty), tl.trans(kb.to(Q.dtype.element_ty)), sc)
                if K_OUT > 0:
                    sc = _score_outliers(sc, xa, xb, KOI + bh64 * kout_cap * K_OUT,
                                         KOV + bh64 * kout_cap * K_OUT, offs_t, g_hi * G,
                                         RopeTable, K_OUT, True, HALF)
            else:
                k = _body_tile(kc_base, ks_base, kz_base, KCB + h * (1 << KBITS), KOI, KOV,
                               g0, g_hi, offs_t, offs_d, d_ok, K_PER_TOKEN, KBITS, G, GPT, D,
                               GK, EVEN_D, USE_PRMT, K_CB, 0, 0, F32, K_FIXED)
                sc = _dot(q, tl.trans(k.to(Q.dtype.element_ty)))  # [M, N]
                if K_OUT > 0:
                    sc = _score_outliers(sc, q, q, KOI + bh64 * kout_cap * K_OUT,
                                         KOV + bh64 * kout_cap * K_OUT, offs_t, g_hi * G,
                                         RopeTable, K_OUT, False)
            # Only tiles at the edges (padding, sequence end, window, last partial step) need the
            # per-element mask; rows past the real query rows are dropped at the store.
            t_lo = sink_len + g0 * G
            edge = (t_lo < start + sink_len) | (g0 + GPT > g_hi) | (t_lo + N - 1 > pos_min)
            if HAS_WINDOW:
                edge = edge | (t_lo <= length - 1 - window)
            if edge:
                vis = _visible(sink_len + offs_t, pos, start + sink_len, length, window,
                               HAS_WINDOW)
                sc = tl.where(vis & (offs_t < g_hi * G)[None, :], sc, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i, softcap, SOFTCAP)
            if FP8:  # the value multiplier scales the finished partial output instead
                v = _fp8_tile(vc_base, offs_t, g_hi, offs_d, d_ok, G, D, EVEN_D)
            else:
                v = _body_tile(vc_base, vs_base, vz_base, VCB + h * (1 << VBITS),
                               VOI + bh64 * vout_cap * V_OUT, VOV + bh64 * vout_cap * V_OUT,
                               g0, g_hi, offs_t, offs_d, d_ok, V_PER_TOKEN, VBITS, G, GPT, D,
                               GV, EVEN_D, USE_PRMT, V_CB, V_OUT, 0, F32)
            acc = acc * alpha[:, None] + _dot(p.to(Q.dtype.element_ty),
                                                v.to(Q.dtype.element_ty))
    else:
        # FP16 tokens (_attend_sink_residual)
        fs = split - n_body_splits
        i_lo = fs * fp_per_split
        m_i, l_i, acc = _attend_sink_residual(
            q, SinkK, SinkV, ResK, ResV, bh64, i_lo,
            tl.minimum(i_lo + fp_per_split, sink_len + res_len), sink_len, body_len, sink_cap,
            res_cap, start, pos, length, window, m_i, l_i, acc, offs_d, d_ok, softcap, D,
            BLOCK_FP, HAS_WINDOW, SOFTCAP)
    if FP8:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if split < n_body_splits:
            acc = acc * tl.load(VS + bh64 * vs_slice)
    _store_partial(Out, Lse, o_row, acc, m_i, l_i, offs_d, m_ok, d_ok, D)
    if MERGE:
        tl.debug_barrier()  # every thread's part of the partial is written before the ticket
        ticket = tl.atomic_add(Counts + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            tl.store(Counts + pid, 0)  # ready for the next call (a replayed graph's too)
            _merge_rows(Out, Lse, O, bh64, mt, 0, 1, n_out, offs_d, d_ok, HG, Lq, D, BLOCK_M,
                        BLOCK_S, ROWS)


@triton.jit(do_not_specialize=("sink_len", "res_len", "n_out"))
def _finish_kernel(
    Q, Out, Lse, O,
    SinkK, SinkV, ResK, ResV, Starts, Lens, LenTab,
    qk_scale, window, softcap, sink_len, body_len, res_len, sink_cap, res_cap,
    Hkv, Lq, m_tiles, n_out,
    HG: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_FP: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr, HAS_FP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_LENS: tl.constexpr,
    LENS_DEV: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr,
):
    """The last launch of a decode step, per m-tile of a (sequence, KV head): with ``HAS_FP``
    (one program), attention over the whole FP16 sink and residual (written as the last partial
    column), then the merge of every split of its query rows (weights ``exp2(lse_s - max)``;
    without ``HAS_FP`` the rows are shared by the programs of the grid's second axis).
    With ``PDL`` it was launched as a programmatic dependent of the body kernel: the FP16 part
    runs while the body finishes, and ``gdc_wait`` holds the merge until the body's partials
    are written."""
    pid = tl.program_id(0)
    if LENS_DEV:  # (sink, body, residual) lengths on the device; the ints are only bounds
        sink_len = tl.load(LenTab)
        body_len = tl.load(LenTab + 1)
        res_len = tl.load(LenTab + 2)
    mt, _h, bh64, start, length, _offs_m, m_ok, pos, offs_d, d_ok, q_row, q = _query_tile(
        Q, Starts, Lens, pid, m_tiles, Hkv, Lq, qk_scale, sink_len + body_len + res_len, HG,
        BLOCK_M, BLOCK_D, D, HAS_STARTS, HAS_LENS)
    if HAS_FP:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = _attend_sink_residual(
            q, SinkK, SinkV, ResK, ResV, bh64, 0, sink_len + res_len, sink_len, body_len,
            sink_cap, res_cap, start, pos, length, window, m_i, l_i, acc, offs_d, d_ok, softcap,
            D, BLOCK_FP, HAS_WINDOW, SOFTCAP)
        _store_partial(Out, Lse, q_row * n_out + n_out - 1, acc, m_i, l_i, offs_d, m_ok, d_ok, D)
        tl.debug_barrier()  # the merge below reads that column back, from other threads
    if PDL:
        tl.extra.cuda.gdc_wait()
    # Without an FP16 part, programs along the grid's second axis share the rows.
    _merge_rows(Out, Lse, O, bh64, mt, tl.program_id(1), tl.num_programs(1), n_out, offs_d,
                d_ok, HG, Lq, D, BLOCK_M, BLOCK_S, ROWS)

_DECODE = FastLaunch(_decode_kernel)
_FINISH = FastLaunch(_finish_kernel)
# Their keywords, built once per combination (launch.keyword_maker), in this order:
_DECODE_KEYWORDS = keyword_maker((
    "HG", "D", "BLOCK_D", "BLOCK_M", "KBITS", "VBITS", "G", "GPT", "GK", "GV", "K_PER_TOKEN",
    "V_PER_TOKEN", "BLOCK_FP", "HAS_WINDOW", "EVEN_D", "USE_PRMT", "FP8", "HAS_STARTS",
    "HAS_LENS", "K_CB", "V_CB", "K_OUT", "V_OUT", "PRE_ROPE", "LENS_DEV", "SOFTCAP", "PDL",
    "MERGE", "BLOCK_S", "ROWS", "K_FIXED", "num_warps", "num_stages"))
_FINISH_NAMES = ("HG", "D", "BLOCK_D", "BLOCK_M", "BLOCK_FP", "BLOCK_S", "ROWS", "HAS_FP",
                 "HAS_WINDOW", "HAS_STARTS", "HAS_LENS", "LENS_DEV", "SOFTCAP", "PDL", "num_warps")
_FINISH_KEYWORDS = keyword_maker(_FINISH_NAMES)
_FINISH_KEYWORDS_PDL = keyword_maker((*_FINISH_NAMES, "launch_pdl"))


def reads(kv: PackedKV) -> bool:
    """Whether this kernel reads the layer: KIVI, uniform (either scale axis), FP8 and KVQuant
    (codebooks, outliers, pre-RoPE keys) layers; pre-RoPE keys only where
    :func:`~kvbits.formats.layout.pre_rope_kernel_ok` (other head dims use the reference). Its
    key groups must fill whole int32 words (G a power of two, G x bits >= 32; 3-bit planes a
    multiple of 32), as every QuantSpec's do, head_dim a multiple of 4, and per-token scale
    groups of a power of two or all of head_dim; layouts built by hand otherwise use the
    reference."""
    G, kb, vb, D = kv.group_size, kv.key_bits, kv.value_bits, kv.head_dim
    words_ok = not G & (G - 1) and G * min(kb, vb) >= 32 and (G % 32 == 0 or 3 not in (kb, vb))
    return words_ok and D % 4 == 0 and _whole_lane_groups(kv) and (
        getattr(kv, "rope_inv_freq", None) is None
        or pre_rope_kernel_ok(D, getattr(kv, "key_axis", "channel")))


def _whole_lane_groups(kv: PackedKV) -> bool:
    """Whether the value-group width is one that ``_scale_tile`` maps onto whole lanes of a
    power-of-two tile: a power of two, or all of head_dim."""
    GV = kv.value_group
    return GV >= kv.head_dim or not GV & (GV - 1)


def num_splits(batch_heads: int, work_units: int, sm_count: int, per_sm: int = 3) -> int:
    """Token splits per (sequence, KV head): about ``per_sm`` programs per SM (three 4-warp
    programs fit an SM's registers, and the loop needs them resident to hide its load latency),
    never more than there are units of work (key groups or FP16 tiles)."""
    want = max(1, (per_sm * sm_count + batch_heads - 1) // batch_heads)
    return max(1, min(want, work_units))


# Body programs per SM by head_dim. At the head dims the Gluon body does not serve (96 padded to
# 128 lanes, 256 at half the tile) twice the programs hide more latency: H200, CUDA-graph time,
# 32k context (benchmarks/results/tune_head_dims.log), Phi-3-mini (96) kivi-2 / kivi-4 batch 1
# 166 -> 147 / 162 -> 144 us, batch 8 1077 -> 911 / 1078 -> 895 us; Gemma-2-9B (256) batch 8
# 643 -> 516 / 677 -> 653 us, batch 1 kivi-4 117 -> 101 us (kivi-2 74 -> 80 us, the one loss).
def body_programs_per_sm(head_dim: int) -> int:
    return 3 if head_dim in (64, 128) else 6


# KVBITS_GLUON=0 keeps every layer on this kernel (read once: the check runs every decode step).
GLUON_ENABLED = env_switch("KVBITS_GLUON", "1")

# Body tokens per loop step for head_dim <= 128 (half that above): the fewest SASS instructions
# per token without register spills on sm_90 (see benchmarks/results/README.md).
DEFAULT_TILE_TOKENS = 128
DEFAULT_WARPS = 4
# FP16 tokens (sink + residual) up to which the finish kernel attends them itself (a decode
# step's residual, R + G - 1, and sink) instead of the Triton kernel's splits in a launch of
# their own. KVBITS_FINISH_FP_TOKENS: "auto" (default, None here) takes EAGER_FINISH_FP_TOKENS in
# eager calls and 0 (splits) under CUDA-graph capture; an integer, that limit everywhere.
# H200, alternated in one process (benchmarks/results/finish_pdl_ab_s30.log, finish_eager_ab_s31.log):
# eagerly, one launch fewer saves ~50 us of host time per call (kivi-2 Llama-3-8B batch 8 32k:
# 188 -> 135 us) at -3% to +46% of device time (batch 1 128k: 160 -> 110 us); in graph replays,
# where host time is gone, the inline part (one program per sequence, KV head and row tile) is
# 1-13% slower on 9 of 12 rows than splits spread over more programs, so captured calls keep
# the splits (and run them beside a Gluon body, SIDE_STREAM).
# KVBITS_PDL=1: programmatic dependent launch of the finish kernel after the body (Hopper): its
# FP16 part runs while the body's last programs finish. Off: -2.4% to +1.3% in graph time,
# -2% to +3.7% eagerly, against the same variant without it (same logs).
_FINISH_ENV = os.environ.get("KVBITS_FINISH_FP_TOKENS", "auto")
if _FINISH_ENV != "auto" and not _FINISH_ENV.isdigit():
    raise ValueError("KVBITS_FINISH_FP_TOKENS must be 'auto' or a non-negative integer, got "
                     f"{_FINISH_ENV!r}")
FINISH_FP_TOKENS = None if _FINISH_ENV == "auto" else int(_FINISH_ENV)
EAGER_FINISH_FP_TOKENS = 256
PDL_ENABLED = env_switch("KVBITS_PDL", "0")
# KVBITS_SIDE_STREAM: "1" (default) lets a captured call with a Gluon body run its FP16 splits on
# a side stream, beside the body; "0" keeps them after it in the call's stream.
SIDE_STREAM = env_switch("KVBITS_SIDE_STREAM", "1")
# KVBITS_SIDE_AFTER: "1" (default) launches those FP16 splits after the body's launch in the
# graph, "0" before it; KVQuant layers (codebooks) always before. H200, graph time
# (benchmarks/results/side_order_ab_s33.log, side_order_ab_s33b.log): after is 0.6-4.1% faster
# on every KIVI / uniform row (Llama-3-8B batch 8 32k kivi-2 97.0 -> 95.8 us, kivi-3 164 -> 157;
# the body started ~3 us late behind the splits' kernel, graph_call_timeline_s33.log), equal
# at batch 1 32k; but kvquant-3 4.5% / 15.8% slower (Llama-3-8B / Llama-2-7B batch 8 32k: its
# sink-and-residual kernel then waits for the long body's programs to drain, as with no side
# stream, +6.5% / +16.8%). A high-priority side stream gained nothing.
SIDE_AFTER_BODY = env_switch("KVBITS_SIDE_AFTER", "1")
# KVBITS_MERGE: where the partial columns are merged. "1": by the stage-1 (Triton) kernel's last
# program of each m-tile (MERGE; after a Gluon body its FP16 splits then run in stream order),
# so no finish launch and no side stream; "0": always the finish kernel; "auto" (default): the
# stage-1 kernel in eager calls the Triton kernel serves alone (one launch instead of two),
# else the finish kernel. H200, alternated in one process (benchmarks/results/merge_ab_s40.log):
# eagerly, batch-1 4k calls without a Gluon body 14% faster (70.1 -> 61.5 us, host included);
# in graph replays the merge lost 1-16% on 16 of 17 rows (the FP16 splits no longer beside the
# body, and one program merging every column of an m-tile where the finish kernel spreads the
# rows: Llama-3-8B batch 8 32k kivi-2 92.4 -> 94.9 us, batch 1 128k 55.1 -> 65.8).
MERGE_IN_SPLITS = env_choice("KVBITS_MERGE", "auto", ("auto", "0", "1"))
# KVBITS_INLINE_PDL: "1" (default) gives a captured call whose finish kernel merges few partial
# rows per program (:func:`inline_pdl_fits`) the inline FP16 part and PDL above, when
# FINISH_FP_TOKENS is "auto": no FP16 splits, and a programmatic dependent finish kernel that
# attends the FP16 part as the body's programs end. Behind a one-wave ring body (session 34's
# one_wave_splits) FP16 splits find no SM slot until the wave ends and then run in series with
# it; behind a short body the dependent launch hides the finish kernel's own start. H200, whole
# captured calls alternated (benchmarks/probes/tail_ab.py, tail_ab_s64.log): Llama-3-8B batch 8
# 32k uniform-int4 98.4 -> 96.9 us, kivi-2 92.1 -> 91.6, kivi-4 108.4 -> 106.9. H100, session 65
# (tail_ab_s65*_h100.log), against the FP16 splits: one-wave rows 4k-32k 1.2-7.4% faster; rows
# the Triton kernel or a Gluon body of few splits reads: batch 1 4k kivi-2 -4.7% (31 splits x 4
# query rows per finish program), kivi-4 -8.2%, batch 8 4k -3.8 to -5.0%, Llama-2-7B batch 1 4k
# -4.7% and 32k kivi-4 (33 x 1) -2.9%, batch 32 4k -4.7% and 32k (25 x 4) -1.4 to -2.0%. It lost
# where the finish program merges many partials (one program per KV head and m-tile when the
# FP16 part is inline, one per query row otherwise): Llama-3-8B batch 1 32k (Triton kernel, 43 x
# 4) +4.5-4.8%, 128k (132 x 4) +11.8%, batch 8 128k (66 x 4) +1.6%. Hence the bound on splits x
# rows, at the wins' largest (124); measured at head_dim 128 on 2- and 4-bit KIVI and uniform
# layers, so only there (session 64 named it KVBITS_ONE_WAVE_PDL, for one-wave bodies alone).
INLINE_PDL = env_switch("KVBITS_INLINE_PDL", "1")
INLINE_PDL_MAX_MERGE = 128  # body splits x query rows of one finish program


def inline_pdl_fits(kv: PackedKV, splits: int, tile_rows: int) -> bool:
    """Whether a captured call of this layer, ``splits`` body splits per (sequence, KV head) and
    ``tile_rows`` query rows per m-tile, takes the inline FP16 part in a dependent finish kernel
    (``INLINE_PDL``): a 2- or 4-bit KIVI or uniform layer at head_dim 128 (where it was timed)
    whose finish program merges at most ``INLINE_PDL_MAX_MERGE`` partial rows."""
    plain = (kv.key_bits in (2, 4) and kv.value_bits in (2, 4) and kv.head_dim == 128
             and not kv.fp8 and all(t is None for t in (
                 kv.k_codebook, kv.v_codebook, kv.k_out_idx, kv.v_out_idx, kv.rope_inv_freq)))
    return plain and 0 < splits * tile_rows <= INLINE_PDL_MAX_MERGE


# Elements of the finish kernel's merge tile [rows, splits, head_dim] (64 fp32 per thread).
FINISH_TILE = 8192
# Offsets inside one (sequence, head) slice of a kv tensor are int32 (the slice bases are int64).
SLICE_ELEMENTS_MAX = 2**31


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device_index(device)
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def one_wave_splits(kv: PackedKV, sm_count: int, device: torch.device,
                    columns: int = 1) -> int | None:
    """Splits per (sequence, KV head) that make one wave of TMA-ring programs
    (:func:`decode_gluon_tma.one_wave_splits`, mid-sized grids), or None where the ring does not
    serve the layer or the grid is not mid-sized."""
    pairs = _column_pairs(kv, columns)
    one_wave = decode_gluon_tma.one_wave_splits(pairs, kv.body_len, sm_count)
    if one_wave and decode_gluon_tma.serves(
            kv, getattr(kv, "key_axis", "channel") == "token", device):
        return one_wave
    return None


def gluon_splits(kv: PackedKV, sm_count: int, device: torch.device, columns: int = 1) -> int:
    """Splits per (sequence, KV head) for a layer the Gluon body serves: one wave where the
    TMA ring serves a mid-sized grid (:func:`one_wave_splits`), else
    :func:`decode_gluon.body_splits`' rule. ``columns``: query heads x rows per KV head; past
    16 each pair is :func:`decode_gluon.column_blocks` programs per split, counted as pairs."""
    return one_wave_splits(kv, sm_count, device, columns) or decode_gluon.body_splits(
        _column_pairs(kv, columns), kv.body_len, sm_count, kv.head_dim)


def _column_pairs(kv: PackedKV, columns: int) -> int:
    return kv.batch * kv.kv_heads * decode_gluon.column_blocks(columns)


def decode_attention(q: torch.Tensor, kv: PackedKV, *, scale: float, starts=None, lengths=None,
                     window: int | None = None, splits: int | None = None,
                     num_warps: int | None = None, tile_tokens: int | None = None,
                     prmt: bool | None = None, gluon: bool | None = None,
                     lens_dev: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over a packed layer (rules of the reference op).

    ``starts``/``lengths``: optional ``[B]`` int tensors (first real position, i.e. left
    padding; sequence end). A sequence's sink holds its own first ``sink_len`` tokens, at
    positions ``start + j``, so its body and residual are visible from ``start + sink_len``.
    ``splits``, ``num_warps`` and ``tile_tokens`` (body tokens per loop step, a power-of-two
    multiple of the group size) override the defaults (tests and tuning); ``prmt`` selects the
    PTX byte-permute code conversion (default: on a GPU, not under ``TRITON_INTERPRET``).
    ``gluon``: the body goes to :mod:`kvbits.kernels.decode_gluon` (``True``: whenever the
    layer is eligible; default: also only where PTX runs, for steps of at least
    ``decode_gluon.MIN_BODY_TOKENS`` body tokens x (sequence, KV head) pairs, unless
    ``KVBITS_GLUON=0``); the FP16 parts and the merge stay here.
    ``lens_dev``: int32 ``[3]`` on the device, the layer's true (sink, body, residual) lengths,
    read by both kernels; ``kv``'s lengths are then upper bounds that only set the launch
    geometry, so one launch (one CUDA graph) serves many decode steps.
    ``softcap``: attention-logit softcapping (Gemma2; scores ``softcap * tanh(s / softcap)``),
    applied in both kernels' online softmax, as is the sliding ``window``.
    """
    check_query(q, kv)  # (kvbits.ops.decode_attention checks the rest)
    if window is not None and window >= WINDOW_NONE:
        window = None
    B, Hq, Lq, D = q.shape
    Hkv = kv.kv_heads
    if D % 4:  # (tiles are padded to a power of two; rows of 8-byte multiples)
        raise ValueError(f"decode_attention: head_dim must be a multiple of 4, got {D}")
    per_token = "token" in (getattr(kv, "key_axis", "channel"), getattr(kv, "value_axis", "token"))
    if per_token and not getattr(kv, "fp8", False) and not _whole_lane_groups(kv):  # (FP8: [1, 1])
        # other per-token group widths read the wrong scales (0.25-0.35 off the reference at 24
        # or 48 of 64 channels) or fail to compile; ops.decode_attention sends such layers to
        # the reference (reads)
        raise ValueError(f"decode_attention: per-token scale groups of {kv.value_group} channels "
                         f"must be a power of two or all of head_dim {D} (see reads())")
    for name in ("sink_k", "sink_v", "res_k", "res_v", "k_codes", "k_scale", "k_zero",
                 "v_codes", "v_scale", "v_zero"):
        t = getattr(kv, name)
        if t is not None and not t.is_contiguous():
            raise ValueError(f"decode_attention: kv.{name} must be contiguous (the kernel derives "
                             "offsets from the layout contract, not from strides)")
    for name in ("sink_k", "res_k", "k_codes", "k_scale", "v_codes", "v_scale", "k_out_idx",
                 "v_out_idx"):  # the V / zero / outlier-value twins have the same shapes
        t = getattr(kv, name, None)
        if t is not None and t.shape[-2] * t.shape[-1] > SLICE_ELEMENTS_MAX:
            raise ValueError(
                f"decode_attention: kv.{name} has {t.shape[-2]} x {t.shape[-1]} elements per "
                f"(sequence, head); the kernel addresses one with int32 offsets, so at most "
                f"2**31 ({SLICE_ELEMENTS_MAX // t.shape[-1]} rows of {t.shape[-1]})")
    HG = Hq // Hkv
    dev = q.device
    q = q.contiguous()
    # Absent starts/lengths cost no device tensors (each would be one more launch per step).
    has_starts, has_lens = starts is not None, lengths is not None
    starts = _as_i32(starts, B, dev) if has_starts else q
    lengths = _as_i32(lengths, B, dev) if has_lens else q
    BLOCK_D = max(16, _next_pow2(D))
    M = HG * Lq
    BLOCK_M = min(64, max(16, _next_pow2(M)))
    m_tiles = _cdiv(M, BLOCK_M)
    G = kv.group_size
    fp8 = bool(getattr(kv, "fp8", False))  # e4m3 body; k/v_scale [B, H, 1, 1] fp32, no zeros
    inv_freq = getattr(kv, "rope_inv_freq", None)  # pre-RoPE keys (KVQuant)
    # head dims past 128: half the tile (registers), except FP8 (one convert per element; at
    # head_dim 256, 128 tokens per step ran 1.14-1.24x faster: few_pairs_sweep.log), and a
    # quarter with pre-RoPE keys (the turned tile and its cos/sin table spill at 64 tokens:
    # kvquant-3 at head_dim 256 ran 1.6-2x faster at 32, probes/kvquant_wide_sweep.py)
    if tile_tokens:
        tile = tile_tokens
    elif BLOCK_D <= 128 or fp8:
        tile = DEFAULT_TILE_TOKENS
    else:
        tile = DEFAULT_TILE_TOKENS // (4 if inv_freq is not None else 2)
    GPT = max(1, tile // G)  # groups per loop step
    n_groups = kv.body_len // G
    bhm = B * Hkv * m_tiles
    sms = _sm_count(dev)
    req_splits = splits
    if splits is None:
        splits = (num_splits(bhm, _cdiv(n_groups, GPT), sms, body_programs_per_sm(D))
                  if n_groups else 0)
    splits = min(max(splits, 1), n_groups)
    groups_per_split = _cdiv(_cdiv(n_groups, splits), GPT) * GPT if splits else 1
    if splits:
        splits = _cdiv(n_groups, groups_per_split)
    use_prmt = _use_prmt(dev) if prmt is None else prmt
    if lens_dev is not None and (lens_dev.dtype != torch.int32 or lens_dev.numel() != 3
                                 or lens_dev.device != dev):
        raise ValueError("decode_attention: lens_dev must be an int32 [3] tensor (sink, body, "
                         f"residual lengths) on {dev}")
    if gluon is None:  # where PTX runs, for layers and batches where it is the faster kernel
        # (not for float32 queries: its operands are float16; the Triton kernel keeps float32)
        gluon = (use_prmt and q.dtype != torch.float32 and GLUON_ENABLED and n_groups > 0
                 and decode_gluon.serves(kv, Lq, HG, B * Hkv))
    elif gluon:  # asked for explicitly (tests, benchmarks): any eligible layer
        gluon = n_groups > 0 and decode_gluon.eligible(kv, Lq, HG)
    if gluon:
        splits = decode_gluon.split_count(kv.body_len,
                                          req_splits or gluon_splits(kv, sms, dev, HG * Lq))
    BLOCK_FP = 64 if BLOCK_D <= 128 else 32
    n_fp = kv.sink_len + kv.res_len
    # A short FP16 part (a decode step's sink and residual) is attended by the finish kernel,
    # which merges anyway; a long one (an FP16 cache, a prompt not yet quantized) gets splits.
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    # The stage-1 launch merges (MERGE_IN_SPLITS) when there is one (FP16 tokens, or a body the
    # Triton kernel reads); the FP16 part then always takes splits.
    # (a bool: ``... and n_fp`` was the FP16 token count, a constexpr that compiled one variant
    # per residual length in eager decoding; tests: test_decode_step_constexprs_do_not_vary)
    merge = bool((MERGE_IN_SPLITS == "1"
                  or MERGE_IN_SPLITS == "auto" and not capturing and not gluon)
                 and (n_fp or not gluon))
    # A captured call whose finish programs merge few partials attends the FP16 part there, as
    # a programmatic dependent of the body (INLINE_PDL).
    dep_finish = bool(req_splits is None and capturing and INLINE_PDL and FINISH_FP_TOKENS is None
                      and inline_pdl_fits(kv, splits, min(M, BLOCK_M)) and _pdl_ok(dev))
    fp_inline = 0 < n_fp <= (EAGER_FINISH_FP_TOKENS if dep_finish else
                             _finish_fp_tokens(capturing)) and not merge
    fp_splits = num_splits(bhm, _cdiv(n_fp, BLOCK_FP), sms) if n_fp and not fp_inline else 0
    if not splits and not n_fp:
        return torch.zeros_like(q)
    fp_per_split = _cdiv(_cdiv(n_fp, fp_splits), BLOCK_FP) * BLOCK_FP if fp_splits else 1
    if fp_splits:
        fp_splits = _cdiv(n_fp, fp_per_split)
    n_total = splits + fp_splits + fp_inline  # partial columns; the finish kernel's is the last
    out = torch.empty(B * Hq * Lq, n_total, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B * Hq * Lq, n_total, dtype=torch.float32, device=dev)
    # Scale/zero axes: "channel" = [groups, D] per (G-token group, channel); "token" = [tokens,
    # D // Gs] per (token, Gs channels). KIVI: keys by channel, values by token.
    k_tok = getattr(kv, "key_axis", "channel") == "token"
    v_tok = getattr(kv, "value_axis", "token") == "token"
    k_zero = kv.k_scale if kv.k_zero is None else kv.k_zero  # never read without zeros
    v_zero = kv.v_scale if kv.v_zero is None else kv.v_zero
    # KVQuant fields (absent ones are never read: q stands in for their pointers).
    kcb, vcb = getattr(kv, "k_codebook", None), getattr(kv, "v_codebook", None)
    koi, kov = getattr(kv, "k_out_idx", None), getattr(kv, "k_out_val", None)
    voi, vov = getattr(kv, "v_out_idx", None), getattr(kv, "v_out_val", None)
    if inv_freq is not None and not pre_rope_kernel_ok(D, "token" if k_tok else "channel"):
        raise ValueError("decode_attention: pre-RoPE keys need an even head_dim >= 32 (a power "
                         f"of two with per-token key scales), got {D}")

    def arg(t, dtype=None):
        if t is None:
            return q
        t = t if dtype is None else t.to(dtype)
        return t.contiguous()
    split0 = splits if gluon else 0
    # Built here, not only when the Triton kernel launches: an eager call that attends its FP16
    # part in the finish kernel must still build it, or a later capture would (a host copy).
    rope_table = (_rope_table(inv_freq, GPT * G, torch.float32 if q.dtype == torch.float32
                              else torch.float16) if inv_freq is not None else q)
    # Captured with a Gluon body, the FP16 splits run on a side stream beside the body (a fork
    # and a join in the graph): in stream order they would start only when the body ends.
    side = bool(gluon and fp_splits and capturing and SIDE_STREAM and not merge)
    side_after = side and SIDE_AFTER_BODY and kcb is None and vcb is None
    if gluon and SIDE_STREAM and not capturing and dev.type == "cuda" and not merge:
        _side_stream(dev)  # made in an eager call (the warm-up), not inside a capture
    pdl = (PDL_ENABLED or dep_finish and fp_inline) and not side and not merge and _pdl_ok(dev)
    o = torch.empty(B, Hq, Lq, D, dtype=q.dtype, device=dev)
    BLOCK_S = max(2, _next_pow2(n_total))
    # The merge takes ``rows`` query rows at a time: with an FP16 part in the finish kernel or
    # in the stage-1 kernel's last program, all of an m-tile's (one program); else one program
    # per query row.
    rows = (max(1, min(_next_pow2(min(M, BLOCK_M)), FINISH_TILE // (BLOCK_S * BLOCK_D)))
            if fp_inline or merge else 1)
    counts = _merge_counts(bhm, dev) if merge else q

    def launch_triton():  # every split, or (after a Gluon body) only the FP16 ones
        _DECODE.launch((bhm, splits + fp_splits - split0), (
            q, out, lse, o, counts,
            kv.sink_k, kv.sink_v, kv.res_k, kv.res_v,
            kv.k_codes, kv.k_scale, k_zero, kv.v_codes, kv.v_scale, v_zero,
            arg(kcb, torch.float32), arg(vcb, torch.float32), arg(koi), arg(kov), arg(voi),
            arg(vov), arg(inv_freq, torch.float32),
            rope_table, starts, lengths, lens_dev if lens_dev is not None else q,
            scale * LOG2E, int(window) if window is not None else 0,
            float(softcap) if softcap is not None else 1.0,
            kv.sink_len, kv.body_len, kv.res_len,
            kv.sink_k.shape[2], kv.res_k.shape[2], kv.k_codes.shape[2],
            kv.k_scale.shape[2] * kv.k_scale.shape[3], kv.v_codes.shape[2],
            kv.v_scale.shape[2] * kv.v_scale.shape[3],
            koi.shape[2] if koi is not None else 0, voi.shape[2] if voi is not None else 0,
            Hkv, Lq, m_tiles, splits, groups_per_split, fp_per_split, split0, n_total,
        ), _DECODE_KEYWORDS(
            HG, D, BLOCK_D, BLOCK_M, kv.key_bits, kv.value_bits, G, GPT,
            kv.value_group if k_tok else G,  # GK (per-token groups: the last may be shorter)
            kv.value_group if v_tok else G,  # GV
            k_tok, v_tok, BLOCK_FP, window is not None, D == BLOCK_D,
            use_prmt and q.dtype != torch.float32, fp8, has_starts,  # (_body_tile's F32)
            has_lens, kcb is not None, vcb is not None,
            koi.shape[3] if koi is not None else 0, voi.shape[3] if voi is not None else 0,
            inv_freq is not None, lens_dev is not None, softcap is not None, pdl, merge,
            BLOCK_S, rows, getattr(kv, "key_scales_fixed", False),
            num_warps or DEFAULT_WARPS, 2 if BLOCK_D <= 128 else 1))

    if side:
        main = torch.cuda.current_stream(dev)
        stream = _side_stream(dev)
        stream.wait_stream(main)
        if not side_after:
            with torch.cuda.stream(stream):
                launch_triton()
    if gluon:
        decode_gluon.attend_body(q, kv, out, lse, scale_log2=scale * LOG2E, starts=starts,
                                 lengths=lengths, has_starts=has_starts, has_lens=has_lens,
                                 n_out=n_total, splits=splits, lens_dev=lens_dev,
                                 window=window, softcap=softcap, pdl=pdl)
    if side_after:
        with torch.cuda.stream(stream):
            launch_triton()
    if splits + fp_splits > split0 and not side:
        launch_triton()
    if side:
        main.wait_stream(stream)
    # A programmatic dependent only of a kernel launched just above (never of the kernel that
    # appended the residual it reads).
    if merge:
        return o
    pdl = pdl and splits + fp_splits > 0
    _FINISH.launch((bhm, 1 if fp_inline else min(M, BLOCK_M)), (
        q, out, lse, o, kv.sink_k, kv.sink_v, kv.res_k, kv.res_v,
        starts, lengths, lens_dev if lens_dev is not None else q,
        scale * LOG2E, int(window) if window is not None else 0,
        float(softcap) if softcap is not None else 1.0,
        kv.sink_len, kv.body_len, kv.res_len, kv.sink_k.shape[2], kv.res_k.shape[2],
        Hkv, Lq, m_tiles, n_total,
    ), (_FINISH_KEYWORDS_PDL if pdl else _FINISH_KEYWORDS)(
        HG, D, BLOCK_D, BLOCK_M, BLOCK_FP, BLOCK_S, rows, fp_inline, window is not None,
        has_starts, has_lens, lens_dev is not None, softcap is not None, pdl, DEFAULT_WARPS,
        *((True,) if pdl else ())))  # launch_pdl: a programmatic dependent
    return o


def _rope_table(inv_freq: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``[2, n, D/2]`` ``cos/sin(j * inv_freq)`` for the offsets ``j`` of a body tile (float16;
    float32 for float32 queries, whose keys are dequantized in float32)."""
    return rope_cos_sin(inv_freq, range(n), key=n, dtype=dtype)


def rope_cos_sin(inv_freq: torch.Tensor, offsets, key=None,
                 dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``[2, len(offsets), D/2]`` ``cos/sin(j * inv_freq)`` in ``dtype`` for the given token
    offsets (computed in float64), built once and kept on the frequency tensor itself (a layer's
    store passes the same tensor every step), so it can never outlive or mismatch the
    frequencies it was made from. ``key`` names the offsets (default: the offsets themselves);
    ``offsets`` may then be a callable, called only when the table is built."""
    tables = getattr(inv_freq, "_kvbits_rope_tables", None)
    if tables is None:
        tables = {}
        inv_freq._kvbits_rope_tables = tables
    if key is None:
        key = tuple(offsets)
    key = (key, dtype)
    if key not in tables:
        offsets = offsets() if callable(offsets) else offsets
        j = torch.tensor(list(offsets), device=inv_freq.device, dtype=torch.float64)
        ang = j[:, None] * inv_freq.double()[None, :]
        tables[key] = torch.stack([ang.cos(), ang.sin()]).to(dtype).contiguous()
    return tables[key]


# Triton reads TRITON_INTERPRET when a kernel is defined, so it cannot change afterwards either.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _finish_fp_tokens(capturing: bool) -> int:
    """The FP16 tokens the finish kernel attends itself (``FINISH_FP_TOKENS``; "auto": all of a
    decode step's in eager calls, none while a CUDA graph is being captured)."""
    if FINISH_FP_TOKENS is not None:
        return FINISH_FP_TOKENS
    return 0 if capturing else EAGER_FINISH_FP_TOKENS


_SIDE_STREAMS: dict = {}


_MERGE_COUNTS: dict = {}


def _merge_counts(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 merge tickets on ``device``, zero between calls (each call's last program
    puts its ticket back). One buffer per device and current stream, never freed: a captured
    graph keeps its address, and calls on one stream never overlap. A larger request gets a new
    buffer; the old one stays for the graphs that hold it."""
    key = (device.type, device_index(device) if device.type == "cuda" else 0,
           torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    bufs = _MERGE_COUNTS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 2 * bufs[-1].numel() if bufs else 256),
                                dtype=torch.int32, device=device))
    return bufs[-1]


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that runs a captured call's FP16 splits beside the Gluon body (one per device,
    made on first use)."""
    idx = device_index(device)
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


_PDL_OK: dict = {}


def _pdl_ok(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched as programmatic dependents: sm_90+, not
    under ``TRITON_INTERPRET``, and a Triton whose CUDA launcher takes ``launch_pdl``."""
    if not _use_prmt(device):  # (a CUDA device, outside the interpreter)
        return False
    idx = device_index(device)
    if idx not in _PDL_OK:
        try:
            from triton.backends.nvidia.compiler import CUDAOptions
            has = "launch_pdl" in CUDAOptions.__dataclass_fields__
        except (ImportError, AttributeError):
            has = False
        _PDL_OK[idx] = has and torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL_OK[idx]


def _use_prmt(device: torch.device) -> bool:
    """Inline PTX runs on CUDA devices only: not on CPU tensors, not in Triton's interpreter."""
    return device.type == "cuda" and not _INTERPRETED


def _as_i32(x, batch: int, device) -> torch.Tensor:
    if (isinstance(x, torch.Tensor) and x.dtype == torch.int32 and x.device == device
            and x.shape == (batch,) and x.is_contiguous()):
        return x  # the store's own starts: no conversion ops on every decode step
    return torch.as_tensor(x, device=device).to(torch.int32).expand(batch).contiguous()


# Host-side integer helpers: triton.cdiv / triton.next_power_of_2 are JIT-wrapped functions whose
# host calls cost microseconds each, which adds up on small decode steps.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
