"""Probe (GPU): the TMA ring's body kernel with its registers capped (``maxnreg``) against the
uncapped kernel, alternated in one process, CUDA-graph time (median of
``triton.testing.do_bench_cudagraph``, best of three rounds each); whether the outputs are bit
for bit equal (a cap spills, it does not change the arithmetic).

Why (session 28): uncapped, the ring holds ~210 registers per thread at 2 bits, so each
scheduler keeps two one-warp programs and issues ~0.64 instructions per cycle
(``ncu_body_s28.log``: stalls are "wait", "not selected" and "dispatch", not memory). At <= 168
registers three fit per scheduler, and the 2-bit ring's three stages (18.5 KB) let 12 programs
share an SM's shared memory; at 4 bits its two stages (20.5 KB) let 11.

    PYTHONPATH=src python3 benchmarks/probes/tma_maxnreg_ab.py [CAP,...] [B:Hq:Hkv:T:preset,...]
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

caps = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [168]
shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
          for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 32768, "kivi-4"),
    (8, 32, 8, 131072, "kivi-4"), (8, 32, 32, 32768, "kivi-2"), (1, 32, 32, 131072, "kivi-2")]
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: TMA ring body kernel only, CUDA-graph us (best of 3 "
      f"medians), register caps {caps} against none")
for B, hq, hkv, T, preset in shapes:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
    calls, outs, times = {}, {}, {}
    for cap in [0, *caps]:
        out = torch.zeros(B * hq, splits, 128, dtype=torch.float32, device="cuda")
        lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

        def call(cap=cap, out=out, lse=lse, q=q, kv=kv, splits=splits):
            dt.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                           has_starts=False, has_lens=False, n_out=splits, splits=splits,
                           extra={"maxnreg": cap} if cap else None)
        call()
        torch.cuda.synchronize()
        calls[cap], outs[cap], times[cap] = call, (out.clone(), lse.clone()), []
    for _ in range(3):
        for cap, fn in calls.items():
            times[cap].append(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    base = min(times[0]) * 1e3
    line = f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits}: none {base:.1f} us"
    for cap in caps:
        t = min(times[cap]) * 1e3
        same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[cap]))
        line += f", {cap} {t:.1f} us ({(base / t - 1) * 100:+.1f}%, bit-identical: {same})"
    print(line, flush=True)
