"""Sweep the Gluon body kernel's launch knobs (splits per SM, maxnreg) on a few decode shapes,
against the Triton kernel and FP16 SDPA in the same process (prints only).

    python3 benchmarks/gluon_sweep.py [PRESET ...]   (env SWEEP_MAXNREG=0,168 SWEEP_SPLITS=3,6)

Mixed key/value widths (k4v2) switch on ``decode_gluon.MIXED_BITS`` (off in the library until
its GPU tests pass)."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_packed_kv  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvbits.kernels import decode_gluon  # noqa: E402
from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

MAXNREGS = [int(r) for r in os.environ.get("SWEEP_MAXNREG", "0").split(",")]
SPLIT_MULTS = [int(m) for m in os.environ.get("SWEEP_SPLITS", "3,6,12").split(",")]
SHAPES = ((32, 32, 8, 32768), (8, 32, 32, 32768), (1, 32, 8, 131072), (32, 32, 32, 4096))
for preset in sys.argv[1:] or ["kivi-2", "kivi-4"]:
    decode_gluon.MIXED_BITS = True
    for B, Hq, Hkv, T in SHAPES:
        kv = random_packed_kv(B, Hkv, T, 128, resolve_spec(preset))
        q = torch.randn(B, Hq, 1, 128, dtype=torch.float16, device="cuda")
        s = 128 ** -0.5
        o4 = decode_attention(q, kv, scale=s, gluon=False)
        t4 = do_bench(lambda: decode_attention(q, kv, scale=s, gluon=False), warmup=25, rep=100)
        k = torch.randn(B, Hkv, T, 128, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        tf = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=s, enable_gqa=True), warmup=25, rep=100)
        del k, v
        nb = B * Hkv * T * 128 * (2 * kv.key_bits / 8) + B * Hkv * T * 2 * 2 * (128 // 32 + 128 / 32)
        print(f"{preset} B={B} Hkv={Hkv} T={T}: fp16 {tf * 1e3:.1f} us, triton v4 {t4 * 1e3:.1f} "
              f"us (x{tf / t4:.2f})", flush=True)
        for reg in MAXNREGS:
            for sp_mult in SPLIT_MULTS:
                splits = decode_gluon.body_splits(B * Hkv, T, 132 * sp_mult)
                try:
                    def fn():
                        return decode_attention(q, kv, scale=s, gluon=True, splits=splits)
                    decode_gluon.DEFAULT_MAXNREG = reg
                    o5 = fn()
                    d = ((o5.float() - o4.float()).norm() / o4.float().norm()).item()
                    t5 = do_bench(fn, warmup=25, rep=100)
                except Exception as e:  # noqa: BLE001
                    print(f"   maxnreg={reg}: {type(e).__name__} {str(e)[:200]}")
                    break
                print(f"   maxnreg={reg:3d} splits={splits:4d}: {t5 * 1e3:8.1f} us "
                      f"x{tf / t5:4.2f} ({nb / t5 * 1e-9:.2f} TB/s)  diff {d:.1e}", flush=True)
        del kv
        torch.cuda.empty_cache()
