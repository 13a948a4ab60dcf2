"""Probe (CPU or GPU): the host time of the cache side of one eager decode step of a layer, with
the attention kernel call stubbed out: ``KVBitsLayer.update`` (append to the FP16 residual),
the flush check (a quantization every G steps, here by the reference quantizer) and the
``PackedKV`` view the kernel would read. Run with ``KVBITS_KERNELS=triton`` on a CPU so that
the store takes the kernels' path (no dequantized body for the reference attention).

    KVBITS_KERNELS=triton PYTHONPATH=src python3 benchmarks/probes/cache_side_host.py [PRESET]

Session 28, desktop CPU (2 cores), kivi-2, 32 KV heads x 128, 4k tokens: ~40 us per step with
the flushes' CPU quantization amortized in, ~20 us without (update ~13, view ~6).
"""
import sys
import time

import torch

from kvbits import ops
from kvbits.integrations import hf
from kvbits.integrations.hf import KVBitsLayer, _attend_as_generated
from kvbits.reference import quant as ref_quant
from kvbits.spec import resolve_spec

ops.quantize_keys = lambda k, b, g, valid=None: ref_quant.quantize_keys(k, b, g, valid)
ops.quantize_values = lambda v, b, vg, g, valid=None: ref_quant.quantize_values(v, b, vg, g,
                                                                                  valid)
hf.ops.decode_attention = lambda q, kv, **kw: q  # the kernel call stubbed: the cache side only

layer = KVBitsLayer(resolve_spec(sys.argv[1] if len(sys.argv) > 1 else "kivi-2"))
B, H, D = 1, 32, 128
g = torch.Generator().manual_seed(0)
layer.update(*(torch.randn(B, H, 4096, D, generator=g).half() for _ in range(2)))
layer.store.flush()
q = torch.randn(B, 32, 1, D, generator=g).half()
k, v = (torch.randn(B, H, 1, D, generator=g).half() for _ in range(2))


def step():
    layer._attended = True  # as the kvbits attention leaves it
    layer.update(k, v)
    _attend_as_generated(q, layer.store, 0.088, None)


for _ in range(100):
    step()
n = 3000
t0 = time.perf_counter()
for _ in range(n):
    step()
print(f"{(time.perf_counter() - t0) / n * 1e6:.1f} us per decode step (update, flush check, "
      f"view; flushes every {layer.spec.group_size} steps included)")
