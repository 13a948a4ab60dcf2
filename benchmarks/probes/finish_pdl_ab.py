"""Probe (GPU): the launches after the body, A/B in one process on the long Llama rows.

Variants of one ``decode_attention`` call (CUDA-graph time, best of three medians of
``do_bench_cudagraph``, alternated; eager median of ``do_bench`` for two of them):

* ``split``: the FP16 sink/residual as Triton-kernel splits (their own launch), then the
  finish kernel as a plain merge, one program per query row (the session-29 structure and the
  default);
* ``inline``: the finish kernel attends the FP16 part itself (one launch fewer);
* ``inline+pdl``: that, launched as a programmatic dependent of the body kernel (its FP16 part
  runs while the body's last programs finish; it waits before merging);
* ``split+pdl``;
* ``split+stream`` (session 31): the FP16 splits on a side stream beside the body (captured
  calls only: eagerly the same as ``split``);
* ``body``: the body kernel alone (the floor).

Each variant's output is checked against the float32 reference on sequence 0.

    PYTHONPATH=src python3 benchmarks/probes/finish_pdl_ab.py [B:Hq:Hkv:T:preset,...]
"""
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import batch_slice, best_graph_us, parse_rows, random_packed_kv

from kvbits.kernels import decode_attention as da
from kvbits.kernels import decode_gluon as dg
from kvbits.reference.attention import decode_attention as reference
from kvbits.spec import resolve_spec

ROWS = [(8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 32768, "kivi-4"),
        (8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 131072, "kivi-2"),
        (8, 32, 8, 131072, "uniform-int4"), (8, 32, 32, 32768, "kivi-2"),
        (1, 32, 8, 131072, "kivi-2"), (1, 32, 8, 4096, "kivi-2"), (32, 32, 8, 32768, "kivi-2"),
        (8, 32, 8, 32768, "kivi-3"), (8, 32, 8, 32768, "fp8-dynamic"),
        (8, 32, 8, 32768, "kvquant-3")]
# name: (FINISH_FP_TOKENS, PDL_ENABLED, SIDE_STREAM)
VARIANTS = {"split": (0, False, False), "inline": (256, False, False),
            "inline+pdl": (256, True, False), "split+pdl": (0, True, False),
            "split+stream": (0, False, True)}
SCALE = 128 ** -0.5


def call(q, kv, fp_tokens, pdl, side=False):
    def fn():
        da.FINISH_FP_TOKENS, da.PDL_ENABLED, da.SIDE_STREAM = fp_tokens, pdl, side
        return da.decode_attention(q, kv, scale=SCALE)
    return fn


def body_only(q, kv):
    B, Hq, _, D = q.shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = dg.split_count(kv.body_len, da.gluon_splits(kv, sms, q.device))  # the library's
    out = torch.empty(B * Hq, splits, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(B * Hq, splits, dtype=torch.float32, device="cuda")

    def fn():
        dg.attend_body(q, kv, out, lse, scale_log2=SCALE * da.LOG2E, starts=q, lengths=q,
                       has_starts=False, has_lens=False, n_out=splits, splits=splits)
    return fn


def main():
    print(f"# {torch.cuda.get_device_name()}: finish kernel variants, CUDA-graph us (best of 3 "
          "medians), eager us (do_bench median); rel err vs the float32 reference on sequence 0")
    for row in parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, ROWS):
        B, hq, hkv, T, preset = row
        torch.manual_seed(0)
        kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
        q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
        fns = {name: call(q, kv, *v) for name, v in VARIANTS.items()
               if name in os.environ.get("VARIANTS", ",".join(VARIANTS)).split(",")}
        ref = reference(q[:1].float(), batch_slice(kv, 0), scale=SCALE)
        errs = {}
        for name, fn in fns.items():
            o = fn()[:1].float()
            errs[name] = ((o - ref).norm() / ref.norm()).item()
        gluon = dg.serves(kv, 1, hq // hkv, B * hkv) if hasattr(dg, "serves") else "?"
        if kv.body_len and gluon:
            fns["body"] = body_only(q, kv)
        us = best_graph_us(fns)
        eager = {name: do_bench(fns[name], warmup=25, rep=200, return_mode="median") * 1e3
                 for name in ("split", "inline+pdl") if name in fns}
        base = us["split"]
        cells = ", ".join(f"{n} {t:.1f}" + ("" if n == "split" else f" ({(base / t - 1) * 100:+.1f}%)")
                          for n, t in us.items())
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} gluon={gluon}: graph {cells}; eager "
              + ", ".join(f"{n} {t:.1f}" for n, t in eager.items()) + "; rel err "
              + " ".join(f"{e:.1e}" for e in errs.values()), flush=True)
        assert max(errs.values()) < 1e-2, errs
        del kv, q, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
