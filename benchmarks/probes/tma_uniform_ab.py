"""Probe (GPU): per-token key scales (the uniform method) and 64-channel value groups through
the TMA ring (``decode_gluon_tma``) against the register body (``decode_gluon``), body kernel
alone, alternated in one process, CUDA-graph time (median of ``do_bench_cudagraph``, best of
three rounds each), on the long Llama rows; the two partial outputs' relative difference.

    PYTHONPATH=src python3 benchmarks/probes/tma_uniform_ab.py [B:Hq:Hkv:T:preset,...]
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


def measure(B, hq, hkv, T, preset, sms):
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
    k_tok = kv.key_axis == "token"
    res, outs = {}, {}
    for mode in ("0", "1"):
        out = torch.zeros(B * hq, splits, 128, dtype=torch.float32, device="cuda")
        lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

        def call(mode=mode, out=out, lse=lse):
            dt.MODE = mode
            dg.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                           has_starts=False, has_lens=False, n_out=splits, splits=splits)
        call()
        torch.cuda.synchronize()
        outs[mode] = out.clone()
        res[mode] = (call, [])
    for _ in range(3):
        for mode in ("0", "1"):
            res[mode][1].append(do_bench_cudagraph(res[mode][0], rep=100, return_mode="median"))
    a, b = min(res["0"][1]) * 1e3, min(res["1"][1]) * 1e3
    err = ((outs["1"] - outs["0"]).norm() / outs["0"].norm()).item()
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits} ring eligible="
          f"{dt.eligible(kv, k_tok)}: register body {a:.1f} us, TMA ring {b:.1f} us "
          f"({(a / b - 1) * 100:+.1f}%), partials rel diff {err:.1e}", flush=True)


def main():
    shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
              for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
        (8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 131072, "uniform-int4"),
        (8, 32, 32, 32768, "uniform-int4"), (8, 32, 8, 32768, "uniform-int2"),
        (8, 32, 8, 131072, "uniform-int2"), (1, 32, 8, 131072, "uniform-int4")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}: register body vs TMA ring, CUDA-graph us (best of "
          "3 medians); (+x%): the ring faster")
    for shape in shapes:
        measure(*shape, sms)


if __name__ == "__main__":
    main()
