"""Probe (GPU): at head dims 96 / 256 (decode_gluon.EXTRA_HEAD_DIMS), where does the Gluon body
beat the Triton kernel at small batches? decode_gluon.serves sends steps under MIN_BODY_TOKENS
body tokens x pairs to the Triton kernel, a limit measured at head dims 64 / 128 only. Prints, per
shape and preset, flash SDPA, the Gluon body (forced) and the Triton kernel, in CUDA-graph time.

    PYTHONPATH=src python3 benchmarks/probes/small_batch_extra_dims.py > small_batch_extra_dims.log
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv  # noqa: E402
from decode_attention import ALL_MODELS, bench_graph, flash_graph_us  # noqa: E402

from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

for model in ("gemma-2-9b", "phi-3-mini"):
    hq, hkv, d = ALL_MODELS[model]
    for B, T in ((1, 4096), (1, 32768), (1, 131072), (2, 32768), (4, 32768)):
        q, tf = flash_graph_us(B, hq, hkv, T, d)
        for preset in ("kivi-2", "kivi-4"):
            kv = random_packed_kv(B, hkv, T, d, resolve_spec(preset))
            tg = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, gluon=True))
            tt = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, gluon=False))
            ta = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5))
            print(f"{model} B={B} T={T} pairs x body={B * hkv * kv.body_len} {preset}: flash "
                  f"{tf:.1f} us, gluon {tg:.1f} ({tf / tg:.2f}x), triton {tt:.1f} ({tf / tt:.2f}x),"
                  f" default {ta:.1f}", flush=True)
            kv = None  # (freed)
