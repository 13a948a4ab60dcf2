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
from ..formats.packing import packed_length, slots_per_column

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(sT, vT, m_i, l_i, accT):
    """One online-softmax update. sT: [N, M] base-2 scores (-inf masked); vT: [D, N]."""
    m_new = tl.maximum(m_i, tl.max(sT, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    pT = tl.exp2(sT - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(pT, axis=0)
    accT = accT * alpha[None, :] + tl.dot(vT, pT.to(vT.dtype))
    return m_new, l_i, accT


@triton.jit
def _visible(t, pos, start, length, window, HAS_WINDOW: tl.constexpr):
    """[N, M] bool: token positions ``t [N]`` visible to query rows at positions ``pos [M]``."""
    ok = (t[:, None] <= pos[None, :]) & (t[:, None] >= start) & (t[:, None] < length)
    if HAS_WINDOW:
        ok = ok & (t[:, None] > pos[None, :] - window)
    return ok


@triton.jit
def _unpack_keys(kc_ptr, g0, offs_d, n_groups_valid, D: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, GPT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Codes of ``GPT`` key groups from group ``g0`` as float32 ``[GPT, G // W, W, BLOCK_D]``.

    Row ``s * W + w`` of a group is token ``s * W + w``: the unpacked slots are contiguous.
    """
    gi = tl.arange(0, GPT)
    g_ok = (gi < n_groups_valid)[:, None, None]
    d_ok = (offs_d < D)[None, None, :]
    if BITS == 3:
        # Bit planes: 3 words per column, plane j at word j * W3 + w, slot s at bit s.
        W3: tl.constexpr = G // 32
        w3 = tl.arange(0, W3)
        slot32 = tl.arange(0, 32)
        base = kc_ptr + ((g0 + gi).to(tl.int64)[:, None, None] * (3 * W3) + w3[None, :, None]) * D \
            + offs_d[None, None, :]
        codes = tl.zeros([GPT, 32, W3, BLOCK_D], dtype=tl.int32)
        for j in tl.static_range(3):
            plane = tl.load(base + j * W3 * D, mask=g_ok & d_ok, other=0)
            codes += ((plane[:, None, :, :] >> slot32[None, :, None, None]) & 1) << j
    else:
        # Fields: slot s of word w holds token s * W + w in bits [s * BITS, (s + 1) * BITS).
        W: tl.constexpr = G * BITS // 32
        SLOTS: tl.constexpr = 32 // BITS
        wi = tl.arange(0, W)
        slot = tl.arange(0, SLOTS)
        ptrs = kc_ptr + ((g0 + gi).to(tl.int64)[:, None, None] * W + wi[None, :, None]) * D \
            + offs_d[None, None, :]
        words = tl.load(ptrs, mask=g_ok & d_ok, other=0)
        codes = (words[:, None, :, :] >> (slot * BITS)[None, :, None, None]) & ((1 << BITS) - 1)
    return codes.to(tl.float32)


@triton.jit
def _unpack_values_T(vc_ptr, offs_t, t_ok, BITS: tl.constexpr, WV: tl.constexpr,
                     WV_PAD: tl.constexpr):
    """Value codes of tokens ``offs_t`` as float32 ``[SLOTS, WV_PAD, N]``: row s*WV_PAD+w holds
    channel ``s * WV + w`` (slot-major packing along channels)."""
    wi = tl.arange(0, WV_PAD)
    ok = (wi < WV)[:, None] & t_ok[None, :]
    ptrs = vc_ptr + offs_t.to(tl.int64)[None, :] * WV + wi[:, None]
    words = tl.load(ptrs, mask=ok, other=0)
    SLOTS: tl.constexpr = 32 // BITS
    slot = tl.arange(0, SLOTS)
    codes = (words[None, :, :] >> (slot * BITS)[:, None, None]) & ((1 << BITS) - 1)
    return codes.to(tl.float32)


@triton.jit
def _decode_kernel(
    Q, Out, Lse,
    SinkK, SinkV, ResK, ResV,
    KC, KS, KZ, VC, VS, VZ,
    Starts, Lens,
    qk_scale, window,
    sink_len, body_len, res_len,
    sink_cap, res_cap, kc_cap, ks_cap, vc_cap,
    Hkv, Lq, m_tiles, n_body_splits, groups_per_split, fp_per_split,
    HG: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr, G: tl.constexpr, GPT: tl.constexpr,
    GV: tl.constexpr, WV: tl.constexpr, WV_PAD: tl.constexpr, V_NATURAL: tl.constexpr,
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
    q_row = (b.to(tl.int64) * Hkv * HG + head) * Lq + qi  # row index into [B*Hq*Lq]
    qT = tl.load(Q + q_row[None, :] * D + offs_d[:, None], mask=d_ok[:, None] & m_ok[None, :],
                 other=0.0)
    qT = (qT.to(tl.float32) * qk_scale).to(Q.dtype.element_ty)  # [D, M], scale * log2(e)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    accT = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
    # Row order of accT: natural channels for FP16 programs and V_NATURAL bodies.
    if split < n_body_splits:
        N: tl.constexpr = GPT * G
        n_groups = body_len // G
        g_lo = split * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
        # Skip groups outside [start, length) of this sequence (and the window).
        first = start - sink_len
        if HAS_WINDOW:
            first = tl.maximum(first, length - Lq - window + 1 - sink_len)
        g_lo = tl.maximum(g_lo, first // G)
        g_hi = tl.minimum(g_hi, (length - sink_len + G - 1) // G)
        kc_base = KC + bh64 * kc_cap * D
        ks_base = KS + bh64 * ks_cap * D
        kz_base = KZ + bh64 * ks_cap * D
        NGV: tl.constexpr = D // GV
        for g0 in range(g_lo, g_hi, GPT):
            gi = tl.arange(0, GPT)
            g_ok = (g0 + gi) < g_hi
            sc_ptr = (g0 + gi).to(tl.int64)[:, None] * D + offs_d[None, :]
            sc_ok = g_ok[:, None] & d_ok[None, :]
            k_s = tl.load(ks_base + sc_ptr, mask=sc_ok, other=0.0).to(tl.float32)
            k_z = tl.load(kz_base + sc_ptr, mask=sc_ok, other=0.0).to(tl.float32)
            codes = _unpack_keys(kc_base, g0, offs_d, g_hi - g0, D, KBITS, G, GPT, BLOCK_D)
            k = codes * k_s[:, None, None, :] + k_z[:, None, None, :]
            k = tl.reshape(k, [N, BLOCK_D]).to(Q.dtype.element_ty)
            sT = tl.dot(k, qT)  # [N, M]
            offs_t = g0 * G + tl.arange(0, N)  # body token index
            t_ok = offs_t < g_hi * G
            vis = _visible(sink_len + offs_t, pos, start, length, window, HAS_WINDOW)
            sT = tl.where(vis & t_ok[:, None] & m_ok[None, :], sT, float("-inf"))
            # Values: V^T [D, N] from per-token codes packed along channels.
            vcodes = _unpack_values_T(VC + bh64 * vc_cap * WV, offs_t, t_ok, VBITS, WV, WV_PAD)
            VSLOTS: tl.constexpr = 32 // VBITS
            if V_NATURAL:
                # Rows are natural channels; a group of GV channels shares one scale per token.
                vs_ptr = bh64 * vc_cap * NGV + offs_t.to(tl.int64)[None, :] * NGV \
                    + tl.arange(0, NGV)[:, None]
                v_s = tl.load(VS + vs_ptr, mask=t_ok[None, :], other=0.0).to(tl.float32)
                v_z = tl.load(VZ + vs_ptr, mask=t_ok[None, :], other=0.0).to(tl.float32)
                vcodes = tl.reshape(vcodes, [NGV, GV, N])
                vT = vcodes * v_s[:, None, :] + v_z[:, None, :]
                vT = tl.reshape(vT, [BLOCK_D, N])
            else:
                slot = tl.arange(0, VSLOTS)
                wi = tl.arange(0, WV_PAD)
                chan = slot[:, None] * WV + wi[None, :]  # [SLOTS, WV_PAD] channel of each row
                c_ok = (wi[None, :] < WV) & (chan < D)
                vs_ptr = bh64 * vc_cap * NGV + offs_t.to(tl.int64)[None, None, :] * NGV \
                    + (chan // GV)[:, :, None]
                ok3 = c_ok[:, :, None] & t_ok[None, None, :]
                v_s = tl.load(VS + vs_ptr, mask=ok3, other=0.0).to(tl.float32)
                v_z = tl.load(VZ + vs_ptr, mask=ok3, other=0.0).to(tl.float32)
                vT = tl.reshape(vcodes * v_s + v_z, [VSLOTS * WV_PAD, N])
            m_i, l_i, accT = _online_softmax_step(sT, vT.to(Q.dtype.element_ty), m_i, l_i, accT)
    else:
        # FP16 tokens: index i < sink_len is sink token i, else residual token i - sink_len.
        fs = split - n_body_splits
        i_lo = fs * fp_per_split
        i_hi = tl.minimum(i_lo + fp_per_split, sink_len + res_len)
        res_pos0 = sink_len + body_len
        for i0 in range(i_lo, i_hi, BLOCK_FP):
            offs_i = i0 + tl.arange(0, BLOCK_FP)
            i_ok = offs_i < i_hi
            in_sink = offs_i < sink_len
            t_pos = tl.where(in_sink, offs_i, res_pos0 + offs_i - sink_len)
            row = tl.where(in_sink, bh64 * sink_cap + offs_i, bh64 * res_cap + offs_i - sink_len)
            kv_ok = i_ok[:, None] & d_ok[None, :]
            in_sink2 = in_sink[:, None]
            kp = row[:, None] * D + offs_d[None, :]
            k = tl.where(in_sink2, tl.load(SinkK + kp, mask=kv_ok & in_sink2, other=0.0),
                         tl.load(ResK + kp, mask=kv_ok & ~in_sink2, other=0.0))
            sT = tl.dot(k.to(Q.dtype.element_ty), qT)
            vis = _visible(t_pos, pos, start, length, window, HAS_WINDOW)
            sT = tl.where(vis & i_ok[:, None] & m_ok[None, :], sT, float("-inf"))
            vpT = row[None, :] * D + offs_d[:, None]
            vT_ok = d_ok[:, None] & i_ok[None, :]
            vT = tl.where(in_sink[None, :],
                          tl.load(SinkV + vpT, mask=vT_ok & in_sink[None, :], other=0.0),
                          tl.load(ResV + vpT, mask=vT_ok & ~in_sink[None, :], other=0.0))
            m_i, l_i, accT = _online_softmax_step(sT, vT.to(Q.dtype.element_ty), m_i, l_i, accT)

    # Partial output (normalised) and base-2 log-sum-exp of this split.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    oT = accT / l_safe[None, :]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    if V_NATURAL:
        chan_r = offs_d
        c_ok_r = d_ok
    else:
        # Body programs hold channel (r // WV_PAD) * WV + r % WV_PAD in row r.
        is_body = split < n_body_splits
        perm = (offs_d // WV_PAD) * WV + offs_d % WV_PAD
        perm_ok = ((offs_d % WV_PAD) < WV) & (perm < D)
        chan_r = tl.where(is_body, perm, offs_d)
        c_ok_r = tl.where(is_body, perm_ok, d_ok)
    o_row = q_row * n_splits + split  # Out is [B*Hq*Lq, n_splits, D]
    tl.store(Out + o_row[None, :] * D + chan_r[:, None], oT,
             mask=c_ok_r[:, None] & m_ok[None, :])
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


def default_tile_tokens(block_d: int) -> int:
    """Body tokens per loop step: a dequantized K tile of at most 128 x 128 elements."""
    return max(32, 16384 // block_d)


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
                     num_warps: int | None = None, tile_tokens: int | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over a packed layer (rules of the reference op).

    ``starts``/``lengths``: optional ``[B]`` int tensors (first visible position; sequence end).
    ``splits``, ``num_warps`` and ``tile_tokens`` (body tokens per loop step) override the
    defaults (tests and tuning).
    """
    B, Hq, Lq, D = q.shape
    Hkv = kv.kv_heads
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    if kv.value_bits == 3 and kv.body_len:
        raise NotImplementedError("3-bit values are served by the reference path")
    HG = Hq // Hkv
    dev = q.device
    q = q.contiguous()
    total = kv.total_len
    starts = _as_i32(starts, B, 0, dev)
    lengths = _as_i32(lengths, B, total, dev)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    M = HG * Lq
    BLOCK_M = min(64, max(16, triton.next_power_of_2(M)))
    m_tiles = triton.cdiv(M, BLOCK_M)
    G = kv.group_size
    GPT = max(1, (tile_tokens or default_tile_tokens(BLOCK_D)) // G)
    n_groups = kv.body_len // G
    bhm = B * Hkv * m_tiles
    sms = _sm_count(dev)
    if splits is None:
        splits = num_splits(bhm, triton.cdiv(n_groups, GPT), sms) if n_groups else 0
    splits = min(splits, n_groups)
    groups_per_split = triton.cdiv(n_groups, splits) if splits else 1
    groups_per_split = triton.cdiv(groups_per_split, GPT) * GPT
    if splits:
        splits = triton.cdiv(n_groups, groups_per_split)
    BLOCK_FP = 64
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
    WV = packed_length(D, kv.value_bits)
    WV_PAD = triton.next_power_of_2(WV)
    v_natural = (WV_PAD == WV) and (D == BLOCK_D)
    _decode_kernel[(bhm, n_total)](
        q, out, lse,
        kv.sink_k, kv.sink_v, kv.res_k, kv.res_v,
        kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero,
        starts, lengths,
        scale * LOG2E, int(window) if window else 0,
        kv.sink_len, kv.body_len, kv.res_len,
        kv.sink_k.shape[2], kv.res_k.shape[2], kv.k_codes.shape[2], kv.k_scale.shape[2],
        kv.v_codes.shape[2],
        Hkv, Lq, m_tiles, splits, groups_per_split, fp_per_split,
        HG=HG, D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
        KBITS=kv.key_bits, VBITS=kv.value_bits, G=G, GPT=GPT,
        GV=kv.value_group, WV=WV, WV_PAD=WV_PAD, V_NATURAL=v_natural,
        BLOCK_FP=BLOCK_FP, HAS_WINDOW=bool(window),
        num_warps=num_warps or 4,
    )
    o = torch.empty(B, Hq, Lq, D, dtype=q.dtype, device=dev)
    _merge_kernel[(B * Hq * Lq,)](out, lse, o, n_total, D=D, BLOCK_D=BLOCK_D,
                                  BLOCK_S=max(2, triton.next_power_of_2(n_total)))
    return o


def _as_i32(x, batch: int, default: int, device) -> torch.Tensor:
    if x is None:
        return torch.full((batch,), default, dtype=torch.int32, device=device)
    return torch.as_tensor(x, device=device).to(torch.int32).expand(batch).contiguous()
