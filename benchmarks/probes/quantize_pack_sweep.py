"""GPU probe: sweep quantize_pack's launch knobs (elements per program, warps) for keys and
values at 2/4/8 bits on the benchmark's 8x8x32768x128 FP16 input, printing TB/s against the
copy bandwidth measured in the same process (prints only; the table comes from
``benchmarks/decode_attention.py``).

    PYTHONPATH=src python3 benchmarks/probes/quantize_pack_sweep.py
"""
import itertools
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth  # noqa: E402

from kvbits.kernels import quantize_pack as qp  # noqa: E402
from kvbits.reference import quant as ref  # noqa: E402

bw = copy_bandwidth()
print(f"copy bandwidth {bw * 1e-12:.2f} TB/s; default tiles {qp._TILES['cuda']} warps {qp._NUM_WARPS}")
x = torch.randn(8, 8, 32768, 128, dtype=torch.float16, device="cuda")
default = (qp._TILES["cuda"], qp._NUM_WARPS)
for bits in (2, 4):
    want_k = ref.quantize_keys(x[:1, :2, :4096], bits, 32)
    want_v = ref.quantize_values(x[:1, :2, :4096], bits, 32, 32)
    for tile, ch, warps in itertools.product((1024, 4096), (128,), (1, 2, 4, 8)):
        qp._TILES["cuda"], qp._NUM_WARPS = (tile, ch), warps
        for name, fn, want in (
                ("keys", lambda: qp.quantize_keys(x, bits, 32), want_k),
                ("values", lambda: qp.quantize_values(x, bits, 32, 32), want_v)):
            try:
                outs = fn()
                small = (qp.quantize_keys if name == "keys" else
                         lambda a, b, g: qp.quantize_values(a, b, 32, g))(x[:1, :2, :4096], bits, 32)
                same = all(torch.equal(a, b) for a, b in zip(small, want))
                nbytes = x.numel() * 2 + sum(o.numel() * o.element_size() for o in outs)
                t = do_bench(fn, warmup=10, rep=50, return_mode="median")
                print(f"{name:6} bits={bits} tile={tile:5d} warps={warps}: {t * 1e3:8.1f} us "
                      f"{nbytes / t * 1e-9:5.2f} TB/s ({nbytes / t * 1e3 / bw * 100:4.1f}%) "
                      f"exact={same}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name} bits={bits} tile={tile} warps={warps}: {type(e).__name__} {str(e)[:150]}")
qp._TILES["cuda"], qp._NUM_WARPS = default
