"""Probe (GPU): where an eager TMA-ring call's host time goes (session 35): the cached
descriptors, FastLaunch's key and plan, the launcher itself (which encodes the six tensor maps
at every launch), against the register body's launch; and whether the plan is used at all.

    PYTHONPATH=src python3 benchmarks/probes/ring_host_s35.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import host_us, random_packed_kv

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt
from kvbits.kernels import launch
from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec


def _per_call(fn):
    return host_us(fn, 300, warmup=20)


kv = random_packed_kv(8, 8, 32768, 128, resolve_spec("kivi-2"))
q = torch.randn(8, 32, 1, 128, dtype=torch.float16, device="cuda")
splits = 16
out = torch.empty(8 * 32, splits, 128, dtype=torch.float32, device="cuda")
lse = torch.empty(8 * 32, splits, dtype=torch.float32, device="cuda")
common = {"scale_log2": 0.127, "starts": q, "lengths": q, "has_starts": False,
          "has_lens": False, "n_out": splits, "splits": splits}
ring = lambda: dt.attend_body(q, kv, out, lse, **common)
kern = ring()
print("plans", len(dt._TMA._plans), "jit_only", dt._TMA._jit_only, "kernel", type(kern).__name__)
print(f"ring attend_body {_per_call(ring):.1f} us/call")
print(f"descriptors (cached) {_per_call(lambda: dt._descriptors(kv)):.1f} us")
print(f"descriptors (built) {_per_call(lambda: dt._build_descriptors(kv)):.1f} us")
descs = dt._descriptors(kv)
args_kw = {}


def spy(grid, args, keywords):
    args_kw["grid"], args_kw["args"], args_kw["kw"] = grid, args, keywords
    return real(grid, args, keywords)


real = dt._TMA.launch
dt._TMA.launch = spy
ring()
dt._TMA.launch = real
g, a, kw = args_kw["grid"], args_kw["args"], args_kw["kw"]
print(f"FastLaunch.launch alone {_per_call(lambda: dt._TMA.launch(g, a, kw)):.1f} us")
print(f"FastLaunch.key alone {_per_call(lambda: dt._TMA.key(a, kw)):.1f} us")
plan = dt._TMA._plans.get(dt._TMA.key(a, kw))
if plan is not None:
    k, tail = plan
    stream = torch.cuda.current_stream().cuda_stream
    gg = (*g, 1, 1)
    print(f"kernel.run (launcher, encodes the maps) {_per_call(lambda: k.run(gg[0], gg[1], gg[2], stream, k.function, k.packed_metadata, None, None, None, *a, *tail)):.1f} us")
launch.ENABLED = False
print(f"through the JIT {_per_call(lambda: dt._TMA.launch(g, a, kw)):.1f} us")
launch.ENABLED = True
dt.MODE = "0"
reg = lambda: dg.attend_body(q, kv, out, lse, **common)
print(f"register body attend_body {_per_call(reg):.1f} us/call")
dt.MODE = "1"
print(f"whole decode_attention, ring {_per_call(lambda: decode_attention(q, kv, scale=0.088)):.1f} us")
dt.MODE = "0"
print(f"whole decode_attention, register {_per_call(lambda: decode_attention(q, kv, scale=0.088)):.1f} us")
