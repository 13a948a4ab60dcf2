"""Probe (GPU): the finish kernel's variants in *eager* calls, alternated in one process.

``finish_pdl_ab.py`` timed the variants in CUDA-graph replays (every round alternated) but its
two eager columns one after the other, once. Here every variant's eager ``do_bench`` median is
taken in each of five rounds, the variants alternated within a round (best median reported),
with its host time to enqueue one call (``common.host_us``), and one ``cProfile`` of the
default call per row (the host's top functions by own time), so that an eager default can be
chosen on alternated numbers.

    PYTHONPATH=src python3 benchmarks/probes/finish_eager_ab.py [B:Hq:Hkv:T:preset,...]
"""
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import host_us, parse_rows, random_packed_kv
from finish_pdl_ab import ROWS, VARIANTS, call

from kvbits.spec import resolve_spec


def main():
    print(f"# {torch.cuda.get_device_name()}: finish kernel variants, eager us (best of 5 "
          "alternated do_bench medians) / host us per call")
    for B, hq, hkv, T, preset in parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, ROWS):
        torch.manual_seed(0)
        kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
        q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
        fns = {name: call(q, kv, *v) for name, v in VARIANTS.items()
               if name != "split+stream"}  # (captured calls only)
        for fn in fns.values():
            fn()
        times = {name: [] for name in fns}
        for _ in range(5):
            for name, fn in fns.items():
                times[name].append(do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3)
        host = {name: host_us(fn) for name, fn in fns.items()}
        base = min(times["split"])
        cells = ", ".join(f"{n} {min(t):.1f}" + ("" if n == "split" else
                                                   f" ({(base / min(t) - 1) * 100:+.1f}%)")
                          for n, t in times.items())
        hosts = ", ".join(f"{n} {h:.0f}" for n, h in host.items())
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset}: eager {cells}; host {hosts}", flush=True)
        prof = cProfile.Profile()
        fn = fns["split"]
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()),
              file=sys.stderr, flush=True)
        del kv, q, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
