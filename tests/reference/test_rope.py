"""Tests for kvbits.reference.rope: our rotation equals transformers' for the rotary variants of
the supported models, and un-rotation inverts it."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvbits.reference import rope

ROPE_VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def llama(variant: str):
    from transformers import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=512, rope_parameters=ROPE_VARIANTS[variant])
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rotate_equals_transformers(variant):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = llama(variant)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 1, 40, 32, generator=g)
    pos = torch.stack([torch.arange(40), (torch.arange(40) - 7).clamp(min=0)])
    cos, sin = model.model.rotary_emb(k, pos)
    _, want = apply_rotary_pos_emb(k, k, cos, sin)
    (inv,) = set(map(lambda t: tuple(t.tolist()), rope.model_inv_freqs(model)))
    inv = torch.tensor(inv)
    assert torch.allclose(rope.rotate(k, pos, inv), want, atol=1e-5)
    assert torch.allclose(rope.unrotate(want, pos, inv), k, atol=1e-5)
    # config-only path gives the same frequencies
    assert torch.allclose(rope.model_inv_freqs(model.config)[0], inv)


def test_gemma3_per_layer_type_frequencies():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=16,
                           layer_types=["sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    sliding, full = rope.model_inv_freqs(model)
    assert torch.allclose(sliding, model.model.rotary_emb.sliding_attention_inv_freq)
    assert torch.allclose(full, model.model.rotary_emb.full_attention_inv_freq)
    assert not torch.allclose(sliding, full)


def test_positions_follow_left_padding():
    pos = rope.token_positions(torch.tensor([0, 3]), 2, 4)
    assert pos.tolist() == [[2, 3, 4, 5], [0, 0, 1, 2]]


def test_dynamic_rope_refused():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      head_dim=32, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                    "factor": 2.0})
    with pytest.raises(NotImplementedError, match="pre_rope=False"):
        rope.model_inv_freqs(cfg)
