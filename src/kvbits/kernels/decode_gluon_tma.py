"""The Gluon body of :mod:`kvbits.kernels.decode_gluon` fed by a TMA ring (Hopper, sm_90+).

The register body waits on memory twice per 64-token step (keys, then values); the L2 prefetch
makes those waits L2 latencies instead of DRAM ones, and the one-warp programs still issue at
about half of peak. Here every byte of a step (key and value words, key scales/zeros of its
groups, value scales/zeros of its tokens) is copied by the TMA engine into a ring of ``NS``
shared-memory stages, ``NS - 1`` steps ahead, completing on one ``mbarrier`` per stage: the warp
only waits when the ring runs dry, and the copies cost no registers (one elected thread issues
8 copies per step; the key scale rows once each, read by the lanes that share a row as one
word, :func:`key_scale_tile`). Each
thread then reads exactly the words and scales its MMA fragments need, from shared memory, in the
register layouts of :mod:`kvbits.kernels.decode_gluon` (``LDS.64`` per key channel pair; the
layout conversions after the loads are register renamings), and the step's math is that kernel's
own (``_key_operand_u``, ``_value_operand``). The word rows land in 128-byte-swizzled tiles, one
per channel half (:func:`word_tile`), so the four rows a load instruction reads sit in distinct
banks: 3-9% faster than unswizzled 512-byte rows on the long Llama rows (session 25,
``benchmarks/results/decode_attention_swizzle_s25.md``).

Served: KIVI and uniform layers with equal key/value bits 2 or 4, keys scaled per channel over
G = 16, 32 or 64 tokens or (uniform) per token over 64 channels, values per token over 32 or 64
channels, head_dim 128, contiguous buffers (TMA needs 16-byte-aligned rows); :func:`eligible`
says which, :func:`serves` when (``KVBITS_GLUON_TMA``: ``auto`` by default, ``1`` always,
``0`` never). H200, against the register body with the L2 prefetch: kivi-2 5-18% faster
(``benchmarks/results/decode_gluon_tma.log``), kivi-4 8-11% faster in CUDA-graph time at every
(sequence, KV head) pair count measured, 8 to 256 (``benchmarks/results/tma4_pairs.log``),
uniform-int4 27-39% (``benchmarks/results/tma_uniform_ab_s29.log``). Eager calls pay ~50 us
more host time than the register body's (the launcher encodes six tensor maps per launch; the
descriptors themselves are built once per layer, :func:`_descriptors`), so ``auto`` takes the
ring outside graph capture only for large calls (``EAGER_MIN_WORK``).
"""

from __future__ import annotations

import functools

from . import decode_gluon as dg
from .launch import FastLaunch, device_index, keyword_maker
from .switches import env_choice

try:  # Hopper's TMA and mbarriers in Gluon (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # async_load in newer Triton; async_copy_global_to_shared (same arguments) in 3.5/3.6
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

# KVBITS_GLUON_TMA: "auto" (default) serves where the H200 sweeps measured a win (2- and 4-bit
# layers; until session 21 4-bit layers only from 256 (sequence, KV head) pairs, after an eager
# timing at 64 pairs that measured the descriptors' host time: in graph time the 4-bit ring is
# 8-11% faster at 8 to 256 pairs, benchmarks/results/tma4_pairs.log); "1" always; "0" never.
# An eager call of the ring costs more host time than the register body, so "auto" takes it
# outside CUDA-graph capture only for calls of at least EAGER_MIN_WORK body tokens x (sequence,
# KV head) pairs, where the kernel outlasts that (H200: Llama-3-8B B=8 32k, 2^21, ran 117 us
# eager on the register body and 204 us on the ring, which wins in graph time, 108 us). Session
# 35 cut the ring's extra host time from ~150 to ~50 us (descriptors built once per layer:
# 114 -> 7 us; the launch through FastLaunch: 91 -> 45 us, of which 28 in the launcher, which
# encodes the six tensor maps at every launch; benchmarks/results/ring_host_s35.log), and still
# measured the register body faster eagerly below 2^23 (eager_ring_ab_s35.log: Llama-3-8B B=8
# 32k kivi-2 166 against 225 us, kivi-4 153 against 225, both host-bound) and the ring faster
# at 2^23 (B=8 128k kivi-4 374 against 474 us): the threshold stays.
MODE = env_choice("KVBITS_GLUON_TMA", "auto", ("auto", "0", "1"))
EAGER_MIN_WORK = 2**23
# Ring depth (stages of one step each): 3 at 2 bits (7 KB per stage), 2 at 4 bits (11 KB), so
# that ~10 one-warp programs per SM fit in shared memory. One stage deeper (uniform 4-bit layers'
# 9 KB stages: 3 still fit the one-wave grid's 8 per SM) measured 1.5-4.8% slower on every row
# timed (H100, benchmarks/results/ring_stages_ab_s67_h100.log): the bytes already arrive in time.
STAGES = {2: 3, 4: 2}


if gluon is not None:

    @gluon.constexpr_function
    def _tbit(kind, i, bits, G):
        """The bit of a step's token offset that bit ``i`` of a word row (``kind="R"``) or of a
        slot (``"S"``) lands on: token ``(R // W) G + R % W + W slot`` with ``W = G bits / 32``."""
        kind, i, bits, G = (getattr(x, "value", x) for x in (kind, i, bits, G))
        lw = (G * bits // 32).bit_length() - 1
        lg = G.bit_length() - 1
        if kind == "S":
            return lw + i
        return i if i < lw else lg + i - lw

    @gluon.constexpr_function
    def _smem_layouts(bits, D, G):
        """Register layouts for reading one stage from shared memory, each the layout of
        :func:`kvbits.kernels.decode_gluon._chunk_layouts` it feeds, re-indexed by the stage's
        own coordinates (broadcast lanes get zero bases):

        ``KWS``: key words of one channel half, ``[RS, DC]`` int32 re-indexed by its swizzled
        tile (:func:`word_tile`), the pair bit first in the registers (one ``LDS.64`` per
        pair); ``KSS``: key scale pairs of one channel half, ``[SG, DC/2]`` int32 of the stage's
        :func:`key_scale_tile` (each group once; lanes that need no group bit broadcast), and
        ``KSP``: ``[SG, 4 / SG, DC/2]``, their broadcast to the four word rows (a register
        renaming: the copy axis is lanes that read the same word); ``VWS``: value words, like
        ``KWS``; ``VSS``: value scale words ``[32, 4]`` int32 (the stage's 64 tokens x 2 words
        of two groups' fp16, 16-byte rows as TMA wants). With one word per token (two 64-channel
        groups' fp16, one per channel half), ``[16, 4]``: ``VS1`` for value scales (``VS``'s
        order, :func:`_words_to_vs`) and ``KTS`` for per-token key scales (the order of
        ``decode_gluon``'s ``KT``: lanes e, a0, a1, the slot / row bits in registers)."""
        bits, D, G = (int(getattr(x, "value", x)) for x in (bits, D, G))

        def _dll(regs, lanes, shape):
            return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[],
                                              block_bases=[], shape=shape)

        def tb(kind, i):
            return int(getattr(_tbit(kind, i, bits, G), "value", _tbit(kind, i, bits, G)))
        DC = D // 2
        dbits = DC.bit_length() - 1
        RS = 2 * bits
        a_row = [[1, 0], [2, 0]] if bits == 2 else [[2, 0], [4, 0]]  # R = a, or R = h + 2a
        h_row = [[1, 0]] if bits == 4 else []
        kws = _dll([[0, 1]] + h_row + [[0, 1 << (b + 1)] for b in range(2, dbits - 1)],
                   [[0, 2], [0, 4], [0, 0], a_row[0], a_row[1]], [RS, DC])
        # key scales: the stage holds the step's SG group rows once (key_scale_tile); lanes a0,
        # a1 address the group of word row a (g = a1 at G = 32, g = a at G = 16, the one group
        # at G = 64) and read the same word otherwise; KSP (below) then broadcasts the rows to
        # the word-row index a without moving data.
        SG = 64 // G
        g_lanes = {1: [[0, 0], [0, 0]], 2: [[0, 0], [1, 0]], 4: [[1, 0], [2, 0]]}[SG]
        kss = _dll([[0, 1 << b] for b in range(2, dbits - 1)],
                   [[0, 1], [0, 2], [0, 0]] + g_lanes, [SG, DC // 2])
        K = 4 // SG  # copies of a group row in [A, J]: row a = g K + k
        k_lanes = {1: [[0, 1, 0], [0, 2, 0]], 2: [[0, 1, 0], [1, 0, 0]],
                   4: [[1, 0, 0], [2, 0, 0]]}[SG]
        ksp = _dll([[0, 0, 4], [0, 0, 8], [0, 0, 16]],
                   [[0, 0, 1], [0, 0, 2], [0, 0, 0]] + k_lanes, [SG, K, DC // 2])
        vws = _dll([[0, 1 << b] for b in range(3, dbits)] + h_row,
                   [a_row[0], a_row[1], [0, 1], [0, 2], [0, 4]], [RS, DC])

        def at(t):  # token bit t of the flat int32 index 2 t + w in [32, 4]
            return [0, 2] if t == 0 else [1 << (t - 1), 0]
        r_bits = 2 if bits == 2 else 3
        R = [tb("R", i) for i in range(r_bits)]
        S = [tb("S", i) for i in range(6 - r_bits)]
        if bits == 2:  # VS registers: E (slot bit 3), I0..I2 (slot bits 0-2); lanes a0, a1
            regs = [at(S[3])] + [at(S[i]) for i in range(3)]
            lanes = [at(R[0]), at(R[1])]
        else:  # E (slot bit 2), H (row bit 0), K0, K1 (slot bits 0, 1); lanes a0, a1 (rows 1, 2)
            regs = [at(S[2]), at(R[0]), at(S[0]), at(S[1])]
            lanes = [at(R[1]), at(R[2])]
        vss = _dll([[0, 1]] + regs, lanes + [[0, 0]] * 3, [32, 4])

        def at1(t):  # token bit t of the flat int32 index t in [16, 4] (one word per token)
            return [0, 1 << t] if t < 2 else [1 << (t - 2), 0]

        def one_word(b):  # a base of the [32, 4] layout above, for [16, 4]
            return [0, 0] if b == [0, 0] else at1(next(t for t in range(6) if at(t) == b))
        vs1 = _dll([one_word(b) for b in regs], [one_word(b) for b in lanes] + [[0, 0]] * 3,
                   [16, 4])
        if bits == 2:  # KT: registers I0..I2 (slot bits 0-2); lanes e (slot bit 3), a0, a1
            kts = _dll([at1(S[i]) for i in range(3)],
                       [[0, 0], [0, 0], at1(S[3]), at1(R[0]), at1(R[1])], [16, 4])
        else:  # KT: registers H (row bit 0), K0, K1; lanes e (slot bit 2), a0, a1 (rows 1, 2)
            kts = _dll([at1(R[0]), at1(S[0]), at1(S[1])],
                       [[0, 0], [0, 0], at1(S[2]), at1(R[1]), at1(R[2])], [16, 4])
        return {"KWS": _words3(kws, bits, DC), "KSS": kss, "KSP": ksp,
                "VWS": _words3(vws, bits, DC), "VSS": vss, "VS1": vs1, "KTS": kts}

    @gluon.constexpr_function
    def word_tile(bits, D):
        """Shape of one channel half's word tile of a stage in shared memory: the half's two
        128-byte quarters of each of the ``RS`` word rows, 128-byte swizzled, ordered so that
        the rows one load instruction reads (word rows ``a``, or ``2a + h``) fall in distinct
        swizzle phases and so in distinct banks: ``[RS, 2, 32]`` for 2 bits (shared-memory row
        ``2R + q``), ``[2, RS, 32]`` for 4 bits (``RS q + R``). Unswizzled 512-byte rows put
        all four in the same banks (4-way conflicts, ``benchmarks/results/ncu_body_s25.log``)."""
        bits, D = (int(getattr(x, "value", x)) for x in (bits, D))
        if D != 128:
            raise ValueError(f"the TMA ring serves head_dim 128, got {D}")
        return [2 * bits, 2, 32] if bits == 2 else [2, 2 * bits, 32]

    @gluon.constexpr_function
    def _words3(layout, bits, DC):
        """A word layout over ``[RS, DC]`` (one channel half) re-indexed by that half's
        shared-memory tile (:func:`word_tile`): channel ``c`` is quarter ``c // 32``, word
        ``c % 32`` of a 128-byte row."""
        bits, DC = (int(getattr(x, "value", x)) for x in (bits, DC))
        layout = getattr(layout, "value", layout)

        def to3(base):
            r, c = base
            q, w = c >> 5, c & 31
            return [r, q, w] if bits == 2 else [q, r, w]
        return gl.DistributedLinearLayout(
            reg_bases=[to3(b) for b in layout.reg_bases],
            lane_bases=[to3(b) for b in layout.lane_bases], warp_bases=[], block_bases=[],
            shape=word_tile(bits, DC * 2))

    @gluon.constexpr_function
    def _lay(name, bits, D, G):
        return _smem_layouts(bits, D, G)[getattr(name, "value", name)]

    # Per-token words of a stage viewed as [2] * 6 (token bits 5..0), permuted to the order of a
    # register tensor: which word-row (R) or slot (S) bit of the token order each axis holds, at
    # 2 / 4 bits. KT: decode_gluon's per-token key scales, [a1, a0, e, i0, i1, i2] (2 bits) or
    # [h, a1, a0, e, k0, k1] (4 bits); VS: its value scales, [a1, a0, i0, i1, i2, e] or [h, a1,
    # a0, k0, k1, e]; ROW: the rows of S^T, k1, k0, h, a1, a0, e of n = e + 2a + 8h + 16k (2
    # bits: word row a, slot k + 4h + 8e; 4 bits: row 2a + h, slot k + 4e).
    _TOKEN_ORDERS = {
        "KT": {2: [("R", 1), ("R", 0), ("S", 3), ("S", 0), ("S", 1), ("S", 2)],
               4: [("R", 0), ("R", 2), ("R", 1), ("S", 2), ("S", 0), ("S", 1)]},
        "VS": {2: [("R", 1), ("R", 0), ("S", 0), ("S", 1), ("S", 2), ("S", 3)],
               4: [("R", 0), ("R", 2), ("R", 1), ("S", 0), ("S", 1), ("S", 2)]},
        "ROW": {2: [("S", 1), ("S", 0), ("S", 2), ("R", 1), ("R", 0), ("S", 3)],
                4: [("S", 1), ("S", 0), ("R", 0), ("R", 2), ("R", 1), ("S", 2)]},
    }

    @gluon.constexpr_function
    def _token_axis(order, bits, G, d):
        """Axis ``d`` of the permutation that takes per-token words ``[2] * 6`` (token bits
        5..0) to the order ``order`` of ``_TOKEN_ORDERS``."""
        order = getattr(order, "value", order)
        bits, G, d = (int(getattr(x, "value", x)) for x in (bits, G, d))
        t = _tbit(*_TOKEN_ORDERS[order][bits][d], bits, G)
        return 5 - int(getattr(t, "value", t))

    @gluon.jit
    def _token_half(x, c: gl.constexpr):
        """Words of two fp16 (channel halves 0 and 1 of one token) -> the fp16 of half ``c``."""
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
        if c == 0:
            y = lo
        else:
            y = hi
        return y

    @gluon.jit
    def _smem_token_keys(ks, kz, c: gl.constexpr, BITS: gl.constexpr, D: gl.constexpr,
                         G: gl.constexpr, KT: gl.constexpr):
        """Per-token key scales and zeros of channel half ``c`` (the uniform method, 64-channel
        key groups: one word per token holds both halves' fp16) in ``KT``, for
        ``decode_gluon._key_operand_u`` with ``K_TOK``."""
        KTS: gl.constexpr = _lay("KTS", BITS, D, G)
        sc = _words_to_kt(_token_half(ks.load(KTS), c), BITS, G, KT)
        ze = _words_to_kt(_token_half(kz.load(KTS), c), BITS, G, KT)
        return sc, ze

    @gluon.jit
    def _tokens_as(x, ORDER: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr):
        """Per-token words ``[16, 4]`` / ``[32, 2]`` (token order) viewed as ``[2] * 6`` and
        permuted to the order ``ORDER`` of ``_TOKEN_ORDERS`` (axes: its bits, most significant
        first)."""
        # (one constexpr per axis: Triton 3.6's permute takes a tuple, not a constexpr sequence)
        A0: gl.constexpr = _token_axis(ORDER, BITS, G, 0)
        A1: gl.constexpr = _token_axis(ORDER, BITS, G, 1)
        A2: gl.constexpr = _token_axis(ORDER, BITS, G, 2)
        A3: gl.constexpr = _token_axis(ORDER, BITS, G, 3)
        A4: gl.constexpr = _token_axis(ORDER, BITS, G, 4)
        A5: gl.constexpr = _token_axis(ORDER, BITS, G, 5)
        return gl.permute(gl.reshape(x, [2, 2, 2, 2, 2, 2]), (A0, A1, A2, A3, A4, A5))

    @gluon.jit
    def _token_rows(x, BITS: gl.constexpr, G: gl.constexpr, rows: gl.constexpr):
        """One half's per-token fp16 ``[16, 4]`` (token order, layout ``KTS``) -> float32
        ``[64]`` in the order and 1-D layout of ``S^T``'s rows (lanes e, a0, a1 as in ``KTS``:
        a renaming of registers)."""
        y = gl.reshape(_tokens_as(x, "ROW", BITS, G), [64])
        return gl.convert_layout(y, rows).to(gl.float32)

    @gluon.jit
    def _smem_token_rows(ks, kz, fr, BITS: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
                         rows: gl.constexpr):
        """A stage's per-token key scales and zeros of both channel halves per ``S^T`` row, as
        ``decode_gluon._fold_rows`` makes them for ``_fold_token_scores``: ``s0, b0, s1, b1``."""
        KTS: gl.constexpr = _lay("KTS", BITS, D, G)
        sw = ks.load(KTS)
        zw = kz.load(KTS)
        s0, b0 = dg._fold_rows(_token_rows(_token_half(sw, 0), BITS, G, rows),
                               _token_rows(_token_half(zw, 0), BITS, G, rows), fr)
        s1, b1 = dg._fold_rows(_token_rows(_token_half(sw, 1), BITS, G, rows),
                               _token_rows(_token_half(zw, 1), BITS, G, rows), fr)
        return s0, b0, s1, b1

    @gluon.jit
    def _dequant_scores(kc_s, ks_s, kz_s, st, q0, q1, BITS: gl.constexpr, D: gl.constexpr,
                        G: gl.constexpr, HP: gl.constexpr, DC: gl.constexpr, KW: gl.constexpr,
                        KT: gl.constexpr, K_TOK: gl.constexpr, a_l: gl.constexpr,
                        mma: gl.constexpr):
        """``S^T`` of stage ``st`` from keys dequantized in the operands (scale and zero FMAs
        per element pair), channel half by channel half."""
        if K_TOK:
            u = _smem_key_halves(kc_s.index(2 * st), BITS, D, G, KW)
            sc, ze = _smem_token_keys(ks_s.index(st), kz_s.index(st), 0, BITS, D, G, KT)
        else:
            u, sc, ze = _smem_keys(kc_s.index(2 * st), ks_s.index(st), kz_s.index(st), 0,
                                   BITS, D, G, KW)
        k = dg._key_operand_u(u, sc, ze, BITS, DC, KW, a_l, K_TOK)
        st_ = mma_v2(k, q0, gl.zeros([64, HP], gl.float32, layout=mma))
        if K_TOK:
            u = _smem_key_halves(kc_s.index(2 * st + 1), BITS, D, G, KW)
            sc, ze = _smem_token_keys(ks_s.index(st), kz_s.index(st), 1, BITS, D, G, KT)
        else:
            u, sc, ze = _smem_keys(kc_s.index(2 * st + 1), ks_s.index(st), kz_s.index(st),
                                   DC, BITS, D, G, KW)
        k = dg._key_operand_u(u, sc, ze, BITS, DC, KW, a_l, K_TOK)
        return mma_v2(k, q1, st_)

    @gluon.jit
    def _words_to_kt(x, BITS: gl.constexpr, G: gl.constexpr, KT: gl.constexpr):
        """One half's per-token fp16 ``[16, 4]`` (token order) -> ``KT``."""
        y = _tokens_as(x, "KT", BITS, G)
        if BITS == 2:
            y = gl.reshape(y, [4, 2, 2, 2, 2])
        else:
            y = gl.reshape(y, [2, 4, 2, 2, 2])
        return gl.convert_layout(y, KT)

    @gluon.jit
    def _halves2(lo, hi, sel):
        """``_key_halves`` from the two words of a channel pair."""
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sel],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _smem_keys(kc, ks, kz, DC0: gl.constexpr, BITS: gl.constexpr, D: gl.constexpr,
                   G: gl.constexpr, KW: gl.constexpr):
        """A stage's keys for channels ``[DC0, DC0 + DC)``: the halves ``u`` and the scale/zero
        pairs, shaped for ``decode_gluon._key_operand_u``."""
        J: gl.constexpr = D // 4
        u = _smem_key_halves(kc, BITS, D, G, KW)
        KSS: gl.constexpr = _lay("KSS", BITS, D, G)
        KSP: gl.constexpr = _lay("KSP", BITS, D, G)
        sc = _rows_to_kw(ks.slice(DC0 // 2, J, dim=1).load(KSS), BITS, J, G, KW, KSP)
        ze = _rows_to_kw(kz.slice(DC0 // 2, J, dim=1).load(KSS), BITS, J, G, KW, KSP)
        return u, sc, ze

    @gluon.jit
    def _smem_key_halves(kc, BITS: gl.constexpr, D: gl.constexpr, G: gl.constexpr,
                         KW: gl.constexpr):
        """A stage's key words of one channel half as the thread's halves ``u`` (layout ``KW``;
        one ``prmt`` per channel pair picks the half of both words that holds its slots)."""
        DC: gl.constexpr = D // 2
        J: gl.constexpr = DC // 2
        x = _half_words(kc, _lay("KWS", BITS, D, G), BITS, DC)
        if BITS == 2:
            lo, hi = gl.split(gl.reshape(x, [4, J, 2]))
            SK: gl.constexpr = gl.SliceLayout(1, KW)
            lo = gl.expand_dims(gl.convert_layout(lo, SK), 1)
            hi = gl.expand_dims(gl.convert_layout(hi, SK), 1)
        else:
            lo, hi = gl.split(gl.reshape(x, [4, 2, J, 2]))
            SK: gl.constexpr = gl.SliceLayout(2, KW)
            lo = gl.expand_dims(gl.convert_layout(gl.permute(lo, (1, 0, 2)), SK), 2)
            hi = gl.expand_dims(gl.convert_layout(gl.permute(hi, (1, 0, 2)), SK), 2)
        return _halves2(lo, hi, dg._half_selector(BITS, DC, KW))

    @gluon.jit
    def _half_words(tile, layout: gl.constexpr, BITS: gl.constexpr, DC: gl.constexpr):
        """One channel half's word tile (:func:`word_tile`) read as ``[RS, DC]``."""
        x = tile.load(layout)
        if BITS == 4:
            x = gl.permute(x, (1, 0, 2))
        return gl.reshape(x, [2 * BITS, DC])

    @gluon.jit
    def _rows_to_kw(y, BITS: gl.constexpr, J: gl.constexpr, G: gl.constexpr, KW: gl.constexpr,
                    KSP: gl.constexpr):
        """A half's key scale pairs as loaded (``KSS``, ``[SG, J]``) -> ``[A, J]`` by word row
        (row ``a = g K + k``, each group row broadcast over the ``K = 4 / SG`` copy lanes, no data
        moved), expanded to broadcast over ``KW`` (and ``H``, 4 bits)."""
        SG: gl.constexpr = 64 // G
        y = gl.convert_layout(y, gl.SliceLayout(1, KSP))
        y, _ = gl.broadcast(gl.expand_dims(y, 1), gl.zeros([SG, 4 // SG, J], gl.int32, KSP))
        y = gl.reshape(y, [4, J])
        if BITS == 2:
            out = gl.expand_dims(gl.convert_layout(y, gl.SliceLayout(1, KW)), 1)
        else:
            y = gl.convert_layout(y, gl.SliceLayout(0, gl.SliceLayout(2, KW)))
            out = gl.expand_dims(gl.expand_dims(y, 0), 2)
        return out

    @gluon.jit
    def _smem_values(vc, vsw, vzw, c: gl.constexpr, BITS: gl.constexpr, D: gl.constexpr,
                     G: gl.constexpr, GV: gl.constexpr, VW: gl.constexpr, VS: gl.constexpr):
        """A stage's values for channel half ``c``: words ``[NGC, GV, (H,) A]`` and the scale
        and zero words (two groups' fp16 each) ``[1, (H,) A, I..., E]`` (fp16 of the half's
        one group at GV = 64), shaped for ``decode_gluon._value_operand``. ``vsw``/``vzw``: the
        stage's scale/zero words, both halves (``VSS``, or ``VS1`` at GV = 64)."""
        DC: gl.constexpr = D // 2
        NGC: gl.constexpr = DC // GV
        x = _half_words(vc, _lay("VWS", BITS, D, G), BITS, DC)
        if BITS == 2:
            w = gl.permute(gl.reshape(x, [4, NGC, GV]), (1, 2, 0))
        else:
            w = gl.permute(gl.reshape(x, [4, 2, NGC, GV]), (2, 3, 1, 0))
        w = gl.convert_layout(w, VW)
        if GV == 64:  # one word per token: its two groups are the two channel halves
            vs = _words_to_vs(_token_half(vsw, c), BITS, G, VS)
            vz = _words_to_vs(_token_half(vzw, c), BITS, G, VS)
        else:
            s0, s1 = gl.split(gl.reshape(vsw, [32, 2, 2]))
            z0, z1 = gl.split(gl.reshape(vzw, [32, 2, 2]))
            if c == 0:
                vs = _words_to_vs(s0, BITS, G, VS)
                vz = _words_to_vs(z0, BITS, G, VS)
            else:
                vs = _words_to_vs(s1, BITS, G, VS)
                vz = _words_to_vs(z1, BITS, G, VS)
        return w, vs, vz

    @gluon.jit
    def _words_to_vs(x, BITS: gl.constexpr, G: gl.constexpr, VS: gl.constexpr):
        """One channel half's scale words ``[32, 2]`` (token bits 5..1, 0) -> ``VS``."""
        y = _tokens_as(x, "VS", BITS, G)
        if BITS == 2:
            y = gl.reshape(y, [4, 2, 2, 2, 2])
        else:
            y = gl.reshape(y, [2, 4, 2, 2, 2])
        return gl.expand_dims(gl.convert_layout(y, gl.SliceLayout(0, VS)), 0)

    @gluon.jit
    def _issue_step(s, bh, st, bars, kc_s, ks_s, kz_s, vc_s, vs_s, vz_s, kc_d, ks_d, kz_d, vc_d,
                    vs_d, vz_d, kc_cap, ks_rows, vc_cap, vs_rows, RS: gl.constexpr,
                    KR: gl.constexpr, KC: gl.constexpr, VR: gl.constexpr, D: gl.constexpr):
        """Copy every byte of step ``s`` into stage ``st`` (completing on ``bars[st]``): ``KR``
        rows of ``KC`` int32 of key scales (and zeros), ``VR`` rows of 4 of value scales."""
        bar = bars.index(st)
        mbarrier.expect(bar, 2 * RS * D * 4 + 2 * KR * KC * 4 + 2 * VR * 4 * 4)
        for c in gl.static_range(2):  # channel halves, each a 128-byte-swizzled word tile
            _tma_load(kc_d, _tile_coord(bh * kc_cap + s * RS, c, RS), bar, kc_s.index(2 * st + c))
        _tma_load(ks_d, [bh * ks_rows + s * KR, 0], bar, ks_s.index(st))  # group rows once
        _tma_load(kz_d, [bh * ks_rows + s * KR, 0], bar, kz_s.index(st))
        for c in gl.static_range(2):
            _tma_load(vc_d, _tile_coord(bh * vc_cap + s * RS, c, RS), bar, vc_s.index(2 * st + c))
        _tma_load(vs_d, [bh * vs_rows + s * VR, 0], bar, vs_s.index(st))
        _tma_load(vz_d, [bh * vs_rows + s * VR, 0], bar, vz_s.index(st))

    @gluon.jit
    def _tile_coord(row, c, RS: gl.constexpr):
        """TMA coordinates of channel half ``c`` of the word rows from ``row`` (see
        :func:`word_tile`)."""
        if RS == 4:
            return [row, 2 * c, 0]
        return [2 * c, row, 0]

    @gluon.jit(do_not_specialize=("sink_len", "res_len", "window", "n_out", "steps_per_split"))
    def _body_tma_kernel(
        Q, Out, Lse, kc_d, ks_d, kz_d, vc_d, vs_d, vz_d, Starts, Lens, LenTab,
        qk_scale, softcap, sink_len, body_len, res_len, window, kc_cap, ks_rows, vc_cap, vs_rows,
        Hkv, n_out, steps_per_split,
        HG: gl.constexpr, HP: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr,
        GV: gl.constexpr, HAS_STARTS: gl.constexpr, HAS_LENS: gl.constexpr,
        LENS_DEV: gl.constexpr, NS: gl.constexpr, HAS_WINDOW: gl.constexpr = False,
        SOFTCAP: gl.constexpr = False, LQ: gl.constexpr = 1, K_TOK: gl.constexpr = False,
        PDL: gl.constexpr = False, NQB: gl.constexpr = 1, KFOLD: gl.constexpr = False,
    ):
        if PDL:  # the finish kernel may be scheduled now (it waits for this one to merge)
            dg._launch_dependents()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                      instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        DC: gl.constexpr = D // 2
        KW: gl.constexpr = dg._layout("KW", BITS, DC, GV)
        VW: gl.constexpr = dg._layout("VW", BITS, DC, GV)
        VS_L: gl.constexpr = dg._layout("VS", BITS, DC, GV)
        KT: gl.constexpr = dg._layout("KT", BITS, DC, GV)
        # scale tiles per stage: key rows (SG groups x DC pairs, or 16 x 4 words of per-token
        # scales), value rows of 16 bytes (64 tokens x D / GV fp16)
        KR: gl.constexpr = 16 if K_TOK else 64 // G
        KC: gl.constexpr = 4 if K_TOK else D // 2
        VR: gl.constexpr = 64 * (D // GV) // 8
        VSS: gl.constexpr = _lay("VS1", BITS, D, G) if GV == 64 else _lay("VSS", BITS, D, G)
        W: gl.constexpr = G * BITS // 32
        RS: gl.constexpr = 2 * BITS
        sink_len, body_len, res_len, bh, split, start, length, q_row0, cols, col0 = \
            dg._program_bounds(Starts, Lens, LenTab, sink_len, body_len, res_len, Hkv, HG,
                               HAS_STARTS, HAS_LENS, LENS_DEV, HP, NQB)

        q0, q1 = dg._query_operands(Q, q_row0, qk_scale, 0, cols, HP, D, DC, b_l, False)
        dn = dg._row_tokens(BITS, W, G, gl.SliceLayout(1, mma))
        if KFOLD:  # per-token key scales folded out of the key operands (K_TOK only)
            fr, qs0, qs1 = dg._fold_constants(q0, q1, BITS, mma)

        n_steps = (body_len + 63) // 64
        s_lo = split * steps_per_split
        s_hi = gl.minimum(s_lo + steps_per_split, n_steps)
        first_any, first_all, end_all, end_any = dg._body_bounds(  # body indices
            start, length, sink_len, body_len, window, HAS_WINDOW, LQ)
        s_lo = gl.maximum(s_lo, first_any // 64)
        s_hi = gl.minimum(s_hi, (end_any + 63) // 64)

        WT: gl.constexpr = word_tile(BITS, D)
        kc_s = gl.allocate_shared_memory(gl.int32, [2 * NS, WT[0], WT[1], WT[2]], kc_d.layout)
        ks_s = gl.allocate_shared_memory(gl.int32, [NS, KR, KC], ks_d.layout)
        kz_s = gl.allocate_shared_memory(gl.int32, [NS, KR, KC], kz_d.layout)
        vc_s = gl.allocate_shared_memory(gl.int32, [2 * NS, WT[0], WT[1], WT[2]], vc_d.layout)
        vs_s = gl.allocate_shared_memory(gl.int32, [NS, VR, 4], vs_d.layout)
        vz_s = gl.allocate_shared_memory(gl.int32, [NS, VR, 4], vz_d.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(NS - 1):  # the ring's first steps
            if s_lo + i < s_hi:
                _issue_step(s_lo + i, bh, i, bars, kc_s, ks_s, kz_s, vc_s, vs_s, vz_s, kc_d,
                            ks_d, kz_d, vc_d, vs_d, vz_d, kc_cap, ks_rows, vc_cap, vs_rows, RS, KR,
                            KC, VR, D)

        m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
        l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, mma))
        acc0 = gl.zeros([DC, HP], gl.float32, layout=mma)
        acc1 = gl.zeros([DC, HP], gl.float32, layout=mma)
        for s in range(s_lo, s_hi):
            it = s - s_lo
            st = it % NS
            if s + NS - 1 < s_hi:  # refill the stage the previous step read
                fence_async_shared()
                _issue_step(s + NS - 1, bh, (it + NS - 1) % NS, bars, kc_s, ks_s, kz_s, vc_s,
                            vs_s, vz_s, kc_d, ks_d, kz_d, vc_d, vs_d, vz_d, kc_cap, ks_rows,
                            vc_cap, vs_rows, RS, KR, KC, VR, D)
            mbarrier.wait(bars.index(st), (it // NS) & 1)
            tok0 = s * 64
            if KFOLD:
                zs = gl.zeros([64, HP], gl.float32, layout=mma)
                u = _smem_key_halves(kc_s.index(2 * st), BITS, D, G, KW)
                m0 = mma_v2(dg._key_codes_magic(u, BITS, DC, a_l), q0, zs)
                u = _smem_key_halves(kc_s.index(2 * st + 1), BITS, D, G, KW)
                m1 = mma_v2(dg._key_codes_magic(u, BITS, DC, a_l), q1, zs)
                s0, b0, s1, b1 = _smem_token_rows(ks_s.index(st), kz_s.index(st), fr, BITS, D, G,
                                                  gl.SliceLayout(1, mma))
                st_ = dg._fold_token_scores(m0, m1, s0, b0, s1, b1, qs0, qs1)
            else:
                st_ = _dequant_scores(kc_s, ks_s, kz_s, st, q0, q1, BITS, D, G, HP, DC, KW, KT,
                                      K_TOK, a_l, mma)
            if SOFTCAP:  # before the mask: masked rows may hold anything
                st_ = dg._cap_scores(st_, softcap)
            boundary = (tok0 < first_all) | (tok0 + 64 > end_all)
            if boundary:  # tokens a row does not see; rows past the body hold anything
                st_ = dg._mask_scores(st_, tok0 + dn, first_all, end_any, start, length,
                                      sink_len, body_len, window, HAS_WINDOW, LQ, HP, mma,
                                      col0)
            p, alpha, m_i, l_i = dg._online_softmax(st_, m_i, l_i)
            pb = gl.convert_layout(p.to(gl.float16), b_l)
            vsw = vs_s.index(st).load(VSS)
            vzw = vz_s.index(st).load(VSS)
            w, vs, vz = _smem_values(vc_s.index(2 * st), vsw, vzw, 0, BITS, D, G, GV, VW, VS_L)
            if tok0 + 64 > body_len:  # scales past the body may be anything (not even finite)
                _, _, _, _, s_ok = dg._value_ptrs(Q, Q, Q, 0, 0, tok0, body_len, 0, BITS, W, G,
                                                  D, DC, GV, VW, VS_L)
                vs = gl.where(s_ok, vs, 0)
                vz = gl.where(s_ok, vz, 0)
            v = dg._value_operand(w, vs, vz, BITS, DC, VW, a_l)
            acc0 = mma_v2(v, pb, acc0 * alpha[None, :])
            w, vs, vz = _smem_values(vc_s.index(2 * st + 1), vsw, vzw, 1, BITS, D, G, GV, VW,
                                     VS_L)
            if tok0 + 64 > body_len:
                _, _, _, _, s_ok = dg._value_ptrs(Q, Q, Q, 0, 0, tok0, body_len, DC, BITS, W, G,
                                                  D, DC, GV, VW, VS_L)
                vs = gl.where(s_ok, vs, 0)
                vz = gl.where(s_ok, vz, 0)
            v = dg._value_operand(w, vs, vz, BITS, DC, VW, a_l)
            acc1 = mma_v2(v, pb, acc1 * alpha[None, :])

        for i in gl.static_range(NS):
            mbarrier.invalidate(bars.index(i))
        dg._store_partial(Out, Lse, acc0, acc1, m_i, l_i, q_row0, n_out, split, cols, HP, D, DC,
                          mma)


def eligible(kv, k_tok: bool) -> bool:
    """Whether :func:`attend_body` serves a layer that ``decode_gluon.eligible`` accepts: equal
    key/value bits, codes packed in groups of G <= 64 tokens, keys scaled per channel over
    those groups or (``k_tok``, the uniform method) per token over 64 channels, values per
    token over 32 or 64 channels, head_dim 128, and buffers TMA can address (contiguous,
    16-byte rows; per-token scales' per-head rows a whole number of 16-byte rows)."""
    if (gluon is None or kv.key_bits != kv.value_bits or kv.key_bits not in STAGES
            or kv.group_size not in (16, 32, 64)
            or getattr(kv, "k_codebook", None) is not None  # (codebooks: the register body)
            or getattr(kv, "key_scales_fixed", False)):  # (one offline key row: that body too)
        return False
    D = kv.res_k.shape[-1]
    if D != 128 or kv.value_group not in (32, 64) or kv.v_scale.shape[3] != D // kv.value_group:
        return False
    if k_tok and kv.k_scale.shape[3] != 2:  # one 64-channel key group per channel half
        return False
    ts = (kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero)
    if any(t is None or not t.is_contiguous() or t.data_ptr() % 16 for t in ts):
        return False
    rows_ok = (kv.v_scale.shape[2] * kv.v_scale.shape[3]) % 8 == 0
    return rows_ok and (not k_tok or (kv.k_scale.shape[2] * kv.k_scale.shape[3]) % 8 == 0)


@functools.cache
def _hopper(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9


def serves(kv, k_tok: bool, device) -> bool:
    """``MODE`` allows it, a Hopper-or-newer GPU (TMA) and an :func:`eligible` layer."""
    import torch

    if not (MODE != "0" and device.type == "cuda" and eligible(kv, k_tok)):
        return False
    if not _hopper(device_index(device)):
        return False
    if MODE == "1":
        return True

    pairs = kv.k_codes.shape[0] * kv.k_codes.shape[1]
    return pairs * kv.body_len >= EAGER_MIN_WORK or torch.cuda.is_current_stream_capturing()


# One wave for mid-sized grids: the ring's programs hold 170-255 registers, so exactly two
# one-warp programs fit a scheduler, RESIDENT_PER_SM per SM (shared memory allows ~10). From
# dg.SMALL_GRID_PAIRS to dg.MANY_PAIRS pairs, splitting each pair into one wave of such programs
# (all start together, none waits for a slot, fewer partials to merge) beat decode_gluon's 32 per
# SM (~4 waves) wherever a program then runs at most ONE_WAVE_MAX_STEPS steps. H200, whole
# captured calls, alternated (benchmarks/results/wave_splits_s34.log): Llama-3-8B batch 8 32k
# kivi-2 95.7 -> 91.9 us, kivi-4 112.1 -> 108.5, uniform-int4 102.8 -> 100.1, batch 16 32k
# kivi-2 170.3 -> 167.0; at 128k (128 steps per program) +1.5% / -0.4%, so not there.
RESIDENT_PER_SM = 8
ONE_WAVE_MAX_STEPS = 64


def one_wave_splits(batch_heads: int, body_len: int, sm_count: int) -> int | None:
    """Splits per (sequence, KV head) pair that make one wave of ring programs (see
    ``RESIDENT_PER_SM``), or None where :func:`decode_gluon.body_splits`' rule stays."""
    if not dg.SMALL_GRID_PAIRS <= batch_heads < dg.MANY_PAIRS:
        return None
    steps = -(-body_len // dg.STEP)
    one_wave = max(1, RESIDENT_PER_SM * sm_count // batch_heads)
    return min(one_wave, steps) if -(-steps // one_wave) <= ONE_WAVE_MAX_STEPS else None


WORD_SWIZZLE = 128  # bytes: the word tiles' shared-memory swizzle (rows of 32 int32)


def key_scale_tile(G: int, D: int = 128) -> list:
    """Shape of a stage's key scale (or zero) tile, int32: the step's ``SG = 64 / G`` group rows
    of ``D / 2`` channel pairs, each row once. Before session 26 the rows were copied 4 / SG
    times so that every lane read its group at a row of its own; now the lanes that need no
    group bit read the same word (a broadcast, free) and the rows are broadcast to the four
    word rows in registers (``KSP``). A load instruction's lanes then read SG rows instead of
    four, which share banks (256-byte rows): 2-way conflicts at G = 32 (4-way before), none at
    G = 64, and two TMA copies per step instead of 2 x 4 / SG. (A swizzled tile would remove
    the last conflicts, but TMA's 32/64-byte swizzles need boxes of at least eight rows, and a
    half cannot be sliced along the swizzle.)"""
    if D != 128:
        raise ValueError(f"the TMA ring serves head_dim 128, got {D}")
    return [64 // G, D // 2]


def block_shapes(bits: int, D: int, G: int, k_tok: bool = False, GV: int = 32) -> dict:
    """The TMA box of each descriptor (int32 elements): one channel half of a step's key and
    value word rows (:func:`word_tile`, two copies per step), its key scale/zero group rows
    (:func:`key_scale_tile`; per-token key scales, ``k_tok``: 16-byte rows, one word of two
    fp16 per token), its value scale/zero words as 16-byte rows (64 tokens x D / GV fp16)."""
    WT = list(word_tile(bits, D))
    KS = [16, 4] if k_tok else key_scale_tile(G, D)
    VS = [64 * (D // GV) // 8, 4]
    return {"kc_d": WT, "ks_d": KS, "kz_d": KS, "vc_d": WT, "vs_d": VS, "vz_d": VS}


def _swizzle(name: str) -> int:
    """The shared-memory swizzle (bytes) of a descriptor's tiles."""
    return WORD_SWIZZLE if name in ("kc_d", "vc_d") else 0


def _kernel_signature(bits: int, D: int, G: int, k_tok: bool = False, GV: int = 32) -> dict:
    """``_body_tma_kernel``'s argument types (constexprs excluded)."""
    def desc(name, block):
        return (f"tensordesc<i32[{', '.join(map(str, block))}],NVMMASharedLayout("
                f"swizzle_byte_width={_swizzle(name)}, element_bitwidth=32, rank={len(block)})>")
    sig = {"Q": "*fp16", "Out": "*fp32", "Lse": "*fp32"}
    sig.update({k: desc(k, b) for k, b in block_shapes(bits, D, G, k_tok, GV).items()})
    sig.update({"Starts": "*i32", "Lens": "*i32", "LenTab": "*i32", "qk_scale": "fp32",
                "softcap": "fp32"})
    sig.update(dict.fromkeys(("sink_len", "body_len", "res_len", "window", "kc_cap", "ks_rows",
                              "vc_cap", "vs_rows", "Hkv", "n_out", "steps_per_split"), "i32"))
    return sig


def compile_sm90(constexprs: dict):
    """``_body_tma_kernel`` compiled for sm_90 without a GPU (Triton ships ptxas): the compile
    test and ``benchmarks/probes/gluon_tma_aot.py`` read its PTX/SASS. ``constexprs``: the
    kernel's constexpr arguments (``BITS``, ``D``, ``G``, ...; those with defaults may be left
    out)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    fn = _body_tma_kernel
    params = inspect.signature(fn.fn).parameters  # constexprs left out take their defaults
    cx = {**{k: p.default for k, p in params.items()
             if "constexpr" in str(p.annotation) and p.default is not p.empty}, **constexprs}
    sig = _kernel_signature(cx["BITS"], cx["D"], cx["G"], cx.get("K_TOK", False),
                            cx.get("GV", 32))
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*")}
    src = gluon._runtime.GluonASTSource(fn=fn, signature={**sig, **dict.fromkeys(cx, "constexpr")},
                                        constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})


# A layer's descriptors, per owner of its buffers (``kv.owner``, the store; else the PackedKV):
# id(owner) -> (weak reference to it, the buffers' key, the six descriptors). A descriptor holds
# its buffer, so an entry leaves with its owner (weakref.finalize) and is replaced when the
# owner's buffers change (a store that grows reallocates them). Building six descriptors costs
# ~50 us of host time on a desktop CPU per eager call (views, validation), twice that on the
# H200's host.
_DESCRIPTORS: dict = {}


def _buffers_key(kv) -> tuple:
    """What the descriptors are built from: each buffer's address, shape and dtype, and the
    layout fields that choose the boxes."""
    ts = (kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero)
    return (tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in ts), kv.key_bits,
            kv.group_size, kv.value_group, getattr(kv, "key_axis", "channel"))


def _descriptors(kv):
    """The TMA descriptors of the layer's six buffers, built once per owner and buffers
    (``_DESCRIPTORS``)."""
    import weakref

    owner = getattr(kv, "owner", None)
    owner = kv if owner is None else owner
    key = _buffers_key(kv)
    hit = _DESCRIPTORS.get(id(owner))
    if hit is not None and hit[0]() is owner and hit[1] == key:
        return hit[2]
    descs = _build_descriptors(kv)
    if hit is None or hit[0]() is not owner:  # a new owner (or a dead one's id reused)
        weakref.finalize(owner, _DESCRIPTORS.pop, id(owner), None)
    _DESCRIPTORS[id(owner)] = (weakref.ref(owner), key, descs)
    return descs


def _build_descriptors(kv):
    """TMA descriptors of the layer's six buffers (int32 views)."""
    import torch

    k_tok = getattr(kv, "key_axis", "channel") == "token"
    blocks = block_shapes(kv.key_bits, kv.k_codes.shape[-1], kv.group_size, k_tok,
                          kv.value_group)
    out = []
    for (name, block), t in zip(blocks.items(), (kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes,
                                                  kv.v_scale, kv.v_zero)):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=_swizzle(name), element_bitwidth=32,
                                      rank=len(block))
        if name in ("kc_d", "vc_d"):  # word rows as [rows, 4 quarters, 32] (2 bits) / [4, rows, 32]
            t2 = t.view(torch.int32).reshape(-1, 4, 32)
            if kv.key_bits == 4:  # quarter-major (word_tile): a permuted view, strides 32, 128
                t2 = t2.permute(1, 0, 2)
        else:  # key scale rows (key_scale_tile) or 16-byte rows of per-token scales
            t2 = t.view(torch.int32).reshape(-1, block[1])
        out.append(TensorDescriptor(t2, list(t2.shape), list(t2.stride()), list(block), layout))
    return out


def attend_body(q, kv, out, lse, *, scale_log2: float, starts, lengths, has_starts: bool,
                has_lens: bool, n_out: int, splits: int, lens_dev=None, window=None,
                softcap=None, pdl: bool = False, extra: dict | None = None):
    """``decode_gluon.attend_body`` for :func:`eligible` layers, through the TMA ring
    (``q [B, Hq, Lq, D]``: its rows as columns, as there). ``pdl``: let the next launch, a
    programmatic dependent, start (as there). ``extra``: keyword arguments that replace or add
    to the launch's (probes only: a register cap ``maxnreg``, ``benchmarks/probes/
    tma_maxnreg_ab.py``; a patched kernel's constexprs). Returns the launch's kernel."""
    q, HG, Lq = dg.query_rows_as_heads(q, kv.kv_heads)
    blocks = dg.column_blocks(HG)  # programs per (sequence, KV head, split)
    B, _, _, D = q.shape
    Hkv = kv.kv_heads
    steps = -(-kv.body_len // dg.STEP)
    kc_d, ks_d, kz_d, vc_d, vs_d, vz_d = _descriptors(kv)
    bits = kv.key_bits
    k_tok = getattr(kv, "key_axis", "channel") == "token"
    ks = kv.k_scale
    ks_rows = ks.shape[2] * ks.shape[3] // 8 if k_tok else ks.shape[2]  # rows per (b, h)
    args = (
        q, out, lse, kc_d, ks_d, kz_d, vc_d, vs_d, vz_d, starts, lengths,
        lens_dev if lens_dev is not None else starts, scale_log2,
        float(softcap) if softcap is not None else 1.0, kv.sink_len, kv.body_len, kv.res_len,
        int(window) if window is not None else 0, kv.k_codes.shape[2], ks_rows,
        kv.v_codes.shape[2], kv.v_scale.shape[2] * kv.v_scale.shape[3] // 8, Hkv, n_out,
        -(-steps // splits))
    keywords = _TMA_KEYWORDS(
        HG, 8 if HG <= 8 else 16, D, bits, kv.group_size, kv.value_group, has_starts, has_lens,
        lens_dev is not None, STAGES[bits], window is not None, softcap is not None, Lq, k_tok,
        pdl, blocks, dg.fold_token_keys(kv, HG, D), 1)
    grid = (B * Hkv * blocks, splits)
    if extra:
        return _TMA.run(grid, args, {**keywords.kwargs, **extra})
    return _TMA.launch(grid, args, keywords)


# The launch through kernels.launch.FastLaunch (its descriptors cached per layer above): an eager
# call then skips Triton's binder as the other kernels' launches do.
_TMA = FastLaunch(_body_tma_kernel) if gluon is not None else None
_TMA_KEYWORDS = keyword_maker(("HG", "HP", "D", "BITS", "G", "GV", "HAS_STARTS", "HAS_LENS",
                               "LENS_DEV", "NS", "HAS_WINDOW", "SOFTCAP", "LQ", "K_TOK", "PDL",
                               "NQB", "KFOLD", "num_warps"))
