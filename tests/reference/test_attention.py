"""Tests for kvbits.reference.attention's own arguments (the attention itself is checked against
the kernels in tests/kernels/test_decode_attention.py)."""

from __future__ import annotations

import pytest
import torch

from kvbits.formats.layout import PackedKV
from kvbits.reference.attention import dequantize_body
from kvbits.reference.quant import quantize_keys, quantize_values


def test_dequantize_body_refuses_a_range_outside_the_body():
    """Tokens past the body came back cut short ([0, 24) of a 16-token body gave 16 tokens, not
    the 24 the docstring promises); a range out of step with the groups failed inside
    dequantize_values (naming its scale)."""
    B, H, T, D, G = 1, 1, 16, 4, 8
    x = torch.randn(B, H, T, D)
    kc, ks, kz = quantize_keys(x, 2, G)
    vc, vs, vz = quantize_values(x, 2, D, G)
    fp = torch.zeros(B, H, 0, D)
    kv = PackedKV(fp, fp, 0, kc, ks, kz, vc, vs, vz, T, fp, fp, 0, 2, 2, G, D)
    assert dequantize_body(kv, 0, T)[0].shape == (B, H, T, D)
    assert dequantize_body(kv, G, G)[0].shape == (B, H, 0, D)
    for t0, t1 in ((0, 24), (-8, 8), (16, 8), (0, 12), (4, 16)):
        with pytest.raises(ValueError, match=rf"dequantize_body: tokens \[{t0}, {t1}\) must lie "
                           r"within the body's 16, in whole groups of 8"):
            dequantize_body(kv, t0, t1)


def test_dequantize_layer_takes_starts_as_ints_for_pre_rope_keys():
    """``starts`` as an int, a list or a 0-d tensor (which the sink placement takes, through
    ``torch.as_tensor(...).expand(batch)``) failed on a pre-RoPE layer without a sink: the raw
    value reached the body's re-rotation (``AttributeError: 'list' object has no attribute
    'to'``, an IndexError for a 0-d tensor)."""
    from kvbits.reference.attention import dequantize_layer

    B, H, T, D, G = 2, 1, 16, 8, 8
    x = torch.randn(B, H, T, D)
    kc, ks, kz = quantize_keys(x, 2, G)
    vc, vs, vz = quantize_values(x, 2, D, G)
    fp = torch.zeros(B, H, 0, D)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    kv = PackedKV(fp, fp, 0, kc, ks, kz, vc, vs, vz, T, fp, fp, 0, 2, 2, G, D,
                  rope_inv_freq=inv_freq)
    want = dequantize_layer(kv, starts=torch.tensor([0, 2]))[0]
    assert not torch.equal(want[0], want[1])  # (the positions differ per row)
    assert torch.equal(dequantize_layer(kv, starts=[0, 2])[0], want)
    same = dequantize_layer(kv, starts=torch.tensor([2, 2]))[0]
    for starts in (2, [2], torch.tensor(2)):
        assert torch.equal(dequantize_layer(kv, starts=starts)[0], same)
