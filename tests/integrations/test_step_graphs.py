"""Tests for kvbits.integrations.step_graphs: transformers' own ``generate()`` with each layer's
one-token decode step run with its lengths on the device (replayed from CUDA graphs on a GPU).

On the CPU ``step_graphs=True`` runs every such step eagerly in that mode (the same device-side
appends, fixed-size flushes and buffer reservations as a captured step), so its tokens must equal
the cache's ordinary steps, across flushes, buffer re-reservations, sinks, padding and the
operations that leave the mode (beam search, crop, save). The capture itself is checked on a GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_decode_loop import (  # noqa: F401 (a fixture)
    INTERPRETED,
    PRESETS,
    gpu_model,
    prompt,
    tiny_llama,
)

from kvbits.cache.store import LayerStore
from kvbits.integrations import step_graphs
from kvbits.integrations.hf import KVBitsCache, cache_kwargs

NEW = 80


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture
def entries(monkeypatch):
    """Every layer's entries into the mode: the token counts it reserved for."""
    calls = []
    begin = LayerStore.begin_device_lengths
    monkeypatch.setattr(LayerStore, "begin_device_lengths",
                        lambda self, n: (calls.append(n), begin(self, n))[1])
    return calls


def generate(model, ids, cache, new=NEW, mask=None, **kw):
    """Greedy tokens and per-step scores of transformers' ``generate`` with ``cache``."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None
                             else mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             output_scores=True, return_dict_in_generate=True,
                             **cache_kwargs(model, cache), **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1)


def both(model, ids, preset, kw, new=NEW, mask=None, **gen):
    """(tokens, scores, cache) with the mode on, then off."""
    out = []
    for steps in (True, False):
        cache = KVBitsCache(model, preset, step_graphs=steps, **kw)
        out.append((*generate(model, ids, cache, new, mask, **gen), cache))
    return out


def assert_same_stores(a: KVBitsCache, b: KVBitsCache) -> None:
    """Every layer holds the same lengths and the same stored rows."""
    a.end_step_graphs()
    for sa, sb in zip(a.stores, b.stores):
        (ta, na), (tb, nb) = sa.state(), sb.state()
        assert na == nb
        assert ta.keys() == tb.keys()
        for name in ta:
            assert torch.equal(ta[name], tb[name]), name


def taken_step(model):
    """A layer-0 store holding a 40-token prompt, then one token's update taken for the mode
    (its attention not run yet): ``(cache, layer, token)``."""
    cache = KVBitsCache(model.config, "kivi-2", step_graphs=True, residual_length=4)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 40, 16)
    cache.update(k, k, 0)
    layer._attended = True  # as if the kvbits attention had consumed the prompt
    layer.store.flush()
    cache._model_config = None  # (no model: the layer takes its steps as kvbits' own)
    one = torch.randn(1, 2, 1, 16)
    cache.update(one, one, 0)
    assert layer._pending is not None and layer._steps_on
    return cache, layer, one


@pytest.mark.parametrize("preset,kw", PRESETS)
def test_generate_in_the_mode_equals_ordinary_steps(model, preset, kw, entries):
    ids = prompt(37, batch=2)
    (got, s_got, c_got), (want, s_want, c_want) = both(model, ids, preset, kw)
    assert entries  # the layers ran their steps with the lengths on the device
    assert all(layer._steps_on for layer in c_got.layers)
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)
    assert_same_stores(c_got, c_want)
    if preset != "fp16":  # flushed along the way, at the device offsets
        assert c_got.stores[0].body_len > (ids.shape[1] - kw.get("residual_length", 128)) // 32 * 32


# (kivi-2 only: the interpreter is slow, and test_decode_loop runs the other methods' device
# lengths on the kernels)
@pytest.mark.parametrize("preset,kw", [("kivi-2", {"residual_length": 4, "group_size": 32})])
@INTERPRETED
def test_the_mode_on_the_kernels(model, preset, kw, entries, monkeypatch):
    """Through the Triton kernels (interpreted on the CPU): the decode kernel reads the true
    lengths from ``lens_dev``, its launch sized by the reserved buffers, and the quantize
    kernels write the flushed groups at the device offsets."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    ids = prompt(63, batch=1)  # the first decode flush comes at step ~5
    (got, s_got, c_got), (want, s_want, c_want) = both(model, ids, preset, kw, new=12)
    assert entries and c_got.stores[0].body_len > (ids.shape[1] - 4) // 32 * 32
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-4, rtol=1e-4)
    assert_same_stores(c_got, c_want)


def test_buffers_reserved_again_when_used_up(model, entries, monkeypatch):
    """A small reserve: each layer leaves the mode, grows and enters again several times."""
    monkeypatch.setattr(step_graphs, "RESERVE_MIN", 8)
    ids = prompt(37, batch=2)
    kw = {"residual_length": 4, "group_size": 32}
    (got, s_got, c_got), (want, s_want, c_want) = both(model, ids, "kivi-2", kw, new=150)
    layers = len(c_got.layers)
    assert len(entries) >= 3 * layers, entries
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)
    assert_same_stores(c_got, c_want)


def test_left_padded_batch_with_sinks(model, entries):
    ids = prompt(61, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    kw = {"residual_length": 8, "group_size": 32, "sink_tokens": 3}
    (got, s_got, c_got), (want, s_want, c_want) = both(model, ids, "kivi-2", kw, mask=mask)
    assert entries
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)
    assert_same_stores(c_got, c_want)


def test_sliding_window_layers_evict_when_they_leave(entries, monkeypatch):
    """Sliding layers keep every token while in the mode (the graphs' buffers cannot move)
    and drop what no query sees when they leave it: the same logits as ordinary steps."""
    from transformers import MistralConfig, MistralForCausalLM

    monkeypatch.setattr(step_graphs, "RESERVE_MIN", 40)
    torch.manual_seed(0)
    m = MistralForCausalLM(MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=48,
        max_position_embeddings=512)).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    ids = prompt(37, batch=1)
    (got, s_got, c_got), (want, s_want, _) = both(
        m, ids, "kivi-4", {"residual_length": 4, "group_size": 32}, new=150)
    assert entries and c_got.stores[0].evicted > 0
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)


def test_beam_search_leaves_the_mode(model, entries):
    ids = prompt(37, batch=1)
    kw = {"residual_length": 4, "group_size": 32}
    (got, _, _), (want, _, _) = both(model, ids, "kivi-2", kw, new=40, num_beams=3)
    assert entries
    assert torch.equal(got, want)


def test_prompt_lookup_crops_leave_the_mode(model, entries):
    """Verification steps hold several rows (ordinary path); the single-row steps between them
    enter the mode; the crops of rejected drafts leave it."""
    ids = prompt(37, batch=1).repeat(1, 2)  # repeated n-grams: drafts to verify
    kw = {"residual_length": 8, "group_size": 32}
    (got, _, _), (want, _, _) = both(model, ids, "kivi-2", kw, new=40,
                                     prompt_lookup_num_tokens=3)
    assert torch.equal(got, want)


def test_save_load_and_copy_in_the_mode(model, tmp_path, entries):
    ids = prompt(37, batch=1)
    kw = {"residual_length": 4, "group_size": 32}
    cache = KVBitsCache(model, "kivi-2", step_graphs=True, **kw)
    generate(model, ids, cache, new=20)
    assert cache.layers[0]._steps_on
    twin = copy.deepcopy(cache)  # leaves the mode first: graphs are not copied
    path = cache.save(tmp_path / "c.safetensors")
    loaded = KVBitsCache.load(path, model)
    nxt = torch.tensor([[5]])
    pos = ids.shape[1] + 19
    outs = []
    for c in (cache, twin, loaded):
        with torch.no_grad():
            outs.append(model(nxt, position_ids=torch.tensor([[pos]]), use_cache=True,
                              **cache_kwargs(model, c)).logits)
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    torch.testing.assert_close(outs[2], outs[0], atol=0, rtol=0)


def test_crop_after_generate_leaves_the_mode(model, entries):
    """A crop of a cache that generate() left in the mode (rolling back its last tokens) leaves
    it first, like reorder or save, and the rolled-back cache decodes as an ordinary one."""
    ids = prompt(37, batch=1)
    out = []
    for steps in (True, False):
        cache = KVBitsCache(model, "kivi-2", step_graphs=steps, residual_length=8, group_size=32)
        first, _ = generate(model, ids, cache, new=30)
        cache.crop(-3)
        out.append((*generate(model, torch.cat([ids, first[:, :-3]], 1), cache, new=40), cache))
    (got, s_got, c_got), (want, s_want, c_want) = out
    assert entries
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)
    assert_same_stores(c_got, c_want)


def test_seq_length_counts_a_step_before_its_attention(model):
    """Between a step's update and its attention (an attention wrapper, a model that reads the
    length there) the layer holds the step's token, as an ordinary step's layer does."""
    cache, layer, _ = taken_step(model)
    assert cache.get_seq_length(0) == 41
    assert layer.get_mask_sizes(1) == (42, 0)


def test_later_uses_of_the_cache(model, entries, monkeypatch):
    """After generate() in the mode: a copy, a chunk over the history, a continuation, the
    batch expanded and cut down (num_return_sequences, finished rows): each leaves the mode
    or enters it again, with the tokens and logits of ordinary steps."""
    monkeypatch.setattr(step_graphs, "RESERVE_MIN", 8)
    ids = prompt(37, batch=2)
    chunk = prompt(20, batch=2)
    out = []
    for steps in (True, False):
        cache = KVBitsCache(model, "kivi-2", step_graphs=steps, residual_length=8, group_size=32)
        got = [*generate(model, ids, cache, new=30)]
        seq = torch.cat([ids, got[0]], 1)
        twin = copy.deepcopy(cache)
        got += generate(model, seq, twin, new=40)
        n = seq.shape[1]
        with torch.no_grad():
            got.append(model(chunk, position_ids=torch.arange(n, n + 20).expand(2, -1),
                             use_cache=True, **cache_kwargs(model, cache)).logits)
        seq = torch.cat([seq, chunk, torch.tensor([[7], [8]])], 1)
        got += generate(model, seq, cache, new=40)
        cache.batch_repeat_interleave(2)
        seq = torch.cat([seq, got[-2]], 1).repeat_interleave(2, 0)
        got += generate(model, seq, cache, new=40)
        cache.batch_select_indices(torch.tensor([0, 3]))
        got += generate(model, torch.cat([seq, got[-2]], 1)[[0, 3]], cache, new=40)
        out.append((got, cache))
    assert entries
    for a, b in zip(out[0][0], out[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert_same_stores(out[0][1], out[1][1])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_layers_with_their_own_bits(arch, entries, monkeypatch):
    """Sliding and full layers (Gemma2: attention logits capped), one layer in FP16 and one
    with other bits beside the spec's: each layer enters, re-reserves and evicts on its own."""
    from test_hf import tiny_model

    from kvbits.spec import resolve_spec

    monkeypatch.setattr(step_graphs, "RESERVE_MIN", 8)
    m = tiny_model(arch)
    spec = resolve_spec("kivi-2", residual_length=4, group_size=32).replace(
        layer_bits=((0, 4, 2),), skip_layers=(1,))
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(3))
    (got, s_got, c_got), (want, s_want, _) = both(m, ids, spec, {}, new=70)
    assert entries and any(s.evicted for s in c_got.stores)
    assert not c_got.stores[1].spec.quantized and c_got.layers[1]._steps_on
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset,kw", [
    ("kivi-2", {"residual_length": 4, "group_size": 32, "sink_tokens": 3}),
    ("kivi-2-had", {"residual_length": 8, "group_size": 32, "sink_tokens": 3}),
    ("kvquant-3", {"residual_length": 4, "group_size": 32, "calibration": "uniform",
                   "sink_tokens": 2}),
    ("fp8-dynamic", {"residual_length": 16})])  # the first flush comes during decode
def test_device_lengths_follow_the_host(model, preset, kw, monkeypatch):
    """After every step in the mode the device lengths are the host's, with a sequence whose
    few real tokens leave its sink slots waiting (the mode waits for them) and re-reservations."""
    monkeypatch.setattr(step_graphs, "RESERVE_MIN", 8)
    run = step_graphs.StepGraphs.step
    steps = []

    def checked(self, store, *args):
        out = run(self, store, *args)
        assert store.lens_dev.tolist() == [store.sink_len, store.body_len, store.res_len]
        steps.append(store)
        return out
    monkeypatch.setattr(step_graphs.StepGraphs, "step", checked)
    ids = prompt(23, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :21] = 0  # two real tokens: fewer than the sink's slots
    mask[2, :9] = 0
    (got, s_got, _), (want, s_want, _) = both(model, ids, preset, kw, new=100, mask=mask)
    assert steps
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)


def test_an_update_without_its_attention_is_kept(model):
    """A step whose attention never ran (another attention function read the tensors): the next
    update appends it, so no token is lost."""
    cache, layer, one = taken_step(model)
    n = layer.store.seq_len
    with pytest.warns(UserWarning, match="slow path"):  # (nothing attended the last step)
        cache.update(one, one, 0)  # the first step's attention never ran
    assert layer.store.seq_len == n + 2 and not layer._steps_on  # both steps' tokens


def test_a_failed_capture_goes_on_eagerly(model, monkeypatch):
    """A capture that fails (e.g. an operation a CUDA graph cannot hold) records nothing: the
    layer warns once and runs its steps eagerly in the same mode, with the same tokens."""
    ids = prompt(37, batch=1)
    kw = {"residual_length": 4, "group_size": 32}
    want, _ = generate(model, ids, KVBitsCache(model, "kivi-2", step_graphs=False, **kw), new=40)
    cache = KVBitsCache(model, "kivi-2", step_graphs=True, **kw)
    for layer in cache.layers:  # as on a GPU: capture after each kind's first step
        layer._steps = step_graphs.StepGraphs(capture=True)

    def fail(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(step_graphs.StepGraphs, "_capture", fail)
    with pytest.warns(UserWarning, match="capturing a layer's decode step failed") as caught:
        got, _ = generate(model, ids, cache, new=40)
    assert torch.equal(got, want)
    assert len([w for w in caught if "capturing" in str(w.message)]) == len(cache.layers)
    assert not any(layer._steps.capture for layer in cache.layers)


def test_store_edits_are_refused_in_the_mode(model):
    cache = KVBitsCache(model, "kivi-2", step_graphs=True, residual_length=4)
    generate(model, prompt(37, batch=1), cache, new=5)
    store = cache.stores[0]
    for op in (store.flush, store.compact_residual, lambda: store.reserve(4096)):
        with pytest.raises(ValueError, match="end_step_graphs"):
            op()
    cache.end_step_graphs()
    store.flush()  # allowed again


def test_setting_is_checked_and_auto_is_off_on_the_cpu(model):
    with pytest.raises(ValueError, match="step_graphs must be 'auto', True or False"):
        KVBitsCache(model, "kivi-2", step_graphs="yes")
    cache = KVBitsCache(model, "kivi-2", residual_length=4)
    assert cache.step_graphs == "auto"
    generate(model, prompt(37, batch=1), cache, new=5)
    assert all(layer._steps is None and not layer._steps_on for layer in cache.layers)


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset,kw", [("kivi-2", {}), ("kivi-4", {"sink_tokens": 2}),
                                       ("uniform-int4", {}), ("kivi-2-had", {}),
                                       ("fp8-dynamic", {"residual_length": 4}),
                                       ("kvquant-3", {"calibration": "uniform"}), ("fp16", {})])
def test_gpu_replayed_steps_match_eager_steps(gpu_model, preset, kw, entries,  # noqa: F811
                                              monkeypatch):
    """Captured per layer and kind, replayed, captured again after each re-reservation (a small
    reserve): the tokens of the same steps run eagerly in the same mode (the same launch
    geometry: bounds from the reserved buffers). Against the ordinary steps (launches sized
    by the true lengths, so other float orders) the scores agree while the tokens do. The
    captured steps attend the FP16 part in splits, the eager ones in the finish kernel, so
    both take the splits here (``FINISH_FP_TOKENS = 0``), merged in the finish kernel."""
    from kvbits.kernels import decode_attention as da

    monkeypatch.setattr(da, "FINISH_FP_TOKENS", 0)
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")  # and merge in the finish kernel
    monkeypatch.setattr(step_graphs, "RESERVE_MIN", 8)
    m = gpu_model
    ids = prompt(300, 2).cuda()
    kw = {"residual_length": 16, **kw}  # a body that grows past the first reservation
    replayed = KVBitsCache(m, preset, **kw)  # "auto": captured on CUDA
    got, s_got = generate(m, ids, replayed, new=200)
    n = len(replayed.layers)
    captures = sum(layer._steps.captures for layer in replayed.layers)
    assert len(entries) >= 2 * n, entries  # entered, then again after the buffers filled
    assert captures >= (2 if preset == "fp16" else 3) * n, captures
    eager = KVBitsCache(m, preset, step_graphs=True, **kw)
    for layer in eager.layers:  # the same mode, every step launched eagerly
        layer._steps = step_graphs.StepGraphs(capture=False)
    want, s_want = generate(m, ids, eager, new=200)
    assert torch.equal(got, want)
    torch.testing.assert_close(s_got.float(), s_want.float(), atol=1e-2, rtol=1e-2)
    ordinary, s_ord = generate(m, ids, KVBitsCache(m, preset, step_graphs=False, **kw), new=200)
    same = int((got == ordinary).all(0).int().cumprod(0).sum())  # steps before a first flip
    assert same >= 20, same
    torch.testing.assert_close(s_got[:, :same].float(), s_ord[:, :same].float(), atol=2e-2,
                               rtol=2e-2)
