"""The Gluon body kernel compiled for sm_90 on the CPU (no GPU needed; Triton ships ptxas).

Gluon has no interpreter, so CPU CI cannot run it; compiling it still catches what breaks most
easily: an API that changed between Triton versions, a layout whose conversion to the MMA
operand is no longer register-only (the whole point of the kernel: no shared-memory tile), or
PTX that ptxas rejects. Numerics are tested on the GPU (test_decode_attention.py, gluon tests).
The compile runs in a child process: this one may be in Triton's interpreter mode, which wraps
every kernel for the CPU.
"""

from __future__ import annotations

import json

import pytest

from kvbits.kernels import decode_gluon

pytestmark = pytest.mark.skipif(decode_gluon.gluon is None, reason="this Triton has no Gluon")

CHILD = r'''
import json, sys
from kvbits.kernels import decode_gluon
out = []
for cx in json.loads(sys.argv[1]):
    c = decode_gluon.compile_sm90(cx)
    ir = c.asm["ttgir"]
    out.append({"mma": "mma" in ir, "local_alloc": ir.count("local_alloc"),
                "shared": c.metadata.shared, "shfl": c.asm["ptx"].count("shfl.sync"),
                "prefetch": c.asm["ptx"].count("prefetch.global.L2"),
                "pdl": c.asm["ptx"].count("griddepcontrol.launch_dependents"),
                "kfix": bool(cx.get("KFIX"))})
print(json.dumps(out))
'''

# 2-bit, GQA 4, per-channel keys, lengths from the host, prefetch after the key loads
BASE = {"HG": 4, "HP": 8, "D": 128, "KBITS": 2, "VBITS": 2, "G": 32, "GV": 32, "HAS_STARTS": True,
        "HAS_LENS": True, "GK": 32, "K_TOK": False, "LENS_DEV": False, "PF": 1, "PF_L1": False,
        "PF_AFTER": True, "EARLY_V": False}
CONFIGS = [
    BASE,
    # 4-bit, 16 heads, per-token keys, lengths on the device (CUDA-graph decode), early values
    {**BASE, "HG": 16, "HP": 16, "D": 64, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64,
     "HAS_LENS": False, "GK": 64, "K_TOK": True, "LENS_DEV": True, "PF_AFTER": False,
     "EARLY_V": True},
    # 3-bit planes merged into 4-bit fields (PLANES3): G 32 at D 128, G 64 at D 64 / 16 heads
    {**BASE, "KBITS": 3, "VBITS": 3},
    {**BASE, "HG": 16, "HP": 16, "D": 64, "KBITS": 3, "VBITS": 3, "G": 64, "GV": 64,
     "HAS_STARTS": False, "GK": 64, "LENS_DEV": True},
    {**BASE, "KBITS": 3, "VBITS": 3, "CB": True},  # KVQuant 3-bit codebooks (prmt tables)
    # KVQuant's full layer (KVQUANT_FULL): outliers as one-hot MMAs, pre-RoPE keys (MHA, D 128,
    # turned in 16-row blocks (ROPE_M) and whole; 16 heads, D 64); outliers alone (GQA 8)
    {**BASE, "HG": 1, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True,
     "ROPE_M": True},
    {**BASE, "HG": 1, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True},
    {**BASE, "HG": 16, "HP": 16, "D": 64, "KBITS": 3, "VBITS": 3, "G": 64, "GV": 64, "GK": 64,
     "CB": True, "KOUT": 1, "VOUT": 1, "ROPE": True, "ROPE_M": True},
    {**BASE, "HG": 8, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 3, "VOUT": 3},
    # ... at head_dim 256 (KVQUANT_WIDE): chunk pairs (0, 2), (1, 3) turned, 3 outliers per
    # token on four chunks, later query chunks reloaded
    {**BASE, "HG": 2, "D": 256, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 3, "VOUT": 3,
     "ROPE": True, "Q_RELOAD": True, "ROPE_M": True},
    # more chunks (EXTRA_HEAD_DIMS): head_dim 256 as four of 64 (2 bits GQA 2; 4 bits G 64),
    # 96 as three of 32 (4 bits, 8 heads)
    {**BASE, "HG": 2, "D": 256},
    {**BASE, "D": 256, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64, "GK": 64},
    # the later query chunks reloaded at every step (Q_RELOAD): 4 bits, 3-bit codebooks
    {**BASE, "HG": 2, "D": 256, "KBITS": 4, "VBITS": 4, "Q_RELOAD": True},
    {**BASE, "HG": 2, "D": 256, "KBITS": 3, "VBITS": 3, "CB": True, "Q_RELOAD": True},
    {**BASE, "HG": 8, "D": 96, "KBITS": 4, "VBITS": 4},
    {**BASE, "HG": 3, "D": 96, "KBITS": 3, "VBITS": 3, "CB": True},  # planes in a third chunk
    # head dims 32 does not divide (PADDED_HEAD_DIMS), the last 32-channel chunk padded: 80 as
    # three (2 bits; 3-bit codebooks; keys per token over 64 channels), 100 as four (4 bits,
    # G 64), 40 as two (MHA)
    {**BASE, "D": 80},
    {**BASE, "HG": 3, "D": 80, "KBITS": 3, "VBITS": 3, "CB": True},
    {**BASE, "D": 80, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64, "GK": 64, "K_TOK": True},
    {**BASE, "HG": 8, "D": 100, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64, "GK": 64},
    {**BASE, "HG": 1, "D": 40},
    # KVQuant's pre-RoPE keys at other head dims (KVQUANT_HALVES): each half in 32-channel
    # chunks of its own, padded: 96 and 80 with outliers (MHA, GQA 3), 100 without, 40 (two)
    {**BASE, "HG": 1, "D": 96, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2,
     "ROPE": True, "ROPE_M": True},
    {**BASE, "HG": 3, "D": 80, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 3, "VOUT": 3,
     "ROPE": True, "ROPE_M": True},
    {**BASE, "HG": 2, "D": 100, "G": 64, "GV": 64, "GK": 64, "KBITS": 3, "VBITS": 3, "CB": True,
     "ROPE": True},
    {**BASE, "HG": 8, "D": 40, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 1, "VOUT": 1,
     "ROPE": True, "ROPE_M": True},
    # ... and outliers alone there, over the straight chunks: three at 96 and 80, four at 100
    {**BASE, "HG": 2, "D": 96, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2},
    {**BASE, "D": 80, "G": 64, "GV": 64, "GK": 64, "KBITS": 3, "VBITS": 3, "CB": True,
     "KOUT": 3, "VOUT": 3},
    {**BASE, "HG": 1, "D": 100, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2},
    # keys per token with their scales folded out of the key operands (KFOLD, KEY_FOLD):
    # head_dim 64 (two 32-channel chunks of one 64-channel group, 4 bits, 16 heads) and 128
    # (2 bits, GQA 4, early values)
    {**BASE, "HG": 16, "HP": 16, "D": 64, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64,
     "HAS_LENS": False, "GK": 64, "K_TOK": True, "LENS_DEV": True, "PF_AFTER": False,
     "EARLY_V": True, "KFOLD": True},
    {**BASE, "G": 64, "GV": 64, "GK": 64, "K_TOK": True, "EARLY_V": True, "KFOLD": True},
    # keys per token at head_dim 256 (TOKEN_KEYS_WIDE): one 64-channel key group per chunk
    {**BASE, "HG": 2, "D": 256, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64, "GK": 64,
     "K_TOK": True},
    # a sliding window and Gemma2's softcapping (2 bits; 3-bit KVQuant at head_dim 256); the
    # finish kernel launched as a programmatic dependent (PDL)
    {**BASE, "HAS_WINDOW": True, "SOFTCAP": True, "PDL": True},
    {**BASE, "HG": 2, "D": 256, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 3, "VOUT": 3,
     "ROPE": True, "Q_RELOAD": True, "HAS_WINDOW": True, "SOFTCAP": True},
    # several query rows per sequence as more columns (speculative verification): 4 heads x 3
    # rows with a window (each row its own causal end and window start); KVQuant's full layer,
    # 2 heads x 4 rows
    {**BASE, "HG": 12, "HP": 16, "LQ": 3, "HAS_WINDOW": True},
    {**BASE, "HG": 8, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True,
     "LQ": 4, "ROPE_M": True},
    # KVQuant at 4 bits (KVQUANT4): the 4-bit words looked up in 16-entry tables; codebooks
    # alone (GQA 4), the full layer (outliers, pre-RoPE keys turned in 16-row blocks; MHA),
    # outliers alone at head_dim 64 with 16 heads
    {**BASE, "KBITS": 4, "VBITS": 4, "CB": True},
    {**BASE, "HG": 1, "KBITS": 4, "VBITS": 4, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True,
     "ROPE_M": True},
    {**BASE, "HG": 16, "HP": 16, "D": 64, "KBITS": 4, "VBITS": 4, "G": 64, "GV": 64, "GK": 64,
     "CB": True, "KOUT": 1, "VOUT": 1},
    # more than 16 columns per KV head as blocks of 16, one program each (NQB, column_blocks):
    # Falcon-7B's 71 heads on one KV head (five blocks, the last of 7), 4 heads x 5 rows with a
    # window (rows of one head in two blocks), KVQuant's full layer at 8 heads x 3 rows
    {**BASE, "HG": 71, "HP": 16, "D": 64, "NQB": 5},
    {**BASE, "HG": 20, "HP": 16, "LQ": 5, "HAS_WINDOW": True, "NQB": 2},
    {**BASE, "HG": 24, "HP": 16, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2,
     "ROPE": True, "LQ": 3, "ROPE_M": True, "NQB": 2},
    # KVQuant at 2 bits (KVQUANT2): the 2-bit words looked up in 4-entry tables; codebooks
    # alone (GQA 4), the full layer (MHA, turned in 16-row blocks), outliers alone at head_dim
    # 64 with 16 heads
    {**BASE, "CB": True},
    {**BASE, "HG": 1, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True, "ROPE_M": True},
    {**BASE, "HG": 16, "HP": 16, "D": 64, "G": 64, "GV": 64, "GK": 64, "CB": True, "KOUT": 1,
     "VOUT": 1},
    # KVQuant with offline key scales (KFIX): one fixed scale / zero row read by every step, not
    # prefetched; 3 bits' full layer (MHA) and 4 bits' codebooks alone (GQA 4)
    {**BASE, "HG": 1, "KBITS": 3, "VBITS": 3, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True,
     "ROPE_M": True, "KFIX": True},
    {**BASE, "KBITS": 4, "VBITS": 4, "CB": True, "KFIX": True},
    {**BASE, "HG": 1, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True, "ROPE_M": True,
     "KFIX": True},
    {**BASE, "KBITS": 4, "PF": 0, "PF_AFTER": False},  # K4V2 (mixed widths; last, no prefetch)
]


def test_body_kernel_compiles_for_sm90_without_shared_memory_tiles(compile_sm90):
    results = compile_sm90(CHILD, CONFIGS)
    *equal, mixed = results
    for r in equal:  # operands built in registers: no shared memory at all
        assert r["mma"] and r["local_alloc"] == 0 and r["shared"] == 0, r
        # and no cross-lane moves beyond the softmax reductions and the P conversion (20 / 40
        # shuffles at 8 / 16 heads; a key layout off by one lane bit costs 100+)
        assert r["shfl"] <= 64, r
        # the next step's bytes are asked for (PF=1): key/value words and their scales/zeros
        # (but for an offline key row, KFIX)
        assert r["prefetch"] >= (4 if r["kfix"] else 6), r
    by_config = {json.dumps({k: v for k, v in cx.items() if k != "KFIX"}, sort_keys=True): r
                 for cx, r in zip(CONFIGS, results, strict=True) if not cx.get("KFIX")}
    for cx, r in zip(CONFIGS, results, strict=True):
        if cx.get("KFIX"):  # the per-group twin prefetches the step's key scales and zeros too
            twin = by_config[json.dumps({k: v for k, v in cx.items() if k != "KFIX"},
                                        sort_keys=True)]
            assert r["prefetch"] == twin["prefetch"] - 2, (r, twin)
    assert [r["pdl"] for r in results] == [int(cx.get("PDL", False)) for cx in CONFIGS]
    assert mixed["prefetch"] == 0, mixed  # PF=0: none
    # mixed widths: only P (64 tokens x 8 heads, fp16) crosses shared memory, to be permuted
    # from the keys' token order to the values'; no K or V tile does
    assert mixed["mma"] and mixed["shared"] <= 64 * 8 * 2, mixed


TMA_CHILD = r'''
import json, sys
from kvbits.kernels import decode_gluon_tma as dt


out = []
for cx in json.loads(sys.argv[1]):
    c = dt.compile_sm90(cx)
    ptx = c.asm["ptx"]
    out.append({"mma": "mma.sync" in ptx, "tma": ptx.count("cp.async.bulk.tensor"),
                "shfl": ptx.count("shfl.sync"), "st_shared": ptx.count("st.shared"),
                "shared": c.metadata.shared, "pdl": ptx.count("griddepcontrol.launch_dependents"),
                "hfma2": ptx.count("fma.rn.f16x2")})
print(json.dumps(out))
'''

TMA_CONFIGS = [  # 2 bits, 3 stages, GQA 4, device lengths; 4 bits, 2 stages, 16 heads; G = 16
    {"HG": 4, "HP": 8, "D": 128, "BITS": 2, "G": 32, "GV": 32, "HAS_STARTS": True,
     "HAS_LENS": True, "LENS_DEV": True, "NS": 3},
    {"HG": 16, "HP": 16, "D": 128, "BITS": 4, "G": 32, "GV": 32, "HAS_STARTS": True,
     "HAS_LENS": False, "LENS_DEV": False, "NS": 2},
    {"HG": 1, "HP": 8, "D": 128, "BITS": 2, "G": 16, "GV": 32, "HAS_STARTS": False,
     "HAS_LENS": True, "LENS_DEV": False, "NS": 3},
    # a sliding window and Gemma2's softcapping
    {"HG": 2, "HP": 8, "D": 128, "BITS": 4, "G": 32, "GV": 32, "HAS_STARTS": True,
     "HAS_LENS": True, "LENS_DEV": True, "NS": 2, "HAS_WINDOW": True, "SOFTCAP": True},
    # five query rows of one head (speculative verification, MHA)
    {"HG": 5, "HP": 8, "D": 128, "BITS": 2, "G": 32, "GV": 32, "HAS_STARTS": True,
     "HAS_LENS": True, "LENS_DEV": False, "NS": 3, "LQ": 5},
    # the uniform method: keys and values scaled per token over 64 channels
    {"HG": 4, "HP": 8, "D": 128, "BITS": 4, "G": 64, "GV": 64, "HAS_STARTS": True,
     "HAS_LENS": True, "LENS_DEV": True, "NS": 2, "K_TOK": True, "PDL": True},
    # ... with the per-token key scales folded out of the key operands (KEY_FOLD), 2 and 4 bits
    {"HG": 4, "HP": 8, "D": 128, "BITS": 4, "G": 64, "GV": 64, "HAS_STARTS": True,
     "HAS_LENS": True, "LENS_DEV": True, "NS": 2, "K_TOK": True, "KFOLD": True},
    {"HG": 16, "HP": 16, "D": 128, "BITS": 2, "G": 64, "GV": 64, "HAS_STARTS": True,
     "HAS_LENS": False, "LENS_DEV": False, "NS": 3, "K_TOK": True, "KFOLD": True, "LQ": 2},
    # StarCoder's 48 heads on one KV head (three blocks of 16); 4 heads x 5 rows (two blocks)
    {"HG": 48, "HP": 16, "D": 128, "BITS": 2, "G": 32, "GV": 32, "HAS_STARTS": False,
     "HAS_LENS": True, "LENS_DEV": False, "NS": 3, "NQB": 3},
    {"HG": 20, "HP": 16, "D": 128, "BITS": 4, "G": 32, "GV": 32, "HAS_STARTS": True,
     "HAS_LENS": True, "LENS_DEV": True, "NS": 2, "LQ": 5, "NQB": 2},
]


def test_tma_body_kernel_compiles_for_sm90(compile_sm90):
    """The TMA ring (decode_gluon_tma): eight bulk tensor copies per step (the word tiles per
    channel half, the key scale rows once each), shared memory only for the ring (no tile
    crosses lanes through it: ``st.shared`` stays at the P conversion's level), and no more
    shuffles than the register body's softmax reductions and P conversion."""
    from kvbits.kernels import decode_gluon_tma
    if decode_gluon_tma.gluon is None:
        pytest.skip("this Triton has no Gluon TMA")
    results = compile_sm90(TMA_CHILD, TMA_CONFIGS)
    for cx, r in zip(TMA_CONFIGS, results):
        SG = 64 // cx["G"]  # key scale rows per step, each once (key_scale_tile)
        key_scales = 64 * 4 if cx.get("K_TOK") else SG * cx["D"] * 2  # or a word per token
        value_scales = 64 * 2 * cx["D"] // cx["GV"]
        ring = cx["NS"] * (2 * 2 * cx["BITS"] * cx["D"] * 4 + 2 * key_scales
                           + 2 * value_scales)
        assert r["mma"] and r["tma"] >= 6 and r["shared"] >= ring, (cx, r)
        assert r["shfl"] <= 64 and r["st_shared"] <= 16, (cx, r)
        assert r["pdl"] == int(cx.get("PDL", False)), (cx, r)  # lets the finish kernel start
    # per-token key scales folded out of the key operands: the keys' half of the float16 FMAs
    # (two per element pair) is gone, the values' stays
    tok = {cx.get("KFOLD", False): r["hfma2"] for cx, r in zip(TMA_CONFIGS, results)
           if cx.get("K_TOK") and cx["BITS"] == 4}
    assert tok[True] == tok[False] // 2, tok


def test_q_reload_rule():
    """Reload the later query chunks only at head_dim 256 (four chunks): 3-bit planes always,
    3-bit codebooks from Q_RELOAD_CB_PAIRS pairs on, never 2 or 4 bits (measured slower at
    batch 1) nor fewer chunks."""
    q = decode_gluon.q_reload
    many = decode_gluon.Q_RELOAD_CB_PAIRS
    assert q(256, 3, False, 1) and q(256, 3, False, many)
    assert q(256, 3, True, many) and not q(256, 3, True, many - 1)
    assert not any(q(256, b, cb, n) for b in (2, 4) for cb in (False, True) for n in (1, many))
    assert not any(q(d, 3, False, many) for d in (64, 96, 128, 192))
