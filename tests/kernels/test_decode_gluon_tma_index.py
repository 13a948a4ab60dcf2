"""The TMA ring's stage indexing, checked on the CPU against the register body's pointer math.

``kernels/decode_gluon_tma.py`` reads each step from shared-memory stages laid out as TMA copies
them (whole rows, key scale rows once each, value scales as a flat ``[32, 4]`` int32 tile)
and turns them into the register body's tensors by reshapes, permutes, splits and joins. The
compiler checks that those conversions move no data between lanes; it cannot check that they
put the right element at each index. This test replays the same tensor operations in NumPy on
stage tiles whose elements are their own addresses, and compares every element with the address
the register body's loads compute (``decode_gluon._key_ptrs`` / ``_value_ptrs``, restated here
from their formulas). No GPU needed; numerics are tested on the GPU
(``test_decode_attention.py -k tma``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvbits.kernels import decode_gluon_tma as dt

pytestmark = pytest.mark.skipif(dt.gluon is None, reason="this Triton has no Gluon")

D, DC, GV = 128, 64, 32
J = DC // 2  # channel pairs per chunk


def tok(R, slot, W, G):
    """Token offset of word row R, slot ``slot`` within a step (``decode_gluon._tok``)."""
    return (R // W) * G + R % W + W * slot


def key_words_smem(bits, c):
    """(lo, hi) ``[A, J]`` (2 bits) / ``[H, A, J]`` (4 bits) as ``_smem_keys`` builds them."""
    RS = 2 * bits
    tile = np.arange(RS)[:, None] * 1000 + np.arange(D)[None, :]  # id = row * 1000 + column
    x = tile[:, c * DC:(c + 1) * DC]
    if bits == 2:
        x = x.reshape(4, J, 2)
        return x[..., 0], x[..., 1]
    x = x.reshape(4, 2, J, 2)
    return x[..., 0].transpose(1, 0, 2), x[..., 1].transpose(1, 0, 2)


def key_scales_smem(G, c):
    """Key scale pairs ``[A, J]`` as ``_smem_keys`` / ``_rows_to_kw`` build them: the stage's
    SG group rows (each once, ``key_scale_tile``), the chunk's half, each row broadcast over
    the 4 / SG copy lanes (``KSP``) and reshaped to the word-row index ``a = g K + k``."""
    SG = 64 // G
    stage = np.arange(SG)[:, None] * 1000 + np.arange(D // 2)[None, :]  # id = group, pair
    assert list(stage.shape) == dt.key_scale_tile(G, D)
    y = stage[:, c * J:(c + 1) * J]
    return np.broadcast_to(y[:, None, :], (SG, 4 // SG, J)).reshape(4, J)


def value_words_smem(bits, c):
    """Value words ``[NGC, GV, (H,) A]`` as ``_smem_values`` builds them."""
    RS = 2 * bits
    tile = np.arange(RS)[:, None] * 1000 + np.arange(D)[None, :]
    x = tile[:, c * DC:(c + 1) * DC]
    if bits == 2:
        return x.reshape(4, DC // GV, GV).transpose(1, 2, 0)
    return x.reshape(4, 2, DC // GV, GV).transpose(2, 3, 1, 0)


def value_scales_smem(bits, G, c):
    """Value scale words ``[1, (H,) A, I..., E]`` as ``_smem_values`` / ``_words_to_vs``."""
    t = np.arange(64)
    flat = np.stack([t * 10, t * 10 + 1], axis=1).reshape(32, 4)  # id = token * 10 + word
    x = flat.reshape(32, 2, 2)[..., c]  # the chunk's word: [32, 2] (token bits 5..1, 0)
    order = [int(dt._token_axis("VS", bits, G, d)) for d in range(6)]
    y = x.reshape([2] * 6).transpose(order)
    y = y.reshape(4, 2, 2, 2, 2) if bits == 2 else y.reshape(2, 4, 2, 2, 2)
    return y[None]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("G", [16, 32, 64])
@pytest.mark.parametrize("c", [0, 1])
def test_stage_reads_match_the_register_body(bits, G, c):
    W = G * bits // 32
    m = 1 if bits == 2 else 2  # the thread's key group row: row0 + m a (decode_gluon._key_ptrs)
    lo, hi = key_words_smem(bits, c)
    sc = key_scales_smem(G, c)
    vw = value_words_smem(bits, c)
    vs = value_scales_smem(bits, G, c)
    for a in range(4):
        for j in range(J):
            pair = c * J + j  # the register body's j0 + j
            for h in range(2 if bits == 4 else 1):
                R = a if bits == 2 else 2 * a + h
                got = (lo[a, j], hi[a, j]) if bits == 2 else (lo[h, a, j], hi[h, a, j])
                assert got == (R * 1000 + 2 * pair, R * 1000 + 2 * pair + 1), (a, h, j)
            assert sc[a, j] == ((m * a) // W) * 1000 + pair, (a, j)
    for g in range(DC // GV):
        for ch in range(GV):
            for a in range(4):
                for h in range(2 if bits == 4 else 1):
                    R = a if bits == 2 else h + 2 * a
                    got = vw[g, ch, a] if bits == 2 else vw[g, ch, h, a]
                    assert got == R * 1000 + c * DC + g * GV + ch, (g, ch, h, a)
    word = c * DC // (2 * GV)  # decode_gluon._value_ptrs: (t NGV + DC0 // GV) // 2
    for idx in np.ndindex(vs.shape):
        if bits == 2:
            _, sa, i0, i1, i2, se = idx
            t = tok(sa, i0 + 2 * i1 + 4 * i2 + 8 * se, W, G)
        else:
            _, sh, sa, k0, k1, se = idx
            t = tok(2 * sa + sh, k0 + 2 * k1 + 4 * se, W, G)
        assert vs[idx] == t * 10 + word, idx


def token_words_smem(c):
    """A stage's per-token scale words ``[16, 4]`` (one int32 per token, its two fp16 the
    channel halves: the uniform method's keys, values in 64-channel groups) with the half of
    chunk ``c`` picked (``_token_half``): ids ``token * 10 + half``."""
    t = np.arange(64)
    return (t * 10 + c).reshape(16, 4)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("c", [0, 1])
def test_token_scale_reads_match_the_register_body(bits, c):
    """Per-token scales through the ring (``_smem_token_keys``, ``_smem_values`` at GV = 64):
    each element of the ``KT`` / ``VS`` tensors is the scale the register body loads for it
    (``decode_gluon._key_ptrs`` with ``K_TOK``: ``t NGK + DC0 // GK``; ``_value_ptrs`` with one
    group per chunk: ``t NGV + DC0 // GV``; both ``2 t + c`` here)."""
    G = 64  # the uniform method's group: codes packed in blocks of 64 tokens
    W = G * bits // 32
    x = token_words_smem(c)
    # KT: [A, E, I0, I1, I2] (2 bits) / [H, A, E, K0, K1]; VS: [A, I0, I1, I2, E] / [H, A, K0, K1, E]
    kt_fields = ("a", "e", "k0", "k1", "h") if bits == 2 else ("h", "a", "e", "k0", "k1")
    vs_fields = ("a", "k0", "k1", "h", "e") if bits == 2 else ("h", "a", "k0", "k1", "e")
    for name, fields in (("KT", kt_fields), ("VS", vs_fields)):
        y = x.reshape([2] * 6).transpose([int(dt._token_axis(name, bits, G, d)) for d in range(6)])
        y = y.reshape(4, 2, 2, 2, 2) if bits == 2 else y.reshape(2, 4, 2, 2, 2)
        for idx in np.ndindex(y.shape):
            f = dict(zip(fields, idx))
            if bits == 2:  # token n = e + 2a + 8h + 16k at word row a, slot k + 4h + 8e
                t = tok(f["a"], f["k0"] + 2 * f["k1"] + 4 * f["h"] + 8 * f["e"], W, G)
            else:  # word row 2a + h, slot k + 4e
                t = tok(2 * f["a"] + f["h"], f["k0"] + 2 * f["k1"] + 4 * f["e"], W, G)
            assert y[idx] == t * 10 + c, (name, idx)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("G", [16, 32, 64])
def test_token_words_reach_the_score_rows_in_their_token_order(bits, G):
    """Per-token words permuted to the rows of ``S^T`` (``_token_rows``, the folded per-token
    key scales) give row ``n`` the word of token ``decode_gluon.token_order(bits, G)[n]``."""
    from kvbits.kernels import decode_gluon as dg

    x = np.arange(64).reshape(16, 4)  # token t's word holds t
    rows = x.reshape([2] * 6).transpose([int(dt._token_axis("ROW", bits, G, d)) for d in range(6)])
    assert rows.reshape(64).tolist() == [int(t) for t in dg.token_order(bits, G)]


def _bank_conflicts(layout, tile, swizzle: bool) -> int:
    """Worst bank conflict (distinct 4-byte words sharing a bank) of one shared-memory load
    instruction of ``layout`` over a word tile ``tile`` (``[.., .., 32]`` int32): the lanes at
    each register index, the first register base counted with it when it is the ``LDS.64`` pair
    bit. Rows are 128 bytes; with ``swizzle`` the 16-byte chunk of row ``r`` is XOR-ed with ``r
    % 8`` (TMA's 128-byte swizzle), without it the rows stand unswizzled."""
    import itertools

    def coord(bits_on, bases):
        c = [0] * len(tile)
        for on, b in zip(bits_on, bases):
            if on:
                c = [x ^ y for x, y in zip(c, b)]
        return c

    pair = [layout.reg_bases[0]] if layout.reg_bases[0] == [0, 0, 1] else []
    others = layout.reg_bases[len(pair):]
    worst = 1
    for regs in itertools.product([0, 1], repeat=len(others)):
        words = set()
        for lanes in itertools.product([0, 1], repeat=len(layout.lane_bases)):
            for p in itertools.product([0, 1], repeat=len(pair)):
                c = coord(list(regs) + list(lanes) + list(p), others + layout.lane_bases + pair)
                words.add(tuple(c))
        banks = {}
        for c in words:
            row = c[0] * tile[1] + c[1]
            chunk = (c[2] // 4) ^ (row % 8 if swizzle else 0)
            banks.setdefault((chunk * 4 + c[2] % 4) % 32, set()).add(c)
        worst = max(worst, max(len(v) for v in banks.values()))
    return worst


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("name", ["KWS", "VWS"])
def test_word_tile_reads_are_free_of_bank_conflicts(bits, name):
    """The reason for the swizzled word tiles (``decode_gluon_tma.word_tile``): each load
    instruction's word rows fall in distinct swizzle phases, so no two of its words share a bank;
    the same reads from unswizzled rows (what the ring did before, 512-byte rows, all in the
    same banks) conflict 4-way, the 5.3-way average Nsight Compute measured
    (``benchmarks/results/ncu_body_s25.log``) with the scale reads."""
    layout = dt._smem_layouts(bits, D, 32)[name]
    layout = getattr(layout, "value", layout)
    tile = [int(x) for x in dt.word_tile(bits, D)]
    assert list(layout.shape) == tile
    assert _bank_conflicts(layout, tile, swizzle=True) == 1
    assert _bank_conflicts(layout, tile, swizzle=False) >= 2


def _key_scale_conflicts(layout, SG: int) -> int:
    """Worst bank conflict of one load instruction of the key-scale layout ``KSS`` over a
    half-slice ``[SG, 32]`` of the stage's ``[SG, 64]`` int32 tile (256-byte rows)."""
    import itertools

    def coord(bits_on, bases):
        c = [0, 0]
        for on, b in zip(bits_on, bases):
            if on:
                c = [c[0] ^ b[0], c[1] ^ b[1]]
        return c
    worst = 1
    for regs in itertools.product([0, 1], repeat=len(layout.reg_bases)):
        for half in (0, 1):
            words = {tuple(coord(list(regs) + list(lanes), layout.reg_bases + layout.lane_bases))
                     for lanes in itertools.product([0, 1], repeat=len(layout.lane_bases))}
            banks = {}
            for r, col in words:
                banks.setdefault((r * 64 + half * 32 + col) % 32, set()).add((r, col))
            worst = max(worst, max(len(v) for v in banks.values()))
    return worst


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("G,want", [(16, 4), (32, 2), (64, 1)])
def test_key_scale_reads_read_each_group_row_once(bits, G, want):
    """Key scale rows once each (session 26): a load instruction's lanes read one word per group
    row they need (the copy lanes broadcast), so its conflicts are the SG rows sharing banks:
    none at G = 64, 2-way at G = 32, 4-way at G = 16, against 4-way at every G when the rows were
    copied 4 / SG times and each lane read its own copy."""
    layout = dt._smem_layouts(bits, D, G)["KSS"]
    layout = getattr(layout, "value", layout)
    assert list(layout.shape) == [64 // G, J]
    assert _key_scale_conflicts(layout, 64 // G) == want


def _ring_layer(B=1, H=2, T=256, owner=None):
    """A KIVI 2-bit layer's six buffers as the ring reads them (CPU tensors; values unused)."""
    from kvbits.formats.layout import PackedKV

    z = lambda *s: torch.zeros(*s, dtype=torch.float16)
    words = T // 32 * 2  # 2-bit groups of 32 tokens: 2 words per channel
    return PackedKV(z(B, H, 0, D), z(B, H, 0, D), 0,
                    torch.zeros(B, H, words, D, dtype=torch.int32), z(B, H, T // 32, D),
                    z(B, H, T // 32, D), torch.zeros(B, H, words, D, dtype=torch.int32),
                    z(B, H, T, D // GV), z(B, H, T, D // GV), T, z(B, H, 8, D), z(B, H, 8, D),
                    0, 2, 2, 32, GV, owner=owner)


def test_descriptors_are_built_once_per_owner_and_buffers():
    """The ring's six descriptors are built once per owner of the buffers (a layer's store, or
    the PackedKV itself) and reused while the buffers stay the same; new buffers (a store that
    grew) rebuild them; the entry leaves with its owner."""
    import gc

    class Store:  # stands for cache.store.LayerStore, whose views name it as their owner
        pass
    store = Store()
    kv = _ring_layer(owner=store)
    first = dt._descriptors(kv)
    assert len(first) == 6 and dt._descriptors(_ring_layer(owner=store)) is not first  # new buffers
    kv2 = _ring_layer(owner=store)
    again = dt._descriptors(kv2)
    assert dt._descriptors(kv2) is again  # same owner, same buffers: the cached objects
    view = dataclasses.replace(kv2, body_len=kv2.body_len - 32)  # the next step's view
    assert dt._descriptors(view) is again  # lengths are not part of a descriptor
    assert [d.base.data_ptr() for d in again[:1]] == [kv2.k_codes.data_ptr()]
    bare = _ring_layer()  # no owner: the PackedKV is its own
    mine = dt._descriptors(bare)
    assert dt._descriptors(bare) is mine
    n = len(dt._DESCRIPTORS)
    del store, kv, kv2, view, again, first
    gc.collect()
    assert len(dt._DESCRIPTORS) == n - 1  # the store's entry left with it
    del bare, mine
    gc.collect()
    assert len(dt._DESCRIPTORS) == n - 2
