"""Host time of one layer's decode step, kvbits store + attention against DynamicCache-style
concat + flash SDPA, at batch 1 (GPU machine; where batch-1 ``generate`` spends its time).

    PYTHONPATH=src python3 benchmarks/probes/decode_host_profile.py [PRESET ...]

Prints µs per step (host wall time over many steps; the GPU work is smaller, so this is what
bounds the step) and a cProfile of the kvbits steps.
"""
import cProfile
import pstats
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import host_us  # noqa: E402

from kvbits.cache.store import LayerStore
from kvbits.integrations.hf import _attend_as_generated
from kvbits.spec import resolve_spec

B, HQ, HKV, D, T, N = 1, 32, 8, 128, 4096, 400
dev = torch.device("cuda")
scale = D ** -0.5


def steps_fp16():
    k = torch.randn(B, HKV, T, D, dtype=torch.float16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(B, HQ, 1, D, dtype=torch.float16, device=dev)
    k1, v1 = k[:, :, :1].clone(), v[:, :, :1].clone()

    def step():
        nonlocal k, v
        k = torch.cat([k, k1], dim=2)
        v = torch.cat([v, v1], dim=2)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                    enable_gqa=True)
    return step


def steps_kvbits(preset):
    store = LayerStore(resolve_spec(preset), B, HKV, D, torch.float16, dev)
    store.append(torch.randn(B, HKV, T, D, dtype=torch.float16, device=dev),
                 torch.randn(B, HKV, T, D, dtype=torch.float16, device=dev))
    q = torch.randn(B, HQ, 1, D, dtype=torch.float16, device=dev)
    k1 = torch.randn(B, HKV, 1, D, dtype=torch.float16, device=dev)

    def step():
        store.append(k1, k1)
        return _attend_as_generated(q, store, scale, None)
    return step


def warm_host_us(step, n=N):
    """Host µs per step after 200 warm-up steps (past a flush of every kind: compiles stay out
    of the timing)."""
    for _ in range(200):
        step()
    return host_us(step, n)


print(f"B={B} Hq={HQ} Hkv={HKV} D={D} T={T}: host µs per layer step (enqueue)")
print("fp16 concat + flash SDPA: %.1f" % warm_host_us(steps_fp16()))
for preset in sys.argv[1:] or ["kivi-2", "kivi-4"]:
    print(f"{preset}: %.1f" % warm_host_us(steps_kvbits(preset)))
prof = cProfile.Profile()
step = steps_kvbits((sys.argv[1:] or ["kivi-2"])[0])
warm_host_us(step, 50)
prof.enable()
for _ in range(N):
    step()
prof.disable()
torch.cuda.synchronize()
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumulative").print_stats(30)
