"""Probe (GPU): how much of the Gluon body's time is its dequantization arithmetic.

Each ``half2`` of 2- or 4-bit codes costs a ``lop3`` (mask + magic exponent) and two ``HFMA2``
(make the code exact, then ``* scale + zero``): 512 of the ~1590 instructions of a 64-token
kivi-2 step. A scale fold into the query / P would remove most of them. Before building it, this
probe removes them (results become wrong; only time is measured) and times the library's call in
CUDA-graph time:

* ``base``: the library as it is;
* ``one-fma``: ``lop3`` + one ``HFMA2`` (what a fold of the exactness FMA alone would leave);
* ``no-fma``: ``lop3`` only, keys and values;
* ``const-scales``: both ``HFMA2`` with constant scales and zeros (no scale loads or registers);
* ``keys-no-fma`` / ``values-no-fma``: one side only;
* ``keys-const`` / ``values-const``: one side's scales and zeros constant.

One variant per process (the patch must precede the first compile):

    PYTHONPATH=src python3 benchmarks/probes/dequant_ablation.py VARIANT
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, packed_nbytes, random_packed_kv
from decode_attention import MODELS, bench_graph, flash_graph_us

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

gluon, gl = dg.gluon, dg.gl


@gluon.constexpr_function
def _ablated_asm(p, bits, fmas):
    """``_pair_asm`` with ``fmas`` (0 or 1) of its two ``HFMA2`` kept."""
    p, bits, fmas = (int(getattr(x, "value", x)) for x in (p, bits, fmas))
    cmax = (1 << bits) - 1
    sh = bits * p
    mask = (cmax << sh) | (cmax << (sh + 16))
    if fmas == 0:
        return f"lop3.b32 $0, $1, {hex(mask)}, 0x64006400, 0xea;"
    if fmas == 2:  # both FMAs, the scale and zero constants (no scale loads or registers)
        return ("{ .reg .b32 t, a, b, c; "
                f"lop3.b32 t, $1, {hex(mask)}, 0x64006400, 0xea; "
                "mov.b32 a, 0x3c003c00; mov.b32 b, 0xe400e400; mov.b32 c, 0x2c002c00; "
                "fma.rn.f16x2 t, t, a, b; fma.rn.f16x2 $0, t, c, a; }")
    return ("{ .reg .b32 t; "
            f"lop3.b32 t, $1, {hex(mask)}, 0x64006400, 0xea; "
            "fma.rn.f16x2 $0, t, $2, $3; }")


@gluon.constexpr_function
def _asm_no_fma(p, bits):
    return _ablated_asm(p, bits, 0)


@gluon.constexpr_function
def _asm_const_scales(p, bits):
    return _ablated_asm(p, bits, 2)


@gluon.constexpr_function
def _asm_one_fma(p, bits):
    return _ablated_asm(p, bits, 1)


@gluon.jit
def _dequant_ablated(u, sc, ze, P: gl.constexpr, BITS: gl.constexpr, FMAS: gl.constexpr):
    NP: gl.constexpr = dg._in_place(BITS)
    if P >= NP:
        u = u >> (BITS * NP)
    return gl.inline_asm_elementwise(_ablated_asm(P % NP, BITS, FMAS), "=r,r,r,r", [u, sc, ze],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _dequant_no_fma(u, sc, ze, P: gl.constexpr, BITS: gl.constexpr):
    return _dequant_ablated(u, sc, ze, P, BITS, 0)


@gluon.jit
def _dequant_const(u, sc, ze, P: gl.constexpr, BITS: gl.constexpr):
    return _dequant_ablated(u, sc, ze, P, BITS, 2)


@gluon.jit
def _vpair_no_fma(w, s, z, P: gl.constexpr, SL: gl.constexpr):
    BITS: gl.constexpr = 2 if len(w.shape) == 3 else 4
    return _dequant_no_fma(w, dg._bcast(s, SL), dg._bcast(z, SL), P, BITS)


@gluon.jit
def _vpair_const(w, s, z, P: gl.constexpr, SL: gl.constexpr):
    BITS: gl.constexpr = 2 if len(w.shape) == 3 else 4
    return _dequant_const(w, dg._bcast(s, SL), dg._bcast(z, SL), P, BITS)


@gluon.jit
def _vpair_library(w, s, z, P: gl.constexpr, SL: gl.constexpr):
    """Values with the library's dequant while keys take the ablated one."""
    BITS: gl.constexpr = 2 if len(w.shape) == 3 else 4
    return _library_dequant(w, dg._bcast(s, SL), dg._bcast(z, SL), P, BITS)


_library_dequant = dg._dequant


def patch(variant: str) -> None:
    if variant == "base":
        return
    if variant == "no-fma":
        dg._pair_asm = _asm_no_fma
    elif variant == "one-fma":
        dg._pair_asm = _asm_one_fma
    elif variant == "const-scales":
        dg._pair_asm = _asm_const_scales
    elif variant == "values-no-fma":
        dg._vpair = _vpair_no_fma
    elif variant == "keys-no-fma":  # keys call _dequant directly, values through _vpair
        dg._dequant = _dequant_no_fma
        dg._vpair = _vpair_library
    elif variant == "values-const":
        dg._vpair = _vpair_const
    elif variant == "keys-const":
        dg._dequant = _dequant_const
        dg._vpair = _vpair_library
    else:
        raise SystemExit(f"unknown variant {variant!r} (see the docstring)")


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "base"
    patch(variant)
    bw = copy_bandwidth()
    shapes = [("llama-3-8b", 8, 32768), ("llama-3-8b", 8, 131072), ("llama-3-8b", 1, 131072)]
    for model, B, T in shapes:
        hq, hkv, d = MODELS[model]
        q, fp = flash_graph_us(B, hq, hkv, T, d)
        for preset in ("kivi-2", "kivi-4"):
            kv = random_packed_kv(B, hkv, T, d, resolve_spec(preset))
            nb = packed_nbytes(kv)
            us = bench_graph(lambda q=q, kv=kv, d=d: decode_attention(q, kv, scale=d ** -0.5))
            print(json.dumps({"variant": variant, "model": model, "B": B, "T": T,
                              "preset": preset, "us": round(us, 1), "flash_us": round(fp, 1),
                              "speedup": round(fp / us, 3),
                              "frac_bw": round(nb / us * 1e6 / bw, 3)}), flush=True)


if __name__ == "__main__":
    main()
