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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import LONG_ROWS, attend_body_fn, body_variants_ab, parse_rows

from kvbits.kernels import decode_gluon_tma as dt

VARIANTS = {  # name: (SKEW, BRANCHLESS, stages at 2 bits, stages at 4 bits)
    "plain": (False, False, 3, 2), "branchless": (False, True, 3, 2),
    "skew": (True, False, 3, 3), "skew+branchless": (True, True, 3, 3)}


def with_shape(skew, branchless, ns2, ns4):
    def fn(*args):
        dt.SKEW, dt.BRANCHLESS = skew, branchless
        dt.STAGES[2], dt.STAGES[4] = ns2, ns4
        attend_body_fn(dt)(*args)
    return fn


dt.MODE = "1"
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: TMA ring body kernel by loop shape, CUDA-graph us "
      "(best of 3 medians); in brackets: partial outputs' relative difference to plain")
for row in parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, LONG_ROWS):
    _, _, us, outs = body_variants_ab(
        row, {name: with_shape(*v) for name, v in VARIANTS.items()}, sms)
    plain = outs["plain"][0]
    cells = []
    for name in VARIANTS:
        err = ((outs[name][0] - plain).norm() / plain.norm()).item()
        cells.append(f"{name} {us[name]:.1f} us ({(us['plain'] / us[name] - 1) * 100:+.1f}%) "
                     f"[{err:.0e}]")
    B, hq, hkv, T, preset = row
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset}: " + ", ".join(cells), flush=True)
