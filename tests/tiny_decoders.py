"""Tiny random decoders shared by the tests that build them, two layers each: the GPT-2 family,
with their own position schemes (learned positions in GPT-2, OPT and GPT-BigCode, whose
multi-query form is StarCoder's; neighbour-pair rotary over the first 8 channels in GPT-J and
CodeGen), and Gemma2 (attention-logit softcapping).
``tests/`` is on ``sys.path`` through its ``conftest.py``."""

from __future__ import annotations

import torch
import transformers as tf


def gpt2_family(arch: str, *, heads: int = 4, head_dim: int = 16, vocab: int = 128,
                positions: int = 512):
    """``arch``: gpt2, opt, gpt-bigcode (one KV head), gptj or codegen; eval mode, seed 0."""
    width = heads * head_dim
    gpt = {"vocab_size": vocab, "n_embd": width, "n_layer": 2, "n_head": heads,
           "n_positions": positions, "bos_token_id": None, "eos_token_id": None}
    build = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**gpt)),
        "gpt-bigcode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(multi_query=True,
                                                                             **gpt)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(rotary_dim=8, **gpt)),
        "codegen": lambda: tf.CodeGenForCausalLM(tf.CodeGenConfig(rotary_dim=8, **gpt)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=vocab, hidden_size=width, ffn_dim=2 * width, num_hidden_layers=2,
            num_attention_heads=heads, max_position_embeddings=positions,
            word_embed_proj_dim=width, bos_token_id=None, eos_token_id=None, pad_token_id=0)),
    }
    torch.manual_seed(0)
    return build[arch]().eval()


def tiny_gemma2(sliding_window: int = 32, softcap: float = 5.0):
    """A Gemma2 (attention-logit softcapping, which SDPA refuses) in its own eager attention;
    eval mode, seed 0."""
    torch.manual_seed(0)
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
        attn_logit_softcapping=softcap, attn_implementation="eager")).eval()
