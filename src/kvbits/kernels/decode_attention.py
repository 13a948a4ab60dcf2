"""Flash-decoding over a packed layer: sink (FP16) + packed body + residual (FP16) in one launch.

Stage 1, grid ``(B * Hkv * m_tiles, body_splits + fp_splits)``: each program owns one KV head of
one sequence and a contiguous range of tokens. A body program loads whole key groups of packed
codes (``[groups, words, D]`` int32), unpacks every slot with one shift (the slot-major layout of
:mod:`kvbits.formats.packing` makes the unpacked slots contiguous token ranges, so the tile is a
reshape that merges leading dims), dequantizes in registers, and computes the scores of *all*
query rows of the GQA group with one ``tl.dot``; values are dequantized as ``V^T [D, tokens]`` the
same way along channels. An FP16 program does the same over the sink and residual. Everything is
computed transposed (``S^T = K Q^T``, ``O^T += V^T P^T``) so that both packed axes unpack into the
leading dimension. Each program writes its normalised partial output and log-sum-exp (base 2).

Stage 2 merges the splits with the usual log-sum-exp weights.

The history is never written back to memory in full precision: the only HBM traffic is the
packed codes, the scales and zeros, the FP16 windows, Q, and the small per-split partials.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats.layout import PackedKV

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online-softmax bookkeeping for base-2 scores ``s [M, N]`` (-inf where masked).

    Returns the probabilities, the factor that rescales earlier partial sums, and the new max
    and sum. A row that has seen nothing keeps max -inf and sum 0 (no NaN)."""
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
def _as_float(codes):
    """Small non-negative int32 codes -> float32 without a conversion instruction: OR-ing them
    into the mantissa of 2**23 and subtracting 2**23 is exact for codes < 2**23."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _slot(w0, w1, w2, shift, BITS: tl.constexpr):
    """Codes of one slot from packed words: a ``BITS``-wide field at ``shift`` (2/4/8 bits), or
    bit ``shift`` of the three bit-plane words ``w0, w1, w2`` (3 bits)."""
    if BITS == 3:
        c = ((w0 >> shift) & 1) | (((w1 >> shift) & 1) << 1) | (((w2 >> shift) & 1) << 2)
    else:
        c = (w0 >> shift) & ((1 << BITS) - 1)
    return _as_float(c)


@triton.jit
def _decode_kernel(
    Q, Out, Lse,
    SinkK, SinkV, ResK, ResV,
    KC, KS, KZ, VC, VS, VZ,
    Starts, Lens,
    qk_scale, window,
    sink_len, body_len, res_len,
    sink_cap, res_cap, kc_cap, ks_cap, vc_cap, vs_cap,
    Hkv, Lq, m_tiles, n_body_splits, groups_per_split, fp_per_split,
    HG: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr, G: tl.constexpr, GPT: tl.constexpr,
    GV: tl.constexpr, NGV: tl.constexpr, NGV_PAD: tl.constexpr,
    BLOCK_FP: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    mt = pid % m_tiles
    bh = pid // m_tiles
    h = bh % Hkv
    b = bh // Hkv
    bh64 = bh.to(tl.int64)

    start = tl.load(Starts + b)
    length = tl.load(Lens + b)

    # Query rows of this KV head: row m -> head h*HG + m // Lq, query index m % Lq.
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
    q = (q.to(tl.float32) * qk_scale).to(Q.dtype.element_ty)  # [M, D], scale * log2(e)
    o_row = q_row * n_splits + split  # Out is [B*Hq*Lq, n_splits, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if split < n_body_splits:
        # Words per group column: W = G * BITS / 32 (G / 32 per plane for 3 bits).
        WK: tl.constexpr = G // 32 if KBITS == 3 else G * KBITS // 32
        WV: tl.constexpr = G // 32 if VBITS == 3 else G * VBITS // 32
        KSLOTS: tl.constexpr = 32 if KBITS == 3 else 32 // KBITS
        KROWS: tl.constexpr = 3 * WK if KBITS == 3 else WK  # stored rows per group
        VROWS: tl.constexpr = 3 * WV if VBITS == 3 else WV
        R: tl.constexpr = GPT * WK  # tokens per slot tile
        n_groups = body_len // G
        g_lo = split * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
        first = start - sink_len  # skip groups outside this sequence's [start, length) and window
        if HAS_WINDOW:
            first = tl.maximum(first, length - Lq - window + 1 - sink_len)
        g_lo = tl.maximum(g_lo, tl.maximum(first, 0) // G)
        g_hi = tl.minimum(g_hi, (length - sink_len + G - 1) // G)
        kc_base = KC + bh64 * kc_cap * D
        vc_base = VC + bh64 * vc_cap * D
        offs_r = tl.arange(0, R)
        wk = offs_r % WK
        offs_j = tl.arange(0, NGV_PAD)
        offs_c = tl.arange(0, GV)
        j_ok = offs_j < NGV
        v_cols = (offs_j * GV)[:, None, None] + offs_c[None, None, :]  # [NGV, 1, GV]
        acc = tl.zeros([NGV_PAD, BLOCK_M, GV], dtype=tl.float32)  # sum_t p s_t c_t per V group
        zacc = tl.zeros([NGV_PAD, BLOCK_M], dtype=tl.float32)  # sum_t p z_t per V group
        for g0 in range(g_lo, g_hi, GPT):
            grp = g0 + offs_r // WK  # [R] group of each tile row
            r_ok = grp < g_hi
            grp64 = grp.to(tl.int64)
            kmask = d_ok[:, None] & r_ok[None, :]
            # K^T words [D, R] (+ planes) and the scale/zero of each row's group, once per tile.
            kw_ptr = kc_base + (grp64 * KROWS + wk)[None, :] * D + offs_d[:, None]
            kw0 = tl.load(kw_ptr, mask=kmask, other=0)
            kw1 = kw0
            kw2 = kw0
            if KBITS == 3:
                kw1 = tl.load(kw_ptr + WK * D, mask=kmask, other=0)
                kw2 = tl.load(kw_ptr + 2 * WK * D, mask=kmask, other=0)
            ks_ptr = (bh64 * ks_cap + grp64)[None, :] * D + offs_d[:, None]
            k_s = tl.load(KS + ks_ptr, mask=kmask, other=0.0).to(tl.float32)
            k_z = tl.load(KZ + ks_ptr, mask=kmask, other=0.0).to(tl.float32)
            vmask = j_ok[:, None, None] & r_ok[None, :, None]
            if KBITS == VBITS:  # K and V slots hold the same tokens: load V words once per tile
                vw_ptr = vc_base + (grp64 * VROWS + wk)[None, :, None] * D + v_cols
                vw0 = tl.load(vw_ptr, mask=vmask, other=0)
                vw1 = vw0
                vw2 = vw0
                if VBITS == 3:
                    vw1 = tl.load(vw_ptr + WV * D, mask=vmask, other=0)
                    vw2 = tl.load(vw_ptr + 2 * WV * D, mask=vmask, other=0)
            for s in tl.static_range(KSLOTS):
                tin = s * WK + wk  # in-group token index of each row for this slot
                tok = grp * G + tin  # body token index
                if KBITS == 3:
                    kT = _slot(kw0, kw1, kw2, s, KBITS) * k_s + k_z
                else:
                    kT = _slot(kw0, kw1, kw2, s * KBITS, KBITS) * k_s + k_z
                sc = tl.dot(q, kT.to(Q.dtype.element_ty))  # [M, R]
                vis = _visible(sink_len + tok, pos, start, length, window, HAS_WINDOW)
                sc = tl.where(vis & r_ok[None, :] & m_ok[:, None], sc, float("-inf"))
                p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
                # V codes of the same tokens: slot tin // WV, row tin % WV of V's packing.
                if KBITS == VBITS:
                    vshift = s
                    if VBITS != 3:
                        vshift = s * VBITS
                    vc = _slot(vw0, vw1, vw2, vshift, VBITS)
                else:
                    vrow = (grp64 * VROWS + tin % WV)[None, :, None]
                    vw0 = tl.load(vc_base + vrow * D + v_cols, mask=vmask, other=0)
                    vw1 = vw0
                    vw2 = vw0
                    if VBITS == 3:
                        vw1 = tl.load(vc_base + (vrow + WV) * D + v_cols, mask=vmask, other=0)
                        vw2 = tl.load(vc_base + (vrow + 2 * WV) * D + v_cols, mask=vmask, other=0)
                        vsh = (tin // WV)[None, :, None]
                    else:
                        vsh = ((tin // WV) * VBITS)[None, :, None]
                    vc = _slot(vw0, vw1, vw2, vsh, VBITS)
                # Per-token value scales fold into the probabilities: one [NGV, M, R] product.
                vs_ptr = (bh64 * vs_cap + grp64 * G + tin)[None, :] * NGV + offs_j[:, None]
                sv_ok = j_ok[:, None] & r_ok[None, :]
                v_s = tl.load(VS + vs_ptr, mask=sv_ok, other=0.0).to(tl.float32)  # [NGV, R]
                v_z = tl.load(VZ + vs_ptr, mask=sv_ok, other=0.0).to(tl.float32)
                ps = p[None, :, :] * v_s[:, None, :]  # [NGV, M, R]
                acc = acc * alpha[None, :, None] + tl.dot(ps.to(Q.dtype.element_ty),
                                                          vc.to(Q.dtype.element_ty))
                zacc = zacc * alpha[None, :] + tl.sum(p[None, :, :] * v_z[:, None, :], axis=2)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = (acc + zacc[:, :, None]) / l_safe[None, :, None]
        o_ptr = Out + o_row[None, :, None] * D + v_cols
        tl.store(o_ptr, o, mask=j_ok[:, None, None] & m_ok[None, :, None])
    else:
        # FP16 tokens: index i < sink_len is sink token i, else residual token i - sink_len.
        fs = split - n_body_splits
        i_lo = fs * fp_per_split
        i_hi = tl.minimum(i_lo + fp_per_split, sink_len + res_len)
        res_pos0 = sink_len + body_len
        acc2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for i0 in range(i_lo, i_hi, BLOCK_FP):
            offs_i = i0 + tl.arange(0, BLOCK_FP)
            i_ok = offs_i < i_hi
            in_sink = offs_i < sink_len
            t_pos = tl.where(in_sink, offs_i, res_pos0 + offs_i - sink_len)
            row = tl.where(in_sink, bh64 * sink_cap + offs_i, bh64 * res_cap + offs_i - sink_len)
            kT_ptr = row[None, :] * D + offs_d[:, None]
            kT_ok = d_ok[:, None] & i_ok[None, :]
            kT = tl.where(in_sink[None, :],
                          tl.load(SinkK + kT_ptr, mask=kT_ok & in_sink[None, :], other=0.0),
                          tl.load(ResK + kT_ptr, mask=kT_ok & ~in_sink[None, :], other=0.0))
            sc = tl.dot(q, kT.to(Q.dtype.element_ty))  # [M, N]
            vis = _visible(t_pos, pos, start, length, window, HAS_WINDOW)
            sc = tl.where(vis & i_ok[None, :] & m_ok[:, None], sc, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(sc, m_i, l_i)
            v_ptr = row[:, None] * D + offs_d[None, :]
            v_ok = i_ok[:, None] & d_ok[None, :]
            v = tl.where(in_sink[:, None],
                         tl.load(SinkV + v_ptr, mask=v_ok & in_sink[:, None], other=0.0),
                         tl.load(ResV + v_ptr, mask=v_ok & ~in_sink[:, None], other=0.0))
            acc2 = acc2 * alpha[:, None] + tl.dot(p.to(Q.dtype.element_ty), v.to(Q.dtype.element_ty))
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(Out + o_row[:, None] * D + offs_d[None, :], acc2 / l_safe[:, None],
                 mask=m_ok[:, None] & d_ok[None, :])
    # Base-2 log-sum-exp of this split (-inf if it saw nothing).
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(Lse + o_row, lse, mask=m_ok)


@triton.jit
def _merge_kernel(Out, Lse, O, n_splits, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Merge the per-split partials of one query row: weights exp2(lse_s - max)."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    lse = tl.load(Lse + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    o = tl.load(Out + (row * n_splits + offs_s[:, None]) * D + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + row * D + offs_d, res.to(O.dtype.element_ty), mask=offs_d < D)


def num_splits(batch_heads: int, work_units: int, sm_count: int) -> int:
    """Token splits per (sequence, KV head): enough programs to fill the GPU about twice over,
    never more than there are units of work (key groups or FP16 tiles)."""
    want = max(1, (2 * sm_count + batch_heads - 1) // batch_heads)
    return max(1, min(want, work_units))


DEFAULT_TILE_ROWS = 16  # tokens per unpacked slot tile (the N of each tl.dot)
DEFAULT_WARPS = 4


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def decode_attention(q: torch.Tensor, kv: PackedKV, *, scale: float, starts=None, lengths=None,
                     window: int | None = None, splits: int | None = None,
                     num_warps: int | None = None, tile_rows: int | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over a packed layer (rules of the reference op).

    ``starts``/``lengths``: optional ``[B]`` int tensors (first visible position; sequence end).
    ``splits``, ``num_warps`` and ``tile_rows`` (tokens per unpacked slot tile, >= 16) override
    the defaults (tests and tuning).
    """
    B, Hq, Lq, D = q.shape
    Hkv = kv.kv_heads
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    if D % 16:
        raise ValueError(f"head_dim must be a multiple of 16, got {D}")
    HG = Hq // Hkv
    dev = q.device
    q = q.contiguous()
    starts = _as_i32(starts, B, 0, dev)
    lengths = _as_i32(lengths, B, kv.total_len, dev)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    M = HG * Lq
    BLOCK_M = min(64, max(16, triton.next_power_of_2(M)))
    m_tiles = triton.cdiv(M, BLOCK_M)
    G = kv.group_size
    wk = G // 32 if kv.key_bits == 3 else G * kv.key_bits // 32
    GPT = max(1, (tile_rows or DEFAULT_TILE_ROWS) // wk)  # groups per loop step
    n_groups = kv.body_len // G
    bhm = B * Hkv * m_tiles
    sms = _sm_count(dev)
    if splits is None:
        splits = num_splits(bhm, triton.cdiv(n_groups, GPT), sms) if n_groups else 0
    splits = min(splits, n_groups)
    groups_per_split = triton.cdiv(triton.cdiv(n_groups, splits), GPT) * GPT if splits else 1
    if splits:
        splits = triton.cdiv(n_groups, groups_per_split)
    BLOCK_FP = 64 if BLOCK_D <= 128 else 32
    n_fp = kv.sink_len + kv.res_len
    fp_splits = num_splits(bhm, triton.cdiv(n_fp, BLOCK_FP), sms) if n_fp else 0
    if not splits and not fp_splits:
        return torch.zeros_like(q)
    fp_per_split = triton.cdiv(triton.cdiv(n_fp, fp_splits), BLOCK_FP) * BLOCK_FP if fp_splits else 1
    if fp_splits:
        fp_splits = triton.cdiv(n_fp, fp_per_split)
    n_total = splits + fp_splits
    out = torch.empty(B * Hq * Lq, n_total, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B * Hq * Lq, n_total, dtype=torch.float32, device=dev)
    NGV = D // kv.value_group
    _decode_kernel[(bhm, n_total)](
        q, out, lse,
        kv.sink_k, kv.sink_v, kv.res_k, kv.res_v,
        kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero,
        starts, lengths,
        scale * LOG2E, int(window) if window else 0,
        kv.sink_len, kv.body_len, kv.res_len,
        kv.sink_k.shape[2], kv.res_k.shape[2], kv.k_codes.shape[2], kv.k_scale.shape[2],
        kv.v_codes.shape[2], kv.v_scale.shape[2],
        Hkv, Lq, m_tiles, splits, groups_per_split, fp_per_split,
        HG=HG, D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
        KBITS=kv.key_bits, VBITS=kv.value_bits, G=G, GPT=GPT,
        GV=kv.value_group, NGV=NGV, NGV_PAD=triton.next_power_of_2(NGV),
        BLOCK_FP=BLOCK_FP, HAS_WINDOW=bool(window),
        num_warps=num_warps or DEFAULT_WARPS, num_stages=2 if BLOCK_D <= 128 else 1,
    )
    o = torch.empty(B, Hq, Lq, D, dtype=q.dtype, device=dev)
    _merge_kernel[(B * Hq * Lq,)](out, lse, o, n_total, D=D, BLOCK_D=BLOCK_D,
                                  BLOCK_S=max(2, triton.next_power_of_2(n_total)))
    return o


def _as_i32(x, batch: int, default: int, device) -> torch.Tensor:
    if x is None:
        return torch.full((batch,), default, dtype=torch.int32, device=device)
    return torch.as_tensor(x, device=device).to(torch.int32).expand(batch).contiguous()
