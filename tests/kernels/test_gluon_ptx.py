"""The inline PTX of the Gluon decode body, executed on the CPU by a small interpreter of the few
instructions it uses (``mov``, ``lop3``, ``prmt``, ``fma.rn.f16x2``), on random inputs against
what each snippet must compute. Gluon has no interpreter, so without this the arithmetic in these
strings is checked only on a GPU.

* ``_pair_asm``: the magic-number dequant of a code field (2 or 4 bits; 3-bit codes in the
  4-bit fields the plane merge produces), ``code * scale + zero`` with one rounding.
* ``_cb_pair_asm``: the KVQuant codebook lookup of two fields of 3-bit codes in an 8-entry
  float16 table held as low/high byte registers, then ``* scale + zero``; ``_cb16_pair_asm``
  the same for 4-bit codes in a 16-entry table (two lookups, one picked by each code's bit 3),
  ``_cb2_pair_asm`` for 2-bit codes (every slot of a word) in a 4-entry table.
* the 3-bit body's operands (``_key_loads3`` / ``_key_operand3`` / ``_key_tile``, the value
  words of ``_value_loads3`` / ``_value_operand3``) mirrored op by op in NumPy, with that PTX,
  on codes packed by the reference quantizer: each MMA row must hold its token's dequantized
  key (or code). The mirror follows ``decode_gluon``'s functions and must change with them.
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
    """``prmt.b32`` in its default mode: selector nibble ``i`` picks byte ``n & 7`` of ``{b, a}``
    for result byte ``i``; with bit 3 set, that byte's sign bit replicated (0x00 or 0xFF)."""
    pool = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (n & 7))) & 0xFF
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
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
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "shl.b32":
            regs[a[0]] = (val(a[1]) << min(val(a[2]), 32)) & M32
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> min(val(a[2]), 32)
        elif op == "mad.lo.u32":
            regs[a[0]] = (val(a[1]) * val(a[2]) + val(a[3])) & M32
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
    """An 8- or 16-entry float16 codebook as the prmt table words of ``_cb_tables`` /
    ``_cb_tables16``: the low bytes of each four entries, then the high bytes."""
    b = cb.astype(np.float16).view(np.uint16).astype(np.int64)
    lo, hi = b & 0xFF, b >> 8
    return [int(sum(int(t[i + 4 * w]) << (8 * i) for i in range(4))) for t in (lo, hi)
            for w in range(len(cb) // 4)]


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


@pytest.mark.parametrize("p0", [0, 2])
def test_codebook16_lookup_ptx(p0):
    """4-bit codes (every value 0-15, bit 3 set in half of them) in a 16-entry table, entries of
    both signs (the byte selection must carry each entry's high byte whole)."""
    rng = np.random.default_rng(10 + p0)
    for _ in range(300):
        cb = np.sort(rng.uniform(-8.0, 16.0, 16)).astype(np.float16)
        tables = _tables(cb)
        codes = rng.integers(0, 16, size=(2, 4))  # [half, field]
        u = sum(int(codes[hf, f]) << (16 * hf + 4 * f) for hf in range(2) for f in range(4))
        s = rng.uniform(0.01, 2.0, (2, 2)).astype(np.float16)
        z = rng.uniform(-3.0, 3.0, (2, 2)).astype(np.float16)
        got = run_ptx(dg._cb16_pair_asm(p0), 2,
                      [u, *tables, _word(s[0]), _word(z[0]), _word(s[1]), _word(z[1])])
        for k in range(2):
            f = p0 + k
            want = [_fma16(cb[codes[hf, f]], s[k][hf], z[k][hf]) for hf in range(2)]
            assert list(_h2(got[k])) == want, (p0, f, codes[:, f], cb)


def test_codebook2_lookup_ptx():
    """2-bit codes at every slot of both 16-bit halves in a 4-entry table, entries of both signs;
    the other slots' codes (random) must not leak into the selector."""
    rng = np.random.default_rng(21)
    for _ in range(300):
        cb = np.sort(rng.uniform(-2.0, 5.0, 4)).astype(np.float16)
        lo, hi = _tables(cb)
        codes = rng.integers(0, 4, size=(2, 8))  # [half, slot]
        u = sum(int(codes[hf, p]) << (16 * hf + 2 * p) for hf in range(2) for p in range(8))
        s = rng.uniform(0.01, 2.0, 2).astype(np.float16)
        z = rng.uniform(-3.0, 3.0, 2).astype(np.float16)
        for p in range(8):
            (got,) = run_ptx(dg._cb2_pair_asm(p), 1, [u, lo, hi, _word(s), _word(z)])
            want = [_fma16(cb[codes[hf, p]], s[hf], z[hf]) for hf in range(2)]
            assert list(_h2(got)) == want, (p, codes[:, p], cb)


def test_prmt_sign_replication_emulated():
    """The emulator's prmt against the PTX manual's rule for selector bit 3 (msb replicated)."""
    assert _prmt(0x80_7F_00_FF, 0, 0xBA98) == 0xFF_00_00_FF
    assert _prmt(0x80_7F_00_FF, 0, 0x3210) == 0x80_7F_00_FF


def test_interpreter_knows_every_instruction():
    """The snippets use only what run_ptx emulates (a new instruction fails here, not silently)."""
    for asm in [dg._pair_asm(p, b) for b in (2, 4) for p in range(dg._in_place(b))] + \
            [dg._cb_pair_asm(p) for p in (0, 2)] + [dg._cb16_pair_asm(p) for p in (0, 2)] + \
            [dg._cb2_pair_asm(p) for p in range(8)]:
        ops = {m.group(1) for m in re.finditer(r"(?:^|;|\{)\s*([a-z][\w.]*)", asm)}
        assert ops <= {"mov.b32", "lop3.b32", "prmt.b32", "fma.rn.f16x2", "and.b32",
                       "shl.b32", "shr.b32", "mad.lo.u32"}, ops


# ----------------------------------------------------------------------------- 3-bit operands
# The glue of the 3-bit body mirrored op by op in NumPy (Gluon's join / permute / reshape have
# NumPy's value semantics; layouts only decide where values live), with the PTX run by run_ptx:
# the K operand tile a step builds must hold, at row n = e + 2a + 8h + 16k, the dequantized key
# of the token token_order(3, G)[n] gives that row (the token its mask and scales use).
def _u32(x) -> int:
    return int(x) & M32


def _stack_h(x0, x1, dim):
    """``decode_gluon._stack_h``: join (h last), the same permute, the same reshape."""
    x = np.stack([x0, x1], axis=-1)
    x = np.transpose(x, (4, 1, 2, 3, 0) if dim == 0 else (0, 1, 4, 3, 2))
    shape = list(x.shape[:-1])
    shape[dim] = 2
    return x.reshape(shape)


def _key_tile_3bit(codes_w, scale, zero, s, DC0, G, D, tables=None):
    """``_key_loads3`` + ``_key_operand3`` (+ ``_key_operand_cb``) + ``_key_tile`` for one step
    and channel half: ``[64, D/2]`` float16."""
    CW, D2, DC = G // 32, D // 2, D // 2
    sw = scale.view(np.uint32).reshape(scale.shape[0], D2)  # int32 view: channel pairs
    zw = zero.view(np.uint32).reshape(zero.shape[0], D2)
    cw = codes_w.view(np.uint32)
    J = DC // 2
    u = [np.zeros((1, 4, 2, J), dtype=np.uint64) for _ in range(2)]  # per h, [1, A, E, J]
    sc = np.zeros((1, 4, 2, J), dtype=np.uint64)
    ze = np.zeros_like(sc)
    for a in range(4):
        a1 = a // 2
        g = s * (64 // G) + a1 // CW
        row = g * 3 * CW + a1 % CW
        for e in range(2):
            for jj in range(J):
                j = jj + DC0 // 2
                sel = 0x5410 + 0x2222 * e
                v = [_prmt(_u32(cw[row + p * CW, 2 * j]), _u32(cw[row + p * CW, 2 * j + 1]), sel)
                     >> (2 * (a % 2)) for p in range(3)]
                for h in range(2):
                    u[h][0, a, e, jj] = _merge(v, h)
                sc[0, a, e, jj], ze[0, a, e, jj] = _u32(sw[g, j]), _u32(zw[g, j])
    u = _stack_h(u[0], u[1], 0)  # [H, A, E, J]
    out = np.zeros((2, 4, 2, J, 4), dtype=np.uint64)  # [.., slot]
    for idx in np.ndindex(2, 4, 2, J):
        x, sc_, ze_ = int(u[idx]), int(sc[(0,) + idx[1:]]), int(ze[(0,) + idx[1:]])
        if tables is None:
            for P in range(4):
                (out[idx + (P,)],) = run_ptx(dg._pair_asm(P % 2, 4), 1,
                                             [x >> 8 if P >= 2 else x, sc_, ze_])
        else:
            for P0 in (0, 2):
                out[idx + (P0,)], out[idx + (P0 + 1,)] = run_ptx(
                    dg._cb_pair_asm(P0), 2, [x, *tables, sc_, ze_, sc_, ze_])
    # _join4: [.., i0, i1] holds slot i0 + 2 i1; _key_tile: permute (5, 4, 0, 1, 2, 3), reshape
    k = out.reshape(2, 4, 2, J, 2, 2).swapaxes(-1, -2)
    k = np.transpose(k, (5, 4, 0, 1, 2, 3)).reshape(64, J).astype(np.uint32)
    lo = (k & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (k >> 16).astype(np.uint16).view(np.float16)
    return np.stack([lo, hi], axis=-1).reshape(64, DC)


def _merge(v, h):
    """``_merge_planes`` (uint32 math)."""
    M = 0x11111111
    if h == 0:
        x = (v[0] & M) | ((v[1] << 1) & (M << 1)) | ((v[2] << 2) & (M << 2))
    else:
        x = ((v[0] >> 1) & M) | (v[1] & (M << 1)) | ((v[2] << 1) & (M << 2))
    return x & M32


@pytest.mark.parametrize("G,cb", [(32, False), (64, False), (32, True)])
def test_plane_key_operand_mirrored(G, cb):
    import torch

    from kvbits.formats.packing import unpack_bits
    from kvbits.reference.quant import quantize_keys

    D = 128
    g = torch.Generator().manual_seed(G + cb)
    x = torch.randn(1, 1, 128, D, generator=g) * (1 + torch.rand(D, generator=g) * 3)
    words, scale, zero = quantize_keys(x, 3, G)
    CW = G // 32
    codes = torch.cat([unpack_bits(words[0, 0, r * 3 * CW:(r + 1) * 3 * CW], 3, G, dim=0)
                       for r in range(128 // G)]).numpy()  # [128, D]
    sc, ze = scale[0, 0].numpy(), zero[0, 0].numpy()  # [groups, D] float16
    rng = np.random.default_rng(G)
    table = np.sort(rng.uniform(-0.5, 7.5, 8)).astype(np.float16) if cb else None
    order = dg.token_order(3, G)
    for s in range(2):
        for DC0 in (0, D // 2):
            got = _key_tile_3bit(words[0, 0].numpy(), sc, ze, s, DC0, G, D,
                                 _tables(table) if cb else None)
            for n in range(64):
                t = s * 64 + order[n]
                for c in range(D // 2):
                    ch = DC0 + c
                    code = table[codes[t, ch]] if cb else codes[t, ch]
                    want = _fma16(code, sc[t // G, ch], ze[t // G, ch])
                    assert got[n, c] == want, (G, cb, s, DC0, n, c)


@pytest.mark.parametrize("G,D,GV", [(32, 128, 32), (64, 64, 64)])
def test_plane_value_words_mirrored(G, D, GV):
    """``_value_loads3`` + ``_value_operand3``'s merge and ``_stack_h(dim=2)``: the 4-bit value
    words ``[NGC, GVC, H, A]`` whose field ``k + 4e`` must hold the code of the token at row
    ``n = e + 2a + 8h + 16k`` (the pair e = 0, 1 of one ``half2``)."""
    import torch

    from kvbits.formats.packing import unpack_bits
    from kvbits.reference.quant import quantize_keys

    g = torch.Generator().manual_seed(G + D)
    words, _, _ = quantize_keys(torch.randn(1, 1, 128, D, generator=g), 3, G)  # same packing
    CW, DC = G // 32, D // 2
    codes = torch.cat([unpack_bits(words[0, 0, r * 3 * CW:(r + 1) * 3 * CW], 3, G, dim=0)
                       for r in range(128 // G)]).numpy()
    cw = words[0, 0].numpy().view(np.uint32)
    order = dg.token_order(3, G)
    GVC = min(GV, DC)
    NGC = DC // GVC
    for s in range(2):
        for DC0 in (0, DC):
            w = [np.zeros((NGC, GVC, 1, 4), dtype=np.uint64) for _ in range(2)]
            for gi, c, a in np.ndindex(NGC, GVC, 4):
                a1 = a // 2
                grp = s * (64 // G) + a1 // CW
                row = grp * 3 * CW + a1 % CW
                ch = DC0 + gi * GVC + c
                v = [_u32(cw[row + p * CW, ch]) >> (2 * (a % 2)) for p in range(3)]
                for h in range(2):
                    w[h][gi, c, 0, a] = _merge(v, h)
            w = _stack_h(w[0], w[1], 2)  # [NGC, GVC, H, A]
            for gi, c, h, a in np.ndindex(NGC, GVC, 2, 4):
                for k in range(4):
                    for e in range(2):
                        t = s * 64 + order[e + 2 * a + 8 * h + 16 * k]
                        field = (int(w[gi, c, h, a]) >> (4 * (k + 4 * e))) & 0xF
                        assert field == codes[t, DC0 + gi * GVC + c], (G, s, gi, c, h, a, k, e)
