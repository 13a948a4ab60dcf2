"""``KVBitsCache`` through transformers' ``Cache`` API, with ``DynamicCache`` as the oracle.

Tiny random decoders: a Llama, a Mistral whose every layer slides over 24 tokens and a Gemma3
whose first three layers slide over 16 (the runs go past the windows). The FP16 preset holds the
exact history, so it must give ``DynamicCache``'s logits; the 8-bit preset is checked against
itself where an operation must not change the result (a cache pickled and loaded, a rollback
against a run that never went past the cut)."""

from __future__ import annotations

import io
import pickle
import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from kvbits.integrations.hf import KVBitsCache, cache_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integrations/conftest.py

COMMON = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 512, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}


def tiny(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=24, **COMMON))
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"]))
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {arch: tiny(arch) for arch in ("llama", "mistral", "gemma3")}


def tokens(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def forward(model, ids, cache, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache), **kw).logits


def decode(model, cache, steps: int, seed: int, batch: int = 2) -> torch.Tensor:
    """``steps`` one-token forwards of fixed tokens: their logits ``[B, steps, V]``."""
    return torch.cat([forward(model, tokens(batch, 1, seed + t), cache) for t in range(steps)], 1)


def make(model, preset: str, **kw):
    if preset == "dynamic":
        return DynamicCache(config=model.config)
    return KVBitsCache(model, preset, **({"residual_length": 8} if preset != "fp16" else {}),
                       **kw)


@pytest.mark.parametrize("arch,preset,step_graphs", [
    ("llama", "kivi-8", False), ("gemma3", "fp16", False), ("gemma3", "kivi-2", True)])
@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_pickled_cache_goes_on_like_the_original(models, arch, preset, step_graphs, how):
    """``torch.save`` / ``pickle`` of a prefilled cache (DynamicCache pickles; this one raised
    TypeError on its weak references): the loaded cache decodes exactly as the original, its
    layers pointing at it, not at the original."""
    model = models[arch]
    cache = make(model, preset, step_graphs=step_graphs)
    forward(model, tokens(2, 40, 1), cache)
    decode(model, cache, 3, seed=50)  # (step graphs: the layers are in their replay mode)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(cache))
    else:
        buf = io.BytesIO()
        torch.save(cache, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    assert loaded.get_seq_length() == cache.get_seq_length() == 43
    assert all(layer._cache is loaded for layer in loaded.layers)
    torch.testing.assert_close(decode(model, loaded, 20, seed=70),
                               decode(model, cache, 20, seed=70), atol=0, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_iteration_and_max_length_as_dynamic_cache(models, arch):
    """``for keys, values, window in cache`` (DynamicCache's iteration; this one was not
    iterable) gives the tokens each layer holds, dequantized: the FP16 preset DynamicCache's
    exactly, 8 bits within their rounding, over a left-padded batch that a sliding window has
    left behind. ``get_max_length`` is the window for sliding layers (was -1 everywhere)."""
    model = models[arch]
    ids = tokens(3, 50, 2)
    mask = torch.ones_like(ids)
    mask[1, :13], mask[2, :6] = 0, 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def run(preset):
        cache = make(model, preset)
        forward(model, ids, cache, attention_mask=mask, position_ids=pos)
        for t in range(10):
            forward(model, tokens(3, 1, 90 + t), cache, attention_mask=torch.cat(
                [mask, torch.ones(3, t + 1, dtype=mask.dtype)], 1), position_ids=pos[:, -1:] + t + 1)
        return cache

    want = run("dynamic")
    real = torch.cat([mask, torch.ones(3, 10, dtype=mask.dtype)], 1).bool()[:, None, :, None]
    for preset, tol in (("fp16", 1e-6), ("kivi-8", 1e-2)):
        cache = run(preset)
        assert cache.get_max_length() == want.get_max_length()
        assert [cache.get_max_length(i) for i in range(len(cache))] == \
            [want.get_max_length(i) for i in range(len(want))]
        got = list(cache)
        assert len(got) == len(want.layers)
        for (k, v, w), (dk, dv, dw) in zip(got, want):
            assert (w is None) == (dw is None) and (w is None or int(w) == int(dw))
            n = dk.shape[2]  # DynamicCache holds the last window - 1 tokens of a sliding layer
            assert k.shape[:2] == dk.shape[:2] and k.shape[2] >= n and k.dtype == dk.dtype
            held = real[:, :, -n:]
            for a, b in ((k[:, :, -n:], dk), (v[:, :, -n:], dv)):
                assert ((a - b).abs() * held).max() <= tol * b.abs().max()
    assert [(k, v) for k, v, _ in KVBitsCache(model, "fp16")] == [(None, None)] * len(want)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
@pytest.mark.parametrize("preset", ["fp16", "kivi-8"])
def test_rollback_after_activate_past_recording_as_dynamic_cache(models, arch, preset):
    """transformers' way to roll a sliding-window cache back (its crop error says so): after
    ``activate_past_recording()``, a crop of the last single-token steps works, as on
    DynamicCache (transformers >= 5.2x). The sliding layers had dropped those steps' window (the
    FP16 preset refused the crop); now they keep what came since the last crop, and decoding
    goes on as a run that never went past the cut (FP16: DynamicCache's logits). With
    ``recurrent_states_to_keep`` (transformers' bound on what it will crop) they keep no more
    than that: a long recording decode still drops what no query sees, and a crop deeper than
    the bound and the window is refused."""
    model = models[arch]
    prompt = tokens(2, 40, 3)

    def run(kind, steps, crop, record=True):
        cache = make(model, kind)
        if record:
            cache.activate_past_recording()
        forward(model, prompt, cache)
        decode(model, cache, steps, seed=10)
        if crop:
            cache.crop(-crop)
        return cache, decode(model, cache, 25, seed=100)

    _, want = run(preset, 2, 0)
    cache, got = run(preset, 5, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert [layer.record_past for layer in cache.layers] == \
        [layer.is_sliding for layer in cache.layers]
    if hasattr(cache, "is_recording_past"):  # (transformers >= 5.2x)
        assert [cache.is_recording_past(i) for i in range(len(cache))] == \
            [layer.is_sliding for layer in cache.layers]
    if preset == "fp16":  # DynamicCache's logits, where it never went past the cut
        torch.testing.assert_close(got, run("dynamic", 2, 0, record=False)[1], atol=1e-5,
                                   rtol=0)

    capped = make(model, preset)
    capped.activate_past_recording(recurrent_states_to_keep=2)
    forward(model, prompt, capped)
    decode(model, capped, 60, seed=10)
    with pytest.raises(ValueError, match="keep at least"):
        capped.crop(-40)  # (recording with no bound, every layer keeps all 100 tokens)
    assert capped.get_seq_length() == 100
    capped.crop(-2)
    assert capped.get_seq_length() == 98
    for layer in capped.layers:
        if layer.is_sliding:
            assert layer.store.evicted > 0 and layer.store.seq_len < 50


def test_batch_edits_check_their_index_as_dynamic_cache(models):
    """``batch_select_indices`` takes rows from the end as DynamicCache's indexing does (-1 failed
    inside ``index_select``); a float beam index (truncated silently: 0.9 -> row 0), a row out
    of range, a mask of the wrong length (its ``nonzero()`` picked other rows) and a repeat
    count that is not a positive integer (0 left an empty batch that still counted its tokens)
    are refused by name, the cache unchanged."""
    model = models["llama"]
    ours, want = make(model, "fp16"), make(model, "dynamic")
    for cache in (ours, want):
        forward(model, tokens(3, 10, 0), cache)
        cache.batch_select_indices(torch.tensor([-1, 0]))
    torch.testing.assert_close(decode(model, ours, 2, seed=1), decode(model, want, 2, seed=1),
                               atol=1e-5, rtol=0)
    for bad, why in ((torch.tensor([0.9, 1.2]), "1-D integer tensor"),
                     (torch.tensor([0, 2]), r"rows in \[0, 2\)")):
        with pytest.raises(ValueError, match=f"reorder: the index must .*{why}"):
            ours.reorder_cache(bad)
    with pytest.raises(ValueError, match=r"boolean mask must have one entry per sequence \(2\)"):
        ours.batch_select_indices(torch.tensor([True]))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="repeats must be a positive integer"):
            ours.batch_repeat_interleave(bad)
    assert ours.get_seq_length() == 12
    assert [layer.store.batch for layer in ours.layers] == [2, 2]


def test_crop_takes_an_integer_count(models):
    """``crop(None)`` failed on a comparison, ``crop(5.0)`` got the advice for drafts longer than
    the residual and ``crop(True)`` kept one token: all are refused by name, nothing cut."""
    model = models["llama"]
    for preset in ("fp16", "kivi-8"):
        cache = make(model, preset)
        forward(model, tokens(2, 10, 0), cache)
        for bad in (None, 5.0, True, "3"):
            with pytest.raises(ValueError, match=r"crop: tokens_to_remove must be an integer "
                                                 r"\(a negative number of tokens to drop.*got") \
                    as err:
                cache.crop(bad)
            assert "residual_length" not in str(err.value)
        assert cache.get_seq_length() == 10
        cache.crop(torch.tensor(-2))  # a 0-d integer tensor is an index
        assert cache.get_seq_length() == 8
