"""KVBitsCache on decoder architectures beyond the ones the accuracy tables use (tiny random
configs of transformers' own classes): prefill, a chunk and single steps through the cache
against the model's full forward. FP16 must match to float rounding; kivi-4 stays close."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tiny_decoders import gpt2_family

from kvbits.integrations.hf import KVBitsCache, cache_kwargs

COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "pad_token_id": 0}
ARCHS = {
    "mistral-sliding": lambda: tf.MistralForCausalLM(tf.MistralConfig(sliding_window=48,
                                                                      **COMMON)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **COMMON)),
    "qwen3-moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **COMMON)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON)),
    "phi-partial-rotary": lambda: tf.PhiForCausalLM(tf.PhiConfig(partial_rotary_factor=0.5,
                                                                 **COMMON)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=16, **COMMON)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**COMMON)),
    "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**COMMON)),
    "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**COMMON)),
    "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**COMMON)),
    "smollm3-nope": lambda: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**COMMON)),
    "glm4": lambda: tf.Glm4ForCausalLM(tf.Glm4Config(head_dim=16, **COMMON)),
    # learned positions, no RoPE (pre-RoPE keys are then the keys as they come); GPT-BigCode:
    # StarCoder / SantaCoder's multi-query attention (one KV head)
    "gpt2": lambda: gpt2_family("gpt2"),
    "opt": lambda: gpt2_family("opt"),
    "gpt-bigcode-mqa": lambda: gpt2_family("gpt-bigcode"),
}


def decode_in_parts(model, x, cache, prefill: int, chunk: int) -> torch.Tensor:
    """Logits of ``x`` through ``cache``: a prefill of ``prefill`` tokens, a chunk up to
    ``chunk``, then single steps."""
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        parts = [model(input_ids=x[:, :prefill], use_cache=True, **kw).logits,
                 model(input_ids=x[:, prefill:chunk], use_cache=True, **kw).logits]
        parts += [model(input_ids=x[:, t:t + 1], use_cache=True, **kw).logits
                  for t in range(chunk, x.shape[1])]
    return torch.cat(parts, 1)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_decoding_through_the_cache_matches_the_model(arch):
    torch.manual_seed(0)
    try:
        model = ARCHS[arch]().eval()
    except AttributeError as e:  # a class this transformers version does not have
        pytest.skip(f"{arch}: {e}")
    x = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=x).logits
    scale = full.abs().max()
    for preset, tol in (("fp16", 1e-5), ("kivi-4", 0.25)):  # random tiny models: loose
        cache = KVBitsCache(model, preset, residual_length=8)
        err = ((decode_in_parts(model, x, cache, 70, 80) - full).abs().max() / scale).item()
        assert err < tol, (arch, preset, err)
        assert cache.layers[0].store.body_len > 0 or preset == "fp16"


def test_latent_attention_is_refused_with_its_reason():
    """DeepSeek-V3's multi-head latent attention caches keys and values of different shapes:
    refused at the first step with what the model cached and what to use instead."""
    cfg = getattr(tf, "DeepseekV3Config", None)
    if cfg is None:
        pytest.skip("this transformers has no DeepSeek-V3")
    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(cfg(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, max_position_embeddings=512, pad_token_id=0)).eval()
    x = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="latent attention.*DynamicCache"):
        decode_in_parts(model, x, KVBitsCache(model, "kivi-4"), 10, 15)


def test_learned_attention_sinks_are_refused_with_their_reason():
    """gpt-oss adds a learned sink logit per head to every softmax (``s_aux``), which neither
    SDPA nor the kvbits kernels apply: the FP16 preset's logits were off by half their scale,
    silently (QA, session 59). Refused at the first step, naming the cause."""
    cfg = getattr(tf, "GptOssConfig", None)
    if cfg is None:
        pytest.skip("this transformers has no gpt-oss")
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(cfg(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0)).eval()
    x = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with pytest.raises(NotImplementedError, match="attention sinks.*s_aux.*DynamicCache"):
        decode_in_parts(model, x, KVBitsCache(model, "fp16"), 10, 15)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [100, 80, 40])
def test_gpu_head_dims_not_multiples_of_16(head_dim, monkeypatch, gluon_calls):
    """Head dims that are not multiples of 16 (OpenLLaMA-3B's 100, Phi-2's 80) through the GPU
    kernels (quantize on append, the decode kernel's padded tiles, KVQuant's padded pre-RoPE
    halves, the Gluon body's padded last chunk and its halves layout for KVQuant, made to serve
    these small steps): logits of a
    prefill, a chunk and single steps equal the reference path's through the same cache to
    float16 rounding."""
    from kvbits.kernels import decode_gluon
    used = gluon_calls
    cfg = tf.LlamaConfig(**{**COMMON, "hidden_size": 2 * head_dim, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "head_dim": head_dim})
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).half().cuda().eval()
    x = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(2)).cuda()

    def run(preset, kw):
        cache = KVBitsCache(model, preset, **kw)
        return decode_in_parts(model, x, cache, 100, 110).float(), cache
    for preset, kw in (("kivi-2", {"residual_length": 8}), ("kivi-3", {"residual_length": 8}),
                       ("uniform-int4", {"residual_length": 8}),
                       ("kvquant-3", {"residual_length": 8, "calibration": "uniform"})):
        monkeypatch.setenv("KVBITS_KERNELS", "reference")
        want, _ = run(preset, kw)
        monkeypatch.setenv("KVBITS_KERNELS", "auto")
        used.clear()
        got, cache = run(preset, kw)
        assert cache.layers[0].store.body_len > 0
        # the Gluon body takes every layer here (KVQuant's pre-RoPE keys in the halves layout)
        assert bool(used) == (decode_gluon.gluon is not None), preset
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (head_dim, preset, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_partial_rotary_pre_rope_keys(monkeypatch, gluon_calls):
    """Phi-2's head (80 channels, 32 of them turned) with KVQuant's pre-RoPE keys on the GPU:
    the store's reordered keys and queries (reference.rope.partial_rotary_layout) through the
    quantize kernels and the Gluon body's halves layout, logits against the reference path's
    through the same cache to float16 rounding."""
    from kvbits.kernels import decode_gluon
    used = gluon_calls
    cfg = tf.PhiConfig(**{**COMMON, "hidden_size": 160, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "partial_rotary_factor": 0.4})
    torch.manual_seed(0)
    model = tf.PhiForCausalLM(cfg).half().cuda().eval()
    x = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(2)).cuda()

    def run():
        cache = KVBitsCache(model, "kvquant-3", residual_length=8, calibration="uniform")
        return decode_in_parts(model, x, cache, 100, 110).float(), cache
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    want, _ = run()
    monkeypatch.setenv("KVBITS_KERNELS", "auto")
    got, cache = run()
    store = cache.layers[0].store
    assert store.key_order is not None and store.body_len > 0
    assert bool(used) == (decode_gluon.gluon is not None)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, err


def _llama_gqa(heads: int, kv_heads: int, head_dim: int):
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{
        **COMMON, "hidden_size": heads * head_dim, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["gpt-bigcode-20x1", "llama-24x2"])
def test_gpu_query_groups_past_16_columns(arch, monkeypatch, gluon_calls):
    """More than 16 query heads x rows per KV head (multi-query StarCoder-style models; a chunk
    of 3 rows at GQA 12) through the Gluon body as blocks of 16 columns
    (decode_gluon.column_blocks), made to serve these small steps: logits of a prefill, a
    3-row chunk and single steps equal the reference path's through the same cache to float16
    rounding."""
    from kvbits.kernels import decode_gluon
    torch.manual_seed(0)
    model = (gpt2_family("gpt-bigcode", heads=20, head_dim=64) if arch.startswith("gpt")
             else _llama_gqa(24, 2, 128))
    model = model.half().cuda().eval()
    x = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(3)).cuda()
    presets = ["kivi-2", "kivi-3", "uniform-int4"]
    presets.append("kvquant-3-post" if arch.startswith("gpt") else "kvquant-3")
    for preset in presets:
        kw = {"residual_length": 8}
        if preset.startswith("kvquant"):
            kw["calibration"] = "uniform"
        monkeypatch.setenv("KVBITS_KERNELS", "reference")
        want = decode_in_parts(model, x, KVBitsCache(model, preset, **kw), 100, 103).float()
        monkeypatch.setenv("KVBITS_KERNELS", "auto")
        gluon_calls.clear()
        cache = KVBitsCache(model, preset, **kw)
        got = decode_in_parts(model, x, cache, 100, 103).float()
        assert cache.layers[0].store.body_len > 0
        blocks = [decode_gluon.column_blocks(q.shape[1] // kv.kv_heads * q.shape[2])
                  for q, kv, _ in gluon_calls]
        if decode_gluon.gluon is not None:  # 20 x 1 steps: 2 blocks, chunks: 4 (24 x 2: 3)
            assert blocks and max(blocks) >= 2, (preset, blocks)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (arch, preset, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("bits", [4, 2])
def test_gpu_kvquant_codebooks_through_the_gluon_body(bits, head_dim, monkeypatch, gluon_calls):
    """kvquant-4 / kvquant-2 (codebooks, outliers, pre-RoPE keys) and their codebook-only forms
    through the Gluon body's 16- / 4-entry tables (decode_gluon.KVQUANT4 / KVQUANT2, switched
    on here): logits of a prefill, a chunk and single steps equal the reference path's through
    the same cache to float16 rounding."""
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(decode_gluon, f"KVQUANT{bits}", True)
    torch.manual_seed(0)
    model = _llama_gqa(8, 2, head_dim).half().cuda().eval()
    x = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(4)).cuda()
    for preset in (f"kvquant-{bits}", f"kvquant-{bits}-dense-post"):
        kw = {"residual_length": 8, "calibration": "uniform"}
        monkeypatch.setenv("KVBITS_KERNELS", "reference")
        want = decode_in_parts(model, x, KVBitsCache(model, preset, **kw), 100, 110).float()
        monkeypatch.setenv("KVBITS_KERNELS", "auto")
        gluon_calls.clear()
        got = decode_in_parts(model, x, KVBitsCache(model, preset, **kw), 100, 110).float()
        assert bool(gluon_calls) == (decode_gluon.gluon is not None), preset
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (head_dim, preset, err)
