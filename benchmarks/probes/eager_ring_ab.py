"""Probe (GPU): eager decode calls through the TMA ring against the register body.

Eager calls (transformers' own ``generate``, every layer of every step) took the ring only from
``decode_gluon_tma.EAGER_MIN_WORK`` body tokens x pairs (2^23), because each call built six TMA
descriptors and launched through Triton's binder: ~100 us more host time than the register
body, which an eager call pays in full wherever the host is slower than the GPU. Session 35
caches the descriptors per layer and launches the ring through ``FastLaunch``. This probe times
both bodies eagerly (``do_bench`` median, L2 flushed; the call's host time shows where it
exceeds the kernel's) and measures the host time per call (calls enqueued back to back, no
sync), variants alternated, to place the new threshold.

    PYTHONPATH=src python3 benchmarks/probes/eager_ring_ab.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import host_us, parse_rows, random_packed_kv

from kvbits.kernels import decode_gluon_tma as dt
from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (1, 32, 8, 4096, "kivi-2"), (1, 32, 8, 32768, "kivi-2"), (1, 32, 8, 131072, "kivi-2"),
    (1, 32, 32, 32768, "kivi-2"), (4, 32, 8, 32768, "kivi-2"), (8, 32, 8, 8192, "kivi-2"),
    (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 32768, "kivi-4"), (8, 32, 8, 32768, "uniform-int4"),
    (1, 32, 8, 32768, "kivi-4"), (1, 32, 32, 32768, "kivi-4"), (4, 32, 8, 32768, "kivi-4"),
    (8, 32, 8, 131072, "kivi-4")])


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: eager decode_attention, "
          "do_bench median us (L2 flushed), host us per call; register body (MODE 0) against the "
          "TMA ring (MODE 1), alternated, best of 3", flush=True)
    for B, hq, hkv, T, preset in ROWS:
        kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
        q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")

        def call(q=q, kv=kv):
            return decode_attention(q, kv, scale=128 ** -0.5)
        res, outs = {}, {}
        for _ in range(3):
            for mode in ("0", "1"):
                dt.MODE = mode
                outs[mode] = call()
                us = do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
                h = host_us(call, warmup=10)
                best = res.get(mode, (float("inf"), float("inf")))
                res[mode] = (min(best[0], us), min(best[1], h))
        dt.MODE = "auto"
        auto = do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
        diff = (outs["0"].float() - outs["1"].float()).abs().max().item()
        (r0, h0), (r1, h1) = res["0"], res["1"]
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} work=2^{(B * hkv * T).bit_length() - 1}: "
              f"register {r0:.1f} us (host {h0:.1f}), ring {r1:.1f} us (host {h1:.1f}), "
              f"ring/register {r1 / r0:.3f}; library auto {auto:.1f} us; max |diff| {diff:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
