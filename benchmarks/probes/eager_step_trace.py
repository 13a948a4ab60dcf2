"""Where the host time of an eager batch-1 decode step goes, per layer, with torch.profiler's
Python tracer instead of cProfile (which inflates Python-heavy code several times), plus a check
for host-device synchronisations inside the decode steps (GPU machine).

Llama-2-7B's layer shape with fewer layers and random weights, batch 1:

1. TPOT of ``fp16-flash``, ``kvbits-fp16`` and ``kivi-2`` (the per-layer gap is the target);
2. ``torch.cuda.set_sync_debug_mode("warn")`` over a few decode steps of each kvbits variant:
   every synchronising call site, with its count (a sync per layer would serialise host and GPU);
3. a trace of 8 decode steps per variant (CPU + CUDA activities, ``with_stack``), written as a
   gzipped Chrome trace to ``$OUT`` (or ``/tmp``) for ``eager_step_breakdown.py``, and the top
   operators by self CPU time printed here.

    PYTHONPATH=src python3 benchmarks/probes/eager_step_trace.py [CONTEXT] [LAYERS]
"""
import collections
import gzip
import os
import shutil
import sys
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from kvbits.eval.speed import build_model, model_config, parse_variant, time_decode

context = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
out_dir = os.environ.get("OUT", "/tmp")
model = build_model(model_config("llama-2-7b", layers=layers, max_positions=context + 256))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, llama-2-7b x {layers} "
      f"layers, batch 1, {context} tokens", flush=True)
VARIANTS = ("fp16-flash", "kvbits-fp16", "kivi-2")
for name in VARIANTS:
    v = parse_variant(name)
    time_decode(model, v, 1, context, steps=4, warmup=2)  # compile / warm up
    r = time_decode(model, v, 1, context, steps=32, warmup=4)
    print(f"{name:12s} TPOT {r['tpot_ms']:7.2f} ms = {r['tpot_ms'] * 1e3 / layers:6.0f} us per "
          f"layer", flush=True)

# --- 2. synchronising calls during decode (the fill before generate syncs on purpose) ------
for name in VARIANTS[1:]:
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None, sites=sites):
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-2]
                 if "warnings" not in f.filename]
        sites["\n      ".join(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"
                                for f in stack[-6:])] += 1

    old = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        time_decode(model, parse_variant(name), 1, context, steps=4, warmup=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    print(f"\n## {name}: synchronising call sites during fill + 5 decode steps "
          f"({sum(sites.values())} calls)")
    for site, n in sites.most_common(12):
        print(f"  {n:4d}x {site}")

# --- 3. traces --------------------------------------------------------------------------------
for name in VARIANTS:
    v = parse_variant(name)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        time_decode(model, v, 1, context, steps=8, warmup=0)
    path = os.path.join(out_dir, f"eager_trace_{name}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    print(f"\n## {name}: top operators by self CPU time (fill included), trace {path}.gz")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                    max_name_column_width=60))
