"""Probe (GPU): where the host time of one eager ``decode_attention`` call goes.

For each shape: µs per call (no sync), µs per call with every kernel launch stubbed out (the
Python around the launches), µs per launch of each kernel through Triton's JIT (``fn[grid](...)``
replayed with the recorded arguments), through the compiled kernel's launcher directly (the
floor a cached launch could reach) and through kvbits' ``FastLaunch``, and FP16 SDPA's host µs
per call for the same shape.

    PYTHONPATH=src python3 benchmarks/probes/decode_host_breakdown.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import host_us, random_packed_kv

from kvbits.kernels import decode_attention as da
from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt
from kvbits.kernels import launch
from kvbits.ops import decode_attention
from kvbits.spec import resolve_spec

KERNELS = {"triton": da._decode_kernel, "finish": da._finish_kernel,
           "gluon": dg._body_kernel, "gluon_tma": getattr(dt, "_body_tma_kernel", None)}
KERNELS = {k: v for k, v in KERNELS.items() if v is not None}
FAST = {"triton": getattr(da, "_DECODE", None), "finish": getattr(da, "_FINISH", None),
        "gluon": getattr(dg, "_BODY", None)}  # kvbits.kernels.launch.FastLaunch wrappers


def per_call(fn, n=400):
    return host_us(fn, n, warmup=30)


def launch_costs(name, a, kw):
    """Host µs of one recorded launch through the JIT, and through the compiled launcher."""
    k = KERNELS[name]
    jit = per_call(lambda: k.run(*a, **kw))
    raw = float("nan")
    try:  # the compiled kernel's launcher, bypassing the JIT's binder and cache lookup
        kernel = k.run(*a, **kw)
        binder = k.device_caches[torch.cuda.current_device()][-1]
        bound, _, _ = binder(*a, **{x: y for x, y in kw.items() if x not in ("grid", "warmup")})
        g = list(kw["grid"]) + [1] * (3 - len(kw["grid"]))
        stream = torch.cuda.current_stream().cuda_stream
        args = list(bound.values())
        raw = per_call(lambda: kernel.run(g[0], g[1], g[2], stream, kernel.function,
                                          kernel.packed_metadata, None, None, None, *args))
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        print(f"   raw launch of {name} failed: {type(e).__name__}: {e}")
    fast = float("nan")
    if FAST.get(name) is not None:  # the same launch through kvbits' FastLaunch
        kw2 = {x: y for x, y in kw.items() if x not in ("grid", "warmup")}
        launch.ENABLED = True
        fast = per_call(lambda: FAST[name].run(kw["grid"], a, kw2))
        launch.ENABLED = False
    return f"{name} {jit:.1f} (raw {raw:.1f}, FastLaunch {fast:.1f}, {len(a)} args)"


def measure(B, hq, hkv, T, preset):
    kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")

    def call():
        return decode_attention(q, kv, scale=0.088)
    totals = {False: [], True: []}  # FastLaunch off / on, alternated (the host's load drifts)
    for _ in range(3):
        for on in (False, True):
            launch.ENABLED = on
            totals[on].append(per_call(call))
    launch.ENABLED = False  # the breakdown below is of the JIT path
    total = min(totals[False])
    calls, orig = [], {name: k.run for name, k in KERNELS.items()}

    def recorder(name):
        def rec(*a, **kw):
            calls.append((name, a, kw))
            return orig[name](*a, **kw)
        return rec
    for name, k in KERNELS.items():
        k.run = recorder(name)
    call()
    torch.cuda.synchronize()
    for k in KERNELS.values():  # stubs: the Python around the launches
        k.run = lambda *a, **kw: None
    python_only = per_call(call)
    for name, k in KERNELS.items():
        k.run = orig[name]
    parts = [launch_costs(name, a, kw) for name, a, kw in calls]
    kf = torch.randn(B, hkv, T, 128, dtype=torch.float16, device="cuda")
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sdpa = per_call(lambda: F.scaled_dot_product_attention(q, kf, kf, enable_gqa=hq != hkv))
    launch.ENABLED = True
    print(f"== B={B} Hq={hq} Hkv={hkv} T={T} {preset}: {total:.1f} us host per call "
          f"({min(totals[True]):.1f} with FastLaunch); "
          f"python without launches {python_only:.1f}; launches (JIT us): "
          f"{'; '.join(parts)}; sdpa flash {sdpa:.1f}", flush=True)


def main():
    shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":"))
              for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
        (1, 32, 8, 4096, "kivi-2"), (1, 32, 32, 32768, "kivi-2"), (8, 32, 32, 4096, "kivi-2"),
        (8, 32, 8, 32768, "kivi-4"), (1, 32, 8, 32768, "kvquant-3")]
    for shape in shapes:
        measure(*shape)


if __name__ == "__main__":
    main()
