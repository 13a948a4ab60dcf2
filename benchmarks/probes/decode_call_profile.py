"""Probe (GPU): host time of one ``decode_attention`` call at batch 1 (where an eager decode step
is bound by it), Gluon body path (Llama-2-7B shape, 32k) and Triton-only path (Llama-3-8B, 4k):
µs per call and a cProfile of each.

    PYTHONPATH=src python3 benchmarks/probes/decode_call_profile.py [B:Hq:Hkv:T:preset,...]
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv  # noqa: E402

from kvbits.ops import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

# SHAPES="B:Hq:Hkv:T:preset,..." overrides the default batch-1 shapes
SHAPES = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
          for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    (1, 32, 32, 32768, "kivi-2"), (1, 32, 8, 4096, "kivi-2"),
    (1, 32, 8, 32768, "kvquant-3-dense-post")]
for B, hq, hkv, T, preset in SHAPES:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")

    def call():
        return decode_attention(q, kv, scale=0.088)
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
        torch.cuda.synchronize()
    synced = (time.perf_counter() - t0) / n * 1e6
    print(f"== B={B} Hq={hq} Hkv={hkv} T={T} {preset}: {host:.1f} us host per call, "
          f"{synced:.1f} us per call with a sync after each", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
