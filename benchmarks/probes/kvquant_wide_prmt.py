"""Probe (GPU): the Triton kernel's PTX paths (prmt code conversion, f16x2 outlier compares) on
and off for KVQuant layers at head_dim 256 (Gemma-2-9B shape, 32k), graph time against flash.

    PYTHONPATH=src python3 benchmarks/probes/kvquant_wide_prmt.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv  # noqa: E402
from decode_attention import flash_graph_us, variant_graph_us  # noqa: E402

from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

T = 32768
for hq, hkv, d, B in ((16, 8, 256, 1), (16, 8, 256, 8)):
    q, tf = flash_graph_us(B, hq, hkv, T, d)
    print(f"Hq={hq} Hkv={hkv} D={d} B={B}: flash {tf:.1f} us", flush=True)
    for name, kw in (("kvquant-3", {}), ("post-RoPE", {"pre_rope": False}),
                     ("no outliers", {"outliers": 0.0}),
                     ("1 outlier", {"outliers": 1 / 256})):
        kv = random_packed_kv(B, hkv, T, d, resolve_spec("kvquant-3", **kw))
        ref = decode_attention(q, kv, scale=d ** -0.5, gluon=False, prmt=False)
        for tile in (None, 32):
            for prmt in (True, False):
                args = dict(gluon=False, prmt=prmt, tile_tokens=tile)
                t, err = variant_graph_us(q, kv, ref, **args)
                print(f"  {name:12s} tile={tile} prmt={prmt}: {t:8.1f} us x{tf / t:.2f} "
                      f"diff {err:.1e}", flush=True)
        del kv
        torch.cuda.empty_cache()
