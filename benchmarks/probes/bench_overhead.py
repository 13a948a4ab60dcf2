"""Probe (GPU): what a ``do_bench`` median of a replayed decode call holds besides its kernels.

Session 64's timeline of the missed uniform-int4 row (Llama-3-8B batch 8 32k, H200) had the
body kernel at 80.5 us and first kernel start -> last kernel end at 88.0 us with L2 warm, while
``do_bench`` (which zeroes a 256 MB buffer before every replay to flush L2) gave 97.7 us. This
probe times the same captured calls, FP16 flash SDPA beside them, four ways, each the median of
``REPS`` replays between CUDA events:

- ``do_bench``: ``triton.testing.do_bench`` (the decode table's number);
- ``zero``: events around the replay after the same 256 MB ``zero_`` (do_bench by hand);
- ``read``: after a 256 MB read instead (``sum``: L2 refilled with clean lines, nothing to
  write back when the call's reads evict them);
- ``warm``: no flush at all;

and, under the ``zero`` flush, the profiler's view: the gap from the flush kernel's end to the
call's first kernel, the span of the call's kernels, and its longest kernel. Last, a ceiling:
``common.read_graph_us`` of as many bytes as the call must read (``packed_nbytes``, and the FP16
K and V for SDPA's bytes: the faster of ``torch.sum`` and a Triton read loop, captured and timed
by ``do_bench``), so ``sdpa do_bench / read(ours)`` bounds the speedup any kernel reading those
bytes could show in the decode table. (The first runs, sessions 64-65, timed ``torch.sum`` into
an int64 alone, which reads at a fraction of the copy bandwidth: their ceiling column is void.)

    PYTHONPATH=src python3 benchmarks/probes/bench_overhead.py [B:Hq:Hkv:T:preset,...]
"""
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import packed_nbytes, parse_rows, random_packed_kv, read_graph_us
from decode_attention import bench, bench_graph, captured, sdpa_fp16

from kvbits.ops import decode_attention
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 32768, "kivi-2"),
    (8, 32, 8, 131072, "uniform-int4"), (8, 32, 32, 32768, "uniform-int4")])
REPS = 60
FLUSH = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
SINK = torch.empty((), dtype=torch.int64, device="cuda")


def flush(kind: str) -> None:
    if kind == "zero":
        FLUSH.zero_()
    elif kind == "read":
        torch.sum(FLUSH, dim=0, dtype=torch.int64, out=SINK)


def timed(replay, kind: str) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for i in range(REPS):
        flush(kind)
        starts[i].record()
        replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def profiled(replay, reps: int = 10) -> tuple[float, float, float]:
    """Median (flush end -> first kernel, first kernel -> last kernel end, longest kernel)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            FLUSH.zero_()
            replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    def is_flush(e):  # the 256 MB fill (~60 us); a call's own small fills are not flushes
        return "fill" in e.name.lower() and e.time_range.elapsed_us() > 20

    gaps, spans, longest, i = [], [], [], 0
    while i < len(kernels):
        if not is_flush(kernels[i]):
            i += 1
            continue
        flush_end, j = kernels[i].time_range.end, i + 1
        call = []
        while j < len(kernels) and not is_flush(kernels[j]):
            call.append(kernels[j])
            j += 1
        if call:
            gaps.append(call[0].time_range.start - flush_end)
            spans.append(max(k.time_range.end for k in call) - call[0].time_range.start)
            longest.append(max(k.time_range.elapsed_us() for k in call))
        i = j
    return statistics.median(gaps), statistics.median(spans), statistics.median(longest)


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us, medians of {REPS} "
      "replays (do_bench: its own median); profiler under the zero flush: gap = flush end -> "
      "first kernel, span = first kernel -> last kernel end, longest = longest kernel",
      flush=True)
for B, hq, hkv, T, preset in ROWS:
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(B, hkv, T, 128, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    calls = {"sdpa flash": lambda q=q, k=k, v=v: sdpa_fp16(q, k, v, 0.088)}
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    calls[preset] = lambda q=q, kv=kv: decode_attention(q, kv, scale=0.088)
    rows = {}
    for name, fn in calls.items():
        graph, _ = captured(fn)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        row = {"do_bench": bench(graph.replay)}
        for kind in ("zero", "read", "warm"):
            row[kind] = timed(graph.replay, kind)
        row["gap"], row["span"], row["longest"] = profiled(graph.replay)
        rows[name] = row
        del graph
    rows["sdpa flash"]["ceiling"] = read_graph_us(k.numel() * 2 * 2, bench_graph)
    rows[preset]["ceiling"] = read_graph_us(packed_nbytes(kv), bench_graph)
    base = rows["sdpa flash"]
    for name, row in rows.items():
        cells = "  ".join(f"{key} {val:7.1f}" for key, val in row.items())
        ratio = "  ".join(f"x{base[key] / row[key]:.2f} {key}"
                          for key in ("do_bench", "zero", "read", "warm", "span"))
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {name:>12}: {cells}   [{ratio}]", flush=True)
    print(f"   ceiling: sdpa do_bench / read of {preset}'s bytes = "
          f"x{base['do_bench'] / rows[preset]['ceiling']:.2f} (measured x"
          f"{base['do_bench'] / rows[preset]['do_bench']:.2f})", flush=True)
    del calls, k, v, kv
    torch.cuda.empty_cache()
