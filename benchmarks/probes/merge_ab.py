"""Probe (GPU): where a decode step's partial columns are merged (``KVBITS_MERGE``).

* ``finish``: the finish kernel, a launch of its own (``MERGE_IN_SPLITS = "0"``, the library
  before session 40): captured calls run the FP16 splits on a side stream beside a Gluon body,
  eager calls attend the FP16 part in the finish kernel;
* ``merge``: the stage-1 (Triton) kernel's last program of each m-tile merges (a ticket per
  m-tile, ``"1"``): after a Gluon body the FP16 splits run in stream order and merge; a call the
  Triton kernel serves alone is one launch.

Per row: whole captured calls, alternated, best of 3 ``do_bench`` medians (L2 flushed); and
eager calls, host included (``EAGER_CALLS`` back-to-back calls per round, wall time / call,
best of 3 rounds, alternated). Each variant's output against ``finish``'s.

    PYTHONPATH=src python3 benchmarks/probes/merge_ab.py [B:Hq:Hkv:T:preset,...]
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import parse_rows, random_packed_kv
from decode_attention import captured_ab, flash_graph_us

from kvbits.kernels import decode_attention as da
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (8, 32, 8, 32768, p) for p in ("kivi-2", "kivi-4", "uniform-int4", "kivi-3", "kvquant-3")
] + [
    (8, 32, 8, 131072, p) for p in ("kivi-2", "kivi-4", "uniform-int4", "kvquant-3")
] + [
    (8, 32, 32, 32768, "kivi-2"), (32, 32, 8, 32768, "kivi-2"), (1, 32, 8, 32768, "kivi-2"),
    (1, 32, 8, 131072, "kivi-2"), (1, 32, 32, 4096, "kivi-2"), (1, 32, 8, 4096, "kivi-4"),
    (8, 32, 32, 32768, "kvquant-3"), (1, 32, 8, 131072, "kvquant-3"),
])
VARIANTS = {"finish": "0", "merge": "1"}
EAGER_CALLS = 200


def variant(q, kv, setting):
    def fn():
        da.MERGE_IN_SPLITS = setting
        return da.decode_attention(q, kv, scale=q.shape[-1] ** -0.5)
    return fn


def eager_us(fns: dict, rounds: int = 3) -> dict:
    """Wall microseconds per eager call (host and device), best of ``rounds``, alternated."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(EAGER_CALLS):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / EAGER_CALLS * 1e6)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: graph = whole captured "
          "calls (best of 3 do_bench medians, alternated); eager = wall time per call, host "
          "included; diff = max |out - finish's|", flush=True)
    for B, hq, hkv, T, preset in ROWS:
        kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
        q, flash = flash_graph_us(B, hq, hkv, T, 128)
        fns = {name: variant(q, kv, s) for name, s in VARIANTS.items()}
        graph, outs = captured_ab(fns)
        eager = eager_us(fns)
        da.MERGE_IN_SPLITS = "auto"
        base, ebase = graph["finish"], eager["finish"]
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} (flash SDPA {flash:.1f} us): " + ", ".join(
            f"{name} graph {graph[name]:.1f} us ({base / graph[name] - 1:+.1%}, "
            f"{flash / graph[name]:.2f}x) eager {eager[name]:.1f} us "
            f"({ebase / eager[name] - 1:+.1%}), diff "
            f"{(outs[name] - outs['finish']).abs().max().item():.1e}" for name in fns),
            flush=True)


if __name__ == "__main__":
    main()
