"""Probe (GPU): the TMA ring's body kernel against an older copy of its module, alternated in
one process, CUDA-graph time (median of ``triton.testing.do_bench_cudagraph``, best of three
rounds each), on the long Llama rows; whether the outputs are bit for bit equal. Session 26: key
scale rows once each against the session-25 ring (``tma_keyscale_ab_s26.log``); session 28: the
scale rows interleaved by 16-byte chunks (``key_scale_tile``, ``value_scale_tile``) against
session 27's.

    PYTHONPATH=src python3 benchmarks/probes/tma_ring_ab.py OLD_MODULE.py [B:Hq:Hkv:T:preset,...]

OLD_MODULE.py: the previous ``kvbits/kernels/decode_gluon_tma.py`` (``git show
<commit>:src/kvbits/kernels/decode_gluon_tma.py``), loaded as a sibling module.
"""
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import LONG_ROWS, attend_body_fn, body_variants_ab, parse_rows

from kvbits.kernels import decode_gluon_tma as new

spec = importlib.util.spec_from_file_location("kvbits.kernels.decode_gluon_tma_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: body kernel only, CUDA-graph us (best of 3 medians)")
for row in parse_rows(sys.argv[2] if len(sys.argv) > 2 else None, LONG_ROWS[:6]):
    _, splits, us, outs = body_variants_ab(
        row, {"old": attend_body_fn(old), "new": attend_body_fn(new)}, sms)
    same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
    o, n = us["old"], us["new"]
    B, hq, hkv, T, preset = row
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits}: old {o:.1f} us, new {n:.1f} "
          f"us ({(o / n - 1) * 100:+.1f}%), outputs bit-identical: {same}", flush=True)
