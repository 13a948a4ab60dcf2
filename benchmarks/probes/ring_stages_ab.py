"""Probe (GPU): the TMA ring one stage deeper. ``decode_gluon_tma.STAGES`` keeps 2 stages at 4
bits, sized for KIVI's 11 KB stage; a uniform layer's 4-bit stage is 9 KB (per-token key scales
and 64-channel value groups), so 3 stages (27 KB of shared memory as compiled for sm_90) still
let the one-wave grid's 8 programs share an SM. The body alone, with the library's split count,
at the default depth and one deeper, alternated over three rounds (best of the medians), timed
the decode table's way (``flushed``) and back to back (``b2b``); the partial outputs compared.

    PYTHONPATH=src python3 benchmarks/probes/ring_stages_ab.py [MODEL:B:T:preset,...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv
from decode_attention import MODELS, bench_graph
from tail_bound import ROUNDS, b2b_us, body_call

from kvbits.kernels import decode_gluon_tma as dt
from kvbits.spec import resolve_spec

ROWS = ["llama-3-8b:8:32768:uniform-int4", "llama-3-8b:8:131072:uniform-int4",
        "llama-3-8b:32:32768:uniform-int4", "llama-3-8b:8:32768:uniform-int2",
        "llama-3-8b:8:32768:kivi-2"]


def main() -> None:
    rows = sys.argv[1].split(",") if len(sys.argv) > 1 else ROWS
    dt.MODE = "1"  # the ring in eager calls too (captured ones take it anyway)
    print(f"# {torch.cuda.get_device_name()}: body alone, ring depth default vs +1, µs (best of "
          f"{ROUNDS} medians)", flush=True)
    for spec in rows:
        model, B, T, preset = spec.split(":")
        B, T = int(B), int(T)
        hq, hkv, D = MODELS[model]
        kv = random_packed_kv(B, hkv, T, D, resolve_spec(preset))
        q = torch.randn(B, hq, 1, D, dtype=torch.float16, device="cuda")
        bits = kv.key_bits
        base = dt.STAGES[bits]
        calls, bodies = {}, {}
        for ns in (base, base + 1):
            body, splits = body_call(q, kv, D ** -0.5)
            bodies[ns] = body

            def call(body=body, ns=ns):
                dt.STAGES[bits] = ns
                try:
                    body()
                finally:
                    dt.STAGES[bits] = base
            calls[ns] = call
        times = {(ns, how): [] for ns in calls for how in ("flushed", "b2b")}
        for _ in range(ROUNDS):
            for ns, fn in calls.items():
                times[ns, "flushed"].append(bench_graph(fn))
                times[ns, "b2b"].append(b2b_us(fn))
        parts = {}
        for ns, fn in calls.items():  # each depth's partials from an eager ring call
            fn()
            torch.cuda.synchronize()
            parts[ns] = (bodies[ns].out.clone(), bodies[ns].lse.clone())
        (o0, l0), (o1, l1) = parts[base], parts[base + 1]
        same = torch.equal(o0, o1) and torch.equal(l0, l1)
        best = {k: min(v) for k, v in times.items()}
        line = "  ".join(f"{how}: {best[base, how]:.1f} -> {best[base + 1, how]:.1f} us "
                         f"({(best[base, how] / best[base + 1, how] - 1) * 100:+.1f}%)"
                         for how in ("flushed", "b2b"))
        print(f"{model} B={B} T={T} {preset} splits={splits} stages {base} -> {base + 1}: "
              f"{line}; partials {'bit for bit equal' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
