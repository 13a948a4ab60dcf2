"""Sweep the Gluon body kernel's knobs (prefetch distance and level, maxnreg, splits per SM) on a
few decode shapes, against the Triton kernel and FP16 SDPA in the same process (prints only),
eager and in CUDA-graph time (the eager time of small calls is host launch time).

    python3 benchmarks/gluon_sweep.py [PRESET ...]
    env: SWEEP_PF=0,1,1A,1E,2L,0T,0T2 (prefetch distance in steps; flags: L prefetch into L1,
         else L2; A prefetch after the step's own key loads; E value loads issued with the key
         loads; T the TMA ring of decode_gluon_tma where it serves, optionally its stage count),
         SWEEP_MAXNREG=0,168, SWEEP_SPLITS=8,16 (programs per SM; 0: the library's rule)

Every timing is checked against the Triton kernel's output (relative difference printed)."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import packed_nbytes, random_packed_kv
from triton.testing import do_bench

from kvbits.kernels import decode_gluon, decode_gluon_tma
from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

MAXNREGS = [int(r) for r in os.environ.get("SWEEP_MAXNREG", "0").split(",")]
SPLIT_MULTS = [int(m) for m in os.environ.get("SWEEP_SPLITS", "0").split(",")]
# variants (see the docstring): prefetch distance digits, flags L, A, E, then T[stages] for the
# TMA ring, e.g. "0,1,1A,1AE,0T,0T2"
VARIANTS = os.environ.get("SWEEP_PF", "0").split(",")
# (batch, query heads, KV heads, context), SWEEP_SHAPES=BxHqxHkvxT,...: default Llama-3-8B
# B=32/8/1, Llama-2-7B B=8, Llama-2 B=32 4k
SHAPES = tuple(tuple(int(x) for x in sh.split("x")) for sh in os.environ.get(
    "SWEEP_SHAPES", "32x32x8x32768,8x32x8x32768,8x32x32x32768,1x32x8x131072,32x32x32x4096").split(","))
SMS = torch.cuda.get_device_properties(0).multi_processor_count
_SEEN_REGS: dict = {}


def _regs(kernel, label) -> str:
    """Registers and spills of the variant ``label`` of ``kernel``: the entry its first run added
    to the JIT cache (later runs reuse it), or '' where this Triton keeps them elsewhere."""
    try:
        cache = next(iter(kernel.device_caches.values()))[0]
        new = [k for key, k in cache.items() if key not in _SEEN_REGS.get("keys", set())]
        _SEEN_REGS["keys"] = set(cache)
        if new:
            _SEEN_REGS[label] = f" regs={new[-1].n_regs} spills={new[-1].n_spills}"
        return _SEEN_REGS.get(label, "")
    except Exception:  # noqa: BLE001
        return ""


decode_gluon.PLANES3 = True  # 3-bit presets (kivi-3) through the Gluon body whatever the env says
TMA_STAGES = dict(decode_gluon_tma.STAGES)
for preset in sys.argv[1:] or ["kivi-2", "kivi-4"]:
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
        k = v = None  # (freed)
        nb = packed_nbytes(kv)
        print(f"{preset} B={B} Hq={Hq} Hkv={Hkv} T={T}: fp16 (default SDPA) {tf * 1e3:.1f} us, "
              f"triton v4 {t4 * 1e3:.1f} us (x{tf / t4:.2f})", flush=True)
        for reg in MAXNREGS:
            for sp_mult in SPLIT_MULTS:
                splits = decode_gluon.split_count(T, -(-sp_mult * SMS // (B * Hkv))) \
                    if sp_mult else None
                for var in VARIANTS:
                    flags, _, stages = var.partition("T")
                    decode_gluon.DEFAULT_MAXNREG = reg
                    decode_gluon.DEFAULT_PREFETCH = int(flags.rstrip("LAE") or 0)
                    decode_gluon.PREFETCH_L1 = "L" in flags
                    decode_gluon.PREFETCH_AFTER_KEYS = "A" in flags
                    decode_gluon.EARLY_VALUES = "E" in flags
                    decode_gluon_tma.MODE = "1" if "T" in var else "0"
                    decode_gluon_tma.STAGES = ({2: int(stages), 4: int(stages)} if stages
                                               else dict(TMA_STAGES))

                    def fn():
                        return decode_attention(q, kv, scale=s, gluon=True, splits=splits)
                    try:
                        o5 = fn()
                        d = ((o5.float() - o4.float()).norm() / o4.float().norm()).item()
                        t5 = do_bench(fn, warmup=25, rep=100)
                        graph = torch.cuda.CUDAGraph()  # graph time: no host launch cost
                        with torch.cuda.graph(graph):
                            fn()
                        tg = do_bench(graph.replay, warmup=25, rep=100)
                        del graph
                    except Exception as e:  # noqa: BLE001
                        print(f"   maxnreg={reg} pf={var}: "
                              f"{type(e).__name__} {str(e)[:300]}", flush=True)
                        continue
                    print(f"   maxnreg={reg:3d} splits={splits or 'lib'} pf={var:4s}: "
                          f"{t5 * 1e3:8.1f} us x{tf / t5:4.2f}, graph {tg * 1e3:8.1f} us "
                          f"x{tf / tg:4.2f} ({nb / min(t5, tg) * 1e-9:.2f} TB/s)  diff {d:.1e}"
                          f"{_regs(decode_gluon._body_kernel, (preset, reg, var)) if 'T' not in var else ''}",
                          flush=True)
        kv = None  # (freed)
        torch.cuda.empty_cache()
