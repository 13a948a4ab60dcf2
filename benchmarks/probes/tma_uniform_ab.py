"""Probe (GPU): per-token key scales (the uniform method) and 64-channel value groups through
the TMA ring (``decode_gluon_tma``) against the register body (``decode_gluon``), body kernel
alone, alternated in one process, CUDA-graph time (median of ``do_bench_cudagraph``, best of
three rounds each), on the long Llama rows; the two partial outputs' relative difference.

    PYTHONPATH=src python3 benchmarks/probes/tma_uniform_ab.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import attend_body_fn, body_variants_ab, parse_rows

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt

ROWS = [(8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 131072, "uniform-int4"),
        (8, 32, 32, 32768, "uniform-int4"), (8, 32, 8, 32768, "uniform-int2"),
        (8, 32, 8, 131072, "uniform-int2"), (1, 32, 8, 131072, "uniform-int4")]


def with_mode(mode):
    """The register body (``decode_gluon_tma.MODE`` "0") or the ring ("1")."""
    def fn(*args):
        dt.MODE = mode
        attend_body_fn(dg)(*args)
    return fn


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}: register body vs TMA ring, CUDA-graph us (best of "
          "3 medians); (+x%): the ring faster")
    for row in parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, ROWS):
        kv, splits, us, outs = body_variants_ab(row, {"0": with_mode("0"), "1": with_mode("1")},
                                                sms)
        a, b = us["0"], us["1"]
        err = ((outs["1"][0] - outs["0"][0]).norm() / outs["0"][0].norm()).item()
        B, hq, hkv, T, preset = row
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits} ring eligible="
              f"{dt.eligible(kv, kv.key_axis == 'token')}: register body {a:.1f} us, TMA ring "
              f"{b:.1f} us ({(a / b - 1) * 100:+.1f}%), partials rel diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
