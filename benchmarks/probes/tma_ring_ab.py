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
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as new
from kvbits.spec import resolve_spec

spec = importlib.util.spec_from_file_location("kvbits.kernels.decode_gluon_tma_old", sys.argv[1])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
          for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 32768, "kivi-4"),
    (8, 32, 8, 131072, "kivi-4"), (8, 32, 32, 32768, "kivi-2"), (8, 32, 32, 32768, "kivi-4")]
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: body kernel only, CUDA-graph us (best of 3 medians)")
for B, hq, hkv, T, preset in shapes:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
    res = {}
    outs = {}
    for name, mod in (("old", old), ("new", new)):
        out = torch.zeros(B * hq, splits, 128, dtype=torch.float32, device="cuda")
        lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

        def call(mod=mod, out=out, lse=lse, q=q, kv=kv, splits=splits):
            mod.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                            has_starts=False, has_lens=False, n_out=splits, splits=splits)
        call()
        torch.cuda.synchronize()
        outs[name] = (out.clone(), lse.clone())
        res[name] = (call, [])
    same = torch.equal(outs["old"][0], outs["new"][0]) and torch.equal(outs["old"][1],
                                                                       outs["new"][1])
    for _ in range(3):
        for name in ("old", "new"):
            res[name][1].append(do_bench_cudagraph(res[name][0], rep=100, return_mode="median"))
    o, n = min(res["old"][1]) * 1e3, min(res["new"][1]) * 1e3
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits}: old {o:.1f} us, new {n:.1f} "
          f"us ({(o / n - 1) * 100:+.1f}%), outputs bit-identical: {same}", flush=True)
