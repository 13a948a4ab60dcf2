"""Fixed orthonormal Hadamard rotation of keys and queries (calibration-free outlier smoothing).

``H`` is the Sylvester Hadamard matrix of size ``n`` (a power of two) divided by ``sqrt(n)``: it
is symmetric and orthonormal (``H @ H = I``), so rotating keys and queries alike leaves every
attention score unchanged, ``(q H) . (k H) = q . k``, while a channel with large magnitude (an
outlier) is spread over all channels before quantization. Head dimensions that are not a power of
two (80, 96, ...) use a block-diagonal matrix of the largest power-of-two block dividing them
(e.g. 96 = 3 blocks of 32, 80 = 5 of 16), still orthonormal and symmetric.

Calibrated subsets (``QuantSpec.hadamard_calibrated``): :func:`subset_matrix` mixes only a chosen
set of channels of one head (a Hadamard over them, identity elsewhere); it is still symmetric,
orthonormal and its own inverse, so the same invariance holds. :func:`head_matrices` stacks one
such matrix per KV head (``[H, D, D]``); :func:`rotate` broadcasts it over ``[B, H, T, D]``
(queries of grouped-query attention as ``[B, H, group x rows, D]``, each with its KV head's).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..checks import as_int


def block_size(head_dim: int) -> int:
    """The Hadamard block used for ``head_dim``: its largest power-of-two divisor (>= 8)."""
    if head_dim < 1:
        raise ValueError(f"hadamard: head_dim must be positive, got {head_dim}")
    block = head_dim & -head_dim
    if block < 8:
        raise ValueError(
            f"hadamard: head_dim {head_dim} has no power-of-two block of at least 8 channels "
            f"(largest power-of-two divisor: {block}); use hadamard=False for this model")
    return block


@functools.lru_cache(maxsize=16)
def _matrix_cpu(head_dim: int) -> torch.Tensor:
    n = block_size(head_dim)
    return torch.block_diag(*([_sylvester(n)] * (head_dim // n))).float()


def hadamard_matrix(head_dim: int, device=None) -> torch.Tensor:
    """float32 ``[head_dim, head_dim]`` normalized (block-diagonal) Hadamard matrix, symmetric
    and orthonormal."""
    return _matrix_cpu(head_dim).to(device)


class Rotation(NamedTuple):
    """A rotation matrix split for :func:`rotate`: every column of a (subset) Hadamard matrix is
    a sign pattern times one magnitude (``1/sqrt(n)``, or 1 for a channel a subset leaves
    alone). Built once per matrix (:func:`factor`), not per call on the decode path."""

    signs: torch.Tensor  # [..., D, D] of -1 / 0 / 1, float64 (float32 on MPS)
    magnitude: torch.Tensor  # [..., 1, D], the same dtype


def factor(matrix: torch.Tensor) -> Rotation:
    """``matrix`` (``[D, D]`` or ``[H, D, D]``) as signs and per-column magnitudes, in float64
    (Apple's MPS has no float64: float32 there)."""
    wide = torch.float32 if matrix.device.type == "mps" else torch.float64
    m = matrix.to(wide)
    return Rotation(torch.sign(m), m.abs().amax(dim=-2, keepdim=True))


def rotate(x: torch.Tensor, matrix: torch.Tensor | Rotation) -> torch.Tensor:
    """``x @ H`` over the last dimension, returned in ``x.dtype``.

    ``matrix`` is ``[D, D]`` or per head ``[H, D, D]`` (``x [B, H, T, D]``), or its
    :func:`factor`. ``H`` is its own inverse, so the same call undoes the rotation.

    The product is summed as ``(x @ signs) * magnitude`` in float64: the sums of float16 and
    bfloat16 inputs (and of float32 ones within 2^29 of each other) are exact there, whatever
    order the matmul adds them in. A token's rotated key is then the same bits whether it came
    in one big append or token by token (a float32 matmul blocks by the token count and
    differed in the last bit). On MPS the sums stay float32.

    A rotated channel sums a block of ``n`` channels / sqrt(n), so finite inputs can pass their
    dtype's range (float16: 65504); the result saturates there instead of becoming inf (NaN
    attention scores). NaN stays NaN."""
    rot = matrix if isinstance(matrix, Rotation) else factor(matrix)
    y = (x.to(rot.signs.dtype) @ rot.signs) * rot.magnitude
    if x.dtype.is_floating_point and x.dtype.itemsize < y.dtype.itemsize:
        top = torch.finfo(x.dtype).max
        y = y.clamp(-top, top)
    return y.to(x.dtype)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def subset_matrix(head_dim: int, channels) -> torch.Tensor:
    """float32 ``[head_dim, head_dim]``: a normalized Hadamard over ``channels`` (their count a
    power of two, in the given order), identity on the other channels; no channel -> identity.

    Symmetric and orthonormal (a permuted block-diagonal of a Hadamard and an identity), hence
    its own inverse."""
    given = list(channels)
    chans = [as_int(c) for c in given]  # (int() took 0.5 as channel 0, silently)
    n = len(chans)
    if None in chans or len(set(chans)) != n or any(not 0 <= c < head_dim for c in chans):
        raise ValueError(f"hadamard: channels must be distinct integer indices below head_dim "
                         f"{head_dim}, got {given}")
    m = torch.eye(head_dim, dtype=torch.float64)
    if n:
        if n & (n - 1):
            raise ValueError(f"hadamard: a channel subset must have a power-of-two size, got {n}")
        idx = torch.tensor(chans)
        m[idx[:, None], idx[None, :]] = _sylvester(n)
    return m.float()


def head_matrices(head_dim: int, subsets, device=None) -> torch.Tensor:
    """float32 ``[H, D, D]``: :func:`subset_matrix` of each KV head's channel subset."""
    return torch.stack([subset_matrix(head_dim, s) for s in subsets]).to(device)
