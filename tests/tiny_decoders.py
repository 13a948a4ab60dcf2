"""Tiny random decoders of the GPT-2 family, shared by the tests that build them: their own
position schemes (learned positions in GPT-2, OPT and GPT-BigCode, whose multi-query form is
StarCoder's; neighbour-pair rotary over the first 8 channels in GPT-J and CodeGen), two layers.
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
