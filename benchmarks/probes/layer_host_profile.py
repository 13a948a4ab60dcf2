"""Where an eager batch-1 decode step of HF ``generate`` spends its host time per layer, FP16
(flash SDPA, DynamicCache) against kvbits presets, on Llama-2-7B's layer shape with fewer layers
and random weights (GPU machine): TPOT per layer, then a cProfile of kivi-2's steps (the kvbits
and Triton functions by cumulative time, then everything by own time).

    PYTHONPATH=src python3 benchmarks/probes/layer_host_profile.py [CONTEXT] [LAYERS]
"""
import cProfile
import pstats
import sys

import torch

from kvbits.eval.speed import build_model, model_config, parse_variant, time_decode

context = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
model = build_model(model_config("llama-2-7b", layers=layers, max_positions=context + 256))
print(f"# {torch.cuda.get_device_name()}, llama-2-7b x {layers} layers, batch 1, {context} tokens")
for name in ("fp16-flash", "kvbits-fp16", "kivi-2", "kivi-4"):
    v = parse_variant(name)
    time_decode(model, v, 1, context, steps=4, warmup=2)  # compile / warm up
    r = time_decode(model, v, 1, context, steps=32, warmup=4)
    print(f"{name:12s} TPOT {r['tpot_ms']:7.2f} ms = {r['tpot_ms'] * 1e3 / layers:6.0f} us per layer",
          flush=True)
v = parse_variant("kivi-2")
prof = cProfile.Profile()
prof.enable()
time_decode(model, v, 1, context, steps=32, warmup=0)
prof.disable()
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(r"kvbits|triton/runtime|transformers/(cache|integrations|masking)", 40)
st.sort_stats("tottime").print_stats(30)
