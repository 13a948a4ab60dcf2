"""Probe (GPU): the TMA ring with per-token key scales (the uniform method) folded out of the
key operands (``decode_gluon_tma.KEY_FOLD`` "1": raw magic-number codes into the MMA, the
scale, zero and 1024 offset applied per score row in float32) against dequantizing them in the
operands ("0"), body kernel alone, alternated in one process, CUDA-graph time (best of three
``do_bench_cudagraph`` medians); the two partial outputs' relative difference.

    PYTHONPATH=src python3 benchmarks/probes/tma_key_fold_ab.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import attend_body_fn, body_variants_ab, parse_rows

from kvbits.kernels import decode_gluon_tma as dt

ROWS = [(8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 131072, "uniform-int4"),
        (8, 32, 32, 32768, "uniform-int4"), (32, 32, 8, 32768, "uniform-int4"),
        (1, 32, 8, 131072, "uniform-int4"), (8, 32, 8, 32768, "uniform-int2"),
        (8, 32, 8, 131072, "uniform-int2"), (8, 32, 32, 32768, "uniform-int2")]


def with_fold(fold):
    def fn(*args):
        dt.MODE = "1"
        dt.KEY_FOLD = fold
        attend_body_fn(dt)(*args)
    return fn


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}: TMA ring, per-token key scales dequantized in the "
          "operands (0) vs folded out of them (1), CUDA-graph us (best of 3 medians); (+x%): "
          "the fold faster")
    for row in parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, ROWS):
        _kv, splits, us, outs = body_variants_ab(row, {"0": with_fold("0"), "1": with_fold("1")},
                                                 sms)
        a, b = us["0"], us["1"]
        o0, l0 = outs["0"]
        o1, l1 = outs["1"]
        err = ((o1 - o0).norm() / o0.norm()).item()
        lerr = (l1 - l0).abs().max().item()
        B, hq, hkv, T, preset = row
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits}: dequantized {a:.1f} us, "
              f"folded {b:.1f} us ({(a / b - 1) * 100:+.1f}%), partials rel diff {err:.1e}, "
              f"lse max diff {lerr:.1e}", flush=True)


if __name__ == "__main__":
    main()
