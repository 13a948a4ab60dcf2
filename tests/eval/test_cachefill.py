"""Filling caches without a model prefill gives the state a real prefill leaves."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from kvbits.eval.cachefill import copy_dense_cache, fill_random
from kvbits.eval.speed import build_model, model_config
from kvbits.integrations.hf import KVBitsCache


@pytest.fixture(scope="module")
def tiny():
    return build_model(model_config("tiny"), device="cpu")


@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "fp16"])
def test_copy_of_a_dense_prefill_matches_a_real_kvbits_prefill(tiny, preset):
    ids = torch.randint(1, 500, (1, 200), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(1, 500, (1, 3), generator=torch.Generator().manual_seed(2))
    real = KVBitsCache(tiny, preset)
    with torch.no_grad():
        tiny(ids, past_key_values=real)
    state = [(a.sink_len, a.body_len, a.res_len) for a in real.stores]
    with torch.no_grad():
        want = tiny(nxt, past_key_values=real).logits
    dense = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(ids, past_key_values=dense)
    copied = KVBitsCache(tiny, preset)
    copy_dense_cache(dense, copied)
    assert state == [(b.sink_len, b.body_len, b.res_len) for b in copied.stores]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = tiny(nxt, past_key_values=copied).logits
    # no slow-path warning: the kvbits attention read the packed store
    assert not [w for w in caught if "slow path" in str(w.message)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert copied.get_seq_length() == 203


def test_copy_of_a_sliding_model_needs_every_token():
    """A sliding-window model (every layer slides over 40 tokens): a config-built DynamicCache
    keeps only the window, and copying it is refused (the tokens would sit at wrong positions:
    the Gemma3 needle run of session 25 answered garbage); a full-layer DynamicCache copies, and
    the kvbits cache (FP16 and kivi-4) then continues like the real prefill through it."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=40)).eval()
    ids = torch.randint(1, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(1, 256, (1, 3), generator=torch.Generator().manual_seed(2))
    windowed = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=windowed)
    with pytest.raises(ValueError, match="sliding-window layer that holds 39 of its 120"):
        copy_dense_cache(windowed, KVBitsCache(model, "fp16"))
    for preset, tol in (("fp16", 1e-4), ("kivi-4", 5e-2)):
        real = KVBitsCache(model, preset, residual_length=8)
        with torch.no_grad():
            model(ids, past_key_values=real)
            want = model(nxt, past_key_values=real).logits
        full = DynamicCache()
        with torch.no_grad():
            model(ids, past_key_values=full)
        copied = KVBitsCache(model, preset, residual_length=8)
        copy_dense_cache(full, copied)
        with torch.no_grad():
            got = model(nxt, past_key_values=copied).logits
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_fill_random_in_chunks_quantizes_through_the_store():
    cfg = model_config("tiny")
    cache = KVBitsCache(cfg, "kivi-2")
    fill_random(cache, 2, batch=2, kv_heads=2, head_dim=32, tokens=1000, dtype=torch.float32,
                device="cpu", chunk=300)
    for store in cache.stores:
        assert store.seq_len == 1000
        assert store.body_len == (1000 - 128) // 32 * 32  # every whole group past R is packed
        assert store.batch == 2
    assert cache.nbytes() < cache.fp16_nbytes()
    dense = DynamicCache(config=cfg)
    fill_random(dense, 2, batch=1, kv_heads=2, head_dim=32, tokens=100, dtype=torch.float32,
                device="cpu", chunk=64)
    assert dense.get_seq_length() == 100


def test_presize_then_compact_holds_exactly_what_decoding_needs():
    from kvbits.eval.cachefill import compact_residual, presize_store

    cfg = model_config("tiny")
    cache = KVBitsCache(cfg, "kivi-2")
    layer = cache.layers[0]
    empty = torch.empty(1, 2, 0, 32)
    layer.lazy_initialization(empty, empty)
    presize_store(layer.store, 1000 + 40, residual=128 + 32 + 300)
    caps = {n: getattr(layer.store, n).shape[2] for n in ("k_codes", "v_scale", "res_k")}
    for s in range(0, 1000, 300):
        k = torch.randn(1, 2, min(300, 1000 - s), 32)
        from kvbits.eval.cachefill import append_kv

        append_kv(cache, 0, k, k.clone())
    compact_residual(layer.store)
    st = layer.store
    # nothing grew: the fill wrote into the pre-sized buffers
    assert {n: getattr(st, n).shape[2] for n in ("k_codes", "v_scale")} == \
        {n: caps[n] for n in ("k_codes", "v_scale")}
    assert st.res_k.shape[2] == 128 + 32 and st.seq_len == 1000
    for _ in range(40):  # decoding fits without growing
        k = torch.randn(1, 2, 1, 32)
        append_kv(cache, 0, k, k.clone())
    assert st.res_k.shape[2] == 128 + 32 and st.k_codes.shape[2] == caps["k_codes"]


@pytest.mark.parametrize("kw, match", [
    ({"chunk": 0}, r"fill_random: chunk must be an integer >= 1, got 0"),  # (range() arg 3)
    ({"tokens": 100.0}, r"fill_random: tokens must be an integer >= 0, got 100.0"),
])
def test_fill_random_refuses_bad_counts(tiny, kw, match):
    args = {"batch": 1, "kv_heads": 2, "head_dim": 16, "tokens": 100, "device": "cpu", **kw}
    with pytest.raises(ValueError, match=match):
        fill_random(KVBitsCache(tiny, "kivi-2"), 2, **args)


def test_copy_into_a_dynamic_cache_without_config():
    """DynamicCache() (no config) makes its layers at their first update: append_kv indexed its
    empty layer list first and failed (IndexError) instead of calling cache.update."""
    g = torch.Generator().manual_seed(0)
    src = DynamicCache()
    for i in range(2):
        k, v = torch.randn(1, 2, 7, 16, generator=g), torch.randn(1, 2, 7, 16, generator=g)
        src.update(k, v, i)
    dst = DynamicCache()
    copy_dense_cache(src, dst)
    assert len(dst.layers) == 2 and dst.get_seq_length() == 7
    for a, b in zip(src.layers, dst.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    fill_random(DynamicCache(), 2, batch=1, kv_heads=2, head_dim=16, tokens=10, device="cpu",
                dtype=torch.float32, chunk=4)
