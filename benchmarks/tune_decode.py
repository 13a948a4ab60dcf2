"""Sweep the decode kernel's launch knobs (warps, tile tokens, split count) on a few shapes.

Prints one line per configuration; used to pick the defaults in kvbits.kernels.decode_attention.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, packed_nbytes, random_packed_kv  # noqa: E402

from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

SHAPES = [(1, 32, 8, 131072), (8, 32, 8, 32768), (32, 32, 32, 32768), (1, 32, 32, 4096)]


def main() -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for preset in ("kivi-2", "kivi-4"):
        for B, hq, hkv, T in SHAPES:
            kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
            q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
            nb = packed_nbytes(kv)
            best = None
            for warps, tile, mult in itertools.product((4, 8), (64, 128, 256), (None, 1, 4)):
                splits = None if mult is None else max(1, mult * 132 // (B * hkv))
                try:
                    fn = lambda: decode_attention(q, kv, scale=0.088, num_warps=warps,  # noqa: E731
                                                  tile_tokens=tile, splits=splits)
                    us = do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
                except Exception as e:  # a config the compiler rejects is reported, not fatal
                    print(f"{preset} B={B} Hkv={hkv} T={T} w={warps} tile={tile} split={splits}: "
                          f"{type(e).__name__}: {str(e)[:120]}")
                    continue
                frac = nb / us * 1e6 / bw
                print(f"{preset} B={B} Hkv={hkv} T={T} w={warps} tile={tile} split={splits}: "
                      f"{us:8.1f} us {frac * 100:5.1f}%", flush=True)
                if best is None or us < best[0]:
                    best = (us, warps, tile, splits, frac)
            print(f"BEST {preset} B={B} Hkv={hkv} T={T}: {best}", flush=True)
            kv = None  # (freed)


if __name__ == "__main__":
    main()
