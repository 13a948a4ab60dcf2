"""Quick GPU check of the Gluon body kernel: agreement with the Triton kernel, then timings
against FP16 SDPA at a few shapes (prints only; the committed table is decode_attention.py's)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_packed_kv  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402

torch.manual_seed(0)
SHAPES = ((8, 32, 8, 32768), (32, 32, 32, 4096), (1, 32, 8, 131072), (32, 32, 8, 32768),
          (8, 32, 32, 32768))
for preset in ("kivi-2", "kivi-4"):
    for B, Hq, Hkv, T in SHAPES:
        kv = random_packed_kv(B, Hkv, T, 128, resolve_spec(preset))
        q = torch.randn(B, Hq, 1, 128, dtype=torch.float16, device="cuda")
        s = 128 ** -0.5
        o5 = decode_attention(q, kv, scale=s, gluon=True)
        o4 = decode_attention(q, kv, scale=s, gluon=False)
        d54 = ((o5.float() - o4.float()).norm() / o4.float().norm()).item()
        t5 = do_bench(lambda: decode_attention(q, kv, scale=s, gluon=True), warmup=25, rep=100)
        t4 = do_bench(lambda: decode_attention(q, kv, scale=s, gluon=False), warmup=25, rep=100)
        k = torch.randn(B, Hkv, T, 128, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        tf = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, scale=s, enable_gqa=True), warmup=25, rep=100)
        print(f"{preset} B={B} Hq={Hq} Hkv={Hkv} T={T}: gluon {t5 * 1e3:8.1f} us  triton "
              f"{t4 * 1e3:8.1f} us  fp16 {tf * 1e3:8.1f} us  x{tf / t5:4.2f} (v4 x{tf / t4:4.2f})"
              f"  |v5-v4|/|v4|={d54:.1e}", flush=True)
        del kv, k, v
        torch.cuda.empty_cache()
