"""Tests for kvbits.reference.rope: our rotation equals transformers' for the rotary variants of
the supported models, and un-rotation inverts it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
    (inv,) = {tuple(t.tolist()) for t in rope.model_inv_freqs(model)}
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


def _tiny(arch: str):
    import transformers as tf

    common = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
    torch.manual_seed(0)
    build = {
        "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(partial_rotary_factor=0.5, **common)),
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(partial_rotary_factor=0.25,
                                                                     **common)),
        "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(pad_token_id=0, **common)),
        "smollm3": lambda: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(pad_token_id=0, **common)),
    }
    if arch not in build:  # GPT-J, CodeGen, GPT-2, OPT, GPT-BigCode
        from tiny_decoders import gpt2_family

        return gpt2_family(arch)
    return build[arch]().eval()


@pytest.mark.parametrize("arch,says", [("cohere", "pairs channels differently"),
                                       ("gptj", "rotate_every_two"),
                                       ("codegen", "rotate_every_two")])
def test_neighbour_pair_rotation_refused(arch, says):
    """Neighbour-pair rotation (Cohere, GLM, GPT-J, CodeGen) is not the rotate-half convention
    the cache re-rotates in: pre-RoPE keys are refused with a pointer to ``pre_rope=False``, not
    crashed on or silently stored in another frame (GPT-J and CodeGen define no
    ``rotate_half`` to probe: their ``rotate_every_two`` is refused by name)."""
    with pytest.raises(ValueError, match=says) as e:
        rope.model_inv_freqs(_tiny(arch))
    assert "pre_rope=False" in str(e.value)


@pytest.mark.parametrize("arch", ["gpt2", "opt", "gpt-bigcode"])
def test_models_without_rope_have_no_frequencies(arch):
    """Learned (GPT-2, GPT-BigCode, OPT) positions: no layer has RoPE frequencies (the keys are
    position-free already), rather than the default formula's, which would turn keys that the
    model never turned; a Llama config has them."""
    assert rope.model_inv_freqs(_tiny(arch)) == [None, None]
    assert all(f is not None for f in rope.model_inv_freqs(_tiny("phi")))


@pytest.mark.parametrize("arch,turned", [("phi", 8), ("stablelm", 4)])
def test_partial_rotary_frequencies(arch, turned):
    """Partial rotary embeddings (Phi, StableLM, GPT-NeoX) give the frequencies of the channels
    they turn (fewer than head_dim / 2); the store reorders the rest around them."""
    inv = rope.model_inv_freqs(_tiny(arch))
    assert all(f.numel() * 2 == turned for f in inv)


@st.composite
def _partial_heads(draw):
    D = 2 * draw(st.integers(1, 128))
    return D, draw(st.integers(1, D // 2))


@settings(max_examples=40, deadline=None)
@given(_partial_heads())
def test_partial_rotary_layout_is_the_models_rotation(head):
    """The model's partial rotation (rotate-half over the first ``2n`` channels, the rest as
    they are) is the whole-head rotation of the reordered channels with zero frequencies for
    the passed-through pairs, and its un-rotation likewise, at any even head dim."""
    D, n = head
    g = torch.Generator().manual_seed(D + n)
    inv = 1.0 / (1e4 ** (torch.arange(0, 2 * n, 2).float() / (2 * n)))
    x = torch.randn(2, 3, 5, D, generator=g)
    pos = torch.randint(0, 300, (2, 5), generator=g)
    want = torch.cat([rope.rotate(x[..., :2 * n], pos, inv), x[..., 2 * n:]], -1)
    order, full = rope.partial_rotary_layout(inv, D)
    if 2 * n == D:
        assert order is None and full is inv
        return
    assert sorted(order.tolist()) == list(range(D)) and full.shape == (D // 2,)
    torch.testing.assert_close(rope.rotate(x[..., order], pos, full), want[..., order])
    torch.testing.assert_close(rope.unrotate(want[..., order], pos, full), x[..., order])
    with pytest.raises(ValueError, match="head_dim / 2"):
        rope.partial_rotary_layout(torch.ones(D // 2 + 1), D)


def test_nope_layers_turn_by_zero():
    """SmolLM3-style NoPE layers (``no_rope_layers[i] == 0``) take no rotation: their
    frequencies are zero, so un-rotation and re-rotation leave their keys as they are."""
    model = _tiny("smollm3")
    flags = model.config.no_rope_layers
    assert 0 in flags and 1 in flags
    invs = rope.model_inv_freqs(model)
    k = torch.randn(1, 2, 10, 16)
    pos = torch.arange(10)[None]
    for flag, attn, inv in zip(flags, (layer.self_attn for layer in model.model.layers), invs):
        assert bool(attn.use_rope) == bool(flag) == bool(inv.abs().sum() > 0)
        if not flag:
            assert torch.equal(rope.unrotate(k, pos, inv), k)


def test_rotate_refuses_mismatched_shapes_by_name():
    """``pos [B, 1]`` for several tokens turned them all by the first position silently; an
    ``inv_freq`` of another length, a 1-d ``pos`` or an odd head failed in a broadcast."""
    x = torch.randn(2, 3, 5, 8)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    pos = torch.arange(5).expand(2, 5)
    for fn in (rope.rotate, rope.unrotate):
        assert fn(x, pos[:1], inv).shape == x.shape  # one row of positions for the batch: fine
        for args in ((x, pos[:, :1], inv), (x, pos, inv[:2]), (x, pos[0], inv),
                     (torch.randn(2, 3, 5, 7), pos, inv), (x, torch.zeros(3, 5), inv)):
            with pytest.raises(ValueError, match=rf"{fn.__name__}: x must be \[B, H, T, D\], pos "
                               r"\[B or 1, T\] and inv_freq \[D / 2\]"):
                fn(*args)
