"""Probe (GPU): transformers' eager ``generate()`` at batch 1 with each layer's decode step
replayed from CUDA graphs (``KVBitsCache``'s default on CUDA, :mod:`kvbits.integrations.
step_graphs`) against the same steps launched eagerly (``+eager-steps``) and FP16 flash SDPA,
alternated in one process (the host's speed drifts by +-30% between runs): median TPOT of each
variant over the repetitions.

    PYTHONPATH=src python3 benchmarks/probes/step_graphs_ab.py MODEL CONTEXTS REPS [BATCH]
"""
import statistics
import sys
import time

import torch

from kvbits.eval.speed import build_model, model_config, parse_variant, time_decode

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
contexts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "4096,32768").split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
batch = int(sys.argv[4]) if len(sys.argv) > 4 else 1
variants = ["fp16-flash", "kivi-2", "kivi-2+eager-steps", "kivi-4", "kivi-4+eager-steps"]
t0 = time.perf_counter()
model = build_model(model_config(name, max_positions=max(contexts) + 256))
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {name} (random weights), "
      f"batch {batch}, built in {time.perf_counter() - t0:.0f} s; TPOT ms per repetition",
      flush=True)
for ctx in contexts:
    tpot = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            r = time_decode(model, parse_variant(v), batch, ctx, steps=32, warmup=4)
            tpot[v].append(r["tpot_ms"])
    base = statistics.median(tpot["fp16-flash"])
    for v in variants:
        med = statistics.median(tpot[v])
        print(f"{name} ctx {ctx:6d} {v:20s} median TPOT {med:7.2f} ms ({base / med:4.2f}x "
              f"fp16-flash)  runs {' '.join(f'{t:.2f}' for t in tpot[v])}", flush=True)
