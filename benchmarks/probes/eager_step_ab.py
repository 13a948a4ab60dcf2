"""Probe (GPU): eager HF ``generate`` time per output token with kvbits' FastLaunch off and on,
against FP16 (flash SDPA, DynamicCache), alternated in one process (the host's load drifts):
Llama-2/3-shaped layers with random weights, batch 1, a few layers, median TPOT of each variant
over ``ROUNDS`` rounds.

    PYTHONPATH=src python3 benchmarks/probes/eager_step_ab.py [MODEL] [CONTEXT] [LAYERS] [ROUNDS]
"""
import statistics
import sys

import torch

from kvbits.eval.speed import build_model, model_config, parse_variant, time_decode
from kvbits.kernels import launch

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
context = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 8
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
model = build_model(model_config(name, layers=layers, max_positions=context + 256))
print(f"# {torch.cuda.get_device_name()}, {name} x {layers} layers, batch 1, {context} tokens, "
      f"eager HF generate, median of {rounds} rounds of 32 steps", flush=True)
runs = [("fp16-flash", True), ("kivi-2", False), ("kivi-2", True), ("kivi-4", False),
        ("kivi-4", True)]
tpot = {run: [] for run in runs}
for variant, _ in runs:  # compile / warm up
    time_decode(model, parse_variant(variant), 1, context, steps=4, warmup=2)
for _ in range(rounds):
    for variant, fast in runs:
        launch.ENABLED = fast
        r = time_decode(model, parse_variant(variant), 1, context, steps=32, warmup=4)
        tpot[(variant, fast)].append(r["tpot_ms"])
for (variant, fast), ts in tpot.items():
    med = statistics.median(ts)
    label = variant if variant.startswith("fp16") else f"{variant} FastLaunch {'on' if fast else 'off'}"
    print(f"{label:24s} TPOT {med:7.2f} ms = {med * 1e3 / layers:6.0f} us per layer "
          f"(rounds: {', '.join(f'{t:.2f}' for t in ts)})", flush=True)
