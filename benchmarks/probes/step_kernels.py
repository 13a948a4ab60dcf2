"""Where a batch-1 decode step's GPU time goes: kernels per step and their summed durations by
kind (matrix products, kvbits attention/cache, inductor-fused, other elementwise), for an FP16
KVBitsCache and kivi-2, with and without ``GreedyDecoder(fuse="inductor")``.

    PYTHONPATH=src python3 benchmarks/probes/step_kernels.py [--model llama-2-7b] [--context 4096]
        [--layers N] [--graphs] [--no-fuse]

Steps run eagerly under ``torch.profiler``, from the third on (the decode loop's one-time setup
copies the cache into buffers sized for the run; kernel durations, not the launch gaps a CUDA graph
replay still has: those are ~1-2 us per kernel, so the kernel count matters as much).
``--graphs``: the steps replayed from CUDA graphs instead (profiled from the sixth step, after
the plain step's capture; a flushing step met for the first time in the window runs eagerly;
the kernels of a replay are recorded one by one), whose attention takes the
captured routes (the TMA ring, the FP16 splits on a side stream), not the eager ones.
Random weights and random K/V (speed does not depend on them).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kvbits.eval.cachefill import fill_random
from kvbits.eval.speed import build_model, model_config
from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.hf import KVBitsCache


def kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemv", "gemm", "cutlass", "xmma", "cublas", "splitk", "nvjet")):
        return "matmul"
    if any(s in n for s in ("_decode_kernel", "_finish_kernel", "_quantize_", "_body", "gluon")):
        return "kvbits"
    if n.startswith("triton_"):
        return "inductor"
    return "elementwise/other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--no-fuse", action="store_true")
    args = ap.parse_args()
    cfg = model_config(args.model, layers=args.layers, max_positions=args.context + 64)
    model = build_model(cfg)
    D = cfg.hidden_size // cfg.num_attention_heads
    first_profiled = 6 if args.graphs else 2
    for preset in ("fp16", "kivi-2"):
        for fuse in (None,) if args.no_fuse else (None, "inductor"):
            runs = []
            for _ in range(2):  # the first run compiles (fuse) and warms the kernels
                cache = KVBitsCache(model, preset)
                fill_random(cache, cfg.num_hidden_layers, 1, cfg.num_key_value_heads, D,
                            args.context)
                first = torch.ones(1, 1, dtype=torch.long, device="cuda")
                prof = profile(activities=[ProfilerActivity.CUDA])

                def start(done, prof=prof):  # after step 2: not the one-time setup of
                    if done == first_profiled:  # begin_device_lengths (buffers sized for the
                        torch.cuda.synchronize()  # run); with graphs, after the captures
                        prof.start()
                dec = GreedyDecoder(model, cache, graphs=args.graphs, fuse=fuse, step_done=start)
                torch.cuda.synchronize()
                dec.decode(first, args.context, args.steps + first_profiled)
                torch.cuda.synchronize()
                prof.stop()
                runs.append(prof)
            count, us = collections.Counter(), collections.Counter()
            top = collections.Counter()
            for ev in runs[-1].events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    k = kind(ev.name)
                    count[k] += 1
                    us[k] += ev.device_time
                    top[ev.name[:60]] += ev.device_time
            s = args.steps
            total = sum(us.values()) / s
            print(f"{args.model} x {cfg.num_hidden_layers} layers ctx {args.context} "
                  f"{preset:6s} fuse={fuse} graphs={args.graphs}: "
                  f"{sum(count.values()) / s:.0f} kernels/step, {total:.0f} us kernel time/step")
            for k in sorted(count):
                print(f"    {k:18s} {count[k] / s:6.1f} kernels  {us[k] / s:8.1f} us")
            for name, t in top.most_common(10):
                print(f"      {t / s:8.1f} us  {name}")
            del cache, dec
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
