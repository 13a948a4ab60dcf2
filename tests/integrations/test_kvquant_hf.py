"""KVQuant through KVBitsCache: pre-RoPE keys equal the model's own attention when the quantizer
is made lossless, real quantization stays close, perplexity through the cache runs."""

from __future__ import annotations

import pytest
import torch

from kvbits.cache import store as store_mod
from kvbits.cache.store import LayerStore
from kvbits.integrations.hf import KVBitsCache
from kvbits.methods import kvquant as kvq
from kvbits.reference import rope as ref_rope

from test_hf import NEW, forward, generate, padded_batch, stepwise_logits, tiny_config, tiny_model

ROPE_VARIANTS = {  # as in tests/reference/test_rope.py
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.fixture
def lossless(monkeypatch):
    """Make the kvquant quantizer lossless while keeping everything around it: the store still
    un-rotates keys at flush and the body is re-rotated at its positions; only the codes are
    replaced by the exact (pre-RoPE) inputs the quantizer received."""
    real_flush = LayerStore.flush

    def flush(self, upto=None):
        def spy_k(k, *args, **kw):
            self.__dict__.setdefault("_exact_k", []).append(k.float().clone())
            return real_qk(k, *args, **kw)

        def spy_v(v, *args, **kw):
            self.__dict__.setdefault("_exact_v", []).append(v.float().clone())
            return real_qv(v, *args, **kw)
        with monkeypatch.context() as m:
            m.setattr(kvq, "quantize_keys", spy_k)
            m.setattr(kvq, "quantize_values", spy_v)
            real_flush(self, upto)

    def dense_body(self):
        if not self.body_len:
            return None
        k = torch.cat(self._exact_k, dim=2)[:, :, : self.body_len]
        v = torch.cat(self._exact_v, dim=2)[:, :, : self.body_len]
        if self.inv_freq is not None:
            pos = ref_rope.token_positions(self.starts, self.sink_len, self.body_len)
            k = ref_rope.rotate(k, pos, self.inv_freq)
        return k, v

    real_qk, real_qv = kvq.quantize_keys, kvq.quantize_values
    monkeypatch.setattr(LayerStore, "flush", flush)
    monkeypatch.setattr(LayerStore, "_dense_body", dense_body)


def llama_with_rope(variant: str):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=512,
        rope_parameters=ROPE_VARIANTS[variant])).eval()


PARTIAL_ROTARY = ("phi", "stablelm", "gpt-neox")


def partial_rotary(arch: str):
    """A tiny Phi (half of each head turned, a layer norm on q and k), StableLM or GPT-NeoX (a
    quarter): partial rotary embeddings, which pre-RoPE keys take in another channel order."""
    import transformers as tf

    common = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}
    torch.manual_seed(0)
    if arch == "gpt-neox":  # (multi-head, one fused q/k/v projection)
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(rotary_pct=0.25, **common)).eval()
    if arch == "phi":
        return tf.PhiForCausalLM(tf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True,
                                              num_key_value_heads=2, **common)).eval()
    return tf.StableLmForCausalLM(tf.StableLmConfig(partial_rotary_factor=0.25,
                                                    num_key_value_heads=2, **common)).eval()


@pytest.mark.parametrize("arch", ["llama-default", "llama-llama3", "llama-linear", "gemma3",
                                  *PARTIAL_ROTARY])
def test_pre_rope_lossless_equals_model(arch, lossless):
    """Left-padded batch, prefill + chunk + single steps, R=0 so the body holds almost all: with
    the codes made lossless the logits equal the model's own (FP32) to 1e-4. Phi, StableLM and
    GPT-NeoX turn only part of each head (their keys and queries are reordered in the store)."""
    if arch in PARTIAL_ROTARY:
        model = partial_rotary(arch)
    else:
        model = tiny_model("gemma3") if arch == "gemma3" else llama_with_rope(arch.split("-")[1])
    x, mask = padded_batch("cpu")
    with torch.no_grad():
        full = model(input_ids=x, attention_mask=mask,
                     position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    cache = KVBitsCache(model, "kvquant-2", calibration="uniform", residual_length=0,
                        group_size=32)
    got = stepwise_logits(model, x, mask, cache)
    assert cache.stores[0].body_len == 32 and cache.stores[0].inv_freq is not None
    assert (cache.stores[0].key_order is not None) == (arch in PARTIAL_ROTARY)
    real = mask.bool()
    torch.testing.assert_close(got[real], full[real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "gpt-bigcode"])
def test_pre_rope_keys_of_a_model_without_rope_are_its_keys(arch):
    """On a model with learned positions (GPT-2; GPT-BigCode, StarCoder's multi-query
    architecture) the keys are position-free already: kvquant-3 stores them as they come, so
    its logits are kvquant-3-post's exactly, not those of keys turned by made-up frequencies."""
    from tiny_decoders import gpt2_family

    model = gpt2_family(arch, head_dim=32, vocab=256)
    x, mask = padded_batch("cpu")
    got = {}
    for preset in ("kvquant-3", "kvquant-3-post"):
        cache = KVBitsCache(model, preset, calibration="uniform", residual_length=0,
                            group_size=32)
        got[preset] = stepwise_logits(model, x, mask, cache)
        assert cache.stores[0].inv_freq is None and cache.stores[0].body_len > 0
    assert torch.equal(got["kvquant-3"], got["kvquant-3-post"])


@pytest.mark.parametrize("arch", ["phi", "stablelm"])
def test_partial_rotary_keys_are_stored_pre_rope(arch, lossless):
    """Un-rotation and re-rotation undo each other in any channel pairing, so the lossless test
    above cannot tell a wrong one: here one token repeated at 40 positions must reach layer 0's
    quantizer as one and the same key (the model's own pre-RoPE key, in the store's order),
    which only the model's pairing of the turned channels gives."""
    model = partial_rotary(arch)
    x = torch.full((1, 40), 7)
    captured = []
    hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda mod, inp, out: captured.append(out.detach()))
    cache = KVBitsCache(model, "kvquant-2", calibration="uniform", residual_length=0,
                        group_size=32)
    forward(model, x, cache)
    hook.remove()
    store = cache.stores[0]
    keys = torch.cat(store._exact_k, dim=2)[0, :, :32]  # [H, 32, D], pre-RoPE, store order
    assert store.key_order is not None
    torch.testing.assert_close(keys, keys[:, :1].expand_as(keys), atol=1e-5, rtol=1e-5)
    attn = model.model.layers[0].self_attn
    H, D = keys.shape[0], keys.shape[-1]
    want = captured[0][0, 0].view(H, D)  # the token's projected key, before any rotation
    if getattr(attn, "k_layernorm", None) is not None:  # Phi's qk_layernorm
        want = attn.k_layernorm(want)
    torch.testing.assert_close(keys[:, 0], want.index_select(-1, store.key_order),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", PARTIAL_ROTARY[:2])
def test_partial_rotary_calibration(arch):
    """Calibration collects the same pre-RoPE keys the store holds under a partial rotary
    embedding (one token at every position: one key at layer 0), and its codebooks serve a
    cache that generates."""
    from kvbits.spec import PRESETS

    model = partial_rotary(arch)
    (k, _, gk, _), *_ = kvq.collect_kv(model, torch.full((1, 40), 7), window=64)
    torch.testing.assert_close(k, k[:, :1].expand_as(k), atol=1e-5, rtol=1e-5)
    assert gk is not None and gk.shape == k.shape
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(3))
    spec = PRESETS["kvquant-3"]
    cache = KVBitsCache(model, spec, calibration=kvq.calibrate(model, ids, spec, window=64),
                        residual_length=16, group_size=32)
    out = generate(model, ids[:, :60], cache)
    assert out.shape == (1, 60 + NEW) and cache.stores[0].body_len > 0
    assert cache.stores[0].key_order is not None


def test_pre_rope_8bit_close_and_positions_right():
    """Real 8-bit kvquant (outliers on): the dequantized post-RoPE body matches the model's keys
    closely (a wrong re-rotation position would give O(1) errors)."""
    model = llama_with_rope("default")
    x, mask = padded_batch("cpu", length=80)
    cache = KVBitsCache(model, "kvquant-4", calibration="uniform", key_bits=8, value_bits=8,
                        residual_length=0)
    captured = {}
    real_update = store_mod.LayerStore.append

    def append(self, k, v, flush=True):
        captured.setdefault(id(self), []).append(k.clone())
        return real_update(self, k, v, flush)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(store_mod.LayerStore, "append", append)
        stepwise_logits(model, x, mask, cache)
    s = cache.stores[1]
    post = torch.cat(captured[id(s)], dim=2)
    got = s._dense_body()[0]
    S = s.sink_len  # the body holds tokens S .. S + body_len - 1 (kvquant presets keep S=1)
    # a padded sequence's own first S tokens live in its sink: the body's copies are hidden
    real = (torch.arange(S, S + s.body_len)[None] >= s.starts[:, None] + S)[:, None, :, None]
    err = ((got - post[:, :, S:S + s.body_len]).abs() * real).max()
    assert err < 0.02 * post.abs().max(), err


def test_position_ids_checked():
    model = llama_with_rope("default")
    x, mask = padded_batch("cpu")
    cache = KVBitsCache(model, "kvquant-2", calibration="uniform")
    with pytest.raises(ValueError, match="position_ids"):
        forward(model, x[:1], cache, position_ids=torch.arange(x.shape[1])[None] + 5)


def test_perplexity_smoke_counts_outliers():
    from kvbits.eval.perplexity import perplexity

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    fp = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=100,
                    progress=False)
    r = perplexity(model, ids, lambda: KVBitsCache(model, "kvquant-4", calibration="uniform",
                                                   residual_length=32), chunk_size=100,
                   progress=False)
    assert abs(r["ppl"] / fp["ppl"] - 1) < 0.05
    dense = perplexity(model, ids, lambda: KVBitsCache(model, "kvquant-4-dense",
                                                       calibration="uniform",
                                                       residual_length=32), chunk_size=100,
                       progress=False)
    # 1 outlier per vector of 64: index (1 B) + FP16 value (2 B), for K and V, per body token
    # (5 groups of 32 = 160 tokens), per KV head (2), per layer (3)
    assert r["cache_bytes"] - dense["cache_bytes"] == 160 * 2 * 3 * 2 * 3


@pytest.mark.model
def test_smollm2_calibrated_kvquant_generates(smollm2, tmp_path):
    """SmolLM2: calibrate on a little text, load the file, generate coherent greedy text."""
    model, tok = smollm2
    ids = tok("The president spoke to the Congress about the economy, the war and the budget. "
              * 12, return_tensors="pt").input_ids[:, :256]
    spec = "kvquant-4"
    from kvbits.spec import resolve_spec

    cal = kvq.calibrate(model, ids, resolve_spec(spec), model_name="smollm2", preset=spec,
                        window=128)
    path = cal.save(tmp_path / "smollm2.safetensors")
    old = model.config._attn_implementation
    try:
        prompt = tok("The capital of France is", return_tensors="pt")
        cache = KVBitsCache(model, spec, calibration=path, residual_length=0)
        out = generate(model, prompt.input_ids, cache)
        model.set_attn_implementation("sdpa")
        ref = generate(model, prompt.input_ids, None)
        assert out.shape == ref.shape
    finally:
        model.set_attn_implementation(old)


def test_pre_rope_chunked_prefill_past_a_long_left_padding():
    """Session 41 QA: with a left padding longer than the first prefill chunk, the positions were
    checked before the chunk's padding was known, so its padding counted as real tokens and a
    false "position_ids are not token index minus left padding" error stopped generate."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, pad_token_id=0)).eval()
    x = torch.randint(1, 128, (2, 150), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :75], x[1, :75] = 0, 0
    outs = []
    for chunk in (None, 64):
        cache = KVBitsCache(model, "kvquant-2:S=0", calibration="uniform", residual_length=8)
        kw = {} if chunk is None else {"prefill_chunk_size": chunk}
        outs.append(model.generate(input_ids=x, attention_mask=mask, max_new_tokens=4,
                                   do_sample=False, pad_token_id=0, past_key_values=cache, **kw))
    assert outs[0].shape == outs[1].shape == (2, 154)
