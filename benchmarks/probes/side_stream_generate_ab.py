"""Probe (GPU): does the captured side stream (FP16 splits beside the Gluon body, a fork and a
join per layer) cost time in a whole model's graph at batch 1? kivi-2 through graph_generate
with ``decode_attention.SIDE_STREAM`` on and off, alternated, time per token from calls of 24
and 120 new tokens; the kvbits FP16 cache as the control. Llama-3-8B shape, 8 layers. (Only
the A/B is fair: for kivi-2 the longer call alone captures the flushing step's graph, so its
row against the FP16 one is biased up; see generate_graphs.py.)

    PYTHONPATH=src python3 benchmarks/probes/side_stream_generate_ab.py [CONTEXT]
"""
import sys
import time

import torch

from kvbits.eval.speed import build_model, model_config
from kvbits.integrations import KVBitsCache, graph_generate
from kvbits.integrations.hf import cache_kwargs
from kvbits.kernels import decode_attention as da

T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
model = build_model(model_config("llama-3-8b", layers=8, max_positions=T + 200))
model.generation_config.eos_token_id = None
ids = torch.randint(100, 20000, (1, T), device="cuda")


def call(preset, new):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       do_sample=False, pad_token_id=0, custom_generate=graph_generate,
                       **cache_kwargs(model, KVBitsCache(model, preset)))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


print(f"# {torch.cuda.get_device_name()}, llama-3-8b x 8 layers, batch 1, {T} tokens", flush=True)
res = {}
for rep in range(3):
    for label, preset, side in (("kivi-2 side", "kivi-2", True), ("kivi-2 inline", "kivi-2", False),
                                ("fp16", "fp16", True)):
        da.SIDE_STREAM = side
        if rep == 0:
            call(preset, 4)
        tpot = (call(preset, 120) - call(preset, 24)) / 96 * 1e3
        res.setdefault(label, []).append(tpot)
for k, v in res.items():
    print(f"{k:14s} ms/token {' '.join(f'{x:.3f}' for x in v)}  best {min(v):.3f}", flush=True)
