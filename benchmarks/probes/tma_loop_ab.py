"""Probe (GPU): loop shapes of the TMA ring's body kernel, alternated in one process, CUDA-graph
time (median of ``triton.testing.do_bench_cudagraph``, best of three rounds each), on the long
Llama rows, with each variant's partial output against the plain loop's (they must agree to
rounding: every variant does the same arithmetic): ``decode_gluon_tma.BRANCHLESS`` (mask every
step: one basic block per step), ``SKEW`` (step s + 1's scores beside step s's softmax and
values), and ``STAGES`` (ring depth).

    git checkout 5c61ffb -- src tests && git apply benchmarks/probes/tma_loop_shapes_s29.patch  # the switches were not kept
    PYTHONPATH=src python3 benchmarks/probes/tma_loop_ab.py [B:Hq:Hkv:T:preset,...]

Session 29: every variant slower than the plain loop (``benchmarks/results/tma_loop_shapes_s29.log``).
"""
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt
from kvbits.spec import resolve_spec

VARIANTS = {  # name: (SKEW, BRANCHLESS, stages at 2 bits, stages at 4 bits)
    "plain": (False, False, 3, 2), "branchless": (False, True, 3, 2),
    "skew": (True, False, 3, 3), "skew+branchless": (True, True, 3, 3)}
shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
          for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 32768, "kivi-4"),
    (8, 32, 8, 131072, "kivi-4"), (8, 32, 32, 32768, "kivi-2"), (8, 32, 32, 32768, "kivi-4"),
    (1, 32, 8, 131072, "kivi-2"), (32, 32, 8, 32768, "kivi-2")]
dt.MODE = "1"
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: TMA ring body kernel by loop shape, CUDA-graph us "
      "(best of 3 medians); in brackets: partial outputs' relative difference to plain")
for B, hq, hkv, T, preset in shapes:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
    res, outs = {}, {}
    for name, (skew, branchless, ns2, ns4) in VARIANTS.items():
        out = torch.zeros(B * hq, splits, 128, dtype=torch.float32, device="cuda")
        lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

        def call(skew=skew, branchless=branchless, ns=(ns2, ns4), out=out, lse=lse, q=q, kv=kv,
                 splits=splits):
            dt.SKEW, dt.BRANCHLESS = skew, branchless
            dt.STAGES[2], dt.STAGES[4] = ns
            dt.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                           has_starts=False, has_lens=False, n_out=splits, splits=splits)
        call()
        torch.cuda.synchronize()
        outs[name] = out.clone()
        res[name] = (call, [])
    for _ in range(3):
        for name in VARIANTS:
            res[name][1].append(do_bench_cudagraph(res[name][0], rep=100, return_mode="median"))
    base = min(res["plain"][1])
    row = []
    for name in VARIANTS:
        t = min(res[name][1])
        err = ((outs[name] - outs["plain"]).norm() / outs["plain"].norm()).item()
        row.append(f"{name} {t * 1e3:.1f} us ({(base / t - 1) * 100:+.1f}%) [{err:.0e}]")
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset}: " + ", ".join(row), flush=True)
