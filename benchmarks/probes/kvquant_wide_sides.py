"""Probe (GPU): which side's outliers cost the Triton kernel at head_dim 256: kvquant-3 layers
(post-RoPE and pre-RoPE keys) with only the key outliers, only the value outliers, both, or
none (Gemma-2-9B shape, batch 1 and 8, 32k; graph time).

    PYTHONPATH=src python3 benchmarks/probes/kvquant_wide_sides.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv  # noqa: E402
from decode_attention import bench_graph, flash_graph_us  # noqa: E402

from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

T = 32768
for hq, hkv, d, B in ((16, 8, 256, 1), (16, 8, 256, 8), (32, 8, 128, 8)):
    q, tf = flash_graph_us(B, hq, hkv, T, d)
    print(f"Hq={hq} Hkv={hkv} D={d} B={B}: flash {tf:.1f} us", flush=True)
    for rope in (False, True):
        kv = random_packed_kv(B, hkv, T, d, resolve_spec("kvquant-3", pre_rope=rope))
        full = (kv.k_out_idx, kv.k_out_val, kv.v_out_idx, kv.v_out_val)
        for name, keep_k, keep_v in (("both", 1, 1), ("keys only", 1, 0), ("values only", 0, 1),
                                     ("none", 0, 0)):
            kv.k_out_idx, kv.k_out_val = full[:2] if keep_k else (None, None)
            kv.v_out_idx, kv.v_out_val = full[2:] if keep_v else (None, None)
            t = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, gluon=False))
            print(f"  pre_rope={rope!s:5} outliers {name:11s}: {t:8.1f} us x{tf / t:.2f}",
                  flush=True)
        kv = None  # (freed)
        torch.cuda.empty_cache()
