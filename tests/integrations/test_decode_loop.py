"""Tests for kvbits.integrations.decode_loop: greedy decoding whose steps a CUDA graph can replay.

On the CPU the loop runs its static runs eagerly (``graphs=False``): the same device-side
appends, lengths and residual windows as a captured run, so the tokens must equal transformers'
own greedy ``generate`` with the same cache, across several flushes. The capture itself is
checked on a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.hf import KVBitsCache

NEW = 80


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512)
    m = LlamaForCausalLM(cfg).eval()
    # a peaked output distribution, so greedy tokens are stable under float-order differences
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


def reference_tokens(model, ids, cache):
    kw = {"cache" if "cache" in model.generate.__code__.co_varnames else "past_key_values": cache}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    return out[:, ids.shape[1]:]


def prompt(n=37, batch=2):
    return torch.randint(1, 96, (batch, n), generator=torch.Generator().manual_seed(n))


PRESETS = [("kivi-2", dict(residual_length=4, group_size=32)),
           ("kivi-4", dict(residual_length=0, group_size=32)), ("fp16", {}),
           ("kivi-2-had", dict(residual_length=8, group_size=32, sink_tokens=2)),
           ("uniform-int4", dict(residual_length=16)), ("fp8-dynamic", dict(residual_length=4)),
           ("kvquant-3", dict(residual_length=4, group_size=32, calibration="uniform"))]


def decode(model, ids, preset, kw, static=True):
    """Tokens of the loop, and the lengths of its static runs (``static=False``: every step
    through the cache's ordinary path)."""
    cache = KVBitsCache(model, preset, **kw)
    runs = []
    begin = cache.begin_static
    cache.begin_static = lambda n: (runs.append(n), begin(n))[1]
    if not static:
        cache.static_room = lambda: 0
    return GreedyDecoder(model, cache, graphs=False).generate(ids, NEW), runs, cache


@pytest.mark.parametrize("preset,kw", PRESETS)
def test_static_runs_match_generate(model, preset, kw):
    ids = prompt(batch=1)
    want = reference_tokens(model, ids, KVBitsCache(model, preset, **kw))
    got, runs, cache = decode(model, ids, preset, kw)
    assert torch.equal(got, want), (got, want)
    assert runs and sum(runs) > NEW // 2  # most steps ran as static runs
    if preset != "fp16":  # runs stop before each flush
        G, R = cache.spec.group_size, cache.spec.residual_length
        assert max(runs) <= G - 1 and len(runs) >= NEW // G
        assert cache.layers[0].store.body_len >= (ids.shape[1] + NEW - R - G) // G * G


@pytest.mark.parametrize("preset,kw", PRESETS)
def test_static_runs_match_eager_steps_batched(model, preset, kw):
    # Batch 2 through the same loop, static runs against ordinary cache updates: equal tokens.
    # (transformers' batched generate itself differs in float order from an unmasked forward.)
    ids = prompt(batch=2)
    got, runs, _ = decode(model, ids, preset, kw)
    want, none, _ = decode(model, ids, preset, kw, static=False)
    assert runs and not none
    assert torch.equal(got, want)


def test_fp16_caches_match_generate(model):
    ids = prompt(29, 1)  # DynamicCache: every step eager; StaticCache: one static run
    want = reference_tokens(model, ids, DynamicCache())
    got = GreedyDecoder(model, DynamicCache(), graphs=False).generate(ids, NEW)
    assert torch.equal(got, want)
    static = StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW + 1)
    got = GreedyDecoder(model, static, graphs=False).generate(ids, NEW)
    assert torch.equal(got, want)


def test_begin_static_checks_room(model):
    ids = prompt(20, 1)
    cache = KVBitsCache(model, "kivi-2", residual_length=4, group_size=32)
    GreedyDecoder(model, cache, graphs=False).generate(ids, 1)
    room = cache.static_room()
    assert 0 <= room <= 32 + 4 - 1
    with pytest.raises(ValueError, match="static_room"):
        cache.begin_static(room + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4"])
def test_gpu_captured_runs_match_eager(model, preset):
    m = LlamaForCausalLM(model.config).half().cuda().eval()
    m.load_state_dict(model.state_dict())
    ids = prompt(300, 1).cuda()
    eager = GreedyDecoder(m, KVBitsCache(m, preset), graphs=False).generate(ids, 80)
    dec = GreedyDecoder(m, KVBitsCache(m, preset), graphs=True)
    got = dec.generate(ids, 80)
    assert dec.captures >= 2  # one per run between flushes
    assert torch.equal(got, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_captured_static_cache_matches_eager(model):
    m = LlamaForCausalLM(model.config).half().cuda().eval()
    m.load_state_dict(model.state_dict())
    ids = prompt(300, 1).cuda()
    n = 60

    def run(graphs):
        cache = StaticCache(config=m.config, max_cache_len=ids.shape[1] + n + 1)
        dec = GreedyDecoder(m, cache, graphs=graphs)
        return dec.generate(ids, n), dec.captures
    eager, _ = run(False)
    got, captures = run(True)
    assert captures == 1 and torch.equal(got, eager)
