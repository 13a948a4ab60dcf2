"""Probe (GPU): the TMA ring with the key-scale fold (``decode_gluon_tma.FOLD = "1"``) against
the dequantizing ring (``"0"``), the body kernel alone, alternated in one process, CUDA-graph
time (median of ``triton.testing.do_bench_cudagraph``, best of three rounds each), on the long
Llama rows; how far apart the two partial outputs are (they round differently).

    git checkout 5c61ffb -- src tests && git apply benchmarks/probes/tma_key_scale_fold_s29.patch  # the fold was not kept
    PYTHONPATH=src python3 benchmarks/probes/tma_fold_ab.py [B:Hq:Hkv:T:preset,...]

Session 29: 1-5% slower on every row (``benchmarks/results/tma_key_scale_fold_s29.log``).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import LONG_ROWS, attend_body_fn, body_variants_ab, parse_rows

from kvbits.kernels import decode_gluon_tma as dt


def with_fold(fold):
    def fn(*args):
        dt.FOLD = fold
        attend_body_fn(dt)(*args)
    return fn


dt.MODE = "1"
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: TMA ring body kernel, dequantizing (fold 0) vs key-"
      "scale fold (fold 1), CUDA-graph us (best of 3 medians)")
for row in parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, LONG_ROWS):
    kv, splits, us, outs = body_variants_ab(row, {"0": with_fold("0"), "1": with_fold("1")}, sms)
    o0, o1 = outs["0"][0], outs["1"][0]
    err = ((o1 - o0).norm() / o0.norm()).item()
    lse_err = (outs["1"][1] - outs["0"][1]).abs().max().item()
    a, b = us["0"], us["1"]
    B, hq, hkv, T, preset = row
    folds = dt.fold_applies(kv.group_size, hq // hkv, 1)
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits} fold={folds}: "
          f"dequantizing {a:.1f} us, fold {b:.1f} us ({(a / b - 1) * 100:+.1f}%), "
          f"partials rel diff {err:.2e}, lse max diff {lse_err:.2e}", flush=True)
