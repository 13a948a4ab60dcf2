"""Probe (GPU): launch knobs of the Triton decode kernel at head dims the Gluon body does not
serve (96: Phi-3-mini, 256: Gemma-2-9B), where the session-15 table of unseen shapes
(decode_attention_other_models.md) had kivi-2/kivi-4 below FP16 flash SDPA. Prints, per shape
and preset, each (num_warps, tile_tokens, splits x) against flash SDPA in CUDA-graph time.

    PYTHONPATH=src python3 benchmarks/probes/tune_head_dims.py > tune.log
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv  # noqa: E402
from decode_attention import ALL_MODELS, flash_graph_us, variant_graph_us  # noqa: E402

from kvbits.kernels.decode_attention import _sm_count, decode_attention, num_splits  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

GRID = [(4, None), (8, None), (4, 64), (8, 64), (2, 64)]  # (warps, tile)
SPLIT_X = [1, 2]  # times the library's split count
SHAPES = [("gemma-2-9b", 8), ("phi-3-mini", 1), ("gemma-2-9b", 1), ("phi-3-mini", 8)]
T = 32768
for preset in ("kivi-2", "kivi-4", "kivi-3"):
    for model, B in SHAPES:
        hq, hkv, d = ALL_MODELS[model]
        q, tf = flash_graph_us(B, hq, hkv, T, d)
        kv = random_packed_kv(B, hkv, T, d, resolve_spec(preset))
        ref = decode_attention(q, kv, scale=d ** -0.5, gluon=False)
        print(f"{preset} {model} B={B}: flash {tf:.1f} us", flush=True)
        G = kv.group_size
        for warps, tile in GRID:
            tl_ = tile or (128 if d <= 128 else 64)
            m_tiles = -(-(hq // hkv) // 64) if hq // hkv > 64 else 1
            base = num_splits(B * hkv * m_tiles, -(-(kv.body_len // G) // max(1, tl_ // G)),
                              _sm_count(q.device))
            for sx in SPLIT_X:
                sp = max(1, int(base * sx))
                kw = dict(num_warps=warps, tile_tokens=tile, splits=sp, gluon=False)
                try:
                    t, err = variant_graph_us(q, kv, ref, **kw)
                except Exception as e:  # noqa: BLE001
                    print(f"   warps={warps} tile={tile} splits={sp}: {type(e).__name__}: "
                          f"{str(e)[:100]}", flush=True)
                    continue
                print(f"   warps={warps} tile={tl_} splits={sp} ({sx}x): {t:8.1f} us "
                      f"x{tf / t:.2f}  diff {err:.1e}", flush=True)
        del kv
        torch.cuda.empty_cache()
