"""Hadamard rotation of keys: orthonormal, scores unchanged, block-diagonal head dims."""

from __future__ import annotations

import pytest
import torch

from kvbits.cache.store import LayerStore
from kvbits.reference.attention import decode_attention, dequantize_layer
from kvbits.reference.hadamard import block_size, hadamard_matrix, rotate
from kvbits.spec import resolve_spec


@pytest.mark.parametrize("d", [64, 128, 256, 80, 96])
def test_matrix_is_symmetric_orthonormal(d):
    h = hadamard_matrix(d).double()
    assert torch.allclose(h, h.T)
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-6)
    assert block_size(d) == {64: 64, 128: 128, 256: 256, 80: 16, 96: 32}[d]
    # every entry of a block is +-1/sqrt(block): outliers spread over the whole block
    n = block_size(d)
    assert torch.allclose(h[:n, :n].abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


@pytest.mark.parametrize("d", [6, 12, 1])
def test_head_dim_without_block_is_refused(d):
    with pytest.raises(ValueError, match="hadamard: head_dim"):
        hadamard_matrix(d)


@pytest.mark.parametrize("d", [64, 96])
def test_scores_invariant(d):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 5, d, generator=g), torch.randn(3, 7, d, generator=g) * 4
    h = hadamard_matrix(d)
    s0 = q @ k.transpose(-1, -2)
    s1 = rotate(q, h) @ rotate(k, h).transpose(-1, -2)
    assert (s0 - s1).abs().max() < 1e-5 * s0.abs().max()
    assert torch.allclose(rotate(rotate(k, h), h), k, atol=1e-5)


def test_store_attention_equals_unrotated_attention_in_fp():
    """Everything in the FP residual: rotated keys + rotated queries give the exact attention."""
    B, H, Hq, T, D = 2, 2, 4, 40, 64
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(B, H, T, D, generator=g) * 3, torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, Hq, 3, D, generator=g)
    st = LayerStore(resolve_spec("kivi-2-had", residual_length=64), B, H, D, torch.float32, "cpu")
    st.append(k, v)
    assert st.body_len == 0
    keys, _ = dequantize_layer(st.view())
    assert not torch.allclose(keys, k, atol=1e-3)  # stored rotated
    assert torch.allclose(st.model_keys(keys), k, atol=1e-5)
    out = decode_attention(st.rotate_query(q), st.view(), scale=D ** -0.5)
    ref = LayerStore(resolve_spec("kivi-2", residual_length=64), B, H, D, torch.float32, "cpu")
    ref.append(k, v)
    want = decode_attention(q, ref.view(), scale=D ** -0.5)
    assert (out - want).abs().max() < 1e-5


def test_rotation_shrinks_key_outlier_error():
    """A key channel 30x larger than the rest: 2-bit error of the model's keys is smaller
    with the rotation (the point of the method)."""
    B, H, T, D = 1, 2, 256, 64
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, H, T, D, generator=g)
    k[..., 3] += 30 * torch.randn(B, H, T, generator=g)  # token-varying outlier channel
    v = torch.randn(B, H, T, D, generator=g)
    err = {}
    for name in ("kivi-2", "kivi-2-had"):
        st = LayerStore(resolve_spec(name, residual_length=0), B, H, D, torch.float32, "cpu")
        st.append(k, v)
        keys, _ = dequantize_layer(st.view())
        err[name] = (st.model_keys(keys) - k).pow(2).mean().item()
    assert err["kivi-2-had"] < err["kivi-2"], err
