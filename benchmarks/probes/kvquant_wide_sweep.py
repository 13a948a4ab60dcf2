"""Probe (GPU): KVQuant layers at head_dim 256 (Gemma-2/3 shapes), which only the Triton kernel
serves. Session 20's table of unseen shapes (decode_attention_unseen.md) had kvquant-3 at
0.06-0.09x flash SDPA there. Which part costs it (outliers, pre-RoPE keys, codebooks), and do
the launch knobs (num_warps, tile_tokens) recover it? CUDA-graph time against flash SDPA.

    PYTHONPATH=src python3 benchmarks/probes/kvquant_wide_sweep.py > kvquant_wide_sweep.log

Session 40: ``[HQ/HKV/D:B,...]`` picks other shapes (Phi-3-mini's 32/32/96, whose pre-RoPE
keys the Triton kernel now reads with padded halves), and ``ONLY=kvquant-3`` one variant.
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv
from decode_attention import bench_graph, flash_graph_us, variant_graph_us

from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

VARIANTS = {"kvquant-3": {}, "no outliers": {"outliers": 0.0}, "post-RoPE": {"pre_rope": False},
            "dense-post": {"outliers": 0.0, "pre_rope": False}}
if os.environ.get("ONLY"):
    VARIANTS = {os.environ["ONLY"]: VARIANTS[os.environ["ONLY"]]}
GRID = [(4, None), (8, None), (4, 32), (8, 32), (8, 128), (2, 32), (4, 64), (8, 64)]
T = 32768
SHAPES = [(16, 8, 256, 1), (16, 8, 256, 8), (8, 1, 256, 8)]
if len(sys.argv) > 1:
    SHAPES = [tuple(int(x) for x in s.replace(":", "/").split("/")) for s in sys.argv[1].split(",")]
for hq, hkv, d, B in SHAPES:
    q, tf = flash_graph_us(B, hq, hkv, T, d)
    print(f"Hq={hq} Hkv={hkv} D={d} B={B} T={T}: flash {tf:.1f} us", flush=True)
    for name, kw in VARIANTS.items():
        kv = random_packed_kv(B, hkv, T, d, resolve_spec("kvquant-3", **kw))
        ref = decode_attention(q, kv, scale=d ** -0.5, gluon=False)
        for warps, tile in GRID:
            args = {"num_warps": warps, "tile_tokens": tile, "gluon": False}
            try:
                t, err = variant_graph_us(q, kv, ref, **args)
            except Exception as e:  # noqa: BLE001
                print(f"  {name:12s} warps={warps} tile={tile}: {type(e).__name__}: "
                      f"{str(e)[:100]}", flush=True)
                continue
            print(f"  {name:12s} warps={warps} tile={tile or 'lib':>3}: {t:8.1f} us "
                  f"x{tf / t:.2f}  diff {err:.1e}", flush=True)
        t = bench_graph(lambda q=q, kv=kv, d=d: decode_attention(q, kv, scale=d ** -0.5))
        print(f"  {name:12s} library default: {t:8.1f} us x{tf / t:.2f}", flush=True)
        kv = ref = None
        torch.cuda.empty_cache()
