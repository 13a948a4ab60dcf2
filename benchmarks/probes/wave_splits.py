"""Probe (GPU): the Gluon body's split count as whole waves of resident programs.

The library's rule (``decode_gluon.body_splits``) gives 32 or 48 one-warp programs per SM from
64 (sequence, KV head) pairs up: at Llama-3-8B batch 8 32k that is 64 pairs x 64 splits = 4096
programs of 8 steps, ~3.9 waves of the ~8 programs an SM holds (registers: two ~200-register
warps per scheduler). Programs that start one after another also end one after another, and the
last ones run with the SM part empty (the drain). One wave of longer programs (16 splits: 1024
programs of 32 steps, all starting together) drains little, merges fewer partials, pays fewer
prologues, but leaves ~3% of the slots empty. This probe times whole captured
``decode_attention`` calls (the library's graph path: side-stream FP16 splits, body, finish)
at split counts of 1-4 whole waves (``floor(w * r * SMs / pairs)`` for ``r`` resident programs
per SM) against ``lib``, ``decode_gluon.body_splits``' rule (the library's for every grid until this probe; since then mid-sized grids served by the ring take ``1w/8`` where
a program runs <= 64 steps, ``decode_gluon_tma.one_wave_splits``), variants alternated, best of 3 ``do_bench`` medians; and
checks every variant's output against the rule's.

    PYTHONPATH=src python3 benchmarks/probes/wave_splits.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import parse_rows, random_packed_kv
from decode_attention import captured_ab

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 32768, "kivi-4"), (8, 32, 8, 32768, "uniform-int4"),
    (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 131072, "kivi-4"),
    (16, 32, 8, 32768, "kivi-2"), (8, 32, 32, 32768, "kivi-2"), (32, 32, 8, 32768, "kivi-4"),
    (8, 28, 4, 65536, "kivi-2"), (4, 32, 8, 65536, "kivi-2"), (1, 32, 8, 131072, "kivi-2")])
SMS = torch.cuda.get_device_properties(0).multi_processor_count
RESIDENT = (8, 9)  # one-warp programs per SM: two per scheduler at ~200 registers; 9 if it fits

print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {SMS} SMs; graph us of the "
      "whole call (best of 3 do_bench medians, variants alternated); splits = per (sequence, KV "
      "head) pair after split_count; diff = max |out - out(lib)|", flush=True)
for B, hq, hkv, T, preset in ROWS:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    pairs = B * hkv
    lib = dg.split_count(kv.body_len, dg.body_splits(pairs, kv.body_len, SMS))
    counts = {"lib": lib}
    for r in RESIDENT:
        for w in (1, 2, 3, 4):
            n = dg.split_count(kv.body_len, max(1, w * r * SMS // pairs))
            counts.setdefault(f"{w}w/{r}", n)
    variants, seen = {}, set()
    for name, n in counts.items():
        if n not in seen:
            seen.add(n)
            variants[name] = n
    us, outs = captured_ab({
        name: lambda n=n, kv=kv, q=q: decode_attention(q, kv, scale=0.088, splits=n)
        for name, n in variants.items()})
    base = us["lib"]
    cells = "  ".join(
        f"{n}={variants[n]}x{pairs}={variants[n] * pairs}: {t:7.1f} ({t / base - 1:+.1%}, diff "
        f"{(outs[n] - outs['lib']).abs().max().item():.0e})" for n, t in us.items())
    best = min(us, key=us.get)
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} ({kv.body_len // 64} steps): {cells}  "
          f"best {best}", flush=True)
    del kv
    torch.cuda.empty_cache()
