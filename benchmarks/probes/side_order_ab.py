"""Probe (GPU): how a captured ``decode_attention`` call with a Gluon body should launch its
FP16 splits: on the side stream before the body's launch, after it (the default since this probe), either
at high stream priority (the probe makes such a stream itself), or in stream order after the
body (no side stream). KVQuant layers (codebooks) always launch before since this probe's
second run, so their "after" rows now time the "before" order. Graph time: the
best of 3 ``do_bench`` medians (L2 flushed) of each variant's replay, variants alternated; and
the largest difference of each variant's output from the default's.

    PYTHONPATH=src python3 benchmarks/probes/side_order_ab.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import parse_rows, random_packed_kv
from decode_attention import ab_cells, captured_ab

from kvbits.kernels import decode_attention as da
from kvbits.ops import decode_attention
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 32768, "kivi-4"),
    (1, 32, 8, 32768, "kivi-2"), (8, 32, 32, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"),
    (32, 32, 8, 32768, "kivi-2")])
VARIANTS = {  # (SIDE_STREAM, SIDE_AFTER_BODY, stream priority)
    "before": (True, False, 0), "after": (True, True, 0), "before+prio": (True, False, -1),
    "after+prio": (True, True, -1), "serial": (False, False, 0)}

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; graph us (best of 3 "
      "do_bench medians, variants alternated); diff = max |out - out(before)|")


streams: dict = {}
for B, hq, hkv, T, preset in ROWS:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    def variant(side, after, prio, kv=kv, q=q):  # streams made here, never inside a capture
        stream = streams[prio] if prio in streams else streams.setdefault(
            prio, torch.cuda.Stream(priority=prio))

        def fn():
            da.SIDE_STREAM, da.SIDE_AFTER_BODY = side, after
            da._SIDE_STREAMS[torch.cuda.current_device()] = stream
            return decode_attention(q, kv, scale=0.088)
        return fn
    us, outs = captured_ab({name: variant(*v) for name, v in VARIANTS.items()})
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset}: {ab_cells(us, outs, 'before')}",
          flush=True)
