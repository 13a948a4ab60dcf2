"""Probe (GPU): per-token key scales (the uniform method) and 64-channel value groups through
the TMA ring (``decode_gluon_tma``) against the register body (``decode_gluon``), body kernel
alone, alternated in one process, CUDA-graph time (median of ``do_bench_cudagraph``, best of
three rounds each), on the long Llama rows; the two partial outputs' relative difference.
With ``--key-fold``: the ring with the per-token key scales folded out of the key operands
(``decode_gluon.KEY_FOLD``) against dequantizing them there, session 55; with ``--key-fold
--register``, the same in the register body (rows may name a head_dim: ``B:Hq:Hkv:T:preset:D``).

    PYTHONPATH=src python3 benchmarks/probes/tma_uniform_ab.py [--key-fold [--register]] [rows]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import attend_body_fn, body_variants_ab, parse_rows

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt

ROWS = [(8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 131072, "uniform-int4"),
        (8, 32, 32, 32768, "uniform-int4"), (8, 32, 8, 32768, "uniform-int2"),
        (8, 32, 8, 131072, "uniform-int2"), (1, 32, 8, 131072, "uniform-int4")]
FOLD_ROWS = [(8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 131072, "uniform-int4"),
             (8, 32, 32, 32768, "uniform-int4"), (32, 32, 8, 32768, "uniform-int4"),
             (1, 32, 8, 131072, "uniform-int4"), (8, 32, 8, 32768, "uniform-int2"),
             (8, 32, 8, 131072, "uniform-int2"), (8, 32, 32, 32768, "uniform-int2")]
REGISTER_FOLD_ROWS = [(8, 32, 8, 32768, "uniform-int4"), (8, 32, 8, 32768, "uniform-int2"),
                      (8, 32, 8, 32768, "uniform-int4", 64), (8, 32, 8, 32768, "uniform-int2", 64),
                      (16, 9, 3, 8192, "uniform-int4", 64), (1, 32, 8, 131072, "uniform-int4")]


def variant(mode, fold="1"):
    """The register body (``decode_gluon_tma.MODE`` "0") or the ring ("1"), with the key fold
    on or off (``KEY_FOLD``)."""
    def fn(*args):
        dt.MODE = mode
        dg.KEY_FOLD = fold == "1"
        attend_body_fn(dg)(*args)
    return fn


def main():
    args = sys.argv[1:]
    fold = "--key-fold" in args
    body = "0" if "--register" in args else "1"
    args = [a for a in args if a not in ("--key-fold", "--register")]
    rows = ROWS
    if fold:
        names = ("dequantized", "folded")
        variants = {"0": variant(body, "0"), "1": variant(body, "1")}
        what = (f"{'register body' if body == '0' else 'TMA ring'}, per-token key scales "
                "dequantized in the operands (0) vs folded out of them (1)")
        rows = REGISTER_FOLD_ROWS if body == "0" else FOLD_ROWS
    else:
        names = ("register body", "TMA ring")
        variants = {"0": variant("0"), "1": variant("1")}
        what = "register body vs TMA ring"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}: {what}, CUDA-graph us (best of 3 medians); (+x%): "
          f"the {names[1]} faster")
    for row in parse_rows(args[0] if args else None, rows):
        row, D = (row[:5], row[5]) if len(row) > 5 else (row, 128)
        kv, splits, us, outs = body_variants_ab(row, variants, sms, head_dim=D)
        a, b = us["0"], us["1"]
        (o0, l0), (o1, l1) = outs["0"], outs["1"]
        err = ((o1 - o0).norm() / o0.norm()).item()
        B, hq, hkv, T, preset = row
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} D={D} {preset} splits={splits} ring eligible="
              f"{dt.eligible(kv, kv.key_axis == 'token')}: {names[0]} {a:.1f} us, {names[1]} "
              f"{b:.1f} us ({(a / b - 1) * 100:+.1f}%), partials rel diff {err:.1e}, lse max diff "
              f"{(l1 - l0).abs().max().item():.1e}", flush=True)


if __name__ == "__main__":
    main()
