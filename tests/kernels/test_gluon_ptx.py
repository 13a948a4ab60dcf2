"""The inline PTX of the Gluon decode body, executed on the CPU by a small interpreter of the few
instructions it uses (``mov``, ``lop3``, ``prmt``, ``fma.rn.f16x2``), on random inputs against
what each snippet must compute. Gluon has no interpreter, so without this the arithmetic in these
strings is checked only on a GPU.

* ``_pair_asm``: the magic-number dequant of a code field (2 or 4 bits; 3-bit codes in the
  4-bit fields the plane merge produces), ``code * scale + zero`` with one rounding.
* ``_cb_pair_asm``: the KVQuant codebook lookup of two fields of 3-bit codes in an 8-entry
  float16 table held as low/high byte registers, then ``* scale + zero``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvbits.kernels import decode_gluon as dg

pytestmark = pytest.mark.skipif(dg.gluon is None, reason="this Triton has no Gluon")
M32 = 0xFFFFFFFF


def _h2(x: int) -> np.ndarray:
    """int32 word -> its two float16 halves (low first)."""
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _word(h: np.ndarray) -> int:
    u = np.asarray(h, dtype=np.float16).view(np.uint16).astype(np.uint64)
    return int(u[0]) | (int(u[1]) << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        assert n < 8, "sign-replicate mode is not used by these snippets"
        out |= ((pool >> (8 * n)) & 0xFF) << (8 * i)
    return out


def run_ptx(asm: str, outs: int, ins: list[int]) -> list[int]:
    """Execute ``asm`` with ``$0 .. $outs-1`` as outputs and the rest bound to ``ins``."""
    regs = {f"${outs + i}": v & M32 for i, v in enumerate(ins)}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) & M32 if tok[0].isdigit() else regs[tok]

    body = asm.strip().strip("{}")
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, _, args = stmt.partition(" ")
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "lop3.b32":
            x, y, z, lut = (val(t) for t in a[1:])
            r = 0
            for bit in range(32):
                i = (((x >> bit) & 1) << 2) | (((y >> bit) & 1) << 1) | ((z >> bit) & 1)
                r |= ((lut >> i) & 1) << bit
            regs[a[0]] = r
        elif op == "prmt.b32":
            regs[a[0]] = _prmt(val(a[1]), val(a[2]), val(a[3]))
        elif op == "fma.rn.f16x2":  # one rounding: fp16 products are exact in float64
            x, y, z = (_h2(val(t)).astype(np.float64) for t in a[1:])
            regs[a[0]] = _word((x * y + z).astype(np.float16))
        else:
            raise AssertionError(f"instruction not emulated: {op}")
    return [regs[f"${i}"] for i in range(outs)]


def _fma16(c, s, z):
    """What the reference's float16 path computes: ``c * s + z`` rounded once to float16."""
    return (np.float64(c) * np.float64(np.float16(s)) + np.float64(np.float16(z))).astype(
        np.float16)


@pytest.mark.parametrize("bits,code_bits", [(2, 2), (4, 4), (4, 3)])
def test_magic_dequant_ptx(bits, code_bits):
    rng = np.random.default_rng(bits * 10 + code_bits)
    slots = 16 // bits
    n_in_place = dg._in_place(bits)
    for _ in range(200):
        codes = rng.integers(0, 1 << code_bits, size=(2, slots))  # [half, slot]
        u = 0
        for hf in range(2):
            for p in range(slots):
                u |= int(codes[hf, p]) << (16 * hf + bits * p)
        s = rng.uniform(0.01, 2.0, 2).astype(np.float16)
        z = rng.uniform(-3.0, 3.0, 2).astype(np.float16)
        for p in range(slots):
            x = u >> (bits * n_in_place) if p >= n_in_place else u  # as _dequant does
            (got,) = run_ptx(dg._pair_asm(p % n_in_place, bits), 1, [x, _word(s), _word(z)])
            want = [_fma16(codes[hf, p], s[hf], z[hf]) for hf in range(2)]
            assert list(_h2(got)) == want, (bits, p, codes[:, p])


def _tables(cb: np.ndarray) -> list[int]:
    """An 8-entry float16 codebook as the four prmt table words of ``_cb_tables``."""
    b = cb.astype(np.float16).view(np.uint16).astype(np.int64)
    lo, hi = b & 0xFF, b >> 8
    return [int(sum(int(t[i + 4 * w]) << (8 * i) for i in range(4))) for t in (lo, hi)
            for w in (0, 1)]


@pytest.mark.parametrize("p0", [0, 2])
def test_codebook_lookup_ptx(p0):
    rng = np.random.default_rng(p0)
    for _ in range(300):
        cb = np.sort(rng.uniform(-0.5, 7.5, 8)).astype(np.float16)  # code units, uneven
        lo0, lo1, hi0, hi1 = _tables(cb)
        codes = rng.integers(0, 8, size=(2, 4))  # [half, field] of 3-bit codes in 4-bit fields
        u = sum(int(codes[hf, f]) << (16 * hf + 4 * f) for hf in range(2) for f in range(4))
        s = rng.uniform(0.01, 2.0, (2, 2)).astype(np.float16)  # per field pair: (s, z) half2s
        z = rng.uniform(-3.0, 3.0, (2, 2)).astype(np.float16)
        got = run_ptx(dg._cb_pair_asm(p0), 2,
                      [u, lo0, lo1, hi0, hi1, _word(s[0]), _word(z[0]), _word(s[1]), _word(z[1])])
        for k in range(2):
            f = p0 + k
            want = [_fma16(cb[codes[hf, f]], s[k][hf], z[k][hf]) for hf in range(2)]
            assert list(_h2(got[k])) == want, (p0, f, codes[:, f], cb)


def test_interpreter_knows_every_instruction():
    """The snippets use only what run_ptx emulates (a new instruction fails here, not silently)."""
    for asm in [dg._pair_asm(p, b) for b in (2, 4) for p in range(dg._in_place(b))] + \
            [dg._cb_pair_asm(p) for p in (0, 2)]:
        ops = {m.group(1) for m in re.finditer(r"(?:^|;|\{)\s*([a-z][\w.]*)", asm)}
        assert ops <= {"mov.b32", "lop3.b32", "prmt.b32", "fma.rn.f16x2"}, ops
