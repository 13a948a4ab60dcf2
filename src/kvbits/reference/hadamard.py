"""Fixed orthonormal Hadamard rotation of keys and queries (calibration-free outlier smoothing).

``H`` is the Sylvester Hadamard matrix of size ``n`` (a power of two) divided by ``sqrt(n)``: it
is symmetric and orthonormal (``H @ H = I``), so rotating keys and queries alike leaves every
attention score unchanged, ``(q H) . (k H) = q . k``, while a channel with large magnitude (an
outlier) is spread over all channels before quantization. Head dimensions that are not a power of
two (80, 96, ...) use a block-diagonal matrix of the largest power-of-two block dividing them
(e.g. 96 = 3 blocks of 32, 80 = 5 of 16), still orthonormal and symmetric.
"""

from __future__ import annotations

import functools
import math

import torch


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
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(n)
    return torch.block_diag(*([h] * (head_dim // n))).float()


def hadamard_matrix(head_dim: int, device=None) -> torch.Tensor:
    """float32 ``[head_dim, head_dim]`` normalized (block-diagonal) Hadamard matrix, symmetric
    and orthonormal."""
    return _matrix_cpu(head_dim).to(device)


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last dimension, computed in float32, returned in ``x.dtype``.

    ``H`` is its own inverse, so the same call undoes the rotation."""
    return (x.float() @ matrix).to(x.dtype)
