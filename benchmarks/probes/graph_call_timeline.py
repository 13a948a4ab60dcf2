"""Probe (GPU): where one captured ``decode_attention`` call spends its time. The call is
captured in a CUDA graph and replayed under ``torch.profiler``; each replay's kernels are listed
with their start (relative to the replay's first kernel), duration and stream, so the body, the
FP16 splits (side stream) and the merge, and the gaps between them, can be read off.

    PYTHONPATH=src python3 benchmarks/probes/graph_call_timeline.py [B:Hq:Hkv:T:preset,...]

Random codes (speed does not depend on values). Also prints the replay's median time from
``do_bench`` (with its L2 flush), as the decode table measures it.
"""
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv
from decode_attention import bench_graph, captured

from kvbits.ops import decode_attention
from kvbits.spec import resolve_spec

SHAPES = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
          for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 32768, "uniform-int4"),
    (8, 32, 8, 32768, "kivi-4"), (8, 32, 8, 131072, "kivi-2")]

for B, hq, hkv, T, preset in SHAPES:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")

    def call(q=q, kv=kv):
        return decode_attention(q, kv, scale=0.088)
    us = bench_graph(call)
    graph, _ = captured(call)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    per = len(kernels) // reps
    print(f"== B={B} Hq={hq} Hkv={hkv} T={T} {preset}: graph median {us:.1f} us (do_bench, L2 "
          f"flushed); {per} kernels per replay")
    spans = []
    for r in range(reps):
        ks = kernels[r * per:(r + 1) * per]
        t0 = ks[0].time_range.start
        spans.append(max(k.time_range.end for k in ks) - t0)
        if r == reps - 1:
            for k in ks:
                print(f"   +{k.time_range.start - t0:7.1f} us  {k.time_range.elapsed_us():7.1f} us"
                      f"  {k.name[:70]}")
    print(f"   first kernel start -> last kernel end: median {statistics.median(spans):.1f} us "
          f"(L2 warm)")
    del graph
