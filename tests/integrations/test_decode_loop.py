"""Tests for kvbits.integrations.decode_loop: greedy decoding whose steps a CUDA graph can replay.

On the CPU the loop runs every step eagerly (``graphs=False``) but with the cache's lengths on
the device: the same device-side appends, fixed-size flushes at device offsets and launch bounds
as a captured step, so the tokens must equal transformers' own greedy ``generate`` with the same
cache, and the cache's ordinary steps, across several flushes. The capture itself is checked on
a GPU.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.hf import KVBitsCache

NEW = 80
# The Triton kernels on this file's CPU models: only in Triton's interpreter (on a GPU machine
# the kernels would get CPU tensors; the test_gpu_* cases run them there, compiled, on CUDA).
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton's interpreter on CPU tensors (on a GPU the "
                                        "test_gpu_* cases run the kernels)")


def tiny_llama(seed: int, **shape) -> LlamaForCausalLM:
    """A random Llama (vocabulary 96, two layers unless ``shape`` says) with its config fields."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{"vocab_size": 96, "num_hidden_layers": 2, **shape})
    m = LlamaForCausalLM(cfg).eval()
    # a peaked output distribution, so greedy tokens are stable under float-order differences
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module")
def model32():
    return tiny_llama(1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=512)


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


def decode(model, ids, preset, kw, device=True, new=NEW):
    """Tokens of the loop and its calls of ``begin_device_lengths``; ``device=False``: every
    step through the cache's ordinary path (the cache says it cannot keep its lengths on the
    device)."""
    cache = KVBitsCache(model, preset, **kw)
    calls = []
    begin = cache.begin_device_lengths
    cache.begin_device_lengths = lambda n: (calls.append(n), begin(n))[1]
    if not device:
        cache.device_lengths_ok = lambda: False
    return GreedyDecoder(model, cache, graphs=False).generate(ids, new), calls, cache


@pytest.mark.parametrize("preset,kw", PRESETS)
def test_device_lengths_match_generate(model, preset, kw):
    ids = prompt(batch=1)
    want = reference_tokens(model, ids, KVBitsCache(model, preset, **kw))
    got, calls, cache = decode(model, ids, preset, kw)
    assert torch.equal(got, want), (got, want)
    assert calls  # every method keeps its lengths on the device
    store = cache.layers[0].store
    assert store.lens_dev is None and store.seq_len == ids.shape[1] + NEW - 1
    if preset != "fp16":  # flushed along the way, at the device offsets
        G, R = cache.spec.group_size, cache.spec.residual_length
        assert store.body_len == (ids.shape[1] + NEW - 1 - R) // G * G


@pytest.mark.parametrize("preset,kw", PRESETS)
def test_device_lengths_match_eager_steps_batched(model, preset, kw):
    # Batch 2 through the same loop against ordinary cache updates: equal tokens.
    # (transformers' batched generate itself differs in float order from an unmasked forward.)
    ids = prompt(batch=2)
    got, calls, _ = decode(model, ids, preset, kw)
    want, none, _ = decode(model, ids, preset, kw, device=False)
    assert calls and not none
    assert torch.equal(got, want)


def test_left_padding_still_in_the_residual(model):
    """A left-padded batch whose padding has not been quantized yet: the device flush masks it
    like the host flush does."""
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # 30 padding tokens: with R=16, G=32 the first body group is padding
    cache = KVBitsCache(model, "kivi-2", residual_length=16)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{_kwarg(model): cache})
    store = cache.layers[0].store
    assert store._pad_end > store.sink_len + store.body_len  # padding still waits to flush
    assert cache.device_lengths_ok()
    eager = KVBitsCache(model, "kivi-2", residual_length=16)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{_kwarg(model): eager})
    eager.device_lengths_ok = lambda: False
    first = torch.full((2, 1), 5)
    got = GreedyDecoder(model, cache, graphs=False).decode(first, ids.shape[1], NEW)
    want = GreedyDecoder(model, eager, graphs=False).decode(first, ids.shape[1], NEW)
    assert torch.equal(got, want)
    assert torch.equal(cache.layers[0].store.k_scale[:, :, :2], eager.layers[0].store.k_scale[:, :, :2])


def _kwarg(model):
    return "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"


@pytest.mark.parametrize("preset,kw", [("kivi-2", dict(residual_length=4, group_size=32)),
                                       ("uniform-int4", dict(residual_length=0)),
                                       ("fp8-dynamic", dict(residual_length=4)),
                                       ("kvquant-3", dict(residual_length=4, group_size=32,
                                                          calibration="uniform"))])
@INTERPRETED
def test_device_lengths_on_the_kernels(model, model32, preset, kw, monkeypatch):
    """The same through the Triton kernels (interpreted on the CPU): the decode kernel reads the
    true lengths from ``lens_dev`` with the launch sized by the buffers' capacities, and the
    quantize kernels write the flushed group at the device offset. (KVQuant's pre-RoPE keys
    need head_dim >= 32 in the kernel.)"""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    if preset == "kvquant-3":
        model = model32
    ids = prompt(63, batch=1)  # the first decode flush comes within the first few steps
    want, _, _ = decode(model, ids, preset, kw, device=False, new=12)
    got, calls, cache = decode(model, ids, preset, kw, new=12)
    assert calls and torch.equal(got, want)
    G, R = cache.spec.group_size, cache.spec.residual_length
    assert cache.layers[0].store.body_len == (ids.shape[1] + 11 - R) // G * G  # a decode flush
    assert cache.layers[0].store.body_len > (ids.shape[1] - R) // G * G


def test_fp16_caches_match_generate(model):
    ids = prompt(29, 1)  # DynamicCache: every step eager; StaticCache: one static run
    want = reference_tokens(model, ids, DynamicCache())
    got = GreedyDecoder(model, DynamicCache(), graphs=False).generate(ids, NEW)
    assert torch.equal(got, want)
    static = StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW + 1)
    got = GreedyDecoder(model, static, graphs=False).generate(ids, NEW)
    assert torch.equal(got, want)


@pytest.fixture
def one_fp16_route(monkeypatch):
    """Eager and captured calls on the same FP16 route (the captured one: the sink and residual
    as Triton-kernel splits). By default an eager call attends them in the finish kernel
    (``decode_attention.FINISH_FP_TOKENS``), which sums them in another order: the tokens of the
    two runs could then differ where two logits tie to the last bit, and these tests check the
    capture machinery, which must change nothing. Likewise the merge: an eager call the Triton
    kernel serves alone merges in that kernel (``MERGE_IN_SPLITS``), a captured one in the
    finish kernel; pinned to the finish kernel."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", 0)
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")


@pytest.fixture(scope="module")
def gpu_model():
    """head_dim 64: the kernels' pre-RoPE path needs >= 32 (a smaller one decodes eagerly)."""
    return tiny_llama(0, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=1024).half().cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset,kw", [("kivi-2", {}), ("kivi-4", {}), ("uniform-int4", {}),
                                       ("kivi-2-had", dict(sink_tokens=2)),
                                       ("fp8-dynamic", dict(residual_length=4)),
                                       ("kvquant-3", dict(calibration="uniform"))])
def test_gpu_captured_runs_match_eager(gpu_model, preset, kw, one_fp16_route):
    m = gpu_model
    ids = prompt(300, 1).cuda()
    eager = GreedyDecoder(m, KVBitsCache(m, preset, **kw), graphs=False).generate(ids, 200)
    dec = GreedyDecoder(m, KVBitsCache(m, preset, **kw), graphs=True)
    with warnings.catch_warnings(record=True) as caught:  # a failed capture says why
        warnings.simplefilter("always")
        got = dec.generate(ids, 200)
    # a plain step and a flushing step, for the whole generation
    assert dec.captures == 2, [str(w.message)[:300] for w in caught]
    assert torch.equal(got, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset,kw", [("kivi-2", {}), ("kvquant-3", {"calibration": "uniform"})])
def test_gpu_captures_on_the_default_fp16_routes(gpu_model, preset, kw):
    """With the default routes (eager steps attend the FP16 part in the finish kernel, captured
    ones as splits, beside the body), both step graphs capture: everything a captured call
    needs is built by the eager warm-up step, though that step takes the other route (pre-RoPE
    keys' cos/sin table, session 31). The tokens start as the eager run's."""
    m = gpu_model
    ids = prompt(300, 1).cuda()
    eager = GreedyDecoder(m, KVBitsCache(m, preset, **kw), graphs=False).generate(ids, 120)
    dec = GreedyDecoder(m, KVBitsCache(m, preset, **kw), graphs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dec.generate(ids, 120)
    assert dec.captures == 2, [str(w.message)[:300] for w in caught]
    assert got.shape == eager.shape and torch.equal(got[:, :16], eager[:, :16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "uniform-int4"])
def test_gpu_captured_tma_ring_matches_eager(preset, monkeypatch, one_fp16_route):
    """At head_dim 128 the captured steps attend through the TMA ring (``decode_gluon_tma``,
    taken inside capture) over the store's own buffers (reserved for the whole generation,
    flushed in place at device offsets); the tokens equal the eager steps' (the register body:
    too small a call for the ring outside capture)."""
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    if decode_gluon_tma.gluon is None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA ring needs Hopper and Gluon")
    monkeypatch.setattr(decode_gluon, "MIN_BODY_TOKENS", 0)  # the Gluon body at this size
    used = []
    real = decode_gluon_tma.attend_body
    monkeypatch.setattr(decode_gluon_tma, "attend_body",
                        lambda *a, **k: used.append(1) or real(*a, **k))
    m = tiny_llama(2, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=128, max_position_embeddings=1024
                   ).half().cuda()
    ids = prompt(300, 2).cuda()
    eager = GreedyDecoder(m, KVBitsCache(m, preset), graphs=False).generate(ids, 150)
    assert not used, "the eager steps were meant to run the register body"
    dec = GreedyDecoder(m, KVBitsCache(m, preset), graphs=True)
    got = dec.generate(ids, 150)
    assert dec.captures == 2 and used, "the captured steps did not take the TMA ring"
    assert torch.equal(got, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kivi-2", "fp16"])
def test_gpu_fused_pointwise_under_graphs(gpu_model, preset, one_fp16_route):
    """Inductor's kernels captured with kvbits' in the two step graphs: the same tokens as the
    same fused steps run eagerly; against the unfused model (which rounds RMSNorm's product in
    a different place) the first tokens agree."""
    m = gpu_model
    ids = prompt(300, 1).cuda()
    plain = GreedyDecoder(m, KVBitsCache(m, preset), graphs=True).generate(ids, 200)
    eager = GreedyDecoder(m, KVBitsCache(m, preset), graphs=False,
                          fuse="inductor").generate(ids, 200)
    dec = GreedyDecoder(m, KVBitsCache(m, preset), graphs=True, fuse="inductor")
    got = dec.generate(ids, 200)
    assert dec.captures == (1 if preset == "fp16" else 2)  # FP16 never flushes: one kind
    assert torch.equal(got, eager)
    assert torch.equal(got[:, :32], plain[:, :32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_captured_static_cache_matches_eager(gpu_model):
    m = gpu_model
    ids = prompt(300, 1).cuda()
    n = 60

    def run(graphs):
        cache = StaticCache(config=m.config, max_cache_len=ids.shape[1] + n + 1)
        dec = GreedyDecoder(m, cache, graphs=graphs)
        return dec.generate(ids, n), dec.captures
    eager, _ = run(False)
    got, captures = run(True)
    assert captures == 1 and torch.equal(got, eager)


@INTERPRETED
def test_small_pre_rope_head_dim_decodes_eagerly_under_kernels(model, monkeypatch):
    """head_dim 16 pre-RoPE keys: the kernel cannot read them (``tl.dot`` needs an inner dim
    >= 16 per half), so where kernels run the cache refuses device lengths (the reference would
    read stale host lengths inside a graph) and the loop decodes eagerly, still correctly."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    ids = prompt(batch=1)
    want, _, _ = decode(model, ids, "kvquant-3", dict(residual_length=4, group_size=32,
                                                     calibration="uniform"), device=False, new=8)
    got, calls, _ = decode(model, ids, "kvquant-3", dict(residual_length=4, group_size=32,
                                                        calibration="uniform"), new=8)
    assert not calls and torch.equal(got, want)


def test_graphs_refuse_a_model_spread_over_gpus():
    """A model loaded over two GPUs cannot be captured in one CUDA graph: refused by name, and
    one GPU (or none) passes."""
    from types import SimpleNamespace

    from kvbits.integrations.decode_loop import check_one_gpu

    def model(*devices):
        params = [SimpleNamespace(device=torch.device(d)) for d in devices]
        return SimpleNamespace(parameters=lambda: iter(params))
    with pytest.raises(ValueError, match=r"cuda:0, cuda:1.*graphs=False"):
        check_one_gpu(model("cuda:0", "cuda:0", "cuda:1"))
    check_one_gpu(model("cuda:1", "cuda:1"))
    check_one_gpu(model("cpu"))
