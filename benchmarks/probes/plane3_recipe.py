"""The 3-bit plane unpacking planned for a Gluon kivi-3 / KVQuant body (docs/KERNEL_LOG.md, "A
KVQuant Gluon body, planned on paper"), emulated on 32-bit integers and checked against
``kvbits.formats.packing`` on random codes, before any kernel is written. No GPU needed:

    PYTHONPATH=src python3 benchmarks/probes/plane3_recipe.py

Token order of a 64-token step at G = 32 (the register body's ``n = e + 2a + 8h + 16k`` with lane
bits ``e, a0, a1`` and register bits ``h, k``): token ``n`` is plane bit position
``p = 16e + 4k + h + 2a0`` of column (group) ``a1`` (at G = 64, one group of two columns,
the same bits name token ``2p + a1``: the thread code is the same). Each sequence of integer operations below is
one PTX instruction per line (``prmt``, ``shf``, ``lop3``), counted in ``OPS``:

* keys, a thread (``e, a0, a1``; one channel pair ``d, d+1``): ``u_j = prmt(P_j[d], P_j[d+1])``
  keeps the 16-bit half ``e`` of each plane word (channel d low, d+1 high); ``v_j = u_j >> 2a0``
  (the only lane-dependent shift); then for each ``h`` the three planes merge into nibbles,
  ``X_h = OR_j shift(v_j, j - h) & (0x11111111 << j)``, so nibble ``m`` holds the code of token
  ``k = m`` (channel d for m < 4, channel d+1 for m >= 4); nibbles ``m, m+4`` are the ``half2`` of
  one token, read by the register body's magic-number ``lop3`` in place for ``k = 0, 1`` and after
  ``>> 8`` for ``k = 2, 3``.
* values, a thread (``a0, a1``; one channel): ``v_j = P_j[d] >> 2a0`` and the same merge; nibble
  ``m = k + 4e`` is token ``(e, k)``, so nibbles ``k, k+4`` are the ``half2`` of the token pair
  ``e = 0, 1`` the value operand wants.
"""
import sys

import torch

from kvbits.formats.packing import pack_bits

M32 = 0xFFFFFFFF
OPS = {"keys": 0, "values": 0}


def _shift(x: int, s: int) -> int:
    """One ``shf``: left for ``s > 0``, right for ``s < 0`` (32-bit)."""
    return (x << s) & M32 if s >= 0 else x >> -s


def _merge(v: list[int], h: int, who: str) -> int:
    """The three planes (already ``>> 2a0``) into one word of nibble-aligned 3-bit codes."""
    x = 0
    for j in range(3):
        t = _shift(v[j], j - h)
        OPS[who] += (j != h) + 1  # a shift unless the plane is already in place, one lop3
        x |= t & (0x11111111 << j)
    return x


def _prmt_half(lo: int, hi: int, e: int) -> int:
    """``prmt(lo, hi, 0x5410 | 0x2222 e)``: half ``e`` of ``lo`` below half ``e`` of ``hi``."""
    return ((lo >> (16 * e)) & 0xFFFF) | (((hi >> (16 * e)) & 0xFFFF) << 16)


def _nibble_codes(x: int) -> list[int]:
    """What the magic-number ``lop3`` reads: nibble m's three low bits."""
    return [(x >> (4 * m)) & 7 for m in range(8)]


def check(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 8, (64, 2), generator=g)  # [token, channel] of one step
    # each key group of G = 32 tokens packed on its own (the cache's layout): group a1 is word
    # rows 3 a1 + j, plane j holding bit j of token 32 a1 + p at bit p
    words = torch.cat([pack_bits(codes[32 * i:32 * (i + 1)], 3, dim=0) for i in range(2)])
    w = (words.to(torch.int64) & M32).tolist()
    for a1 in range(2):
        planes = [[w[3 * a1 + j][c] for c in range(2)] for j in range(3)]
        for a0 in range(2):
            for e in range(2):  # keys: channels (0, 1) as the pair
                v = [_prmt_half(planes[j][0], planes[j][1], e) >> (2 * a0) for j in range(3)]
                OPS["keys"] += 6
                for h in range(2):
                    got = _nibble_codes(_merge(v, h, "keys"))
                    for k in range(4):
                        t = 32 * a1 + 16 * e + 4 * k + h + 2 * a0
                        want = [int(codes[t, 0]), int(codes[t, 1])]
                        assert [got[k], got[k + 4]] == want, (a1, a0, e, h, k, got, want)
            for c in range(2):  # values: channel c, tokens e = 0, 1 paired
                v = [planes[j][c] >> (2 * a0) for j in range(3)]
                OPS["values"] += 3
                for h in range(2):
                    got = _nibble_codes(_merge(v, h, "values"))
                    for k in range(4):
                        ts = [32 * a1 + 16 * e + 4 * k + h + 2 * a0 for e in range(2)]
                        want = [int(codes[t, c]) for t in ts]
                        assert [got[k], got[k + 4]] == want, (a1, a0, h, k, got, want)
    # every token of the step is visited exactly once per channel
    seen = sorted(32 * a1 + 16 * e + 4 * k + h + 2 * a0 for a1 in range(2) for a0 in range(2)
                  for e in range(2) for h in range(2) for k in range(4))
    assert seen == list(range(64))


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    for s in range(n):
        check(s)
    # per thread and channel pair (keys: 8 tokens) or channel (values: 8 token pairs), per call
    calls = n * 2 * 2 * 2
    print(f"{n} random steps: every code recovered. Unpack ops before the magic-number dequant: "
          f"keys {OPS['keys'] / calls:.1f} per 8 pairs, values {OPS['values'] / calls:.1f} per "
          f"8 pairs; the dequant adds 3 per pair (lop3 + 2 HFMA2) and 2 shifts (k = 2, 3).")
