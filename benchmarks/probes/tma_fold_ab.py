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
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt
from kvbits.spec import resolve_spec

shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
          for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 32768, "kivi-4"),
    (8, 32, 8, 131072, "kivi-4"), (8, 32, 32, 32768, "kivi-2"), (8, 32, 32, 32768, "kivi-4"),
    (1, 32, 8, 131072, "kivi-2"), (32, 32, 8, 32768, "kivi-2")]
dt.MODE = "1"
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# {torch.cuda.get_device_name()}: TMA ring body kernel, dequantizing (fold 0) vs key-"
      "scale fold (fold 1), CUDA-graph us (best of 3 medians)")
for B, hq, hkv, T, preset in shapes:
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
    res, outs = {}, {}
    for fold in ("0", "1"):
        out = torch.zeros(B * hq, splits, 128, dtype=torch.float32, device="cuda")
        lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

        def call(fold=fold, out=out, lse=lse, q=q, kv=kv, splits=splits):
            dt.FOLD = fold
            dt.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                           has_starts=False, has_lens=False, n_out=splits, splits=splits)
        call()
        torch.cuda.synchronize()
        outs[fold] = (out.clone(), lse.clone())
        res[fold] = (call, [])
    o0, o1 = outs["0"][0], outs["1"][0]
    err = ((o1 - o0).norm() / o0.norm()).item()
    lse_err = (outs["1"][1] - outs["0"][1]).abs().max().item()
    for _ in range(3):
        for fold in ("0", "1"):
            res[fold][1].append(do_bench_cudagraph(res[fold][0], rep=100, return_mode="median"))
    a, b = min(res["0"][1]) * 1e3, min(res["1"][1]) * 1e3
    folds = dt.fold_applies(kv.group_size, hq // hkv, 1)
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits} fold={folds}: "
          f"dequantizing {a:.1f} us, fold {b:.1f} us ({(a / b - 1) * 100:+.1f}%), "
          f"partials rel diff {err:.2e}, lse max diff {lse_err:.2e}", flush=True)
