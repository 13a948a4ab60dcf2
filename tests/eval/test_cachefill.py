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
