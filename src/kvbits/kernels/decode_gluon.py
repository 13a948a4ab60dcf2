"""Decode attention over the packed body with the MMA operands built in registers (Gluon, sm_80+).

The Triton kernel of :mod:`kvbits.kernels.decode_attention` cannot place a dequantized tile in
the tensor-core operand layout: it writes the FP16 tile to shared memory and reads it back
(``benchmarks/results/README.md``), and that round trip, not the bytes, bounds it. This kernel
states the layouts explicitly (Gluon), so every thread loads exactly the packed words whose codes
its own MMA fragments hold and unpacks them there: nothing but the small probability tile changes
layout.

One program is one warp over a range of 64-token steps of one (sequence, KV head):

* ``S^T = K Q^T`` (``mma.m16n8k16``; tokens are the M dimension, the GQA group's query heads,
  padded to 8 or 16, the N dimension), so one MMA serves all heads of the group;
* online softmax per head over the tokens; ``O^T += V^T P^T`` with P converted once to the B
  operand layout;
* partial output and base-2 log-sum-exp per split, merged by the Triton merge kernel with the FP16
  (sink and residual) splits that the Triton kernel computes.

Token order inside a step is a permutation chosen so that each thread's codes sit in few words:
logical token ``n = e + 2a + 8h + 16k`` (``e``, ``a``: lane bits of the fragments; ``h``, ``k``:
register bits) is stored at word row ``R`` and slot ``s`` of the slot-major packing with, for 2
bits, ``R = a, s = k + 4h + 8e`` and, for 4 bits, ``R = 2a + h, s = k + 4e``. Then a key fragment
pair (channels d, d+1 of one token) is one byte permute of two words plus one mask, and a value
fragment pair (tokens e = 0, 1 of one channel) is one mask of one word: both halves of the
``half2`` come out of one ``lop3``. Softmax and P V do not care about the token order.

Only the KIVI layout family is served here (keys scaled per channel over G tokens, values per
token over GV channels, key/value bits of 2 or 4, up to 16 query heads x query rows per KV
head as the MMA's columns (each row masked by its own causal end and window; up to 128 as
blocks of 16, one program each: ``column_blocks``), head_dim 64 or 128
as two channel chunks, with ``EXTRA_HEAD_DIMS`` also 96, 192 and 256 as three
or four: ``head_chunks``, chunks past the second loaded only after the first two's MMAs; with
``PADDED_HEAD_DIMS`` other multiples of 4 up to 124 in 32-channel chunks, the last one masked);
:func:`eligible` says which layers, the Triton kernel does the rest.
Different key and value widths (``MIXED_BITS``) permute P's rows between
the two token orders, which differ only by a permutation of the row index's six bits. 3-bit
layers (bit planes; ``PLANES3``) use their own token order (``_tok3``),
in which three plane words merge into 4-bit fields, and from there the 4-bit path; KVQuant's
3-bit codebooks ride on it (``CB``), with their dense-and-sparse outliers as one-hot tiles on the
tensor cores and their pre-RoPE keys turned per element between the two channel chunks, which
are the rotate-half partners (``KVQUANT_FULL``; at head_dim 256 chunk pairs (0, 2) and (1, 3),
``KVQUANT_WIDE``; at other head dims each half in 32-channel chunks of its own, padded, turned
in the same pairs, ``KVQUANT_HALVES``). Keys scaled per token over at least half the
head (the uniform method, ``TOKEN_KEYS``) are served too. Each step's key words are loaded at
its start and its value words after the softmax; right after its key loads a step asks, with
``prefetch.global.L2`` (no registers, no shared memory), for every byte of the next step, so the
one warp waits on L2 rather than DRAM (``DEFAULT_PREFETCH``).
Prefetches of the next step *into registers* measured slower on the H200 (255 registers and
spills), and so did a cp.async double buffer through shared memory (2x slower).
"""

from __future__ import annotations

from .launch import FastLaunch, keyword_maker
from .switches import env_choice, env_count, env_switch

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel serves everything.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

STEP = 64  # body tokens per loop step


if gluon is not None:

    @gluon.constexpr_function
    def _chunk_layouts(bits, D, GV):
        """The explicit register layouts of one warp, as Gluon ``DistributedLinearLayout``s.

        ``KW``: key channel pairs ``[A, E, D/2]`` (2 bits) or ``[H, A, E, D/2]`` (4 bits): the lanes
        of the A operand of ``K [64, D]`` (``d1, d2, e, a0, a1``) with the slot bits (``k``, and ``h``
        for 2 bits) and the pair bit ``d0`` removed; a key element pair is one 64-bit word load and
        one ``half2`` (int32) from then on. ``VW``: value words ``[NGV, GV, A]`` / ``[NGV, GV, H, A]``
        (the channel axis split into scale groups, so a scale broadcasts over its group), lanes
        ``a0, a1, d0, d1, d2`` like the A operand of ``V^T [D, 64]``. ``VS``: value scales ``[NGV,
        H?, A, I..., E]`` with the group bits first in the registers (one vector load per token) and
        no lanes for the channels (all lanes of a scale group read the same scale)."""
        bits, D, GV = (int(getattr(x, "value", x)) for x in (bits, D, GV))
        dbits = D.bit_length() - 1
        gvb = GV.bit_length() - 1
        nd = 4 if bits == 4 else 3  # [H?, A, E, D/2]
        off = 1 if bits == 4 else 0

        def kvec(dim, val):
            v = [0] * nd
            v[dim + off] = val
            return v
        kw_lanes = [kvec(2, 1), kvec(2, 2), kvec(1, 1), kvec(0, 1), kvec(0, 2)]
        kw_regs = ([[1, 0, 0, 0]] if bits == 4 else []) + \
            [kvec(2, 1 << (b - 1)) for b in range(3, dbits)]
        kshape = ([2] if bits == 4 else []) + [4, 2, D // 2]
        kw = gl.DistributedLinearLayout(reg_bases=kw_regs, lane_bases=kw_lanes, warp_bases=[],
                                        block_bases=[], shape=kshape)

        ngv = D // GV
        vnd = 4 if bits == 4 else 3  # [NGV, GV, H?, A]
        a_dim = vnd - 1

        def dvec(b):  # channel bit b in [NGV, GV, ...]
            v = [0] * vnd
            if b < gvb:
                v[1] = 1 << b
            else:
                v[0] = 1 << (b - gvb)
            return v

        def vvec(dim, val):
            v = [0] * vnd
            v[dim] = val
            return v
        vw_lanes = [vvec(a_dim, 1), vvec(a_dim, 2), dvec(0), dvec(1), dvec(2)]
        vw_regs = [dvec(b) for b in range(3, dbits)] + ([vvec(2, 1)] if bits == 4 else [])
        vshape = [ngv, GV] + ([2] if bits == 4 else []) + [4]
        vw = gl.DistributedLinearLayout(reg_bases=vw_regs, lane_bases=vw_lanes, warp_bases=[],
                                        block_bases=[], shape=vshape)

        # Value scales [NW, H?, A, I..., E]: 2 bits: I = k0, k1, h; 4 bits: I = k0, k1. With two
        # or more scale groups in the chunk, NW = NGV / 2 int32 words each holding the float16
        # scales of two groups (half the registers, one PRMT per pair later); else NW = 1 fp16.
        n_i = 2 if bits == 4 else 3
        ngv = ngv // 2 if ngv >= 2 else 1
        hb = 1 if bits == 4 else 0
        snd = 1 + hb + 1 + n_i + 1
        s_a = 1 + hb

        def svec(dim, val):
            v = [0] * snd
            v[dim] = val
            return v
        vs_regs = [svec(0, 1 << b) for b in range(ngv.bit_length() - 1)] + [svec(snd - 1, 1)] + \
            ([svec(1, 1)] if bits == 4 else []) + [svec(s_a + 1 + i, 1) for i in range(n_i)]
        vs_lanes = [svec(s_a, 1), svec(s_a, 2), [0] * snd, [0] * snd, [0] * snd]
        sshape = [ngv] + ([2] if bits == 4 else []) + [4] + [2] * n_i + [2]
        vs = gl.DistributedLinearLayout(reg_bases=vs_regs, lane_bases=vs_lanes, warp_bases=[],
                                        block_bases=[], shape=sshape)
        # Per-token key scales (uniform method), one scale group per chunk: [H?, A, E, I...] fp16,
        # lanes e, a0, a1 like the keys, no lanes for the channel pairs (broadcast).
        tnd = hb + 2 + n_i

        def tvec(dim, val):
            v = [0] * tnd
            v[dim] = val
            return v
        kt_regs = ([tvec(0, 1)] if bits == 4 else []) + [tvec(hb + 2 + i, 1) for i in range(n_i)]
        kt_lanes = [[0] * tnd, [0] * tnd, tvec(hb + 1, 1), tvec(hb, 1), tvec(hb, 2)]
        kt = gl.DistributedLinearLayout(reg_bases=kt_regs, lane_bases=kt_lanes, warp_bases=[],
                                        block_bases=[], shape=([2] if bits == 4 else []) + [4, 2]
                                        + [2] * n_i)
        return {"KW": kw, "VW": vw, "VS": vs, "KT": kt}

    @gluon.constexpr_function
    def _layout(name, bits, D, GV):
        """One of :func:`_chunk_layouts`'s layouts, inside a kernel (compile time)."""
        return _chunk_layouts(bits, D, GV)[getattr(name, "value", name)]


    @gluon.constexpr_function
    def _pair_asm(p, bits):
        """PTX for one ``half2`` of codes at slot position ``p`` of each 16-bit half of a word,
        ``code * scale + zero`` for both halves (scale and zero given as ``half2``), with the
        code made exact before the FMA like the reference's FP16 path. Positions whose
        ``code << (bits * p)`` stays below 1024 are masked in place (the magic ``0x6400``
        exponent makes the half read ``1024 + code * 2^(bits p)``) and rescaled by a power of
        two; the others (given a word already shifted right by ``bits * p0``) likewise."""
        import struct

        def h2(x):  # a float16 constant in both halves of a 32-bit immediate
            b = struct.unpack("<H", struct.pack("<e", x))[0]
            return f"0x{(b << 16) | b:08x}"
        p = int(p)
        bits = int(bits)
        cmax = (1 << bits) - 1
        sh = bits * p
        mask = (cmax << sh) | (cmax << (sh + 16))
        c1 = h2(2.0 ** -sh)
        c2 = h2(-1024.0 * 2.0 ** -sh)
        return ("{ .reg .b32 t, c1, c2; "
                f"lop3.b32 t, $1, {hex(mask)}, 0x64006400, 0xea; "
                f"mov.b32 c1, {c1}; mov.b32 c2, {c2}; "
                "fma.rn.f16x2 t, t, c1, c2; fma.rn.f16x2 $0, t, $2, $3; }")

    @gluon.constexpr_function
    def _in_place(bits):
        """Slot positions per 16-bit half that the magic-number trick reads without a shift."""
        bits = int(bits)
        cmax = (1 << bits) - 1
        p = 0
        while (cmax << (bits * (p + 1))) < 1024:
            p += 1
        return p + 1

    @gluon.jit
    def _dequant(u, sc, ze, P: gl.constexpr, BITS: gl.constexpr):
        """``half2`` (as int32) of the codes at slot position P of both halves of ``u``."""
        NP: gl.constexpr = _in_place(BITS)
        if P >= NP:
            u = u >> (BITS * NP)
        return gl.inline_asm_elementwise(_pair_asm(P % NP, BITS), "=r,r,r,r", [u, sc, ze],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.constexpr_function
    def _magic_asm(p, bits):
        """PTX: :func:`_pair_asm`'s mask alone, the ``half2`` ``1024 + code * 2^(bits p)``
        with no FMA (the scale folded out of the operand, :func:`_magic_codes`)."""
        p = int(p)
        bits = int(bits)
        sh = bits * p
        cmax = (1 << bits) - 1
        return f"lop3.b32 $0, $1, {hex((cmax << sh) | (cmax << (sh + 16)))}, 0x64006400, 0xea;"

    @gluon.jit
    def _magic_codes(u, P: gl.constexpr, BITS: gl.constexpr):
        """``half2`` (as int32) ``1024 + code * 2^(BITS (P % NP))`` of the codes at slot
        position P of both halves of ``u``: one ``lop3`` (after :func:`_dequant`'s shift for
        the positions past ``NP``), exact, and unscaled."""
        NP: gl.constexpr = _in_place(BITS)
        if P >= NP:
            u = u >> (BITS * NP)
        return gl.inline_asm_elementwise(_magic_asm(P % NP, BITS), "=r,r", [u], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _key_codes_magic(u, BITS: gl.constexpr, DC: gl.constexpr, a_l: gl.constexpr):
        """The A operand ``[64, DC]`` of a chunk's key codes as :func:`_magic_codes` halves
        (keys scaled per token, the uniform method: the scale folds out of each row of the
        scores, :func:`_fold_token_scores`)."""
        if BITS == 2:
            k = _join8(_magic_codes(u, 0, 2), _magic_codes(u, 1, 2), _magic_codes(u, 2, 2),
                       _magic_codes(u, 3, 2), _magic_codes(u, 4, 2), _magic_codes(u, 5, 2),
                       _magic_codes(u, 6, 2), _magic_codes(u, 7, 2))
        else:
            k = _join4(_magic_codes(u, 0, 4), _magic_codes(u, 1, 4), _magic_codes(u, 2, 4),
                       _magic_codes(u, 3, 4))
        return _key_tile(k, BITS, DC, a_l)

    @gluon.jit
    def _magic_row_factor(BITS: gl.constexpr, rows: gl.constexpr):
        """``2^-(BITS (P % NP))`` of each ``S^T`` row (``[64]`` in the 1-D layout ``rows``):
        what turns a row of :func:`_key_codes_magic` products back into codes. Row ``n = e +
        2a + 8h + 16k`` holds slot position ``P = k + 4h`` (2 bits) or ``k`` (4 bits)."""
        n = gl.arange(0, 64, layout=rows)
        NP: gl.constexpr = _in_place(BITS)
        if BITS == 2:
            p = n // 16 + 4 * ((n // 8) % 2)
        else:
            p = n // 16
        return gl.exp2(-(BITS * (p % NP)).to(gl.float32))

    @gluon.jit
    def _fold_constants(q0, q1, BITS: gl.constexpr, mma: gl.constexpr):
        """What :func:`_fold_token_scores` needs of a program, once: the rows' magic factor
        (:func:`_magic_row_factor`) and the query chunks' sums ``qs_c[h] = sum_d q_hd`` (float32,
        per ``S^T`` column)."""
        fr = _magic_row_factor(BITS, gl.SliceLayout(1, mma))
        qs0 = gl.convert_layout(gl.sum(q0.to(gl.float32), axis=0), gl.SliceLayout(0, mma))
        qs1 = gl.convert_layout(gl.sum(q1.to(gl.float32), axis=0), gl.SliceLayout(0, mma))
        return fr, qs0, qs1

    @gluon.jit
    def _fold_rows(s, z, fr):
        """A chunk's per-row token scales and zeros (float32 ``[64]``) as
        :func:`_fold_token_scores` takes them: ``s' = s fr`` (``fr``: the rows' magic factor)
        and ``b = z - 1024 s'``."""
        s = s * fr
        return s, z - 1024.0 * s

    @gluon.jit
    def _fold_token_scores(m0, m1, s0, b0, s1, b1, qs0, qs1):
        """Scores of keys scaled per token over each 64-channel chunk, from the MMAs of the raw
        :func:`_key_codes_magic` operands: chunk ``c``'s ``m_c[t, h] = sum_d (1024 + code
        2^(bits p_t)) q_hd``, so its share of ``S^T`` is ``s'_t m_c + b_t qs_c`` with ``s', b``
        from :func:`_fold_rows` and ``qs_c`` the query chunk's sum (:func:`_fold_constants`;
        float32 ``[64]`` per row / per column; four FMAs per score). The 1024 terms cancel in
        float32: what is lost is ~2^-14 of ``s' sum |q|``, against the 2^-11 of ``|k|`` that
        dequantizing to float16 loses."""
        t = m0 * s0[:, None] + b0[:, None] * qs0[None, :]
        return t + m1 * s1[:, None] + b1[:, None] * qs1[None, :]

    @gluon.jit
    def _kt_rows(x, BITS: gl.constexpr, rows: gl.constexpr):
        """Per-token key scales or zeros in ``KT`` (float16) -> float32 ``[64]`` in the order
        and 1-D layout ``rows`` of ``S^T``'s rows (the permutation :func:`_key_tile` gives the
        keys; ``KT``'s lanes e, a0, a1 are the rows' lanes)."""
        if BITS == 2:  # [a1, a0, e, k0, k1, h] -> [k1, k0, h, a1, a0, e]
            y = gl.permute(gl.reshape(x, [2, 2, 2, 2, 2, 2]), (4, 3, 5, 0, 1, 2))
        else:  # [h, a1, a0, e, k0, k1] -> [k1, k0, h, a1, a0, e]
            y = gl.permute(gl.reshape(x, [2, 2, 2, 2, 2, 2]), (5, 4, 0, 1, 2, 3))
        return gl.convert_layout(gl.reshape(y, [64]), rows).to(gl.float32)

    @gluon.jit
    def _key_halves(w, sel):
        """Byte permute of a channel pair's two words (one int64): the half of each word that
        holds the thread's slots (``sel`` 0x5410: low halves, 0x7632: high halves)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; prmt.b32 $0, lo, hi, $2; }",
            "=r,l,r", [w, sel], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pack_half2(lo, hi):
        return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pairs_by_group(x0, x1):
        """Scale words ``[NW, ...]`` of tokens e = 0 and e = 1 (each word: two groups' fp16) ->
        ``half2 (token e=0, token e=1)`` per group, ``[2 NW, ...]``."""
        lo, hi = gl.inline_asm_elementwise(
            "prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;", "=r,=r,r,r", [x0, x1],
            dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        y = gl.permute(gl.join(lo, hi), (0, 5, 1, 2, 3, 4))  # [NW, 2, ...] (rank 6 always)
        return gl.reshape(y, [y.shape[0] * 2, y.shape[2], y.shape[3], y.shape[4], y.shape[5]])

    @gluon.jit
    def _unpack_half2(x):
        """int32 ``half2`` tensor ``[..., N]`` -> float16 ``[..., 2 N]`` (pairs adjacent)."""
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [x],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
        y = gl.join(lo, hi)
        shape: gl.constexpr = _double_last(x.shape)
        return gl.reshape(y, shape)

    @gluon.constexpr_function
    def _double_last(shape):
        shape = [int(x) for x in shape]
        return shape[:-1] + [2 * shape[-1]]

    @gluon.constexpr_function
    def _all_but(layout, dim):
        """``layout`` with every dim except ``dim`` sliced away (innermost first)."""
        for d in reversed(range(len(layout.shape))):
            if d != dim:
                layout = gl.SliceLayout(d, layout)
        return layout

    @gluon.jit
    def _ar(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
        """``arange(n)`` along ``dim`` of ``layout``, shaped to broadcast against it."""
        x = gl.arange(0, n, layout=_all_but(layout, dim))
        for d in gl.static_range(len(layout.shape)):
            if d != dim:
                x = gl.expand_dims(x, d)
        return x

    @gluon.jit
    def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
        """Eight tensors stacked on three new trailing size-2 dims: ``[..., i0, i1, i2]`` holds
        ``c[i0 + 2 i1 + 4 i2]``."""
        return gl.join(gl.join(gl.join(c0, c1), gl.join(c2, c3)),
                       gl.join(gl.join(c4, c5), gl.join(c6, c7)))

    @gluon.jit
    def _join4(c0, c1, c2, c3):
        return gl.join(gl.join(c0, c1), gl.join(c2, c3))

    @gluon.jit
    def _split8(x):
        """Inverse of :func:`_join8`."""
        x0, x1 = gl.split(x)
        a0, a1 = gl.split(x0)
        b0, b1 = gl.split(x1)
        c0, c1 = gl.split(a0)
        c2, c3 = gl.split(a1)
        c4, c5 = gl.split(b0)
        c6, c7 = gl.split(b1)
        return c0, c1, c2, c3, c4, c5, c6, c7

    @gluon.jit
    def _split4(x):
        x0, x1 = gl.split(x)
        c0, c1 = gl.split(x0)
        c2, c3 = gl.split(x1)
        return c0, c1, c2, c3

    @gluon.jit
    def _rows4(x):
        """A ``[64, C]`` tile -> its four 16-row blocks (rows ``16 m`` to ``16 m + 15``, ``m`` =
        0 .. 3). In the MMA layouts the row bits 4 and 5 are register bits: no data moves."""
        C: gl.constexpr = x.shape[1]
        y = gl.permute(gl.reshape(x, [2, 2, 16, C]), (2, 3, 1, 0))  # [r, c, m0, m1]
        y0, y1 = gl.split(y)
        b0, b1 = gl.split(y0)
        b2, b3 = gl.split(y1)
        return b0, b1, b2, b3

    @gluon.jit
    def _join_rows4(b0, b1, b2, b3, layout: gl.constexpr):
        """Inverse of :func:`_rows4`, in ``layout``."""
        C: gl.constexpr = b0.shape[1]
        y = gl.permute(gl.join(gl.join(b0, b1), gl.join(b2, b3)), (3, 2, 0, 1))
        return gl.convert_layout(gl.reshape(y, [64, C]), layout)

    @gluon.jit
    def _tok(R, slot, W: gl.constexpr, G: gl.constexpr):
        """Body-token offset (from the step's first token) of word row ``R``, slot ``slot``."""
        return (R // W) * G + R % W + W * slot

    @gluon.constexpr_function
    def token_order(bits: int, G: int) -> list[int]:
        """Body-token offset (within a 64-token step, G <= 64) of each MMA row ``n`` for codes of
        ``bits`` bits: ``n = e + 2a + 8h + 16k`` is stored at word row ``R`` and slot ``s`` (module
        docstring), i.e. token ``(R // W) G + R % W + W s`` with ``W = G bits / 32`` word rows per
        group."""
        W = G * bits // 32
        out = []
        for n in range(64):
            e, a, h, k = n & 1, (n >> 1) & 3, (n >> 3) & 1, n >> 4
            if bits == 3:  # see _tok3
                cw, a1 = G // 32, a // 2
                out.append((a1 // cw) * G + a1 % cw + cw * (16 * e + 4 * k + h + 2 * (a % 2)))
                continue
            R, slot = (a, k + 4 * h + 8 * e) if bits == 2 else (2 * a + h, k + 4 * e)
            out.append((R // W) * G + R % W + W * slot)
        return out

    @gluon.constexpr_function
    def token_bit_map(kbits: int, vbits: int, G: int) -> list[int]:
        """For each bit ``i`` of a value-order row index, the bit of the key-order row index that
        holds the same token: both orders put the six row bits at distinct token bits, so P moves
        from one to the other by permuting bits (``_reorder_tokens``)."""
        key_row = {t: n for n, t in enumerate(token_order(kbits, G))}
        val = token_order(vbits, G)
        out = []
        for i in range(6):
            n = key_row[val[1 << i]]
            if n & (n - 1):
                raise AssertionError(f"token orders of {kbits} and {vbits} bits (G={G}) are not a "
                                     "bit permutation of each other")
            out.append(n.bit_length() - 1)
        return out

    @gluon.constexpr_function
    def _p_axis(kbits, vbits, G, d):
        """Source axis of axis ``d`` when P's rows (tokens), viewed as six size-2 axes (row bits,
        most significant first), go from the keys' token order to the values' (see
        :func:`token_bit_map`)."""
        bit = token_bit_map(*(int(getattr(x, "value", x)) for x in (kbits, vbits, G)))
        d = int(getattr(d, "value", d))
        return 5 - bit[5 - d]

    @gluon.jit
    def _reorder_tokens(p, KBITS: gl.constexpr, VBITS: gl.constexpr, G: gl.constexpr,
                        HP: gl.constexpr):
        """P ``[64, HP]`` with its rows moved from the keys' token order to the values' (mixed
        key/value widths): a permutation of the six bits of the row index."""
        # (one constexpr per axis: Triton 3.6's permute takes a tuple, not a constexpr sequence)
        A0: gl.constexpr = _p_axis(KBITS, VBITS, G, 0)
        A1: gl.constexpr = _p_axis(KBITS, VBITS, G, 1)
        A2: gl.constexpr = _p_axis(KBITS, VBITS, G, 2)
        A3: gl.constexpr = _p_axis(KBITS, VBITS, G, 3)
        A4: gl.constexpr = _p_axis(KBITS, VBITS, G, 4)
        A5: gl.constexpr = _p_axis(KBITS, VBITS, G, 5)
        x = gl.permute(gl.reshape(p, [2, 2, 2, 2, 2, 2, HP]), (A0, A1, A2, A3, A4, A5, 6))
        return gl.reshape(x, [64, HP])

    @gluon.jit
    def _tok3(a, e, h, k, G: gl.constexpr):
        """Token offset (in its step) of row ``n = e + 2a + 8h + 16k`` for 3-bit planes (32
        tokens per column): the thread's codes sit at plane bit ``p = 16e + 4k + h + 2 a0`` of
        column ``a1`` (``a = a0 + 2 a1``), the order in which :func:`_merge_planes` turns three
        plane words into 4-bit fields (``benchmarks/probes/plane3_recipe.py``); column ``a1`` is
        group ``a1 // (G / 32)`` of the step, column ``a1 % (G / 32)`` of it."""
        CW: gl.constexpr = G // 32
        a1 = a // 2
        return (a1 // CW) * G + a1 % CW + CW * (16 * e + 4 * k + h + 2 * (a % 2))

    @gluon.jit
    def _merge_planes(v0, v1, v2, H: gl.constexpr):
        """Three plane words (uint32, already shifted right by ``2 a0``) -> one word of 4-bit
        fields: field ``m`` holds bits ``4m + H`` of ``v0, v1, v2`` as its bits 0, 1, 2 (bit 3
        stays 0), i.e. the 3-bit code of the thread's token ``k = m % 4`` (register bit ``h =
        H``), read from then on exactly like a 4-bit word."""
        M: gl.constexpr = 0x11111111
        if H == 0:
            x = (v0 & M) | ((v1 << 1) & (M << 1)) | ((v2 << 2) & (M << 2))
        else:
            x = ((v0 >> 1) & M) | (v1 & (M << 1)) | ((v2 << 1) & (M << 2))
        return x.to(gl.int32, bitcast=True)

    @gluon.jit
    def _stack_h(x0, x1, dim: gl.constexpr):
        """Tensors with a size-1 axis ``dim`` (h = 0 and h = 1) -> one with h at ``dim``."""
        x = gl.join(x0, x1)  # h last
        if dim == 0:
            x = gl.permute(x, (4, 1, 2, 3, 0))
        else:
            x = gl.permute(x, (0, 1, 4, 3, 2))
        shape: gl.constexpr = _h_shape(x.shape, dim)
        return gl.reshape(x, shape)

    @gluon.constexpr_function
    def _h_shape(shape, dim):
        shape = [int(v) for v in shape][:-1]
        shape[int(getattr(dim, "value", dim))] = 2
        return shape

    @gluon.jit
    def _plane_row(a, s, n_groups, G: gl.constexpr):
        """The key group of lane index ``a`` in step ``s`` (3-bit planes, :func:`_tok3`), whether
        it is inside the body, and the word row of its column's plane 0 (plane ``p`` is ``p *
        G / 32`` rows further)."""
        CW: gl.constexpr = G // 32
        a1 = a // 2
        g = s * (64 // G) + a1 // CW
        return g, g < n_groups, g * (3 * CW) + a1 % CW

    @gluon.jit
    def _plane_loads(wp, plane_step, ok, sp, zp, s_ok):
        """The three plane words of a 3-bit column (plane ``p`` ``p * plane_step`` further than
        ``wp``) and its scales / zeros."""
        return (gl.load(wp, mask=ok, other=0), gl.load(wp + plane_step, mask=ok, other=0),
                gl.load(wp + 2 * plane_step, mask=ok, other=0), gl.load(sp, mask=s_ok, other=0),
                gl.load(zp, mask=s_ok, other=0))

    @gluon.jit
    def _key_loads3(kc_base, ks_base, kz_base, s, n_groups, DC0: gl.constexpr, G: gl.constexpr,
                    D: gl.constexpr, DC: gl.constexpr, KW: gl.constexpr, END: gl.constexpr,
                    KFIX: gl.constexpr = False):
        """3-bit keys of step ``s``, channels ``[DC0, DC0 + DC)``: the three plane words (int64
        channel pairs) of the thread's column, ``[1, A, E, D/2]`` in the 4-bit ``KW``, and the
        scale / zero pairs of the thread's group (:func:`_key_operand3` unpacks them). Channels
        from ``END`` on are masked (the padded last chunk of a head or of a half). ``KFIX``: one
        fixed scale / zero row for every group (offline key scales, ``key_scales_fixed``)."""
        D2: gl.constexpr = D // 2
        CW: gl.constexpr = G // 32
        a = _ar(4, 1, KW)
        e = _ar(2, 2, KW)
        j = _ar(DC // 2, 3, KW) + DC0 // 2
        g, ok, row = _plane_row(a, s, n_groups, G)
        if DC0 + DC > END:  # the padded last chunk (head_chunks)
            ok = ok & (j < END // 2)
        wp = kc_base.to(gl.pointer_type(gl.int64), bitcast=True) + (row * D2 + j + e * 0)
        s_off = g * (0 if KFIX else D2) + j + e * 0
        sp = ks_base.to(gl.pointer_type(gl.int32), bitcast=True) + s_off
        zp = kz_base.to(gl.pointer_type(gl.int32), bitcast=True) + s_off
        return _plane_loads(wp, CW * D2, ok, sp, zp, ok)

    @gluon.jit
    def _key_operand3(w0, w1, w2, sc, ze, lo0, lo1, hi0, hi1, DC: gl.constexpr,
                      KW: gl.constexpr, a_l: gl.constexpr, CB: gl.constexpr):
        """:func:`_key_operand` for 3-bit planes: half ``e`` of both channels' words of each
        plane (``prmt``), shifted by ``2 a0``, merged into the 4-bit body's key halves ``[H, A,
        E, D/2]``, then that body's dequant."""
        sel = _half_selector(4, DC, KW)
        sh = (2 * (_ar(4, 1, KW) % 2)).to(gl.uint32)
        v0 = _key_halves(w0, sel).to(gl.uint32, bitcast=True) >> sh
        v1 = _key_halves(w1, sel).to(gl.uint32, bitcast=True) >> sh
        v2 = _key_halves(w2, sel).to(gl.uint32, bitcast=True) >> sh
        u = gl.convert_layout(
            _stack_h(_merge_planes(v0, v1, v2, 0), _merge_planes(v0, v1, v2, 1), 0), KW)
        if CB:  # KVQuant: the head's codebook (lo0 .. hi1: _cb_tables)
            return _key_operand_cb(u, sc, ze, lo0, lo1, hi0, hi1, DC, KW, a_l)
        return _key_operand_u(u, sc, ze, 4, DC, KW, a_l, False)

    @gluon.jit
    def _value_loads3(vc_base, vs_base, vz_base, s, n_groups, tok0, body_len,
                      DC0: gl.constexpr, G: gl.constexpr, D: gl.constexpr, DC: gl.constexpr,
                      GV: gl.constexpr, VW: gl.constexpr, VS: gl.constexpr):
        """3-bit values of step ``s``, channels ``[DC0, DC0 + DC)``: the three plane words of the
        thread's column, ``[NGC, GVC, 1, A]`` in the 4-bit ``VW``, and the per-token scales /
        zeros in the 4-bit ``VS`` layout at the 3-bit token order."""
        CW: gl.constexpr = G // 32
        GVC: gl.constexpr = GV if GV < DC else DC  # noqa: FURB136
        NGC: gl.constexpr = DC // GVC
        NGV: gl.constexpr = (D + GV - 1) // GV
        gi = _ar(NGC, 0, VW)
        c = _ar(GVC, 1, VW)
        _, ok, row = _plane_row(_ar(4, 3, VW), s, n_groups, G)
        if DC0 + DC > D:  # the padded last chunk (head_chunks)
            ok = ok & (DC0 + gi * GVC + c < D)
        wp = vc_base + (row * D + DC0 + gi * GVC + c)
        NW: gl.constexpr = NGC // 2 if NGC >= 2 else 1  # scale loads per token (see VS)
        sg = _ar(NW, 0, VS)
        kk = _ar(2, 3, VS) + 2 * _ar(2, 4, VS)
        t = tok0 + _tok3(_ar(4, 2, VS), _ar(2, 5, VS), _ar(2, 1, VS), kk, G)
        s_ok = t < body_len
        sp, zp = _value_scale_ptrs(vs_base, vz_base, t, sg, DC0, NGC, NGV, GV)
        return _plane_loads(wp, CW * D, ok, sp, zp, s_ok)

    @gluon.jit
    def _value_operand3(w0, w1, w2, sc, ze, lo0, lo1, hi0, hi1, DC: gl.constexpr,
                        VW: gl.constexpr, a_l: gl.constexpr, CB: gl.constexpr):
        """:func:`_value_operand` for 3-bit planes: each plane word shifted by ``2 a0`` and the
        three merged into the 4-bit body's value words ``[NGC, GVC, H, A]`` (field ``k + 4e``:
        tokens e = 0, 1 of one ``half2``), then that body's dequant."""
        sh = (2 * (_ar(4, 3, VW) % 2)).to(gl.uint32)
        v0 = w0.to(gl.uint32, bitcast=True) >> sh
        v1 = w1.to(gl.uint32, bitcast=True) >> sh
        v2 = w2.to(gl.uint32, bitcast=True) >> sh
        w = gl.convert_layout(
            _stack_h(_merge_planes(v0, v1, v2, 0), _merge_planes(v0, v1, v2, 1), 2), VW)
        if CB:
            return _value_operand_cb(w, sc, ze, lo0, lo1, hi0, hi1, DC, VW, a_l)
        return _value_operand(w, sc, ze, 4, DC, VW, a_l)

    @gluon.jit
    def _key_ptrs(kc_base, ks_base, kz_base, row0, n_rows, tok0, body_len, DC0: gl.constexpr,
                  BITS: gl.constexpr, W: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                  DC: gl.constexpr, GK: gl.constexpr, KW: gl.constexpr, KT: gl.constexpr,
                  K_TOK: gl.constexpr, KFIX: gl.constexpr = False):
        """Addresses of the packed keys of one step, channels ``[DC0, DC0 + DC)``, in the
        threads that will unpack them: channel-pair words (int64) and scale/zero pairs (int32
        ``half2``), with the masks of rows past the body. ``K_TOK``: keys scaled per token
        over ``GK >= DC`` channels (the uniform method): fp16 scales ``[H?, A, E, I...]``, one
        per token of the thread (:func:`_key_operand` broadcasts them over the channels).
        ``KFIX``: per-channel keys with one fixed scale / zero row (offline key scales)."""
        D2: gl.constexpr = D // 2
        j0: gl.constexpr = DC0 // 2
        if BITS == 2:
            a = _ar(4, 0, KW)
            e = _ar(2, 1, KW)
            j = _ar(DC // 2, 2, KW) + j0
            R = a
        else:
            h = _ar(2, 0, KW)
            a = _ar(4, 1, KW)
            e = _ar(2, 2, KW)
            j = _ar(DC // 2, 3, KW) + j0
            R = 2 * a + h
        row = row0 + R
        ra = row0 + (2 if BITS == 4 else 1) * a  # one key group per thread and step
        wp = kc_base.to(gl.pointer_type(gl.int64), bitcast=True) + (row * D2 + j + e * 0)
        w_ok = row < n_rows
        if DC0 + DC > D:  # the padded last chunk of a head (head_chunks): channel pairs past D
            w_ok = w_ok & (j < D2)
        if K_TOK:
            NGK: gl.constexpr = (D + GK - 1) // GK
            if BITS == 2:
                idx = _ar(2, 2, KT) + 2 * _ar(2, 3, KT) + 4 * _ar(2, 4, KT)
                t = tok0 + _tok(_ar(4, 0, KT), idx + 8 * _ar(2, 1, KT), W, G)
            else:
                kk = _ar(2, 3, KT) + 2 * _ar(2, 4, KT)
                t = tok0 + _tok(2 * _ar(4, 1, KT) + _ar(2, 0, KT), kk + 4 * _ar(2, 2, KT), W, G)
            s_ok = t < body_len
            sp = ks_base + (t * NGK + DC0 // GK)
            zp = kz_base + (t * NGK + DC0 // GK)
        else:
            s_ok = ra < n_rows
            if DC0 + DC > D:
                s_ok = s_ok & (j < D2)
            s_off = (ra // W) * (0 if KFIX else D2) + j + e * 0
            sp = ks_base.to(gl.pointer_type(gl.int32), bitcast=True) + s_off
            zp = kz_base.to(gl.pointer_type(gl.int32), bitcast=True) + s_off
        return wp, sp, zp, w_ok, s_ok

    @gluon.jit
    def _key_loads(kc_base, ks_base, kz_base, row0, n_rows, tok0, body_len, DC0: gl.constexpr,
                   BITS: gl.constexpr, W: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                   DC: gl.constexpr, GK: gl.constexpr, KW: gl.constexpr, KT: gl.constexpr,
                   K_TOK: gl.constexpr, KFIX: gl.constexpr = False):
        """The packed keys of one step (see :func:`_key_ptrs`) loaded into registers."""
        wp, sp, zp, w_ok, s_ok = _key_ptrs(kc_base, ks_base, kz_base, row0, n_rows, tok0,
                                           body_len, DC0, BITS, W, G, D, DC, GK, KW, KT, K_TOK,
                                           KFIX)
        return (gl.load(wp, mask=w_ok, other=0), gl.load(sp, mask=s_ok, other=0),
                gl.load(zp, mask=s_ok, other=0))

    @gluon.jit
    def _key_operand(w, sc, ze, BITS: gl.constexpr, DC: gl.constexpr, KW: gl.constexpr,
                     a_l: gl.constexpr, K_TOK: gl.constexpr, CB2: gl.constexpr = False, tlo=0,
                     thi=0):
        """Dequantized keys of one step (from :func:`_key_loads`) as the A operand
        ``[64, DC]`` of ``S^T = K Q^T``."""
        u = _key_halves(w, _half_selector(BITS, DC, KW))
        return _key_operand_u(u, sc, ze, BITS, DC, KW, a_l, K_TOK, CB2, tlo, thi)

    @gluon.jit
    def _half_selector(BITS: gl.constexpr, DC: gl.constexpr, KW: gl.constexpr):
        """``prmt`` selector per key word pair: the low halves (0x5410) for lanes with e = 0,
        the high halves (0x7632) for e = 1."""
        if BITS == 2:
            e = _ar(2, 1, KW)
        else:
            e = _ar(2, 2, KW)
        return 0x5410 + 0x2222 * e + 0 * _ar(DC // 2, len(KW.shape) - 1, KW)

    @gluon.jit
    def _key_operand_u(u, sc, ze, BITS: gl.constexpr, DC: gl.constexpr, KW: gl.constexpr,
                       a_l: gl.constexpr, K_TOK: gl.constexpr, CB2: gl.constexpr = False,
                       tlo=0, thi=0):
        """:func:`_key_operand` from the thread's halves ``u`` (layout ``KW``)."""
        if K_TOK:  # per-token scales: half2(s, s) per slot, broadcast over the channel pairs
            SK: gl.constexpr = gl.SliceLayout(len(KW.shape) - 1, KW)
            sc = _dup_half2(sc)
            ze = _dup_half2(ze)
            if BITS == 2:
                s0, s1, s2, s3, s4, s5, s6, s7 = _split8(sc)
                z0, z1, z2, z3, z4, z5, z6, z7 = _split8(ze)
                k = _join8(_kpair(u, s0, z0, 0, 2, SK), _kpair(u, s1, z1, 1, 2, SK),
                           _kpair(u, s2, z2, 2, 2, SK), _kpair(u, s3, z3, 3, 2, SK),
                           _kpair(u, s4, z4, 4, 2, SK), _kpair(u, s5, z5, 5, 2, SK),
                           _kpair(u, s6, z6, 6, 2, SK), _kpair(u, s7, z7, 7, 2, SK))
            else:
                s0, s1, s2, s3 = _split4(sc)
                z0, z1, z2, z3 = _split4(ze)
                k = _join4(_kpair(u, s0, z0, 0, 4, SK), _kpair(u, s1, z1, 1, 4, SK),
                           _kpair(u, s2, z2, 2, 4, SK), _kpair(u, s3, z3, 3, 4, SK))
        elif BITS == 2:  # (CB2: KVQuant's 4-entry codebook looked up first)
            k = _join8(_dequant2(u, sc, ze, 0, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 1, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 2, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 3, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 4, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 5, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 6, CB2, tlo, thi),
                       _dequant2(u, sc, ze, 7, CB2, tlo, thi))
        else:
            k = _join4(_dequant(u, sc, ze, 0, 4), _dequant(u, sc, ze, 1, 4),
                       _dequant(u, sc, ze, 2, 4), _dequant(u, sc, ze, 3, 4))
        return _key_tile(k, BITS, DC, a_l)

    @gluon.jit
    def _key_tile(k, BITS: gl.constexpr, DC: gl.constexpr, a_l: gl.constexpr):
        """The dequantized key ``half2``s, stacked by slot, as the A operand ``[64, DC]``."""
        if BITS == 2:
            k = gl.reshape(gl.permute(k, (4, 3, 5, 0, 1, 2)), [64, DC // 2])
        else:
            k = gl.reshape(gl.permute(k, (5, 4, 0, 1, 2, 3)), [64, DC // 2])
        return gl.convert_layout(_unpack_half2(k), a_l)

    @gluon.jit
    def _kpair(u, s, z, P: gl.constexpr, BITS: gl.constexpr, SK: gl.constexpr):
        """Keys at slot position P with one per-token scale pair broadcast over the channels."""
        R: gl.constexpr = len(u.shape) - 1
        s = gl.expand_dims(gl.convert_layout(s, SK), R)
        z = gl.expand_dims(gl.convert_layout(z, SK), R)
        return _dequant(u, s, z, P, BITS)

    @gluon.jit
    def _dup_half2(x):
        """float16 tensor -> int32 ``half2(x, x)``."""
        return gl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [x], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _value_scale_ptrs(vs_base, vz_base, t, sg, DC0: gl.constexpr, NGC: gl.constexpr,
                          NGV: gl.constexpr, GV: gl.constexpr):
        """Addresses of token ``t``'s value scales / zeros for the chunk at channel ``DC0``: with
        two or more scale groups in the chunk, int32 words of two groups' fp16 (``sg``-th
        word), else the one fp16 group."""
        if NGC >= 2:
            off = (t * NGV + DC0 // GV) // 2 + sg
            sp = vs_base.to(gl.pointer_type(gl.int32), bitcast=True) + off
            zp = vz_base.to(gl.pointer_type(gl.int32), bitcast=True) + off
        else:
            sp = vs_base + (t * NGV + DC0 // GV + sg)
            zp = vz_base + (t * NGV + DC0 // GV + sg)
        return sp, zp

    @gluon.jit
    def _value_ptrs(vc_base, vs_base, vz_base, row0, n_rows, tok0, body_len,
                    DC0: gl.constexpr, BITS: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
                    D: gl.constexpr, DC: gl.constexpr, GV: gl.constexpr, VW: gl.constexpr,
                    VS: gl.constexpr):
        """Addresses of the packed values of one step, channels ``[DC0, DC0 + DC)``: words in
        the threads that unpack them, per-token scales/zeros (one vector per token), and their
        masks."""
        NGV: gl.constexpr = (D + GV - 1) // GV  # scale groups per token
        GVC: gl.constexpr = GV if GV < DC else DC  # noqa: FURB136 (channels per group, chunk)
        NGC: gl.constexpr = DC // GVC
        g = _ar(NGC, 0, VW)
        c = _ar(GVC, 1, VW)
        if BITS == 2:
            R = _ar(4, 2, VW)
        else:
            R = _ar(2, 2, VW) + 2 * _ar(4, 3, VW)
        row = row0 + R
        w_ok = row < n_rows
        if DC0 + DC > D:  # the padded last chunk (head_chunks): channels past D
            w_ok = w_ok & (DC0 + g * GVC + c < D)
        wp = vc_base + (row * D + DC0 + g * GVC + c)
        NW: gl.constexpr = NGC // 2 if NGC >= 2 else 1  # scale loads per token (see VS)
        sg = _ar(NW, 0, VS)
        if BITS == 2:
            sa = _ar(4, 1, VS)
            idx = _ar(2, 2, VS) + 2 * _ar(2, 3, VS) + 4 * _ar(2, 4, VS)
            se = _ar(2, 5, VS)
            t = tok0 + _tok(sa, idx + 8 * se, W, G)
        else:
            sh = _ar(2, 1, VS)
            sa = _ar(4, 2, VS)
            kk = _ar(2, 3, VS) + 2 * _ar(2, 4, VS)
            se = _ar(2, 5, VS)
            t = tok0 + _tok(2 * sa + sh, kk + 4 * se, W, G)
        s_ok = t < body_len
        sp, zp = _value_scale_ptrs(vs_base, vz_base, t, sg, DC0, NGC, NGV, GV)
        return wp, sp, zp, w_ok, s_ok

    @gluon.jit
    def _value_loads(vc_base, vs_base, vz_base, row0, n_rows, tok0, body_len,
                     DC0: gl.constexpr, BITS: gl.constexpr, W: gl.constexpr, G: gl.constexpr,
                     D: gl.constexpr, DC: gl.constexpr, GV: gl.constexpr, VW: gl.constexpr,
                     VS: gl.constexpr):
        """The packed values of one step (see :func:`_value_ptrs`) loaded into registers."""
        wp, sp, zp, w_ok, s_ok = _value_ptrs(vc_base, vs_base, vz_base, row0, n_rows, tok0,
                                             body_len, DC0, BITS, W, G, D, DC, GV, VW, VS)
        return (gl.load(wp, mask=w_ok, other=0), gl.load(sp, mask=s_ok, other=0),
                gl.load(zp, mask=s_ok, other=0))

    @gluon.jit
    def _value_operand(w, sc, ze, BITS: gl.constexpr, DC: gl.constexpr, VW: gl.constexpr,
                       a_l: gl.constexpr, CB2: gl.constexpr = False, tlo=0, thi=0):
        """Dequantized values of one step (from :func:`_value_loads`) as the A operand
        ``[DC, 64]`` of ``O^T += V^T P^T``: the scale pair of tokens (e = 0, 1) of each slot is
        packed into one ``half2``, broadcast over its channel group."""
        SL: gl.constexpr = gl.SliceLayout(1, VW)
        sc, ze = _value_scale_pairs(sc, ze)
        if BITS == 2:
            s0, s1, s2, s3, s4, s5, s6, s7 = _split8(sc)
            z0, z1, z2, z3, z4, z5, z6, z7 = _split8(ze)
            v = _join8(_vpair(w, s0, z0, 0, SL, CB2, tlo, thi),
                       _vpair(w, s1, z1, 1, SL, CB2, tlo, thi),
                       _vpair(w, s2, z2, 2, SL, CB2, tlo, thi),
                       _vpair(w, s3, z3, 3, SL, CB2, tlo, thi),
                       _vpair(w, s4, z4, 4, SL, CB2, tlo, thi),
                       _vpair(w, s5, z5, 5, SL, CB2, tlo, thi),
                       _vpair(w, s6, z6, 6, SL, CB2, tlo, thi),
                       _vpair(w, s7, z7, 7, SL, CB2, tlo, thi))
            v = gl.reshape(gl.permute(v, (0, 1, 4, 3, 5, 2)), [DC, 32])
        else:
            s0, s1, s2, s3 = _split4(sc)
            z0, z1, z2, z3 = _split4(ze)
            v = _join4(_vpair(w, s0, z0, 0, SL), _vpair(w, s1, z1, 1, SL),
                       _vpair(w, s2, z2, 2, SL), _vpair(w, s3, z3, 3, SL))
            v = gl.reshape(gl.permute(v, (0, 1, 5, 4, 2, 3)), [DC, 32])
        return gl.convert_layout(_unpack_half2(v), a_l)

    @gluon.jit
    def _value_scale_pairs(sc, ze):
        """Per-token value scales / zeros -> ``half2 (token e=0, token e=1)`` per slot and group
        (words of two groups: one PRMT per (group, token pair))."""
        s_lo, s_hi = gl.split(sc)
        z_lo, z_hi = gl.split(ze)
        if sc.dtype == gl.int32:
            sc = _pairs_by_group(s_lo, s_hi)
            ze = _pairs_by_group(z_lo, z_hi)
        else:
            sc = _pack_half2(s_lo, s_hi)
            ze = _pack_half2(z_lo, z_hi)
        return sc, ze

    @gluon.constexpr_function
    def _cb_pair_asm(p0):
        """PTX: the ``half2``s of fields ``p0`` and ``p0 + 1`` of both 16-bit halves of a word of
        4-bit fields holding 3-bit codes (field bit 3 zero), looked up in an 8-entry float16
        table held as its low bytes (``$3``: entries 0-3, ``$4``: 4-7) and high bytes (``$5``,
        ``$6``), then ``* scale + zero`` (``$7, $8`` for field ``p0``, ``$9, $10`` for ``p0 +
        1``). One ``prmt`` gathers the four codes into a selector, two look up their low and
        high bytes, two interleave them: 5 per two pairs, then the FMAs."""
        gather = "0x4420" if int(getattr(p0, "value", p0)) == 0 else "0x4431"
        return ("{ .reg .b32 g, lo, hi, t0, t1, z; mov.b32 z, 0; "
                f"prmt.b32 g, $2, z, {gather}; "
                "prmt.b32 lo, $3, $4, g; prmt.b32 hi, $5, $6, g; "
                "prmt.b32 t0, lo, hi, 0x6240; prmt.b32 t1, lo, hi, 0x7351; "
                "fma.rn.f16x2 $0, t0, $7, $8; fma.rn.f16x2 $1, t1, $9, $10; }")

    @gluon.constexpr_function
    def _cb16_pair_asm(p0):
        """PTX: :func:`_cb_pair_asm` for 4-bit codes and a 16-entry float16 table (kvquant-4):
        low bytes ``$3 .. $6`` (entries 0-3, 4-7, 8-11, 12-15), high bytes ``$7 .. $10``, then
        ``* scale + zero`` (``$11, $12`` for field ``p0``, ``$13, $14`` for ``p0 + 1``). A
        ``prmt`` indexes 8 bytes and reads a selector's bit 3 as sign replication, so the codes'
        low 3 bits look entries 0-7 and 8-15 up (four ``prmt``) and bit 3 picks one of the two
        per byte: ``prmt`` of 0x80 bytes in that mode gives 0xFF or 0x80, its shift the bit 7
        of the byte mask, one ``lop3`` the mask, two the selection: 13 per two pairs (7 at 3
        bits), then the FMAs."""
        gather = "0x4420" if int(getattr(p0, "value", p0)) == 0 else "0x4431"
        return ("{ .reg .b32 g, s, m, b, la, lb, ha, hb, lo, hi, t0, t1, z, c, k; "
                "mov.b32 z, 0; mov.b32 c, 0x80808080; mov.b32 k, 0x7F7F7F7F; "
                f"prmt.b32 g, $2, z, {gather}; and.b32 s, g, 0x7777; "
                "prmt.b32 la, $3, $4, s; prmt.b32 lb, $5, $6, s; "
                "prmt.b32 ha, $7, $8, s; prmt.b32 hb, $9, $10, s; "
                "prmt.b32 m, c, c, g; shl.b32 b, m, 1; lop3.b32 m, m, b, k, 0xE4; "
                "lop3.b32 lo, la, lb, m, 0xD8; lop3.b32 hi, ha, hb, m, 0xD8; "
                "prmt.b32 t0, lo, hi, 0x6240; prmt.b32 t1, lo, hi, 0x7351; "
                "fma.rn.f16x2 $0, t0, $11, $12; fma.rn.f16x2 $1, t1, $13, $14; }")

    @gluon.constexpr_function
    def _cb2_pair_asm(p):
        """PTX: :func:`_pair_asm` for 2-bit KVQuant codes (kvquant-2): the codes at slot ``p`` of
        both 16-bit halves of ``$1`` looked up in a 4-entry float16 table held as one word of
        its low bytes (``$2``) and one of its high bytes (``$3``), then ``* scale + zero``
        (``$4, $5``). A ``prmt`` gathers the two codes into bytes 0 and 1, a multiply-add makes
        the lookup's selector (nibbles ``code, code + 4`` per half: the entry's low byte from
        ``$2``, its high byte from ``$3``), one ``prmt`` looks both entries up: 6 per pair
        with the shift and the FMA (5 at slot 0; the uniform dequant takes 3)."""
        sh = 2 * int(getattr(p, "value", p))
        shift = f"shr.b32 t, $1, {sh}; " if sh else "mov.b32 t, $1; "
        return ("{ .reg .b32 t, g, c, v, z; mov.b32 z, 0; " + shift
                + "prmt.b32 g, t, z, 0x4420; and.b32 g, g, 0x0303; "
                "mad.lo.u32 c, g, 0x11, 0x4040; prmt.b32 v, $2, $3, c; "
                "fma.rn.f16x2 $0, v, $4, $5; }")

    @gluon.jit
    def _dequant2(u, sc, ze, P: gl.constexpr, CB2: gl.constexpr, tlo, thi):
        """:func:`_dequant` of 2-bit codes, or with ``CB2`` their entries in the head's 4-entry
        codebook (``tlo`` / ``thi``: :func:`_cb_word` 0 of its low / high bytes)."""
        if CB2:
            zero = u * 0  # the scalar tables as tensors of u's shape
            return gl.inline_asm_elementwise(_cb2_pair_asm(P), "=r,r,r,r,r,r",
                                             [u, zero + tlo, zero + thi, sc, ze],
                                             dtype=gl.int32, is_pure=True, pack=1)
        return _dequant(u, sc, ze, P, 2)

    @gluon.jit
    def _cb_pair(u, lo0, lo1, hi0, hi1, s0, z0, s1, z1, P0: gl.constexpr, lo2=0, lo3=0, hi2=0,
                 hi3=0, N16: gl.constexpr = False):
        """:func:`_cb_pair_asm` over a tensor of words (tables and scales broadcast); ``N16``:
        :func:`_cb16_pair_asm`, 4-bit codes in a 16-entry table (``lo0 .. lo3``, ``hi0 ..
        hi3``: :func:`_cb_tables16`)."""
        zero = u * 0  # the scalar tables as tensors of u's shape (folded to one register each)
        if N16:
            return gl.inline_asm_elementwise(
                _cb16_pair_asm(P0), "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [u, zero + lo0, zero + lo1, zero + lo2, zero + lo3, zero + hi0, zero + hi1,
                 zero + hi2, zero + hi3, s0, z0, s1, z1],
                dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return gl.inline_asm_elementwise(
            _cb_pair_asm(P0), "=r,=r,r,r,r,r,r,r,r,r,r",
            [u, zero + lo0, zero + lo1, zero + hi0, zero + hi1, s0, z0, s1, z1],
            dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _cb_byte(ptr, i: gl.constexpr, HI: gl.constexpr):
        """Low (or high) byte of the float16 bits of float32 codebook entry ``ptr[i]``, shifted to
        byte ``i % 4`` of a word."""
        b = gl.load(ptr + i).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        if HI:
            b = b >> 8
        return (b & 0xFF) << (8 * (i % 4))

    @gluon.jit
    def _cb_word(ptr, W: gl.constexpr, HI: gl.constexpr):
        """Low (or high) bytes of entries ``4 W .. 4 W + 3`` as one ``prmt`` table word."""
        return (_cb_byte(ptr, 4 * W, HI) | _cb_byte(ptr, 4 * W + 1, HI)
                | _cb_byte(ptr, 4 * W + 2, HI) | _cb_byte(ptr, 4 * W + 3, HI))

    @gluon.jit
    def _cb_tables(ptr):
        """A head's 8-entry codebook as ``prmt`` tables: low bytes of entries 0-3 and 4-7, high
        bytes of 0-3 and 4-7."""
        return (_cb_word(ptr, 0, False), _cb_word(ptr, 1, False), _cb_word(ptr, 0, True),
                _cb_word(ptr, 1, True))

    @gluon.jit
    def _cb_tables16(ptr):
        """A head's 16-entry codebook (4-bit codes) as ``prmt`` tables: low bytes of entries
        0-3, 4-7, 8-11, 12-15, then their high bytes."""
        return (_cb_word(ptr, 0, False), _cb_word(ptr, 1, False), _cb_word(ptr, 2, False),
                _cb_word(ptr, 3, False), _cb_word(ptr, 0, True), _cb_word(ptr, 1, True),
                _cb_word(ptr, 2, True), _cb_word(ptr, 3, True))

    @gluon.jit
    def _key_operand_cb(u, sc, ze, lo0, lo1, hi0, hi1, DC: gl.constexpr, KW: gl.constexpr,
                        a_l: gl.constexpr, lo2=0, lo3=0, hi2=0, hi3=0, N16: gl.constexpr = False):
        """KVQuant keys (3-bit codes in 4-bit fields ``u``, layout ``KW`` of 4 bits; ``N16``:
        4-bit codes, a 16-entry table): the head's codebook entry of each code ``* scale +
        zero``, as the A operand."""
        k0, k1 = _cb_pair(u, lo0, lo1, hi0, hi1, sc, ze, sc, ze, 0, lo2, lo3, hi2, hi3, N16)
        k2, k3 = _cb_pair(u, lo0, lo1, hi0, hi1, sc, ze, sc, ze, 2, lo2, lo3, hi2, hi3, N16)
        return _key_tile(_join4(k0, k1, k2, k3), 4, DC, a_l)

    @gluon.jit
    def _value_operand_cb(w, sc, ze, lo0, lo1, hi0, hi1, DC: gl.constexpr, VW: gl.constexpr,
                          a_l: gl.constexpr, lo2=0, lo3=0, hi2=0, hi3=0,
                          N16: gl.constexpr = False):
        """KVQuant values (3-bit codes in 4-bit fields ``w``, layout ``VW`` of 4 bits; ``N16``:
        4-bit codes, a 16-entry table): codebook entries ``* scale + zero`` per token pair, as
        the A operand of ``O^T += V^T P^T``."""
        SL: gl.constexpr = gl.SliceLayout(1, VW)
        sc, ze = _value_scale_pairs(sc, ze)
        s0, s1, s2, s3 = _split4(sc)
        z0, z1, z2, z3 = _split4(ze)
        v0, v1 = _cb_pair(w, lo0, lo1, hi0, hi1, _bcast(s0, SL), _bcast(z0, SL), _bcast(s1, SL),
                          _bcast(z1, SL), 0, lo2, lo3, hi2, hi3, N16)
        v2, v3 = _cb_pair(w, lo0, lo1, hi0, hi1, _bcast(s2, SL), _bcast(z2, SL), _bcast(s3, SL),
                          _bcast(z3, SL), 2, lo2, lo3, hi2, hi3, N16)
        v = gl.reshape(gl.permute(_join4(v0, v1, v2, v3), (0, 1, 5, 4, 2, 3)), [DC, 32])
        return gl.convert_layout(_unpack_half2(v), a_l)

    @gluon.jit
    def _bcast(x, SL: gl.constexpr):
        """A per-(group, token) scale over its group's channels (as :func:`_vpair` does)."""
        return gl.expand_dims(gl.convert_layout(x, SL), 1)

    @gluon.jit
    def _vpair(w, s, z, P: gl.constexpr, SL: gl.constexpr, CB2: gl.constexpr = False, tlo=0,
               thi=0):
        BITS: gl.constexpr = 2 if len(w.shape) == 3 else 4
        if BITS == 2:
            return _dequant2(w, _bcast(s, SL), _bcast(z, SL), P, CB2, tlo, thi)
        return _dequant(w, _bcast(s, SL), _bcast(z, SL), P, BITS)

    @gluon.constexpr_function
    def _prefetch_asm(l1):
        level = "L1" if getattr(l1, "value", l1) else "L2"
        return ("{ .reg .pred p; setp.ne.b32 p, $2, 0; "
                f"@p prefetch.global.{level} [$1]; mov.b32 $0, 0; }}")

    @gluon.jit
    def _prefetch(base, NBYTES: gl.constexpr, L1: gl.constexpr):
        """Ask for ``[base, base + NBYTES)`` to be brought into L2 (or L1), one 128-byte line per
        lane: no register waits on it, so the loads of a later step find their bytes close
        instead of in DRAM."""
        PL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        line = gl.arange(0, 32, layout=PL) * 128
        b8 = base.to(gl.pointer_type(gl.int8), bitcast=True)
        for i in gl.static_range((NBYTES + 4095) // 4096):
            off = line + i * 4096
            ok = (off < NBYTES).to(gl.int32)
            gl.inline_asm_elementwise(_prefetch_asm(L1), "=r,l,r", [b8 + off, ok], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _prefetch_step(s, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base, D: gl.constexpr,
                       RS: gl.constexpr, RSV: gl.constexpr, G: gl.constexpr, SPAN: gl.constexpr,
                       NGV: gl.constexpr, NGK: gl.constexpr, K_TOK: gl.constexpr,
                       L1: gl.constexpr, KFIX: gl.constexpr = False):
        """Prefetch every byte step ``s`` will load: key and value words, key scales/zeros (per
        channel over the step's groups, or per token; not ``KFIX``'s one fixed row, read by
        every step), value scales/zeros of its tokens."""
        KWB: gl.constexpr = RS * D * 4
        VWB: gl.constexpr = RSV * D * 4
        _prefetch(kc_base + s * (RS * D), KWB, L1)
        _prefetch(vc_base + s * (RSV * D), VWB, L1)
        t0 = (s * 64 // SPAN) * SPAN
        VSB: gl.constexpr = SPAN * NGV * 2
        _prefetch(vs_base + t0 * NGV, VSB, L1)
        _prefetch(vz_base + t0 * NGV, VSB, L1)
        if K_TOK:
            KSB: gl.constexpr = SPAN * NGK * 2
            _prefetch(ks_base + t0 * NGK, KSB, L1)
            _prefetch(kz_base + t0 * NGK, KSB, L1)
        elif not KFIX:
            SG: gl.constexpr = SPAN // G
            KSB2: gl.constexpr = SG * D * 2
            _prefetch(ks_base + (t0 // G) * D, KSB2, L1)
            _prefetch(kz_base + (t0 // G) * D, KSB2, L1)

    @gluon.jit
    def _prefetch_outliers(s, koi_base, kov_base, voi_base, vov_base, KOUT: gl.constexpr,
                           VOUT: gl.constexpr, L1: gl.constexpr):
        """Prefetch step ``s``'s dense-and-sparse outliers (KVQuant): each side's ``n`` uint8
        indices and float16 corrections per token, 64 tokens a step. Their loads come late in
        the step (the key corrections after the scores, the value ones after the softmax), where
        a register body at 255 registers cannot hoist them."""
        if KOUT > 0:
            _prefetch(koi_base + s * (64 * KOUT), 64 * KOUT, L1)
            _prefetch(kov_base + s * (64 * KOUT), 128 * KOUT, L1)
        if VOUT > 0:
            _prefetch(voi_base + s * (64 * VOUT), 64 * VOUT, L1)
            _prefetch(vov_base + s * (64 * VOUT), 128 * VOUT, L1)

    @gluon.jit
    def _program_bounds(Starts, Lens, LenTab, sink_len, body_len, res_len, Hkv, HG: gl.constexpr,
                        HAS_STARTS: gl.constexpr, HAS_LENS: gl.constexpr,
                        LENS_DEV: gl.constexpr, HP: gl.constexpr = 16, NQB: gl.constexpr = 1):
        """What a body program works within: the layer's (sink, body, residual) lengths (from
        the device with ``LENS_DEV``; the ints are then only bounds), its (sequence, KV head)
        and split, the sequence's first visible position and end, the first query row of its
        columns in ``[B*Hq, D]``, how many of its ``HP`` columns are real and the first one's
        index in the GQA group. Groups of more than 16 columns (``NQB`` blocks of ``HP``, see
        :func:`column_blocks`) take ``NQB`` programs side by side, one block each."""
        if LENS_DEV:
            sink_len = gl.load(LenTab)
            body_len = gl.load(LenTab + 1)
            res_len = gl.load(LenTab + 2)
        if NQB == 1:
            bh = gl.program_id(0)
            col0 = 0
            cols = HG
        else:  # the blocks of one (sequence, KV head) are neighbours: they share its tiles in L2
            bh = gl.program_id(0) // NQB
            col0 = (gl.program_id(0) % NQB) * HP
            cols = HG - col0
        b = bh // Hkv
        start = 0
        length = sink_len + body_len + res_len
        if HAS_STARTS:
            start = gl.load(Starts + b)
        if HAS_LENS:
            length = gl.load(Lens + b)
        q_row0 = (b.to(gl.int64) * Hkv + bh % Hkv) * HG + col0
        return (sink_len, body_len, res_len, bh, gl.program_id(1), start, length, q_row0, cols,
                col0)

    @gluon.jit
    def _query_operand(Q, q_row0, qk_scale, C: gl.constexpr, cols, HP: gl.constexpr,
                       D: gl.constexpr, DC: gl.constexpr, b_l: gl.constexpr,
                       HALVES: gl.constexpr):
        """Q^T chunk ``C`` (``[DC, HP]``, channels ``[C DC, (C + 1) DC)``, or in the halves
        layout :func:`key_base`'s) of a program's columns as a B operand, pre-scaled by ``scale
        * log2(e)``; columns past ``cols`` and channels past the chunk's end are zero."""
        C0: gl.constexpr = key_base(C, D, DC, HALVES)
        qd = gl.arange(0, DC, layout=gl.SliceLayout(1, b_l))
        qj = gl.arange(0, HP, layout=gl.SliceLayout(0, b_l))
        q_ptr = Q + (q_row0 + qj[None, :]) * D + C0 + qd[:, None]
        q_ok = (qj[None, :] < cols) & (C0 + qd[:, None] < key_end(C, D, DC, HALVES))
        return (gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float32) * qk_scale).to(gl.float16)

    @gluon.jit
    def _query_operands(Q, q_row0, qk_scale, C0: gl.constexpr, cols, HP: gl.constexpr,
                        D: gl.constexpr, DC: gl.constexpr, b_l: gl.constexpr,
                        HALVES: gl.constexpr):
        """Chunks ``C0`` and ``C0 + 1`` of :func:`_query_operand`."""
        return (_query_operand(Q, q_row0, qk_scale, C0, cols, HP, D, DC, b_l, HALVES),
                _query_operand(Q, q_row0, qk_scale, C0 + 1, cols, HP, D, DC, b_l, HALVES))

    @gluon.jit
    def _row_tokens(KBITS: gl.constexpr, W: gl.constexpr, G: gl.constexpr, rows: gl.constexpr):
        """Token offset (from the step's first token) of each ``S^T`` row (module docstring),
        as a ``[64]`` tensor of the 1-D layout ``rows`` (rows of S^T, P or an operand)."""
        n = gl.arange(0, 64, layout=rows)
        ne = n % 2
        na = (n // 2) % 4
        nh = (n // 8) % 2
        nk = n // 16
        if KBITS == 2:
            dn = _tok(na, nk + 4 * nh + 8 * ne, W, G)
        elif KBITS == 3:
            dn = _tok3(na, ne, nh, nk, G)
        else:
            dn = _tok(2 * na + nh, nk + 4 * ne, W, G)
        return dn

    @gluon.jit
    def _online_softmax(st, m_i, l_i):
        """One step of the online softmax over the token rows of ``S^T`` (base 2): the step's
        probabilities, the factor that rescales what came before, the new max and sum."""
        m_new = gl.maximum(m_i, gl.max(st, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(st - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=0)

    @gluon.jit
    def _cap_scores(st, softcap):
        """Gemma2's attention-logit softcapping on base-2 scores, as the Triton kernel's
        ``_softmax_step`` does it: ``c tanh(s / c)`` in natural units with
        ``tanh(u) = 1 - 2 / (1 + e^(2u))`` (no overflow: the exponent is clamped)."""
        t = 1.0 - 2.0 / (1.0 + gl.exp2(gl.minimum(st * (2.0 / softcap), 64.0)))
        return (softcap * 1.4426950408889634) * t  # log2(e): back to base-2 units

    @gluon.jit
    def _visible_from(start, length, sink_len, window, HAS_WINDOW: gl.constexpr):
        """The first body index a query row at ``length - 1`` sees (``length`` may be a tensor
        of per-column ends, :func:`_mask_scores`): past the left padding and the copies of the
        sequence's own sink, and inside a sliding window."""
        first = gl.maximum(start, 0)
        if HAS_WINDOW:
            first = gl.maximum(first, length - window - sink_len)
        return first

    @gluon.jit
    def _body_bounds(start, length, sink_len, body_len, window, HAS_WINDOW: gl.constexpr,
                     LQ: gl.constexpr):
        """Body indices seen by the ``LQ`` query rows of a sequence (at ``length - LQ`` ..
        ``length - 1``; their columns are ``head * LQ + row``): ``[first_any, end_any)`` by at
        least one row (the steps to walk), ``[first_all, end_all)`` by every row (steps inside
        it need no mask). One row: both are the row's own range."""
        first_all = _visible_from(start, length, sink_len, window, HAS_WINDOW)  # the last row
        end_any = gl.minimum(length - sink_len, body_len)
        if LQ == 1:
            first_any = first_all
            end_all = end_any
        else:  # the first row: the window's start and the causal end earliest
            first_any = _visible_from(start, length - (LQ - 1), sink_len, window, HAS_WINDOW)
            end_all = gl.minimum(length - (LQ - 1) - sink_len, body_len)
        return first_any, first_all, end_all, end_any

    @gluon.jit
    def _mask_scores(st, t, first, end, start, length, sink_len, body_len, window,
                     HAS_WINDOW: gl.constexpr, LQ: gl.constexpr, HP: gl.constexpr,
                     mma: gl.constexpr, col0=0):
        """``S^T [64, HP]`` with tokens (body indices ``t``) a column's row does not see at
        ``-inf``: before its first visible index or at / past its own position (causal among
        ``LQ`` rows: row ``r`` of ``LQ`` ends ``LQ - 1 - r`` tokens before ``length``). One row:
        outside ``[first, end)`` (:func:`_body_bounds`' ``first_all``, ``end_any``). ``col0``:
        the program's first column in the GQA group (:func:`_program_bounds`)."""
        if LQ == 1:
            return gl.where(((t >= first) & (t < end))[:, None], st, float("-inf"))
        back = (LQ - 1) - (col0 + gl.arange(0, HP, layout=gl.SliceLayout(0, mma))) % LQ
        row_len = length - back  # each column's own sequence end
        seen = t[:, None] < gl.minimum(row_len - sink_len, body_len)[None, :]
        if HAS_WINDOW:
            seen = seen & (t[:, None] >= _visible_from(start, row_len, sink_len, window,
                                                       HAS_WINDOW)[None, :])
        else:
            seen = seen & (t >= gl.maximum(start, 0))[:, None]
        return gl.where(seen, st, float("-inf"))

    @gluon.jit
    def _store_chunk(Out, acc, l_i, q_row0, n_out, split, C: gl.constexpr, cols,
                     HP: gl.constexpr, D: gl.constexpr, DC: gl.constexpr, mma: gl.constexpr):
        """Output chunk ``C`` of a split, normalized; the rows of ``Lse`` and the safe sums."""
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        od = gl.arange(0, DC, layout=gl.SliceLayout(1, mma))
        oj = gl.arange(0, HP, layout=gl.SliceLayout(0, mma))
        o_row = (q_row0 + oj) * n_out + split
        o_ptr = Out + o_row[None, :] * D + C * DC + od[:, None]
        o_ok = (oj[None, :] < cols) & (C * DC + od[:, None] < D)
        gl.store(o_ptr, acc / l_safe[None, :], mask=o_ok)
        return o_row, oj, l_safe

    @gluon.jit
    def _store_partial(Out, Lse, acc0, acc1, m_i, l_i, q_row0, n_out, split, cols,
                       HP: gl.constexpr, D: gl.constexpr, DC: gl.constexpr, mma: gl.constexpr):
        """A split's normalized partial output (its first two chunks) and base-2 log-sum-exp
        (``-inf`` when it saw no token) for its first ``cols`` columns, for the merge kernel."""
        _store_chunk(Out, acc0, l_i, q_row0, n_out, split, 0, cols, HP, D, DC, mma)
        o_row, oj, l_safe = _store_chunk(Out, acc1, l_i, q_row0, n_out, split, 1, cols, HP, D,
                                         DC, mma)
        lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))
        gl.store(Lse + o_row, lse, mask=oj < cols)

    @gluon.jit
    def _later_key_chunk(st, qc, C: gl.constexpr, kc_base, ks_base, kz_base, s, n_groups, r_cur,
                         n_rows, t_cur, body_len, klo0, klo1, khi0, khi1, KBITS: gl.constexpr,
                         W: gl.constexpr, G: gl.constexpr, D: gl.constexpr, DC: gl.constexpr,
                         GK: gl.constexpr, KW: gl.constexpr, KT: gl.constexpr,
                         K_TOK: gl.constexpr, a_l: gl.constexpr, CB: gl.constexpr,
                         KFIX: gl.constexpr = False):
        """Scores of key chunk ``C >= 2`` (head dims 96 / 192 / 256) added to ``st``: its words
        loaded, dequantized and multiplied only now."""
        if KBITS == 3:
            kp, kq, kr, ks, kz = _key_loads3(kc_base, ks_base, kz_base, s, n_groups, C * DC, G,
                                             D, DC, KW, D, KFIX)
            k = _key_operand3(kp, kq, kr, ks, kz, klo0, klo1, khi0, khi1, DC, KW, a_l, CB)
        else:
            kw, ks, kz = _key_loads(kc_base, ks_base, kz_base, r_cur, n_rows, t_cur, body_len,
                                    C * DC, KBITS, W, G, D, DC, GK, KW, KT, K_TOK, KFIX)
            k = _key_operand(kw, ks, kz, KBITS, DC, KW, a_l, K_TOK)
        return mma_v2(k, qc, st)

    @gluon.jit
    def _later_value_chunk(acc, pb, alpha, C: gl.constexpr, vc_base, vs_base, vz_base, s,
                           n_groups, rv, nv_rows, t_cur, body_len, vlo0, vlo1, vhi0, vhi1,
                           VBITS: gl.constexpr, WV: gl.constexpr, G: gl.constexpr,
                           D: gl.constexpr, DC: gl.constexpr, GV: gl.constexpr,
                           VW: gl.constexpr, VS_L: gl.constexpr, a_l: gl.constexpr,
                           CB: gl.constexpr):
        """``acc`` of value chunk ``C >= 2``, rescaled by ``alpha``, plus this step's ``V^T
        P^T`` (words loaded only now)."""
        if VBITS == 3:
            vp, vq, vr, vs, vz = _value_loads3(vc_base, vs_base, vz_base, s, n_groups, t_cur,
                                               body_len, C * DC, G, D, DC, GV, VW, VS_L)
            v = _value_operand3(vp, vq, vr, vs, vz, vlo0, vlo1, vhi0, vhi1, DC, VW, a_l, CB)
        else:
            vw, vs, vz = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur, body_len,
                                      C * DC, VBITS, WV, G, D, DC, GV, VW, VS_L)
            v = _value_operand(vw, vs, vz, VBITS, DC, VW, a_l)
        return mma_v2(v, pb, acc * alpha[None, :])

    # ---------------------------------------------------------- KVQuant: outliers, pre-RoPE keys
    @gluon.jit
    def _one_hot(rows, cols):
        """``[R, C]`` float16 in the parent layout of the two 1-D float16 tensors: 1.0 where
        ``rows[r] == cols[c]``, else 0.0; one ``set.eq.f16x2`` per element pair."""
        a, b = gl.broadcast(rows[:, None], cols[None, :])
        return gl.inline_asm_elementwise("set.eq.f16x2.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _magic(x):
        """Integers ``0 <= x < 1024`` -> the float16 ``1024 + x``, exactly, by one OR (``0x6400``
        is 1024's exponent): what the one-hot compares, with no int -> float conversion."""
        return (x.to(gl.int16) | 0x6400).to(gl.float16, bitcast=True)

    @gluon.jit
    def _outlier_words(oi_base, ov_base, t, ok, NOUT: gl.constexpr):
        """With two outliers per token, both indices of tokens ``t`` in one 16-bit load and
        both corrections in one 32-bit load (:func:`_outlier` takes them apart); else nothing
        (``_outlier`` loads each one)."""
        if NOUT == 2:
            w = gl.load(oi_base.to(gl.pointer_type(gl.uint16), bitcast=True) + t, mask=ok,
                        other=0).to(gl.int32)
            v = gl.load(ov_base.to(gl.pointer_type(gl.int32), bitcast=True) + t, mask=ok,
                        other=0)
        else:
            w = 0
            v = 0
        return w, v

    @gluon.jit
    def _outlier(oi_base, ov_base, t, ok, w, v, j: gl.constexpr, NOUT: gl.constexpr):
        """Outlier ``j`` of tokens ``t``: its channel (int16) and correction (float16), from
        :func:`_outlier_words`' words ``w, v`` or loaded here."""
        if NOUT == 2:
            idx = ((w >> (8 * j)) & 0xFF).to(gl.int16)
            val = ((v >> (16 * j)) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
        else:
            idx = gl.load(oi_base + t * NOUT + j, mask=ok, other=0).to(gl.int16)
            val = gl.load(ov_base + t * NOUT + j, mask=ok, other=0.0)
        return idx, val

    @gluon.jit
    def _cos_sin(a):
        """``cos(a), sin(a)`` of float32 angles: reduced to ``[-pi, pi]`` (2 pi in two float32
        parts) and the MUFU ``cos/sin.approx``, as the Triton kernel's ``_cos_sin`` does."""
        k = gl.floor(a * 0.15915494309189535 + 0.5)
        r = a - k * 6.2831854820251465
        r = r - k * -1.7484556000744883e-07
        return gl.inline_asm_elementwise(
            "cos.approx.f32 $0, $2; sin.approx.f32 $1, $2;", "=r,=r,r", [r],
            dtype=(gl.float32, gl.float32), is_pure=True, pack=1)

    @gluon.jit
    def _rope_query(qa, qb, p0, inv_freq):
        """``R(p0)^T q`` of a query held as its two halves (B operands ``[D/2, HP]``, float16):
        the step's keys at positions ``p0 + j`` then only take the fixed ``R(j)`` of their
        offset (``q . R(p0 + j) k = (R(p0)^T q) . (R(j) k)``; rotate-half convention)."""
        c, s = _cos_sin(p0.to(gl.float32) * inv_freq)
        c = c[:, None]
        s = s[:, None]
        a = qa.to(gl.float32)
        b = qb.to(gl.float32)
        return (a * c + b * s).to(gl.float16), (b * c - a * s).to(gl.float16)

    @gluon.jit
    def _rope_block(st, ka, kb, xa, xb, cs, H2: gl.constexpr, a_l: gl.constexpr,
                    mma: gl.constexpr):
        """One 16-row block of :func:`_rope_scores`."""
        ka = gl.convert_layout(ka, a_l)
        kb = gl.convert_layout(kb, a_l)
        c = gl.load(cs)
        s = gl.load(cs + 64 * H2)
        st = mma_v2(ka * c - kb * s, xa, gl.convert_layout(st, mma))
        return mma_v2(kb * c + ka * s, xb, st)

    @gluon.jit
    def _rope_scores(st, ka, kb, xa, xb, cs, H2: gl.constexpr, a_l: gl.constexpr,
                     mma: gl.constexpr):
        """``st + (R(j) k) . (xa, xb)`` for pre-RoPE keys held as their rotate-half halves
        ``ka, kb`` ``[64, DC]`` (A operands) against the query halves turned by the step's
        ``R(p0)`` (:func:`_rope_query`), in four 16-row blocks: each block's ``cos / sin(j
        theta)`` rows (the step table, ``cs``: pointers to block 0's ``[16, DC]``) are loaded
        just before its MMAs, so a quarter of the table is live at a time instead of all of it
        beside both key halves (``ROPE_BLOCKS``)."""
        a0, a1, a2, a3 = _rows4(ka)
        b0, b1, b2, b3 = _rows4(kb)
        s0, s1, s2, s3 = _rows4(st)
        s0 = _rope_block(s0, a0, b0, xa, xb, cs, H2, a_l, mma)
        s1 = _rope_block(s1, a1, b1, xa, xb, cs + 16 * H2, H2, a_l, mma)
        s2 = _rope_block(s2, a2, b2, xa, xb, cs + 32 * H2, H2, a_l, mma)
        s3 = _rope_block(s3, a3, b3, xa, xb, cs + 48 * H2, H2, a_l, mma)
        return _join_rows4(s0, s1, s2, s3, mma)

    @gluon.jit
    def _key_outliers(st, oi_base, ov_base, t_cur, body_len, rows_a, rows_c, x0, x1, x2, x3,
                      cs_ptr, NOUT: gl.constexpr, NCH: gl.constexpr, DC: gl.constexpr,
                      H2R: gl.constexpr, ROPE: gl.constexpr, a_l: gl.constexpr,
                      mma: gl.constexpr):
        """Dense-and-sparse keys: the ``NOUT`` FP16 corrections ``val`` at channel ``idx`` of
        each token, added to the scores as ``val * q'[idx]``. A one-hot tile times the query
        operand picks ``q'[idx]`` for every head on the tensor cores (one ``set.eq.f16x2`` per
        element pair; the compare-and-add into the key tile costs three). ``rows_a`` /
        ``rows_c``: token offsets of the rows in the A operand / ``S^T`` layouts. Post-RoPE:
        ``q'`` is the query, ``x0 .. x3`` its channel chunks (``NCH`` of them, 2 to 4).
        Pre-RoPE (``ROPE``): the correction turns with its key, ``R(j) e_idx`` having two
        non-zeros (channels ``i = idx mod D/2`` and ``i + D/2``, at ``cos/sin(j theta_i)`` from
        the step table ``cs_ptr``, rows in MMA-row order), so both rotated query halves are
        picked at ``i`` and combined; ``(x0, x1)`` are the rotated halves' chunk-0 pair and, at
        four chunks, ``(x2, x3)`` the chunk-1 pair (a half is then two chunks: the one-hot over
        ``i`` is cut in two). ``H2R``: the head's half, ``D / 2``; ``H2``, the table's row (the
        half padded to whole chunks in the halves layout, :func:`head_chunks`)."""
        H2: gl.constexpr = DC * NCH // 2  # channels per rotate-half half, as the table has them
        ta = t_cur + rows_a
        tc = t_cur + rows_c
        ch = gl.arange(0, DC, layout=gl.SliceLayout(0, a_l))
        zero = gl.zeros(st.shape, gl.float32, layout=mma)
        wa, va = _outlier_words(oi_base, ov_base, ta, ta < body_len, NOUT)
        wc, vc = _outlier_words(oi_base, ov_base, tc, tc < body_len, NOUT)
        for j in gl.static_range(NOUT):
            idx, _ = _outlier(oi_base, ov_base, ta, ta < body_len, wa, va, j, NOUT)
            ic, val = _outlier(oi_base, ov_base, tc, tc < body_len, wc, vc, j, NOUT)
            val = val.to(gl.float32)
            if ROPE:
                if H2R == H2:  # a power of two
                    m = _magic(idx & (H2 - 1))
                else:  # (channel i of half B is head channel H2R + i)
                    m = _magic(gl.where(idx >= H2R, idx - H2R, idx))
                oh = _one_hot(m, _magic(ch))
                ga = mma_v2(oh, x0, zero)
                gb = mma_v2(oh, x1, zero)
                if NCH == 4:  # the half's second chunk
                    oh = _one_hot(m, _magic(ch + DC))
                    ga = mma_v2(oh, x2, ga)
                    gb = mma_v2(oh, x3, gb)
                if H2R == H2:
                    i_c = (ic & (H2 - 1)).to(gl.int32)
                else:
                    i_c = gl.where(ic >= H2R, ic - H2R, ic).to(gl.int32)
                cs = cs_ptr + gl.arange(0, 64, layout=gl.SliceLayout(1, mma)) * H2 + i_c
                c = gl.load(cs).to(gl.float32) * val
                s = gl.load(cs + 64 * H2).to(gl.float32) * val
                hi = ic >= H2R  # the partner is i (below) instead of i + D/2: -s and c
                st = st + gl.where(hi, -s, c)[:, None] * ga + gl.where(hi, c, s)[:, None] * gb
            else:
                m = _magic(idx)
                g = mma_v2(_one_hot(m, _magic(ch)), x0, zero)
                g = mma_v2(_one_hot(m, _magic(ch + DC)), x1, g)
                if NCH >= 3:
                    g = mma_v2(_one_hot(m, _magic(ch + 2 * DC)), x2, g)
                if NCH == 4:
                    g = mma_v2(_one_hot(m, _magic(ch + 3 * DC)), x3, g)
                st = st + val[:, None] * g
        return st

    @gluon.jit
    def _value_outliers(acc0, acc1, acc2, acc3, pb, oi_base, ov_base, t_cur, body_len, cols_a,
                        rows_b, NOUT: gl.constexpr, NCH: gl.constexpr, DC: gl.constexpr,
                        a_l: gl.constexpr):
        """Dense-and-sparse values: ``O^T[idx, h] += val * P[t, h]`` for the ``NOUT`` FP16
        corrections of each token, as ``OneHot^T (P * val)`` on the tensor cores (the one-hot
        ``[DC, 64]`` per channel chunk, ``NCH`` of them, 2 to 4; the accumulators past ``NCH``
        pass through; ``cols_a`` / ``rows_b``: token offsets of P's rows in the A operand's
        columns / the B operand's rows). P already carries the online softmax's scale, so the
        correction rescales with the accumulators (add it after this step's rescale)."""
        ta = t_cur + cols_a
        tb = t_cur + rows_b
        ch = gl.arange(0, DC, layout=gl.SliceLayout(1, a_l))
        wa, va = _outlier_words(oi_base, ov_base, ta, ta < body_len, NOUT)
        wb, vb = _outlier_words(oi_base, ov_base, tb, tb < body_len, NOUT)
        for j in gl.static_range(NOUT):
            idx, _ = _outlier(oi_base, ov_base, ta, ta < body_len, wa, va, j, NOUT)
            _, val = _outlier(oi_base, ov_base, tb, tb < body_len, wb, vb, j, NOUT)
            w = pb * val[:, None]
            m = _magic(idx)
            acc0 = mma_v2(_one_hot(_magic(ch), m), w, acc0)
            acc1 = mma_v2(_one_hot(_magic(ch + DC), m), w, acc1)
            if NCH >= 3:
                acc2 = mma_v2(_one_hot(_magic(ch + 2 * DC), m), w, acc2)
            if NCH == 4:
                acc3 = mma_v2(_one_hot(_magic(ch + 3 * DC), m), w, acc3)
        return acc0, acc1, acc2, acc3

    @gluon.constexpr_function
    def _partner_chunk(NCH, ROPE):
        """The chunk a step loads with chunk 0 (see ``K1`` in :func:`_body_kernel`)."""
        return 2 if int(getattr(NCH, "value", NCH)) == 4 and bool(getattr(ROPE, "value", ROPE)) \
            else 1

    @gluon.constexpr_function
    def head_chunks(D, HALVES=False):
        """Channel chunks of a head (one MMA operand each): two at head_dim 64 and 128 (32 / 64
        channels), else 64-channel chunks where they divide it (192: 3, 256: 4), else 32-channel
        ones (96: 3), the last one padded where 32 does not divide it either (80: 3, 100: 4;
        :func:`padded_head`). ``HALVES`` (pre-RoPE keys at other head dims than 64 / 128 / 256,
        :func:`halves_layout`): each rotate-half half of ``D / 2`` channels in 32-channel
        chunks of its own, padded (96: 48 + 16 padding per half, four chunks; 40: two)."""
        D = int(getattr(D, "value", D))
        if bool(getattr(HALVES, "value", HALVES)):
            return 2 * -(-(D // 2) // 32)
        if D in (64, 128):
            return 2
        return D // 64 if D % 64 == 0 else -(-D // 32)

    @gluon.constexpr_function
    def chunk_width(D, HALVES=False):
        """Channels per chunk (:func:`head_chunks`): 32 or 64; the last chunk of a padded head
        (of a padded half) holds fewer real channels, its other lanes masked (zero query, no
        loads, no stores)."""
        D = int(getattr(D, "value", D))
        if bool(getattr(HALVES, "value", HALVES)):
            return 32
        return 64 if D == 128 or D % 64 == 0 and D > 128 else 32

    @gluon.constexpr_function
    def halves_layout(D, ROPE):
        """Whether pre-RoPE keys (``ROPE``) at this head dim take the halves layout: every
        head dim but 64, 128 and 256, whose chunks already are whole rotate-half halves."""
        D = int(getattr(D, "value", D))
        return bool(getattr(ROPE, "value", ROPE)) and D not in (64, 128, 256)

    @gluon.constexpr_function
    def key_base(C, D, DC, HALVES):
        """First channel of key / query chunk ``C`` (``DC`` channels wide): ``C * DC``, or in
        the halves layout the chunk's place in its half (chunks ``[0, NCH/2)`` hold half A, the
        rest half B)."""
        C, D, DC = (int(getattr(x, "value", x)) for x in (C, D, DC))
        if not bool(getattr(HALVES, "value", HALVES)):
            return C * DC
        per = -(-(D // 2) // DC)  # chunks per half
        return (C // per) * (D // 2) + (C % per) * DC

    @gluon.constexpr_function
    def key_end(C, D, DC, HALVES):
        """End (exclusive) of the channels chunk ``C`` may hold: ``D``, or the end of its
        half in the halves layout (the lanes past it are masked)."""
        C, D, DC = (int(getattr(x, "value", x)) for x in (C, D, DC))
        if not bool(getattr(HALVES, "value", HALVES)):
            return D
        return (C // -(-(D // 2) // DC) + 1) * (D // 2)

    # the same, called from the host: a constexpr_function call costs ~7 us there (every step)
    chunks_of = head_chunks.fn
    chunk_width_of = chunk_width.fn

    @gluon.jit
    def _launch_dependents():
        """``griddepcontrol.launch_dependents``: a kernel launched after this one as a
        programmatic dependent (``launch_pdl``) may start once every program has passed here."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    # Step-varying integers are not specialized (see decode_attention._STEP_VARYING).
    @gluon.jit(do_not_specialize=("sink_len", "res_len", "n_out", "steps_per_split"))
    def _body_kernel(
        Q, Out, Lse, KC, KS, KZ, VC, VS, VZ, Starts, Lens, LenTab, KCB, VCB,
        KOI, KOV, VOI, VOV, InvFreq, RopeCS,
        qk_scale, softcap, sink_len, body_len, res_len, window, kc_cap, ks_slice, vc_cap,
        vs_slice, kout_cap, vout_cap, Hkv, n_out, steps_per_split,
        HG: gl.constexpr, HP: gl.constexpr, D: gl.constexpr, KBITS: gl.constexpr,
        VBITS: gl.constexpr, G: gl.constexpr, GV: gl.constexpr, HAS_STARTS: gl.constexpr,
        HAS_LENS: gl.constexpr, GK: gl.constexpr, K_TOK: gl.constexpr,
        LENS_DEV: gl.constexpr, PF: gl.constexpr = 0, PF_L1: gl.constexpr = False,
        PF_AFTER: gl.constexpr = False, EARLY_V: gl.constexpr = False, CB: gl.constexpr = False,
        PF_OUT: gl.constexpr = False,
        Q_RELOAD: gl.constexpr = False,
        KOUT: gl.constexpr = 0, VOUT: gl.constexpr = 0, ROPE: gl.constexpr = False,
        HAS_WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = False, LQ: gl.constexpr = 1,
        PDL: gl.constexpr = False, ROPE_M: gl.constexpr = False, NQB: gl.constexpr = 1,
        KFIX: gl.constexpr = False, KFOLD: gl.constexpr = False,
    ):
        if PDL:  # the finish kernel may be scheduled now (it waits for this one to merge)
            _launch_dependents()
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                      instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # pre-RoPE keys at head dims other than 64 / 128 / 256: each half in chunks of its own
        HALVES: gl.constexpr = halves_layout(D, ROPE)
        NCH: gl.constexpr = head_chunks(D, HALVES)  # 2 to 4 chunks of 32 or 64 channels
        gl.static_assert(NCH <= 4, "head_dim: 33 to 128 (multiples of 4), 192 or 256")
        DC: gl.constexpr = chunk_width(D, HALVES)  # channels per chunk (the last may be padded)
        GVC: gl.constexpr = GV if GV < DC else DC  # noqa: FURB136 (value-scale group in a chunk)
        # 3-bit planes are merged into 4-bit fields after loading: the 4-bit layouts serve them
        KL: gl.constexpr = 4 if KBITS == 3 else KBITS
        VL: gl.constexpr = 4 if VBITS == 3 else VBITS
        KW: gl.constexpr = _layout("KW", KL, DC, GVC)
        KT: gl.constexpr = _layout("KT", KL, DC, GVC)
        VW: gl.constexpr = _layout("VW", VL, DC, GVC)
        VS_L: gl.constexpr = _layout("VS", VL, DC, GVC)
        W: gl.constexpr = G * KBITS // 32  # word rows per key group
        RS: gl.constexpr = 2 * KBITS  # key word rows per step
        WV: gl.constexpr = G * VBITS // 32  # the same for the values
        RSV: gl.constexpr = 2 * VBITS
        SPAN: gl.constexpr = G if G > 64 else 64  # noqa: FURB136 (tokens a step's groups span)
        sink_len, body_len, res_len, bh, split, start, length, q_row0, cols, col0 = \
            _program_bounds(Starts, Lens, LenTab, sink_len, body_len, res_len, Hkv, HG,
                            HAS_STARTS, HAS_LENS, LENS_DEV, HP, NQB)
        bh64 = bh.to(gl.int64)
        gl.static_assert(not (ROPE or KOUT > 0 or VOUT > 0)
                         or (KBITS == 3 and CB and (NCH == 2 or (NCH == 4 and DC == 64)
                                                    or HALVES or not ROPE))
                         or (KBITS == VBITS and KBITS != 3 and CB and NCH == 2),
                         "outliers / pre-RoPE keys: 3-bit codebooks (2- and 4-bit at head_dim "
                         "64 / 128); pre-RoPE keys in chunks that are whole halves (head_dim 64, "
                         "128, 256) or the halves layout")
        # KVQuant at 4 bits (CB4): the 4-bit body's words, codes looked up in 16-entry tables;
        # at 2 bits (CB2): the 2-bit body's words, codes looked up in 4-entry tables
        CB4: gl.constexpr = CB and KBITS == 4
        CB2: gl.constexpr = CB and KBITS == 2
        gl.static_assert(not CB or KBITS == 3 or ((CB4 or CB2) and VBITS == KBITS and NCH == 2),
                         "codebooks: 3 bits, or 2 / 4 bits at head_dim 64 / 128")
        # channels per rotate-half half as the cos / sin table and InvFreq hold them (in the
        # halves layout padded to whole chunks by the host, attend_body), and as the head does
        H2: gl.constexpr = DC * NCH // 2
        H2R: gl.constexpr = D // 2
        # the chunk loaded with chunk 0 at the step's start: its rotate-half partner (chunk 2 of
        # four) with pre-RoPE keys at head_dim 256, else chunk 1
        K1: gl.constexpr = _partner_chunk(NCH, ROPE)

        q0, q1 = _query_operands(Q, q_row0, qk_scale, 0, cols, HP, D, DC, b_l, HALVES)
        if KFOLD:  # per-token key scales folded out of the key operands (fold_token_keys)
            fr, qs0, qs1 = _fold_constants(q0, q1, KBITS, mma)
        if NCH >= 3 and not Q_RELOAD:
            q2 = _query_operand(Q, q_row0, qk_scale, 2, cols, HP, D, DC, b_l, HALVES)
        if NCH == 4 and not Q_RELOAD:
            q3 = _query_operand(Q, q_row0, qk_scale, 3, cols, HP, D, DC, b_l, HALVES)
        dn = _row_tokens(KBITS, W, G, gl.SliceLayout(1, mma))
        klo2, klo3, khi2, khi3 = 0, 0, 0, 0  # (entries 8-15: 4-bit codebooks only)
        vlo2, vlo3, vhi2, vhi3 = 0, 0, 0, 0
        if CB4:  # KVQuant (4 bits): the KV head's codebooks as prmt tables, [Hkv, 16] float32
            klo0, klo1, klo2, klo3, khi0, khi1, khi2, khi3 = _cb_tables16(KCB + (bh % Hkv) * 16)
            vlo0, vlo1, vlo2, vlo3, vhi0, vhi1, vhi2, vhi3 = _cb_tables16(VCB + (bh % Hkv) * 16)
        elif CB2:  # KVQuant (2 bits): [Hkv, 4] float32, one low-byte and one high-byte word
            kcb2 = KCB + (bh % Hkv) * 4
            vcb2 = VCB + (bh % Hkv) * 4
            klo0, khi0 = _cb_word(kcb2, 0, False), _cb_word(kcb2, 0, True)
            vlo0, vhi0 = _cb_word(vcb2, 0, False), _cb_word(vcb2, 0, True)
            klo1, khi1, vlo1, vhi1 = 0, 0, 0, 0
        elif CB:  # KVQuant (3 bits): the KV head's codebooks as prmt tables, [Hkv, 8] float32
            klo0, klo1, khi0, khi1 = _cb_tables(KCB + (bh % Hkv) * 8)
            vlo0, vlo1, vhi0, vhi1 = _cb_tables(VCB + (bh % Hkv) * 8)
        else:
            klo0, klo1, khi0, khi1 = 0, 0, 0, 0
            vlo0, vlo1, vhi0, vhi1 = 0, 0, 0, 0
        # KVQuant's dense-and-sparse outliers and pre-RoPE keys (3-bit codebooks, two chunks
        # that are the two rotate-half halves): eligible() admits them only there.
        koi_base = KOI + bh64 * kout_cap * KOUT  # (never read without outliers)
        kov_base = KOV + bh64 * kout_cap * KOUT
        voi_base = VOI + bh64 * vout_cap * VOUT
        vov_base = VOV + bh64 * vout_cap * VOUT
        if KOUT > 0:
            rows_a = _row_tokens(KBITS, W, G, gl.SliceLayout(1, a_l))
        if VOUT > 0:
            cols_a = _row_tokens(KBITS, W, G, gl.SliceLayout(0, a_l))
            rows_b = _row_tokens(KBITS, W, G, gl.SliceLayout(1, b_l))
        if ROPE:  # cos / sin(j theta) per A-operand element: the [2, 64, D/2] table of row j
            inv_f = gl.load(InvFreq + gl.arange(0, DC, layout=gl.SliceLayout(1, b_l)))
            if NCH == 4:  # the frequencies of the second chunk pair, (1, 3)
                inv_f1 = gl.load(InvFreq + DC + gl.arange(0, DC, layout=gl.SliceLayout(1, b_l)))
            cs_off = (gl.arange(0, 64, layout=gl.SliceLayout(1, a_l))[:, None] * H2
                      + gl.arange(0, DC, layout=gl.SliceLayout(0, a_l))[None, :])
            cs_off16 = (gl.arange(0, 16, layout=gl.SliceLayout(1, a_l))[:, None] * H2
                        + gl.arange(0, DC, layout=gl.SliceLayout(0, a_l))[None, :])

        n_groups = body_len // G
        n_rows = n_groups * W
        nv_rows = n_groups * WV
        n_steps = (body_len + 63) // 64
        s_lo = split * steps_per_split
        s_hi = gl.minimum(s_lo + steps_per_split, n_steps)
        first_any, first_all, end_all, end_any = _body_bounds(  # body indices, as [first, end)
            start, length, sink_len, body_len, window, HAS_WINDOW, LQ)
        s_lo = gl.maximum(s_lo, (first_any // SPAN) * (SPAN // 64))
        s_hi = gl.minimum(s_hi, ((end_any + SPAN - 1) // SPAN) * (SPAN // 64))

        kc_base = KC + bh64 * kc_cap * D
        vc_base = VC + bh64 * vc_cap * D
        ks_base = KS + bh64 * ks_slice
        kz_base = KZ + bh64 * ks_slice
        vs_base = VS + bh64 * vs_slice
        vz_base = VZ + bh64 * vs_slice
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
        l_i = gl.zeros([HP], gl.float32, layout=gl.SliceLayout(0, mma))
        acc0 = gl.zeros([DC, HP], gl.float32, layout=mma)
        acc1 = gl.zeros([DC, HP], gl.float32, layout=mma)
        if NCH >= 3:
            acc2 = gl.zeros([DC, HP], gl.float32, layout=mma)
        if NCH == 4:
            acc3 = gl.zeros([DC, HP], gl.float32, layout=mma)
        row0 = s_lo * RS
        tok0 = (row0 // W) * G + row0 % W
        NGV: gl.constexpr = (D + GV - 1) // GV  # (a shorter last group: QuantSpec.value_group)
        NGK: gl.constexpr = (D + GK - 1) // GK
        if PF > 0:  # the first steps' bytes on their way before the loop starts
            for s in range(s_lo + 1, gl.minimum(s_lo + PF, s_hi)):
                _prefetch_step(s, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base, D, RS,
                               RSV, G, SPAN, NGV, NGK, K_TOK, PF_L1, KFIX)
                if PF_OUT:
                    _prefetch_outliers(s, koi_base, kov_base, voi_base, vov_base, KOUT, VOUT,
                                       PF_L1)
        for s in range(s_lo, s_hi):
            if PF > 0 and not PF_AFTER:  # noqa: SIM102 (a constexpr if around a runtime one)
                if s + PF < s_hi:
                    _prefetch_step(s + PF, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base,
                                   D, RS, RSV, G, SPAN, NGV, NGK, K_TOK, PF_L1, KFIX)
                    if PF_OUT:
                        _prefetch_outliers(s + PF, koi_base, kov_base, voi_base, vov_base, KOUT,
                                           VOUT, PF_L1)
            lo = (row0 // W) * G
            r_cur = row0
            t_cur = tok0
            row0 = row0 + RS  # the next step
            tok0 = (row0 // W) * G + row0 % W
            if KBITS == 3:
                kp0, kq0, kr0, ks0, kz0 = _key_loads3(kc_base, ks_base, kz_base, s, n_groups, 0,
                                                      G, D, DC, KW,
                                                      key_end(0, D, DC, HALVES), KFIX)
                kp1, kq1, kr1, ks1, kz1 = _key_loads3(kc_base, ks_base, kz_base, s, n_groups,
                                                      key_base(K1, D, DC, HALVES), G, D, DC,
                                                      KW, key_end(K1, D, DC, HALVES), KFIX)
            else:
                kw0, ks0, kz0 = _key_loads(kc_base, ks_base, kz_base, r_cur, n_rows, t_cur,
                                           body_len, 0, KBITS, W, G, D, DC, GK, KW, KT, K_TOK,
                                           KFIX)
                kw1, ks1, kz1 = _key_loads(kc_base, ks_base, kz_base, r_cur, n_rows, t_cur,
                                           body_len, DC, KBITS, W, G, D, DC, GK, KW, KT, K_TOK,
                                           KFIX)
            if KBITS == VBITS:
                rv = r_cur
            else:  # G <= 64 (eligible): a step is whole groups for either width
                rv = s * RSV
            if EARLY_V and VBITS != 3:  # this step's values requested with its keys
                vw0, vs0, vz0 = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur,
                                             body_len, 0, VBITS, WV, G, D, DC, GV, VW, VS_L)
                vw1, vs1, vz1 = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur,
                                             body_len, DC, VBITS, WV, G, D, DC, GV, VW, VS_L)
            # after this step's own loads are issued (a constexpr if around a runtime one)
            if PF > 0 and PF_AFTER:  # noqa: SIM102
                if s + PF < s_hi:
                    _prefetch_step(s + PF, kc_base, ks_base, kz_base, vc_base, vs_base, vz_base,
                                   D, RS, RSV, G, SPAN, NGV, NGK, K_TOK, PF_L1, KFIX)
                    if PF_OUT:
                        _prefetch_outliers(s + PF, koi_base, kov_base, voi_base, vov_base, KOUT,
                                           VOUT, PF_L1)
            if KBITS == 3:
                k = _key_operand3(kp0, kq0, kr0, ks0, kz0, klo0, klo1, khi0, khi1, DC, KW, a_l,
                                  CB)
            elif CB4:
                k = _key_operand_cb(_key_halves(kw0, _half_selector(4, DC, KW)), ks0, kz0, klo0,
                                    klo1, khi0, khi1, DC, KW, a_l, klo2, klo3, khi2, khi3, True)
            elif not KFOLD:
                k = _key_operand(kw0, ks0, kz0, KBITS, DC, KW, a_l, K_TOK, CB2, klo0, khi0)
            if ROPE:  # both halves first: R(j) k against R(p0)^T q (_rope_query)
                if CB4:
                    k1 = _key_operand_cb(_key_halves(kw1, _half_selector(4, DC, KW)), ks1, kz1,
                                         klo0, klo1, khi0, khi1, DC, KW, a_l, klo2, klo3, khi2,
                                         khi3, True)
                elif CB2:
                    k1 = _key_operand(kw1, ks1, kz1, KBITS, DC, KW, a_l, K_TOK, CB2, klo0, khi0)
                else:
                    k1 = _key_operand3(kp1, kq1, kr1, ks1, kz1, klo0, klo1, khi0, khi1, DC, KW,
                                       a_l, CB)
                if NCH == 4:  # chunk pairs (0, 2) and (1, 3) are the rotate-half partners
                    if Q_RELOAD:
                        q2 = _query_operand(Q, q_row0, qk_scale, 2, cols, HP, D, DC, b_l, HALVES)
                    xa, xb = _rope_query(q0, q2, sink_len + t_cur - start, inv_f)
                else:
                    xa, xb = _rope_query(q0, q1, sink_len + t_cur - start, inv_f)
                if ROPE_M:
                    st = _rope_scores(gl.zeros([64, HP], gl.float32, layout=mma), k, k1, xa, xb,
                                      RopeCS + cs_off16, H2, a_l, mma)
                else:
                    cj = gl.load(RopeCS + cs_off)
                    sj = gl.load(RopeCS + 64 * H2 + cs_off)
                    st = mma_v2(k * cj - k1 * sj, xa,
                                gl.zeros([64, HP], gl.float32, layout=mma))
                    st = mma_v2(k1 * cj + k * sj, xb, st)
                if NCH == 4:  # the second pair's words only now (registers)
                    kp, kq, kr, ksc, kzr = _key_loads3(kc_base, ks_base, kz_base, s, n_groups,
                                                       key_base(1, D, DC, HALVES), G, D, DC,
                                                       KW, key_end(1, D, DC, HALVES), KFIX)
                    k = _key_operand3(kp, kq, kr, ksc, kzr, klo0, klo1, khi0, khi1, DC, KW, a_l,
                                      CB)
                    kp, kq, kr, ksc, kzr = _key_loads3(kc_base, ks_base, kz_base, s, n_groups,
                                                       key_base(3, D, DC, HALVES), G, D, DC,
                                                       KW, key_end(3, D, DC, HALVES), KFIX)
                    k1 = _key_operand3(kp, kq, kr, ksc, kzr, klo0, klo1, khi0, khi1, DC, KW,
                                       a_l, CB)
                    if Q_RELOAD:
                        q3 = _query_operand(Q, q_row0, qk_scale, 3, cols, HP, D, DC, b_l, HALVES)
                    xa1, xb1 = _rope_query(q1, q3, sink_len + t_cur - start, inv_f1)
                    if ROPE_M:
                        st = _rope_scores(st, k, k1, xa1, xb1, RopeCS + DC + cs_off16, H2, a_l,
                                          mma)
                    else:
                        cj = gl.load(RopeCS + DC + cs_off)
                        sj = gl.load(RopeCS + 64 * H2 + DC + cs_off)
                        st = mma_v2(k * cj - k1 * sj, xa1, st)
                        st = mma_v2(k1 * cj + k * sj, xb1, st)
            elif KFOLD:
                zs = gl.zeros([64, HP], gl.float32, layout=mma)
                sel = _half_selector(KBITS, DC, KW)
                m0 = mma_v2(_key_codes_magic(_key_halves(kw0, sel), KBITS, DC, a_l), q0, zs)
                m1 = mma_v2(_key_codes_magic(_key_halves(kw1, sel), KBITS, DC, a_l), q1, zs)
                rows: gl.constexpr = gl.SliceLayout(1, mma)
                s0, b0 = _fold_rows(_kt_rows(ks0, KBITS, rows), _kt_rows(kz0, KBITS, rows), fr)
                s1, b1 = _fold_rows(_kt_rows(ks1, KBITS, rows), _kt_rows(kz1, KBITS, rows), fr)
                st = _fold_token_scores(m0, m1, s0, b0, s1, b1, qs0, qs1)
            else:
                st = mma_v2(k, q0, gl.zeros([64, HP], gl.float32, layout=mma))
                if KBITS == 3:
                    k = _key_operand3(kp1, kq1, kr1, ks1, kz1, klo0, klo1, khi0, khi1, DC, KW,
                                      a_l, CB)
                elif CB4:
                    k = _key_operand_cb(_key_halves(kw1, _half_selector(4, DC, KW)), ks1, kz1,
                                        klo0, klo1, khi0, khi1, DC, KW, a_l, klo2, klo3, khi2,
                                        khi3, True)
                else:
                    k = _key_operand(kw1, ks1, kz1, KBITS, DC, KW, a_l, K_TOK, CB2, klo0, khi0)
                st = mma_v2(k, q1, st)
            # chunks past the second: their words only now (at head_dim 256, 255 registers with
            # 8-18 spilled words per step this way, 54-98 with every load at the step's start)
            # both chunks' words first at head_dim 256 (fewer spills at 4 bits); at 100 (four
            # 32-channel chunks, the last padded) one at a time: 16 bytes of stack against 24
            if NCH == 4 and KBITS != 3 and DC == 64:
                kw2, ks2, kz2 = _key_loads(kc_base, ks_base, kz_base, r_cur, n_rows, t_cur,
                                           body_len, 2 * DC, KBITS, W, G, D, DC, GK, KW, KT,
                                           K_TOK, KFIX)
                kw3, ks3, kz3 = _key_loads(kc_base, ks_base, kz_base, r_cur, n_rows, t_cur,
                                           body_len, 3 * DC, KBITS, W, G, D, DC, GK, KW, KT,
                                           K_TOK, KFIX)
                if Q_RELOAD:
                    q2 = _query_operand(Q, q_row0, qk_scale, 2, cols, HP, D, DC, b_l, HALVES)
                k = _key_operand(kw2, ks2, kz2, KBITS, DC, KW, a_l, K_TOK, CB2, klo0, khi0)
                st = mma_v2(k, q2, st)
                if Q_RELOAD:
                    q3 = _query_operand(Q, q_row0, qk_scale, 3, cols, HP, D, DC, b_l, HALVES)
                k = _key_operand(kw3, ks3, kz3, KBITS, DC, KW, a_l, K_TOK, CB2, klo0, khi0)
                st = mma_v2(k, q3, st)
            elif NCH >= 3 and not ROPE:  # (pre-RoPE keys: all four chunks above)
                if Q_RELOAD:  # from L1 each step: 8-16 fewer live registers through the loop
                    q2 = _query_operand(Q, q_row0, qk_scale, 2, cols, HP, D, DC, b_l, HALVES)
                st = _later_key_chunk(st, q2, 2, kc_base, ks_base, kz_base, s, n_groups, r_cur,
                                      n_rows, t_cur, body_len, klo0, klo1, khi0, khi1, KBITS, W,
                                      G, D, DC, GK, KW, KT, K_TOK, a_l, CB, KFIX)
                if NCH == 4:
                    if Q_RELOAD:
                        q3 = _query_operand(Q, q_row0, qk_scale, 3, cols, HP, D, DC, b_l, HALVES)
                    st = _later_key_chunk(st, q3, 3, kc_base, ks_base, kz_base, s, n_groups,
                                          r_cur, n_rows, t_cur, body_len, klo0, klo1, khi0, khi1,
                                          KBITS, W, G, D, DC, GK, KW, KT, K_TOK, a_l, CB,
                                          KFIX)
            if KOUT > 0:  # after every chunk's scores (at four chunks the later query chunks)
                if ROPE and NCH == 4:
                    st = _key_outliers(st, koi_base, kov_base, t_cur, body_len, rows_a, dn, xa,
                                       xb, xa1, xb1, RopeCS, KOUT, NCH, DC, H2R, True, a_l, mma)
                elif ROPE:
                    st = _key_outliers(st, koi_base, kov_base, t_cur, body_len, rows_a, dn, xa,
                                       xb, xa, xb, RopeCS, KOUT, NCH, DC, H2R, True, a_l, mma)
                elif NCH == 4:
                    st = _key_outliers(st, koi_base, kov_base, t_cur, body_len, rows_a, dn, q0,
                                       q1, q2, q3, RopeCS, KOUT, NCH, DC, H2R, False, a_l, mma)
                elif NCH == 3:
                    st = _key_outliers(st, koi_base, kov_base, t_cur, body_len, rows_a, dn, q0,
                                       q1, q2, q2, RopeCS, KOUT, NCH, DC, H2R, False, a_l, mma)
                else:
                    st = _key_outliers(st, koi_base, kov_base, t_cur, body_len, rows_a, dn, q0,
                                       q1, q0, q1, RopeCS, KOUT, NCH, DC, H2R, False, a_l, mma)
            if SOFTCAP:  # before the mask: masked rows may hold anything
                st = _cap_scores(st, softcap)
            if (lo < first_all) | (lo + SPAN > end_all):
                st = _mask_scores(st, t_cur + dn, first_all, end_any, start, length, sink_len,
                                  body_len, window, HAS_WINDOW, LQ, HP, mma, col0)
            p, alpha, m_i, l_i = _online_softmax(st, m_i, l_i)
            p = p.to(gl.float16)
            if KBITS != VBITS:  # P's rows from the keys' token order to the values'
                p = _reorder_tokens(p, KBITS, VBITS, G, HP)
            pb = gl.convert_layout(p, b_l)
            if VBITS == 3:  # values only now (EARLY_V does not apply to 3-bit planes)
                vp0, vq0, vr0, vs0, vz0 = _value_loads3(vc_base, vs_base, vz_base, s, n_groups,
                                                        t_cur, body_len, 0, G, D, DC, GV, VW,
                                                        VS_L)
                vp1, vq1, vr1, vs1, vz1 = _value_loads3(vc_base, vs_base, vz_base, s, n_groups,
                                                        t_cur, body_len, DC, G, D, DC, GV, VW,
                                                        VS_L)
            elif not EARLY_V:  # values only now: fewer registers through the key MMA and softmax
                vw0, vs0, vz0 = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur,
                                             body_len, 0, VBITS, WV, G, D, DC, GV, VW, VS_L)
                vw1, vs1, vz1 = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur,
                                             body_len, DC, VBITS, WV, G, D, DC, GV, VW, VS_L)
            if VBITS == 3:
                v = _value_operand3(vp0, vq0, vr0, vs0, vz0, vlo0, vlo1, vhi0, vhi1, DC, VW,
                                    a_l, CB)
            elif CB4:
                v = _value_operand_cb(vw0, vs0, vz0, vlo0, vlo1, vhi0, vhi1, DC, VW, a_l, vlo2,
                                      vlo3, vhi2, vhi3, True)
            else:
                v = _value_operand(vw0, vs0, vz0, VBITS, DC, VW, a_l, CB2, vlo0, vhi0)
            acc0 = mma_v2(v, pb, acc0 * alpha[None, :])
            if VBITS == 3:
                v = _value_operand3(vp1, vq1, vr1, vs1, vz1, vlo0, vlo1, vhi0, vhi1, DC, VW,
                                    a_l, CB)
            elif CB4:
                v = _value_operand_cb(vw1, vs1, vz1, vlo0, vlo1, vhi0, vhi1, DC, VW, a_l, vlo2,
                                      vlo3, vhi2, vhi3, True)
            else:
                v = _value_operand(vw1, vs1, vz1, VBITS, DC, VW, a_l, CB2, vlo0, vhi0)
            acc1 = mma_v2(v, pb, acc1 * alpha[None, :])
            # chunks past the second: their words only now (as for the keys)
            if NCH == 4 and VBITS != 3 and DC == 64:
                vw2, vs2, vz2 = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur,
                                             body_len, 2 * DC, VBITS, WV, G, D, DC, GV, VW, VS_L)
                vw3, vs3, vz3 = _value_loads(vc_base, vs_base, vz_base, rv, nv_rows, t_cur,
                                             body_len, 3 * DC, VBITS, WV, G, D, DC, GV, VW, VS_L)
                v = _value_operand(vw2, vs2, vz2, VBITS, DC, VW, a_l, CB2, vlo0, vhi0)
                acc2 = mma_v2(v, pb, acc2 * alpha[None, :])
                v = _value_operand(vw3, vs3, vz3, VBITS, DC, VW, a_l, CB2, vlo0, vhi0)
                acc3 = mma_v2(v, pb, acc3 * alpha[None, :])
            elif NCH >= 3:
                # (in the halves layout the last value chunk may lie wholly past D: skipped)
                acc2 = _later_value_chunk(acc2, pb, alpha, 2, vc_base, vs_base, vz_base, s,
                                          n_groups, rv, nv_rows, t_cur, body_len, vlo0, vlo1,
                                          vhi0, vhi1, VBITS, WV, G, D, DC, GV, VW, VS_L, a_l, CB)
                if NCH == 4 and 3 * DC < D:
                    acc3 = _later_value_chunk(acc3, pb, alpha, 3, vc_base, vs_base, vz_base, s,
                                              n_groups, rv, nv_rows, t_cur, body_len, vlo0,
                                              vlo1, vhi0, vhi1, VBITS, WV, G, D, DC, GV, VW,
                                              VS_L, a_l, CB)
            if VOUT > 0:  # after every chunk's rescale by alpha (the corrections are this step's)
                if NCH == 4:
                    acc0, acc1, acc2, acc3 = _value_outliers(
                        acc0, acc1, acc2, acc3, pb, voi_base, vov_base, t_cur, body_len, cols_a,
                        rows_b, VOUT, NCH, DC, a_l)
                elif NCH == 3:
                    acc0, acc1, acc2, _a3 = _value_outliers(
                        acc0, acc1, acc2, acc2, pb, voi_base, vov_base, t_cur, body_len, cols_a,
                        rows_b, VOUT, NCH, DC, a_l)
                else:
                    acc0, acc1, _a2, _a3 = _value_outliers(
                        acc0, acc1, acc0, acc1, pb, voi_base, vov_base, t_cur, body_len, cols_a,
                        rows_b, VOUT, NCH, DC, a_l)

        _store_partial(Out, Lse, acc0, acc1, m_i, l_i, q_row0, n_out, split, cols, HP, D, DC,
                       mma)
        if NCH >= 3:
            _store_chunk(Out, acc2, l_i, q_row0, n_out, split, 2, cols, HP, D, DC, mma)
        if NCH == 4:
            _store_chunk(Out, acc3, l_i, q_row0, n_out, split, 3, cols, HP, D, DC, mma)


# Keys scaled per token (the uniform method) through this kernel: uniform-int4 B=32 32k on the H200
# 522 us here against 870 us through the Triton kernel (benchmarks/gluon_sweep.py). False sends
# those layers to the Triton kernel (a switch for comparisons).
TOKEN_KEYS = True

# Different key and value widths (e.g. k4v2: P's rows are permuted between the two token orders,
# group size <= 64 so that a step covers the same tokens at both widths). On the H200, k4v2 B=32
# Llama-3 32k: 560 us here against 894 us through the Triton kernel (benchmarks/gluon_sweep.py);
# False sends those layers to the Triton kernel.
MIXED_BITS = True

# 3-bit KIVI layers (bit planes, equal key/value bits, G = 32 or 64, keys per channel): the
# planes of a thread's column are merged into 4-bit fields after loading and the 4-bit body does
# the rest (_merge_planes; token order in _tok3). KVQuant codebook layers (no outliers, post-RoPE
# keys) look their fields up in the head's table (CB). Verified on the H200 (session 15: the
# GPU tests against the reference) and faster there than the Triton kernel: Llama-3 B=32 32k
# kivi-3 554 us against 1861 us, kvquant-3-dense-post 629 us against 2203 us, in graph time
# (benchmarks/results/decode_planes3.log). KVBITS_GLUON_3BIT=0 sends them to the Triton kernel.
PLANES3 = env_switch("KVBITS_GLUON_3BIT", "1")

# Head dims past 64/128 as more channel chunks (head_chunks): 96 (Phi-3-style) as three of 32,
# 192 as three of 64, 256 (Gemma-style) as four of 64, for KIVI layers with keys per channel
# (2, 4 and 3 bits, KVQuant codebooks too). Written after the Triton kernel measured 0.8-1.5x
# flash SDPA on Phi-3-mini and Gemma-2-9B shapes (decode_attention_other_models.md); verified on
# the H200 in session 16 (its GPU tests against the reference: 8 of 8 at 2/4 bits, 6 of 6 for the
# 3-bit planes there) and faster there in graph time: Gemma-2-9B B=8
# 32k kivi-2 270 us against 522 us through the Triton kernel, Phi-3-mini B=8 32k 459 against 918,
# B=1 32k 74 against 131 (decode_attention_extra_dims.md). KVBITS_GLUON_EXTRA_DIMS=0 sends
# those layers to the Triton kernel.
EXTRA_HEAD_DIMS = env_switch("KVBITS_GLUON_EXTRA_DIMS", "1")
# ... and there keys scaled per token (the uniform method: one scale group per chunk, e.g.
# uniform-int4's 64 channels at head_dim 256), where the Triton kernel ran 0.89-0.96x flash SDPA.
# Verified on the H200 in session 18 (its GPU tests against the reference) and faster there, in
# graph time against flash SDPA (decode_attention_token_keys_wide.md): uniform-int4 Gemma-2-9B
# batch 8 32k 1.34x (Triton kernel 0.89x), Phi-3-mini batch 8 2.48x (1.63x), batch 1 1.45x
# (0.96x), Gemma-2-9B batch 1 1.08x (1.06x). KVBITS_GLUON_TOKEN_KEYS_WIDE=0 sends them to Triton.
TOKEN_KEYS_WIDE = env_switch("KVBITS_GLUON_TOKEN_KEYS_WIDE", "1")
# Head dims that 32 does not divide (multiples of 4 from 36 to 124: Phi-2's and StableLM-3B's 80,
# OpenLLaMA-3B's 100) as 32-channel chunks with the last one padded: its query lanes past D are
# zero and its loads and stores masked (padded_head). Value and key groups must not cross a chunk
# (multiples of 32 channels, or the whole head), 2, 3 or 4 bits (KVQuant's pre-RoPE keys take the
# halves layout instead, KVQUANT_HALVES; its outliers alone, KVQUANT_STRAIGHT_OUTLIERS). Before
# this the Triton kernel served them at 7-28% of the copy bandwidth
# (decode_attention_hd100_s41b.md).
# KVBITS_GLUON_PADDED_DIMS=0 sends those layers to the Triton kernel.
PADDED_HEAD_DIMS = env_switch("KVBITS_GLUON_PADDED_DIMS", "1")

# KVQuant's full layer (3-bit codebooks with dense-and-sparse outliers and/or pre-RoPE keys,
# head_dim 64 or 128) through this kernel: outliers as one-hot tiles on the tensor cores
# (_key_outliers, _value_outliers), pre-RoPE keys turned by R(j) per element against a query
# turned by R(p0) per step (_rope_query). Verified on the H200 in session 18 (its GPU tests
# against the reference, 6 cases) and 2.2-2.5x faster there than the Triton kernel in graph time
# (decode_attention_kvquant2.md, kvquant-3: Llama-2-7B B=8 32k 1762 against 3906 us, Llama-3-8B
# B=8 32k 472 against 1077 us): 1.00-1.02x flash SDPA at Llama-2-7B B=32, 0.55-0.97x elsewhere;
# ~4570 instructions per 64-token step against ~2570 without outliers and rotation, with spills.
# KVBITS_GLUON_KVQUANT=0 sends those layers to the Triton kernel.
KVQUANT_FULL = env_switch("KVBITS_GLUON_KVQUANT", "1")
# ... and at head_dim 256 (Gemma-style), four 64-channel chunks: pre-RoPE keys turned per chunk
# pair (0, 2) and (1, 3), the rotate-half partners, the outliers' one-hot tiles one per chunk
# (session 21). KVBITS_GLUON_KVQUANT_WIDE=0 sends those layers to the Triton kernel.
KVQUANT_WIDE = env_switch("KVBITS_GLUON_KVQUANT_WIDE", "1")
# ... and, with pre-RoPE keys, at the other head dims from 36 to 124 (Phi-3's 96, Phi-2's 80,
# OpenLLaMA-3B's 100; session 42): each rotate-half half of D/2 channels in 32-channel chunks of
# its own, padded (halves_layout; 96: four chunks, 48 + 16 padding per half), turned in chunk
# pairs as at 256; the value chunks stay whole 32-channel runs of the head. Before this those
# layers went to the Triton kernel at 0.3-0.4x flash SDPA (decode_attention_s42b.md, Phi-2).
# KVBITS_GLUON_KVQUANT_HALVES=0 sends them back there.
KVQUANT_HALVES = env_switch("KVBITS_GLUON_KVQUANT_HALVES", "1")
# ... and there outliers without pre-RoPE keys (the kvquant-*-post presets) over the straight
# chunks (three at 96 and 80, four at 100: the one-hot tiles take a third chunk too). Written in
# session 42, GPU-verified in session 43 (gpu_tests_s42d.log, 33 cases). kvquant-3-post at 32k,
# H200 graph time (decode_attention_kvquant_post_odd.md): Phi-3-mini batch 8 767 us against
# 2827 for the Triton kernel (1.74x flash SDPA), Phi-2 batch 8 706 against 2904 (1.91x); batch 1
# 1.01x / 0.88x flash. KVBITS_GLUON_KVQUANT_ODD_OUTLIERS=0 sends them to the Triton kernel.
KVQUANT_STRAIGHT_OUTLIERS = env_switch("KVBITS_GLUON_KVQUANT_ODD_OUTLIERS", "1")
# KVQuant at 4 bits (kvquant-4 and its -dense / -post forms) at head dims 64 and 128: the 4-bit
# body's words with each code looked up in the head's 16-entry table (_cb16_pair_asm: two 8-byte
# prmt lookups picked by the code's bit 3; checked on the CPU by tests/kernels/test_gluon_ptx.py),
# outliers and pre-RoPE keys as at 3 bits. Written in session 43, GPU-verified in session 44
# (gpu_tests_s44.log, 55 cases). H200 graph time at 32k (decode_attention_kvquant4_s44.md):
# kvquant-4 Llama-2-7B batch 8 1777 us against 3058 for the Triton kernel, Llama-3-8B batch 8
# 507 against 845, batch 1 106 against 141 (0.5-0.96x flash SDPA: the turn and the outliers
# bound it, as at 3 bits). KVBITS_GLUON_KVQUANT4=0 sends these layers to the Triton kernel.
KVQUANT4 = env_switch("KVBITS_GLUON_KVQUANT4", "1")
# KVQuant at 2 bits (kvquant-2, -offline, -dense, -post) at head dims 64 and 128: the 2-bit
# body's words with each code looked up in the head's 4-entry table (_cb2_pair_asm: one prmt per
# pair, checked on the CPU by tests/kernels/test_gluon_ptx.py), outliers and pre-RoPE keys as at
# 3 and 4 bits. Session 45: its 25 GPU cases passed (gpu_tests_s45c.log); H200 batch 8 32k graph
# time (decode_attention_kvquant2_gluon_s45.md) kvquant-2 390 / 1400 us at Llama-3-8B /
# Llama-2-7B shapes against 711 / 2502 for the Triton kernel (0.66x / 1.21x flash SDPA).
# KVBITS_GLUON_KVQUANT2=0 sends these layers back to the Triton kernel.
KVQUANT2 = env_switch("KVBITS_GLUON_KVQUANT2", "1")
MAX_OUTLIERS = 4  # per token, keys or values (one pair of MMAs each)
# Pre-RoPE keys turned in four 16-row blocks, each with its quarter of the cos/sin table loaded
# just before its MMAs (_rope_scores), instead of the whole [64, D/2] table beside both key halves.
# sm_90 compile at head_dim 128 with two outliers per token: 104 bytes of stack instead of 320,
# 4517 instructions per step instead of 4658. H200, whole captured calls alternated (session 39,
# benchmarks/results/kvquant_rope_ab_s39.log): 0.7-4.0% faster on four of five kvquant-3 rows
# (Llama-3-8B batch 1 128k 270.7 -> 259.8 us, batch 32 32k 1583 -> 1538), 1.8% slower on one
# (Llama-3-8B batch 8 128k 1629 -> 1659). The same blocks sharing one [16, D/2] table with the
# query turned per block instead (its blocks' tokens are block 0's shifted by 4 G / 32) measured
# 1.8-7.3% slower than these (more instructions: 5066 per step, 176 bytes of stack) and was
# dropped. KVBITS_GLUON_ROPE_BLOCKS=0 turns the whole-table turn back on.
ROPE_BLOCKS = env_switch("KVBITS_GLUON_ROPE_BLOCKS", "1")
# Keys scaled per token (the uniform method) over whole channel chunks: their codes go into the
# score MMA as magic-number halves (1024 + code 2^(bits p), one lop3 per pair) and each score row
# takes s' m + (zero - 1024 s') sum(q) in float32 after it, instead of two float16 FMAs per
# element pair in the operand (session 55; the TMA ring and this body at head
# dim 128, two 64-channel chunks). sm_90, ring: 1764 -> 1630 instructions per step at 4 bits;
# H200, body alone: the ring 3-7% faster (benchmarks/results/tma_key_fold_ab_s55.log), this body
# 1.4% / 6.0% at 4 / 2 bits (register_key_fold_ab_s55.log). At head_dim 64 (two 32-channel
# chunks of one group) the compile saves 1.5-3% of the instructions and the H200 measured
# -2.3% to +1.2%, so it keeps the operands' FMAs there. KVBITS_GLUON_KEY_FOLD=0: off.
KEY_FOLD = env_switch("KVBITS_GLUON_KEY_FOLD", "1")


def fold_token_keys(kv, columns: int, head_dim: int) -> bool:
    """Whether a layer's per-token key scales are folded out of the key operands
    (``KEY_FOLD``): keys scaled per token (``key_axis == "token"``) at 2 or 4 bits, without
    codebooks or pre-RoPE keys, at head_dim 128 (two 64-channel chunks; at 64 the H200 measured
    no gain), for programs of at most 8 score columns (query heads x rows per KV head). At 16
    columns the float32 epilogue costs twice as much and the sm_90 compiles spill (ring, 4 bits:
    32 bytes; register body: 104) or gain nothing (head_dim 64: 1226 -> 1269 instructions per
    step), so those keep the operands' FMAs."""
    return (KEY_FOLD and getattr(kv, "key_axis", "channel") == "token"
            and kv.key_bits in (2, 4) and columns <= 8 and head_dim == 128
            and getattr(kv, "k_codebook", None) is None
            and getattr(kv, "rope_inv_freq", None) is None)


_BODY = FastLaunch(_body_kernel) if gluon is not None else None  # (kernels.launch)
# Its keywords, built once per combination (launch.keyword_maker), in this order (+ maxnreg):
_BODY_NAMES = ("HG", "HP", "D", "KBITS", "VBITS", "G", "GV", "HAS_STARTS", "HAS_LENS", "GK",
               "K_TOK", "LENS_DEV", "PF", "PF_L1", "PF_AFTER", "EARLY_V", "CB", "KOUT", "VOUT",
               "ROPE", "Q_RELOAD", "HAS_WINDOW", "SOFTCAP", "LQ", "PDL", "PF_OUT", "ROPE_M",
               "NQB", "KFIX", "KFOLD", "num_warps")
_BODY_KEYWORDS = keyword_maker(_BODY_NAMES)
_BODY_KEYWORDS_MAXNREG = keyword_maker(_BODY_NAMES + ("maxnreg",))


def eligible(kv, q_rows: int, heads_per_kv: int) -> bool:
    """Whether :func:`attend_body` serves this layer and call: Gluon importable, integer codes
    (KVQuant codebooks at 3 bits with ``PLANES3``, at 4 and 2 bits and head_dim 64 / 128 with
    ``KVQUANT4`` and ``KVQUANT2``; their outliers, at most ``MAX_OUTLIERS`` per
    token, and pre-RoPE keys with ``KVQUANT_FULL`` at head_dim 64 / 128, and 256 with
    ``KVQUANT_WIDE``; pre-RoPE layers at the other multiples of 4 from 36 to 124 with
    ``KVQUANT_HALVES``, outliers alone there with ``KVQUANT_STRAIGHT_OUTLIERS``),
    per-channel key scales per group or in one fixed offline row (``KFIX``), or, with
    ``TOKEN_KEYS``, per-token key scales
    over at least half the head; per-token value scales, key/value bits of 2 or 4 (equal, or
    with ``MIXED_BITS`` any pair at group size <= 64) or, with ``PLANES3``, both 3 at group
    size 32 or 64 with per-channel key scales, group
    size 16-128, head_dim 64 or 128 (or 96, 192, 256 with ``EXTRA_HEAD_DIMS``: per-channel
    keys; or, with ``PADDED_HEAD_DIMS``, a multiple of 4 from 36 to 124 in 32-channel chunks,
    per-token groups a multiple of 32 channels or the whole head), value groups of 32 to 128 channels (smaller ones compile but
    are not tested on a GPU), at most ``MAX_COLUMNS`` query heads x query rows per KV head
    (several rows: speculative verification, short chunks; past 16, :func:`column_blocks`
    programs each). Sliding windows, softcapping and each row's causal
    end are applied by the kernel."""
    if gluon is None or kv.body_len == 0 or getattr(kv, "fp8", False):
        return False
    if getattr(kv, "key_scales_fixed", False) and getattr(kv, "key_axis", "channel") != "channel":
        return False  # one offline key scale row (KFIX) replaces per-channel groups only
    codebooks = getattr(kv, "k_codebook", None) is not None
    D = kv.res_k.shape[-1]
    if any(getattr(kv, n, None) is not None for n in ("k_out_idx", "v_out_idx",
                                                      "rope_inv_freq")):
        # KVQuant outliers and pre-RoPE keys: with KVQUANT_FULL, 3-bit codebooks at head_dim
        # 64 / 128 (the two channel chunks are the two rotate-half halves) and, with
        # KVQUANT_WIDE, 256 (four chunks, the halves two each); else Triton
        outs = [t.shape[3] for t in (getattr(kv, "k_out_idx", None),
                                     getattr(kv, "v_out_idx", None)) if t is not None]
        # two outliers per token are read as one 16-bit word of indices, one 32-bit of values
        aligned = all(t.data_ptr() % a == 0 for n, a in (("k_out_idx", 2), ("v_out_idx", 2),
                                                         ("k_out_val", 4), ("v_out_val", 4))
                      if (t := getattr(kv, n, None)) is not None)
        wide = D == 256 and KVQUANT_WIDE and EXTRA_HEAD_DIMS  # chunk pairs (0, 2), (1, 3)
        # other head dims (KVQUANT_HALVES): pre-RoPE keys with each half in 32-channel chunks
        # of its own; outliers alone in the straight chunks (96: three, 80: three, 100: four)
        odd = KVQUANT_HALVES and (padded_head(D) or D == 96) and (
            getattr(kv, "rope_inv_freq", None) is not None or KVQUANT_STRAIGHT_OUTLIERS)
        if not (KVQUANT_FULL and codebooks and (D in (64, 128) or wide or odd) and aligned
                and all(n <= MAX_OUTLIERS for n in outs)
                and (kv.key_bits == 3 or D in (64, 128))):
            return False
    if codebooks != (getattr(kv, "v_codebook", None) is not None) or (
            codebooks and kv.key_bits != kv.value_bits):
        return False
    if codebooks and kv.key_bits != 3 and not (D in (64, 128) and (
            kv.key_bits == 4 and KVQUANT4 or kv.key_bits == 2 and KVQUANT2)):
        return False  # KVQuant codebooks: 3-bit planes (PLANES3, below), 4 / 2 bits (KVQUANT4 / 2)
    G, GV = kv.group_size, kv.value_group
    key_axis = getattr(kv, "key_axis", "channel")
    # keys per token: at most one scale group per channel chunk (the chunk broadcasts it)
    keys_ok = key_axis == "channel" or (TOKEN_KEYS and key_axis == "token"
                                        and kv.k_scale.shape[3] <= chunks_of(D))
    if kv.key_bits == 3 or kv.value_bits == 3:  # bit planes: equal widths, G 32 or 64
        bits_ok = (PLANES3 and kv.key_bits == kv.value_bits and G in (32, 64)
                   and key_axis == "channel")
    else:
        bits_ok = (kv.key_bits in (2, 4) and kv.value_bits in (2, 4)
                   and (kv.key_bits == kv.value_bits or (MIXED_BITS and G <= 64)))
    if padded_head(D):  # 32-channel chunks, the last one padded: groups may not cross one
        groups = -(-D // GV)  # per-token groups: keys (uniform method) as values
        dims_ok = (PADDED_HEAD_DIMS and kv.v_scale.shape[3] == groups
                   and (key_axis == "channel"
                        or TOKEN_KEYS_WIDE and kv.k_scale.shape[3] == groups))
        groups_ok = GV >= D or GV % 32 == 0
    else:
        dims_ok = D in (64, 128) or (D in (96, 192, 256) and EXTRA_HEAD_DIMS
                                     and (key_axis == "channel" or TOKEN_KEYS_WIDE))
        groups_ok = GV in (32, 64, 128) and D % GV == 0
    return (keys_ok and bits_ok and getattr(kv, "value_axis", "token") == "token"
            and G in (16, 32, 64, 128) and dims_ok and groups_ok
            and q_rows * heads_per_kv <= MAX_COLUMNS)


# Query columns (heads x rows) per KV head: up to 16 are one program's MMA columns; past that
# (Falcon-7B's 71 heads on one KV head, StarCoder's 48, speculative verification of 5 rows at
# GQA 4) column_blocks programs of 16 columns each walk the same KV tiles side by side (the
# later ones find them in L2). Past MAX_COLUMNS the Triton kernel takes the layer.
MAX_COLUMNS = 128


# Each block of columns unpacks the whole KV tile again, and for plain KIVI layers (2 or 4 bits,
# keys per channel, no codebooks) the Triton kernel, whose programs take 64 columns, then keeps
# up. H200, graph time (decode_attention_mqa_s43.md, _rows5_s43.md): Falcon-7B's 71 heads on one
# KV head (five blocks) batch 8 32k kivi-2 61.2 us here against 57.9, kivi-4 64.2 against 58.3,
# batch 1 128k 46.9 / 48.8 against 35.4 / 35.7; StarCoder's 48 (three blocks) even (batch 8 32k
# kivi-2 55.8 against 56.7, 128k kivi-4 161.9 against 160.6); Llama-3-8B with 5 query rows (20
# columns, two blocks) batch 8 32k kivi-2 204 against 308 us. kivi-3, uniform-int4 and KVQuant
# layers stay here at any count (Falcon-7B batch 8 32k 71.7 against 94.6, 62.0 against 81.0,
# 140 against 353 us). Past MAX_PLAIN_BLOCKS blocks plain KIVI layers go to the Triton kernel.
MAX_PLAIN_BLOCKS = 2


def plain_kivi(kv) -> bool:
    """KIVI's own layout at 2 or 4 bits (keys per channel, no codebooks, outliers or
    pre-RoPE keys): what the Triton kernel reads fastest."""
    return (kv.key_bits in (2, 4) and kv.value_bits in (2, 4)
            and getattr(kv, "key_axis", "channel") == "channel"
            and getattr(kv, "k_codebook", None) is None)


def column_blocks(columns: int) -> int:
    """Programs per (sequence, KV head, split): one for up to 16 query columns, else one per
    16 (:func:`_program_bounds`)."""
    return 1 if columns <= 16 else -(-columns // 16)


def padded_head(D: int) -> bool:
    """Head dims the body serves as 32-channel chunks with the last one padded
    (:func:`head_chunks`): multiples of 4 from 36 to 124 other than 64 and 96 (OpenLLaMA-3B's
    100, Phi-2's and StableLM-3B's 80)."""
    return 32 < D < 128 and D % 4 == 0 and D % 32 != 0


# Below this size the Triton kernel is the better choice: on the H200 in CUDA-graph time
# (benchmarks/probes/decode_small_batch.py; its output is benchmarks/results/
# decode_small_batch.log) Llama-3-8B batch 1 at 4k (8 pairs x ~4k tokens) takes 13 us through
# Triton against 17 us here, and the two are even at ~128-256k tokens (Llama-2 batch 1 at 4k,
# Llama-3 batch 8 at 4k); from 256k up this kernel leads (Llama-3 batch 1 32k: 34 vs 39 us,
# Llama-2 batch 1 32k: 75 vs 136 us, Llama-2 batch 8 4k: 81 vs 131 us).
MIN_BODY_TOKENS = 1 << 18  # body tokens x (sequence, KV head) pairs
# 3-bit layers (bit planes) cross over four times earlier: the Triton kernel reads planes at
# 1.6-3.7x this body's time from 2^17 tokens up (H200, graph time, decode_attention.md: Llama-2
# batch 1 4k kivi-3 43 against 27 us, Llama-3 batch 1 32k 77 against 41 us, batch 8 32k 511
# against 162 us), where the Triton kernel ran slower than FP16 SDPA (0.75-0.81x), and wins only
# below that (Llama-3 batch 1 4k, 2^15 tokens: 17 against 21 us).
MIN_BODY_TOKENS_PLANES = 1 << 16
# At head dims other than 64 / 128 the Triton kernel is weaker and this one takes over earlier
# (H200, graph time, benchmarks/results/small_batch_extra_dims.log): Phi-3-mini batch 1 4k
# (~2^17 tokens x pairs) kivi-2 25 us here against 29 us, Gemma-2-9B batch 1 32k (~2^18) kivi-4
# 94 against 103 us; Gemma-2-9B batch 1 4k (2^15) is the Triton kernel's (22 against 23 us).
MIN_BODY_TOKENS_WIDE = 1 << 16


def serves(kv, q_rows: int, heads_per_kv: int, batch_heads: int) -> bool:
    """:func:`eligible` and a step big enough for this kernel to be the faster one; for
    groups of more than ``MAX_PLAIN_BLOCKS`` blocks of columns, a layer the Triton kernel
    reads slowly (see there)."""
    # 3-bit planes and codebooks: the Triton kernel reads them slowly, this one takes over early
    planes = (kv.key_bits == 3 or kv.value_bits == 3
              or getattr(kv, "k_codebook", None) is not None)
    if planes:
        min_tokens = MIN_BODY_TOKENS_PLANES
    else:
        min_tokens = MIN_BODY_TOKENS if kv.res_k.shape[-1] in (64, 128) else MIN_BODY_TOKENS_WIDE
    if column_blocks(q_rows * heads_per_kv) > MAX_PLAIN_BLOCKS and plain_kivi(kv):
        return False
    return (batch_heads * kv.body_len >= min_tokens
            and eligible(kv, q_rows, heads_per_kv))


# Fewer (sequence, KV head) pairs than this: the grid is one wave, SMALL_GRID_PER_SM programs per
# SM (about that many fit at ~170 registers per thread); more: LARGE_GRID_PER_SM per SM, several
# waves, and MANY_PAIRS_PER_SM from MANY_PAIRS pairs. H200 sweeps (kivi-2, graph time;
# benchmarks/results/decode_gluon_splits.log): below 64 pairs one wave wins (Llama-3 batch 1 32k:
# 33 us against 83 us at 32 per SM; Llama-2 batch 1 32k: 76 against 81 us), and a grid just past
# one wave costs nearly a second one (Llama-3 batch 8 32k at 17 x 64 = 1088 programs: 202 us, at
# 32 per SM: 142 us). With the L2 prefetch (benchmarks/results/decode_gluon_prefetch.log, eager):
# at 256 pairs 48 per SM is ~5% faster than 32 (kivi-2 Llama-2 B=8 32k 374 vs 396 us, Llama-3
# B=32 32k 385 vs 403; kivi-4 473 vs 499, 479 vs 498); at 64 pairs 32 per SM stays best (115 us,
# against 119-158 at 8-48 per SM).
SMALL_GRID_PAIRS = 64
SMALL_GRID_PER_SM = 8
LARGE_GRID_PER_SM = 32
MANY_PAIRS = 256
MANY_PAIRS_PER_SM = 48


def body_splits(batch_heads: int, body_len: int, sm_count: int, head_dim: int = 128) -> int:
    """One-warp programs per (sequence, KV head), never more than there are 64-token steps.

    Large grids: 32 or 48 programs per SM (about eight are resident; the rest fill the tail;
    sweeps: ``benchmarks/gluon_sweep.py``, ``benchmarks/probes/decode_small_batch.py splits``).
    Small grids (few pairs, so many splits each): at most one wave of ~8 per SM, rounded down: a
    second wave of short programs costs a whole program's latency again, and every split adds a
    partial to merge. Never more splits per pair than SMs, and at head dims past 128 (four
    chunks: a longer prologue and epilogue per program) at least ``MIN_STEPS_WIDE`` steps per
    program (``benchmarks/results/few_pairs_sweep.log``)."""
    steps = -(-body_len // STEP)
    if batch_heads < SMALL_GRID_PAIRS:
        want = min(SMALL_GRID_PER_SM * sm_count // batch_heads, sm_count)
        if head_dim > 128:
            want = min(want, max(1, steps // MIN_STEPS_WIDE))
    else:
        per_sm = MANY_PAIRS_PER_SM if batch_heads >= MANY_PAIRS else LARGE_GRID_PER_SM
        want = -(-per_sm * sm_count // batch_heads)
    return max(1, min(want, steps))


# H200, CUDA-graph time (benchmarks/probes/few_pairs_sweep.py): under 8 pairs the one-wave rule
# gave each pair 2x the SM count of splits; one per SM is twice as fast (Qwen2.5-7B batch 1 32k,
# 4 pairs, kivi-3: 34 us at 132 splits against 66 us at 264, Triton kernel 44 us; 128k: 74
# against 95, Triton 132). Gemma-2-9B batch 1 32k (head_dim 256, 8 pairs, 512 steps): 64 splits
# (8 steps each) against 132: kivi-2 61 against 81 us, kivi-4 80 against 94; kivi-3 105 against
# 99 (the one loss).
MIN_STEPS_WIDE = 8


# Register cap for ptxas (0: ptxas chooses; caps measured slower: spills). Read once at import:
# the launch is on every decode step.
DEFAULT_MAXNREG = env_count("KVBITS_GLUON_MAXNREG", 0)

# Prefetch distance in 64-token steps (0: none): each step asks for the bytes of the step PF
# ahead with ``prefetch.global`` (no registers, no shared memory), so the one warp of a program
# finds its next loads in L2 (or L1, KVBITS_GLUON_PREFETCH_L1=1) instead of waiting on DRAM.
# H200 sweep (benchmarks/gluon_sweep.py, SWEEP_PF; benchmarks/results/decode_gluon_prefetch.log):
# one step ahead, issued after the step's own key loads, is the best of 0-4 steps, L1/L2, before
# or after: kivi-2 Llama-3-8B B=32 32k 518 -> 402 us, Llama-3 B=8 32k 146 -> 116 us, Llama-2-7B
# B=8 32k 500 -> 395 us; kivi-4, uniform-int4 and k4v2 gain 5-25%. Two or more steps ahead
# measured slower (the prefetches crowd the demand loads).
DEFAULT_PREFETCH = env_count("KVBITS_GLUON_PREFETCH", 1)
PREFETCH_L1 = env_switch("KVBITS_GLUON_PREFETCH_L1", "0")
PREFETCH_AFTER_KEYS = env_switch("KVBITS_GLUON_PREFETCH_AFTER", "1")
# KVQuant layers: prefetch the outliers of the step PF ahead too (indices and corrections, keys
# and values: 6 lines of 128 bytes per 64-token step at two per token), with the step's codes.
# Off: H200, whole captured calls alternated (benchmarks/results/kvquant_ab_s35.log), 5-6%
# slower at Llama-3-8B batch 8 (32k 422 -> 451 us, 128k 1647 -> 1734), 2% at Llama-2-7B batch
# 8, 2% faster only at batch 1 128k; into L1, the same or worse. The layer's ~15 us per step and
# program is its arithmetic and spills, not these loads' latency.
PREFETCH_OUTLIERS = env_switch("KVBITS_GLUON_PREFETCH_OUTLIERS", "0")
# Issue a step's value loads with its key loads (one wait per step instead of two; ~250
# registers): measured 0-6% faster with 4-bit keys, 4-50% slower for kivi-2, so off.
EARLY_VALUES = env_switch("KVBITS_GLUON_EARLY_V", "0")
# Head dims of four chunks (256): reload the query operands of chunks 2 and 3 from L1 at every
# step instead of holding them through the loop (16 registers at 8 heads). sm_90 SASS per step
# (GQA 2, G 32): 3-bit planes 4243 -> 4353 instructions with spilled words 44/53 -> 27/32
# (loads/stores), 4-bit 3409 -> 3489 with 32/36 -> 13/13, 3-bit codebooks 4947 -> 4927 with
# 129/155 -> 66/89. H200, Gemma-2-9B 32k, graph time, two runs each within 0.5%
# (decode_attention_q_reload*.md): 3-bit planes batch 1 101 -> 98.5 us, batch 8 420 -> 418;
# codebooks batch 8 534 -> 492 us but batch 1 115 -> 120; 4 bits batch 8 402 -> 400, batch 1
# 82.5 -> 86.6. Hence: 3-bit planes always, codebooks from Q_RELOAD_CB_PAIRS (sequence, KV head)
# pairs, never 2 or 4 bits. KVBITS_GLUON_Q_RELOAD=0 turns it off, =1 forces it for 3/4 bits.
_Q_RELOAD_ENV = env_choice("KVBITS_GLUON_Q_RELOAD", "auto", ("auto", "0", "1"))
Q_RELOAD_CB_PAIRS = 64


def q_reload(D: int, key_bits: int, codebooks: bool, batch_heads: int,
             full: bool = False) -> bool:
    """Whether the body reloads its later query chunks at every step (see ``Q_RELOAD_CB_PAIRS``;
    ``full``: KVQuant outliers or pre-RoPE keys, which hold more live registers: always, sm_90
    SASS of the 3-outlier pre-RoPE layer at GQA 2: 9749 -> 9546 instructions per step, spill
    stack 1360 -> 1016 bytes)."""
    if D != 256 or key_bits not in (3, 4) or _Q_RELOAD_ENV == "0":
        return False
    if _Q_RELOAD_ENV == "1":
        return True
    return key_bits == 3 and (not codebooks or full or batch_heads >= Q_RELOAD_CB_PAIRS)


def split_count(body_len: int, splits: int) -> int:
    """The number of non-empty splits when ``body_len`` tokens of 64-token steps are cut into
    about ``splits`` equal ranges."""
    steps = -(-body_len // STEP)
    return -(-steps // -(-steps // splits))


def attend_body(q, kv, out, lse, *, scale_log2: float, starts, lengths, has_starts: bool,
                has_lens: bool, n_out: int, splits: int, maxnreg: int | None = None,
                lens_dev=None, prefetch: int | None = None, window: int | None = None,
                softcap: float | None = None, pdl: bool = False) -> None:
    """Write the body partials of ``q [B, Hq, Lq, D]`` over ``kv`` into columns ``[0, splits)``
    of ``out [B*Hq*Lq, n_out, D]`` / ``lse [B*Hq*Lq, n_out]``. Several query rows (speculative
    verification, short chunks) are more columns of the MMA: a row is a head of its own
    (``q`` read as ``[B, Hq*Lq, 1, D]``, the same memory), masked causally where the body
    reaches past the first row (see :func:`query_rows_as_heads`). ``splits`` must already be
    :func:`split_count`'s (every split non-empty). ``lens_dev``: int32 ``[3]`` true (sink, body,
    residual) lengths on the device, ``kv``'s being bounds (splits past the true body end
    write empty partials). ``window``: a sliding window (tokens the query sees, itself
    included); ``softcap``: Gemma2's attention-logit softcapping, both as in the reference.
    ``pdl``: the next launch is a programmatic dependent (the finish kernel): let it start."""
    Hkv = kv.kv_heads
    k_tok = getattr(kv, "key_axis", "channel") == "token"
    from . import decode_gluon_tma  # (imports this module: imported here, not at the top)

    if decode_gluon_tma.serves(kv, k_tok, q.device):
        decode_gluon_tma.attend_body(q, kv, out, lse, scale_log2=scale_log2, starts=starts,
                                     lengths=lengths, has_starts=has_starts, has_lens=has_lens,
                                     n_out=n_out, splits=splits, lens_dev=lens_dev,
                                     window=window, softcap=softcap, pdl=pdl)
        return
    q, HG, Lq = query_rows_as_heads(q, Hkv)
    blocks = column_blocks(HG)  # programs per (sequence, KV head, split)
    B, _, _, D = q.shape
    steps = -(-kv.body_len // STEP)
    per = -(-steps // splits)  # steps per split
    maxnreg = maxnreg or DEFAULT_MAXNREG or None
    kcb, vcb = getattr(kv, "k_codebook", None), getattr(kv, "v_codebook", None)
    if kcb is not None:  # [Hkv, 2^bits] float32, a row per KV head (the kernel reads bh % Hkv)
        kcb = kcb.float().expand(Hkv, 1 << kv.key_bits).contiguous()
        vcb = vcb.float().expand(Hkv, 1 << kv.value_bits).contiguous()
    koi, kov = getattr(kv, "k_out_idx", None), getattr(kv, "k_out_val", None)
    voi, vov = getattr(kv, "v_out_idx", None), getattr(kv, "v_out_val", None)
    inv_freq = getattr(kv, "rope_inv_freq", None)
    if inv_freq is not None:
        inv_freq = rope_freqs(inv_freq.float().contiguous(), D)
    keywords = (
        HG, 8 if HG <= 8 else 16, D, kv.key_bits, kv.value_bits, kv.group_size, kv.value_group,
        has_starts, has_lens, kv.value_group if k_tok else kv.group_size, k_tok,
        lens_dev is not None, DEFAULT_PREFETCH if prefetch is None else prefetch, PREFETCH_L1,
        PREFETCH_AFTER_KEYS, EARLY_VALUES, kcb is not None,
        koi.shape[3] if koi is not None else 0, voi.shape[3] if voi is not None else 0,
        inv_freq is not None,
        q_reload(D, kv.key_bits, kcb is not None, B * Hkv,
                 full=koi is not None or voi is not None or inv_freq is not None),
        window is not None, softcap is not None, Lq, pdl,
        PREFETCH_OUTLIERS and (koi is not None or voi is not None),
        ROPE_BLOCKS and inv_freq is not None, blocks, bool(getattr(kv, "key_scales_fixed", False)),
        fold_token_keys(kv, HG, D), 1)
    _BODY.launch((B * Hkv * blocks, splits), (
        q, out, lse, kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero,
        starts, lengths, lens_dev if lens_dev is not None else starts,
        kcb if kcb is not None else starts, vcb if vcb is not None else starts,
        *(t.contiguous() if t is not None else starts for t in (koi, kov, voi, vov)),
        inv_freq if inv_freq is not None else starts,
        rope_rows(inv_freq, kv.key_bits, kv.group_size) if inv_freq is not None else starts,
        scale_log2, float(softcap) if softcap is not None else 1.0, kv.sink_len, kv.body_len,
        kv.res_len, int(window) if window is not None else 0, kv.k_codes.shape[2],
        kv.k_scale.shape[2] * kv.k_scale.shape[3], kv.v_codes.shape[2],
        kv.v_scale.shape[2] * kv.v_scale.shape[3],
        koi.shape[2] if koi is not None else 0, voi.shape[2] if voi is not None else 0,
        Hkv, n_out, per,
    ), _BODY_KEYWORDS_MAXNREG(*keywords, maxnreg) if maxnreg else _BODY_KEYWORDS(*keywords))


def query_rows_as_heads(q, kv_heads: int):
    """``q [B, Hq, Lq, D]`` (contiguous) as ``[B, Hq*Lq, 1, D]``: row ``r`` of head ``h`` is
    column ``h*Lq + r`` of its KV head's group of ``Hq/Hkv*Lq`` (the layout of ``out`` rows,
    ``(b*Hq + h)*Lq + r``, is the same). Returns the view, that group size and ``Lq``."""
    B, Hq, Lq, D = q.shape
    return q.view(B, Hq * Lq, 1, D), Hq // kv_heads * Lq, Lq


# Run-time arguments of _body_kernel with their types for an ahead-of-time compile (pointers,
# then integers); the JIT specializes pointers and the *_cap / *_slice strides to 16-divisibility.
_SM90_POINTERS = {"Q": "*fp16", "Out": "*fp32", "Lse": "*fp32", "KC": "*i32", "KS": "*fp16",
                  "KZ": "*fp16", "VC": "*i32", "VS": "*fp16", "VZ": "*fp16", "Starts": "*i32",
                  "Lens": "*i32", "LenTab": "*i32", "KCB": "*fp32", "VCB": "*fp32",
                  "KOI": "*u8", "KOV": "*fp16", "VOI": "*u8", "VOV": "*fp16",
                  "InvFreq": "*fp32", "RopeCS": "*fp16"}


def compile_sm90(constexprs: dict, **options):
    """``_body_kernel`` compiled for sm_90 without a GPU (Triton ships ptxas): the compile test
    and the probes (``benchmarks/probes/gluon_body_aot.py``, ``gluon_kvquant_aot.py``) read its
    PTX/SASS. ``constexprs``: the kernel's constexpr arguments (those with defaults may be left
    out); ``options``: compile options besides ``num_warps=1`` (e.g. ``maxnreg``)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget

    fn = _body_kernel
    params = inspect.signature(fn.fn).parameters
    cx = {**{k: p.default for k, p in params.items()
             if "constexpr" in str(p.annotation) and p.default is not p.empty}, **constexprs}
    sig = {k: _SM90_POINTERS.get(k, "fp32" if k in ("qk_scale", "softcap") else "i32")
           for k, p in params.items() if "constexpr" not in str(p.annotation)}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*") or k.endswith(("_cap", "_slice"))}
    src = gluon._runtime.GluonASTSource(fn=fn, signature={**sig, **dict.fromkeys(cx, "constexpr")},
                                        constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 1, **options})


def rope_freqs(inv_freq, D: int):
    """A layer's RoPE frequencies as the kernel reads them: as they are at head dims 64 / 128 /
    256; in the halves layout (:func:`halves_layout`) padded with zeros to whole 32-channel
    chunks (48 -> 64 at head_dim 96), kept on the frequency tensor like its tables, so a
    captured call finds the one its eager calls built."""
    width = chunk_width_of(D, True) * chunks_of(D, True) // 2
    if not halves_layout.fn(D, True) or inv_freq.numel() == width:
        return inv_freq
    padded = getattr(inv_freq, "_kvbits_padded", None)
    if padded is None:
        padded = inv_freq.new_zeros(width)
        padded[:inv_freq.numel()] = inv_freq
        inv_freq._kvbits_padded = padded
    return padded


def rope_rows(inv_freq, bits: int, G: int):
    """``[2, 64, D/2]`` float16 ``cos/sin(j * inv_freq)`` with ``j`` the step offset of MMA row
    ``n`` (:func:`token_order`): the per-element turn of a step's pre-RoPE keys, the same for
    every step (cached on the frequency tensor)."""
    from .decode_attention import rope_cos_sin

    return rope_cos_sin(inv_freq, lambda: token_order(bits, G), key=("gluon rows", bits, G))
