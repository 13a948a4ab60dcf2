"""Probe (GPU): what runs after a one-wave Gluon body in a captured ``decode_attention`` call.

Since session 34 mid-sized grids (64-255 pairs) split into one wave of ring programs that fill
every SM slot, so FP16 splits launched beside the body find no slot until its programs end and
then run in series with it, followed by the finish kernel. The launch orders of session 33
(``side_order_ab.py``) and the inline FP16 part with PDL of sessions 30-31 (``finish_pdl_ab.py``)
were measured before that change. This probe re-times them against it, whole captured calls,
variants alternated (best of 3 ``do_bench`` medians, L2 flushed), with each variant's largest
output difference from the library's:

- ``lib``: the defaults (since session 65, ``INLINE_PDL``: where the finish program merges few
  partials, a one-wave body among them, the ``inline+pdl`` route below; elsewhere ``splits``);
- ``splits``: FP16 splits on the side stream launched after the body, the finish kernel merges
  (the default until this probe);
- ``before``: those splits launched before the body;
- ``serial``: no side stream (splits after the body in stream order);
- ``inline``: the finish kernel attends the FP16 part itself (``FINISH_FP_TOKENS``), no splits;
- ``inline+pdl``: that, launched as a programmatic dependent of the body (Hopper), so its FP16
  part can run while the wave drains;
- ``pdl``: the FP16 splits as in ``splits``, the finish kernel a programmatic dependent.

    PYTHONPATH=src python3 benchmarks/probes/tail_ab.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import parse_rows, random_packed_kv
from decode_attention import ab_cells, captured_ab

from kvbits.kernels import decode_attention as da
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 32768, "kivi-4"),
    (8, 32, 8, 131072, "uniform-int4"), (16, 32, 8, 32768, "uniform-int4"),
    (1, 32, 8, 131072, "kivi-2"), (32, 32, 8, 32768, "kivi-2")])
VARIANTS = {  # SIDE_STREAM, SIDE_AFTER_BODY, FINISH_FP_TOKENS, PDL_ENABLED, INLINE_PDL
    "lib": (da.SIDE_STREAM, da.SIDE_AFTER_BODY, da.FINISH_FP_TOKENS, da.PDL_ENABLED,
            da.INLINE_PDL),
    "splits": (True, True, None, False, False), "before": (True, False, None, False, False),
    "serial": (False, True, None, False, False), "inline": (True, True, 256, False, False),
    "inline+pdl": (True, True, 256, True, False), "pdl": (True, True, None, True, False)}

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; graph us (best of 3 "
      "do_bench medians, variants alternated); diff = max |out - out(lib)|", flush=True)
for B, hq, hkv, T, preset in ROWS:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")

    def variant(side, after, fp_tokens, pdl, dep_finish, kv=kv, q=q):
        def fn():
            da.SIDE_STREAM, da.SIDE_AFTER_BODY = side, after
            da.FINISH_FP_TOKENS, da.PDL_ENABLED, da.INLINE_PDL = fp_tokens, pdl, dep_finish
            return da.decode_attention(q, kv, scale=0.088)
        return fn
    us, outs = captured_ab({name: variant(*v) for name, v in VARIANTS.items()})
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset}: {ab_cells(us, outs, 'lib')}",
          flush=True)
