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


def decode(model, ids, preset, kw, mode="static", new=NEW):
    """Tokens of the loop and the calls it made: ``mode`` "static" (runs between flushes),
    "device" (lengths on the device where the layers allow it) or "eager" (every step through
    the cache's ordinary path)."""
    cache = KVBitsCache(model, preset, **kw)
    calls = {"static": [], "device": []}
    begin, begin_dev = cache.begin_static, cache.begin_device_lengths
    cache.begin_static = lambda n: (calls["static"].append(n), begin(n))[1]
    cache.begin_device_lengths = lambda n: (calls["device"].append(n), begin_dev(n))[1]
    if mode == "eager":
        cache.static_room = lambda: 0
    dec = GreedyDecoder(model, cache, graphs=False, device_lengths=mode == "device")
    return dec.generate(ids, new), calls, cache


@pytest.mark.parametrize("preset,kw", PRESETS)
def test_static_runs_match_generate(model, preset, kw):
    ids = prompt(batch=1)
    want = reference_tokens(model, ids, KVBitsCache(model, preset, **kw))
    got, calls, cache = decode(model, ids, preset, kw)
    runs = calls["static"]
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
    got, calls, _ = decode(model, ids, preset, kw)
    want, none, _ = decode(model, ids, preset, kw, mode="eager")
    assert calls["static"] and not none["static"]
    assert torch.equal(got, want)


DEVICE_OK = {p for p, _ in PRESETS}  # every method keeps its lengths on the device


@pytest.mark.parametrize("preset,kw", PRESETS)
@pytest.mark.parametrize("batch", [1, 2])
def test_device_lengths_match_eager_steps(model, preset, kw, batch):
    """Lengths on the device (a fixed-size flush at a device offset, two graphs' worth of
    launches) give the tokens of ordinary steps, for every method (KVQuant's pre-RoPE keys and
    outliers, FP8 and Hadamard included)."""
    ids = prompt(batch=batch)
    want, _, _ = decode(model, ids, preset, kw, mode="eager")
    got, calls, cache = decode(model, ids, preset, kw, mode="device")
    assert torch.equal(got, want)
    assert bool(calls["device"]) == (preset in DEVICE_OK)
    assert bool(calls["static"]) == (preset not in DEVICE_OK)
    store = cache.layers[0].store
    assert store.lens_dev is None and store.seq_len == ids.shape[1] + NEW - 1
    if preset in DEVICE_OK and preset != "fp16":
        G = cache.spec.group_size
        assert store.body_len >= (ids.shape[1] + NEW - cache.spec.residual_length - G) // G * G


@pytest.mark.parametrize("preset,kw", [("kivi-2", dict(residual_length=4, group_size=32)),
                                       ("uniform-int4", dict(residual_length=0)),
                                       ("fp8-dynamic", dict(residual_length=4)),
                                       ("kvquant-3", dict(residual_length=4, group_size=32,
                                                          calibration="uniform"))])
def test_device_lengths_on_the_kernels(model, preset, kw, monkeypatch):
    """The same through the Triton kernels (interpreted on the CPU): the decode kernel reads the
    true lengths from ``lens_dev`` with the launch sized by the buffers' capacities, and the
    quantize kernels write the flushed group at the device offset."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    ids = prompt(batch=1)  # 37 tokens: the first decode flush comes at step ~31
    want, _, _ = decode(model, ids, preset, kw, mode="eager", new=40)
    got, calls, cache = decode(model, ids, preset, kw, mode="device", new=40)
    assert calls["device"] and torch.equal(got, want)
    G, R = cache.spec.group_size, cache.spec.residual_length
    assert cache.layers[0].store.body_len == (ids.shape[1] + 39 - R) // G * G  # a decode flush
    assert cache.layers[0].store.body_len > (ids.shape[1] - R) // G * G


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
@pytest.mark.parametrize("device_lengths", [True, False], ids=["two-graphs", "per-run"])
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "uniform-int4"])
def test_gpu_captured_runs_match_eager(model, preset, device_lengths):
    m = LlamaForCausalLM(model.config).half().cuda().eval()
    m.load_state_dict(model.state_dict())
    ids = prompt(300, 1).cuda()
    eager = GreedyDecoder(m, KVBitsCache(m, preset), graphs=False,
                          device_lengths=False).generate(ids, 200)
    dec = GreedyDecoder(m, KVBitsCache(m, preset), graphs=True, device_lengths=device_lengths)
    got = dec.generate(ids, 200)
    # two graphs (plain, flushing) for the generation; or one per run between flushes
    assert dec.captures == 2 if device_lengths else dec.captures >= 2
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
