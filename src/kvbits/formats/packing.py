"""Bit packing of integer codes into int32 words: the one layout every part of kvbits shares.

The layout is *slot-major* ("strided"), chosen so that a kernel unpacks a tile with one shift per
slot and a reshape that only merges leading dimensions (no interleaving shuffle):

* An axis of N codes is padded with zeros to P = W * slots, where ``slots`` is ``32 // bits``
  for 2, 4 and 8 bits and 32 for 3 bits. Element ``e`` sits in column ``w = e % W`` and slot
  ``s = e // W``, so unpacking slot ``s`` of all W columns yields the contiguous elements
  ``[s * W, (s + 1) * W)``.
* 2, 4, 8 bits ("fields"): word ``w`` holds slot ``s`` in bits ``[s * bits, (s + 1) * bits)``.
  The axis is W words long.
* 3 bits ("bit planes"): 32 slots per column, stored as 3 words per column; word ``j * W + w``
  holds bit ``j`` of the code in slot ``s`` at bit position ``s``. The axis is 3 * W words long,
  exactly 3 bits per element when N is a multiple of 32.

The words are int32 (two's complement); the top slot of a field word may set the sign bit, so
unpacking masks after an arithmetic shift.
"""

from __future__ import annotations

import torch

from ..checks import as_int

PACK_BITS = (2, 3, 4, 8)


def slots_per_column(bits: int) -> int:
    """Codes that share one column of words: 32 // bits, or 32 for 3-bit bit planes."""
    _check_bits(bits)
    return 32 if bits == 3 else 32 // bits


def packed_length(n: int, bits: int) -> int:
    """Number of int32 words that hold ``n`` codes of ``bits`` bits (after zero padding)."""
    slots = slots_per_column(bits)
    if as_int(n) is None or n < 0:  # (a negative count gave 0 words, a float a float)
        raise ValueError(f"packed_length: n must be a non-negative int (codes), got {n!r}")
    columns = -(-n // slots)
    return columns * (3 if bits == 3 else 1)


def pack_bits(codes: torch.Tensor, bits: int, dim: int = -1, check: bool = True) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along ``dim`` into int32 words.

    Args:
        codes: integer tensor (any int dtype) of codes; never modified.
        bits: 2, 3, 4 or 8.
        dim: the axis to pack; its length N may be anything >= 1 (padded with zero codes).
        check: verify the range (reads the codes' min and max on the host: a device sync, not
            allowed inside a CUDA-graph capture); callers whose codes are in range by
            construction pass False.

    Returns:
        int32 tensor with ``dim`` of length ``packed_length(N, bits)``; other dims unchanged.
    """
    _check_bits(bits)
    if codes.is_floating_point() or codes.is_complex():
        raise TypeError(f"pack_bits: codes must be an integer tensor, got {codes.dtype}")
    dim = _axis("pack_bits", dim, codes.dim())
    n = codes.shape[dim]
    if n == 0:
        raise ValueError("pack_bits: the packed axis is empty")
    slots = slots_per_column(bits)
    columns = -(-n // slots)
    x = codes.movedim(dim, -1).to(torch.int64)
    if check and x.numel() and (int(x.min()) < 0 or int(x.max()) >= (1 << bits)):
        raise ValueError(f"pack_bits: codes must lie in [0, {1 << bits}) for bits={bits}")
    x = torch.nn.functional.pad(x, (0, columns * slots - n))
    x = x.reshape(*x.shape[:-1], slots, columns)  # [..., slot, column]
    if bits == 3:
        shifts = torch.arange(slots, device=x.device).view(slots, 1)
        planes = [(((x >> j) & 1) << shifts).sum(-2) for j in range(3)]  # each [..., column]
        words = torch.cat(planes, dim=-1)
    else:
        shifts = (torch.arange(slots, device=x.device) * bits).view(slots, 1)
        words = (x << shifts).sum(-2)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _axis(op: str, dim: int, ndim: int) -> int:
    """``dim`` as a non-negative axis of an ``ndim``-d tensor (it wrapped silently before)."""
    if ndim == 0 or as_int(dim) is None or not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim must be in [{-ndim}, {ndim}) for a {ndim}-d tensor, got "
                         f"{dim}")
    return dim % ndim


def unpack_bits(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 words -> uint8 codes, ``n`` of them along ``dim``."""
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise TypeError(f"unpack_bits: words must be int32, got {words.dtype}")
    dim = _axis("unpack_bits", dim, words.dim())
    if as_int(n) is None or n < 0:
        raise ValueError(f"unpack_bits: n must be a non-negative int (codes), got {n!r}")
    if words.shape[dim] != packed_length(n, bits):
        raise ValueError(
            f"unpack_bits: axis {dim} has {words.shape[dim]} words, "
            f"but {n} codes of {bits} bits need {packed_length(n, bits)}"
        )
    slots = slots_per_column(bits)
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    if bits == 3:
        columns = w.shape[-1] // 3
        planes = w.reshape(*w.shape[:-1], 3, 1, columns)  # [..., plane, 1, column]
        shifts = torch.arange(slots, device=w.device).view(slots, 1)
        codes = sum(((planes[..., j, :, :] >> shifts) & 1) << j for j in range(3))
    else:
        shifts = (torch.arange(slots, device=w.device) * bits).view(slots, 1)
        codes = (w.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)  # [..., slot, column]
    # (not reshape(..., -1): ambiguous when another axis is 0, as in an empty body)
    codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * codes.shape[-1])[..., :n]
    return codes.to(torch.uint8).movedim(-1, dim).contiguous()


def _check_bits(bits: int) -> None:
    if as_int(bits) is None or bits not in PACK_BITS:  # (2.0 passed, then failed in a shift)
        raise ValueError(f"bits must be one of {PACK_BITS}, got {bits!r}")
