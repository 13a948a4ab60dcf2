"""Probe (GPU): split counts where the session-16 unseen-shapes table still had rows at or below
flash SDPA. (1) 3-bit planes at few (sequence, KV head) pairs (Qwen2.5-7B batch 1: 4 pairs,
sent to the Triton kernel by a pair limit since dropped; Llama-3-8B batch 1: 8 pairs): the
Gluon body at several split counts against the Triton kernel. (2) Gemma-2-9B (head_dim 256)
batch 1 through the Gluon body at several split counts. (3) fp8 at Gemma-2-9B batch 8 (Triton
kernel): warps / tile / splits. CUDA-graph time throughout.

    PYTHONPATH=src python3 benchmarks/probes/few_pairs_sweep.py > few_pairs_sweep.log
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv  # noqa: E402
from decode_attention import ALL_MODELS, bench_graph, flash_graph_us, variant_graph_us  # noqa: E402

from kvbits.kernels import decode_gluon  # noqa: E402
from kvbits.kernels.decode_attention import _sm_count, decode_attention, num_splits  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402


def gluon_splits(label, model, B, T, presets):
    hq, hkv, d = ALL_MODELS[model]
    q, tf = flash_graph_us(B, hq, hkv, T, d)
    sms = _sm_count(q.device)
    for preset in presets:
        kv = random_packed_kv(B, hkv, T, d, resolve_spec(preset))
        ref = decode_attention(q, kv, scale=d ** -0.5, gluon=False)
        tt = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, gluon=False))
        base = decode_gluon.body_splits(B * hkv, kv.body_len, sms)
        line = [f"{label} {model} B={B} T={T} {preset}: flash {tf:.1f} us, triton {tt:.1f} "
                f"({tf / tt:.2f}x); gluon splits"]
        for sp in sorted({base, 256, 132, 96, 64, 32, 16, 8}, reverse=True):
            kw = dict(gluon=True, splits=sp)
            t, err = variant_graph_us(q, kv, ref, **kw)
            line.append(f"{sp}{'*' if sp == base else ''}: {t:.1f} ({tf / t:.2f}x, d {err:.0e})")
        print(" ".join(line[:1]) + " " + ", ".join(line[1:]), flush=True)
        kv = None  # (freed)


gluon_splits("planes", "qwen2.5-7b", 1, 32768, ("kivi-3", "kvquant-3-dense-post"))
gluon_splits("planes", "qwen2.5-7b", 1, 131072, ("kivi-3", "kvquant-3-dense-post"))
gluon_splits("planes", "llama-3-8b", 1, 32768, ("kivi-3",))
gluon_splits("wide", "gemma-2-9b", 1, 32768, ("kivi-2", "kivi-3", "kivi-4", "kvquant-3-dense-post"))

hq, hkv, d = ALL_MODELS["gemma-2-9b"]
for B in (8, 1):
    q, tf = flash_graph_us(B, hq, hkv, 32768, d)
    kv = random_packed_kv(B, hkv, 32768, d, resolve_spec("fp8-dynamic"))
    td = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5))
    print(f"fp8 gemma-2-9b B={B}: flash {tf:.1f} us, default {td:.1f} ({tf / td:.2f}x)", flush=True)
    for warps, tile in ((4, None), (8, None), (4, 64), (8, 64), (4, 128), (8, 128), (2, 64)):
        tl_ = tile or 64
        base = num_splits(B * hkv, -(-kv.body_len // tl_), _sm_count(q.device))
        for sx in (0.5, 1, 2):
            sp = max(1, int(base * sx))
            kw = dict(num_warps=warps, tile_tokens=tile, splits=sp)
            try:
                t = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, **kw))
            except Exception as e:  # noqa: BLE001
                print(f"   warps={warps} tile={tile} splits={sp}: {type(e).__name__}: "
                      f"{str(e)[:80]}", flush=True)
                continue
            print(f"   warps={warps} tile={tile} splits={sp} ({sx}x): {t:.1f} us "
                  f"({tf / t:.2f}x)", flush=True)
    kv = None  # (freed)
