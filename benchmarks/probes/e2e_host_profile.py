"""Where a batch-1 decode step of HF ``generate`` spends its host time, per cache variant
(FP16 DynamicCache vs kvbits), on SmolLM2's shape with random weights (GPU machine).

    PYTHONPATH=src python3 benchmarks/probes/e2e_host_profile.py [VARIANT ...]
"""
import sys

from torch.profiler import ProfilerActivity, profile

from kvbits.eval.speed import build_model, model_config, parse_variant, time_decode

model = build_model(model_config("smollm2", max_positions=2048))
for name in sys.argv[1:] or ["fp16", "kivi-2"]:
    v = parse_variant(name)
    time_decode(model, v, 1, 1024, steps=4, warmup=1)  # compile / warm up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = time_decode(model, v, 1, 1024, steps=8, warmup=1)
    print(f"\n=== {name}: TPOT {r['tpot_ms']:.1f} ms (under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
