"""Tests for kvbits.integrations.graph_generate: transformers' ``generate`` with its decoding
loop replaced (``custom_generate=graph_generate``) must return what ``generate`` returns with
the same cache (greedy: the same tokens; EOS: the same stop and padding, the cache as long),
fall back to transformers' loop with a warning where the loop cannot serve the call, and refuse
beam search. On the CPU the loop's steps run eagerly; the capture is checked on a GPU."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from test_decode_loop import prompt, tiny_llama
from transformers import DynamicCache, StaticCache
from transformers.generation.streamers import BaseStreamer

from kvbits.integrations import generate_loop, graph_generate
from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.hf import KVBitsCache, cache_kwargs

NEW = 60


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def generate(model, ids, cache, ours: bool, **kw):
    """``model.generate`` with ``cache``, through graph_generate or transformers' own loop; the
    output and the graph_generate warnings it raised. Through graph_generate, checks that the
    kvbits loop ran exactly when no warning says it did not."""
    runs = []
    real = GreedyDecoder.generate

    def counted(self, *a, **k):
        runs.append(1)
        return real(self, *a, **k)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught, \
            pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("always")
        mp.setattr(GreedyDecoder, "generate", counted)
        out = model.generate(ids, max_new_tokens=kw.pop("max_new_tokens", NEW),
                             pad_token_id=kw.pop("pad_token_id", 0),
                             **({"custom_generate": graph_generate} if ours else {}),
                             **cache_kwargs(model, cache), **kw)
    warned = [str(w.message) for w in caught if "graph_generate" in str(w.message)]
    assert len(runs) == (1 if ours and not warned else 0), (runs, warned)
    return out, warned


def kvbits_cache(model, preset="kivi-2"):
    return KVBitsCache(model, preset, **({} if preset == "fp16" else {"residual_length": 4}))


@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "uniform-int4", "fp16"])
def test_greedy_matches_generate(model, preset):
    ids = prompt(37, 2)
    want, _ = generate(model, ids, kvbits_cache(model, preset), ours=False, do_sample=False)
    got, warned = generate(model, ids, kvbits_cache(model, preset), ours=True, do_sample=False)
    assert not warned, warned
    assert got.shape == (2, 37 + NEW) and torch.equal(got, want)


def test_static_cache_matches_generate(model):
    ids = prompt(29, 2)

    def static():
        return StaticCache(config=model.config, max_cache_len=29 + NEW + 8)
    want, _ = generate(model, ids, static(), ours=False, do_sample=False)
    got, warned = generate(model, ids, static(), ours=True, do_sample=False)
    assert not warned, warned
    assert torch.equal(got, want)


def test_eos_stops_and_pads_like_generate(model):
    """Two sequences, two EOS ids, each met at another step: both runs stop when the later one
    is met, pad the earlier sequence after its EOS, and leave the cache as long."""
    ids = prompt(41, 2)
    free, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    new = free[:, 41:]
    eos = [int(new[0, 5]), int(new[1, 30])]
    caches = [kvbits_cache(model), kvbits_cache(model)]
    want, _ = generate(model, ids, caches[0], ours=False, do_sample=False, eos_token_id=eos)
    got, warned = generate(model, ids, caches[1], ours=True, do_sample=False, eos_token_id=eos)
    assert not warned, warned
    assert want.shape[1] < 41 + NEW, "no early stop: the test checks nothing"
    assert (want[:, 41:] == 0).any(), "no padded sequence: the test checks nothing"
    assert torch.equal(got, want)
    assert caches[1].get_seq_length() == caches[0].get_seq_length()


@pytest.mark.parametrize("at_least", [{"min_new_tokens": 20}, {"min_length": 41 + 15}])
def test_min_length_bans_eos_like_generate(model, at_least):
    """``min_new_tokens`` / ``min_length``: EOS cannot be chosen before, inside the loop too;
    the EOS ids are tokens greedy decoding meets early, so the ban changes the tokens."""
    ids = prompt(41, 2)
    free, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    eos = [int(free[0, 41 + 3]), int(free[1, 41 + 6])]
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False,
                       eos_token_id=eos, **at_least)
    unbanned, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False,
                           eos_token_id=eos)
    assert not torch.equal(want[:, :unbanned.shape[1]], unbanned), "the ban changed nothing"
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, do_sample=False,
                           eos_token_id=eos, **at_least)
    assert not warned, warned
    assert torch.equal(got, want)


def test_top_k_one_samples_the_greedy_tokens(model):
    """Sampling runs inside the loop (no fallback): with top-k 1 every draw is the argmax."""
    ids = prompt(33, 2)
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, do_sample=True,
                           temperature=0.7, top_k=1, top_p=0.9)
    assert not warned, warned
    assert torch.equal(got, want)


def test_sampling_follows_the_seed(model):
    ids = prompt(33, 2)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        out, warned = generate(model, ids, kvbits_cache(model), ours=True, do_sample=True,
                               temperature=1.5, top_k=20)
        assert not warned, warned
        runs.append(out)
    assert torch.equal(runs[0], runs[1])
    greedy, _ = generate(model, ids, kvbits_cache(model), ours=True, do_sample=False)
    assert not torch.equal(runs[0], greedy), "sampling at temperature 1.5 drew the argmax only"


class Collect(BaseStreamer):
    """A transformers streamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def test_streamer_gets_the_tokens_as_generate_gives_them(model):
    """Batch 1 with a streamer runs in the loop: the prompt, then the new tokens up to EOS,
    then one ``end``, as transformers' loop streams them (split into other chunks)."""
    ids = prompt(35, 1)
    free, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    eos = int(free[0, 35 + 25])
    runs = []
    for ours in (False, True):
        st = Collect()
        out, warned = generate(model, ids, kvbits_cache(model), ours=ours, do_sample=False,
                               eos_token_id=eos, streamer=st)
        assert not warned, warned
        assert st.ended == 1 and torch.equal(st.puts[0].reshape(1, -1), ids)
        streamed = torch.cat([p.reshape(-1) for p in st.puts[1:]])
        assert torch.equal(streamed, out[0, 35:])
        runs.append(out)
    assert torch.equal(runs[0], runs[1]) and runs[1].shape[1] < 35 + NEW


def test_streamer_found_through_a_wrapper(model):
    """A Python wrapper around graph_generate (a frame between it and generate) still finds
    the streamer, so it still gets the tokens and its end."""
    def wrapped(model, input_ids, logits_processor, stopping_criteria, generation_config,
                synced_gpus=False, streamer=None, **kw):
        return graph_generate(model, input_ids, logits_processor, stopping_criteria,
                              generation_config, synced_gpus, streamer, **kw)
    st = Collect()
    with torch.no_grad():
        out = model.generate(prompt(30, 1), max_new_tokens=10, do_sample=False, pad_token_id=0,
                             custom_generate=wrapped, streamer=st,
                             **cache_kwargs(model, kvbits_cache(model)))
    assert st.ended == 1 and torch.equal(torch.cat([p.reshape(-1) for p in st.puts]), out[0])


def test_fuse_given_to_generate_reaches_the_loop(model, monkeypatch):
    seen = []
    real = GreedyDecoder.__init__

    def init(self, *a, fuse=None, **k):
        seen.append(fuse)
        real(self, *a, **k)  # (not compiled here: the CPU test checks the plumbing)
    monkeypatch.setattr(GreedyDecoder, "__init__", init)
    generate(model, prompt(30, 1), kvbits_cache(model), ours=True, do_sample=False,
             max_new_tokens=5, fuse="inductor")
    assert seen == ["inductor"]


def test_dict_output_holds_sequences_and_cache(model):
    ids = prompt(30, 2)
    cache = kvbits_cache(model)
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    got, warned = generate(model, ids, cache, ours=True, do_sample=False,
                           return_dict_in_generate=True)
    assert not warned, warned
    assert torch.equal(got.sequences, want) and got.past_key_values is cache


@pytest.mark.parametrize("preset", ["kivi-2", "fp16", "kvquant-3"])
def test_left_padded_batch_matches_generate(model, preset):
    """Prompts of different lengths, left-padded: each sequence's positions start at its first
    real token and its padding is masked by its start, as in generate."""
    ids = prompt(40, 3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :23] = 0

    def cache():
        kw = {"calibration": "uniform"} if preset == "kvquant-3" else {}
        return (KVBitsCache(model, preset, residual_length=4, **kw) if preset != "fp16"
                else KVBitsCache(model, preset))
    want, _ = generate(model, ids, cache(), ours=False, do_sample=False, attention_mask=mask)
    got, warned = generate(model, ids, cache(), ours=True, do_sample=False, attention_mask=mask)
    assert not warned, warned
    assert torch.equal(got, want)
    if preset == "fp16":  # (quantized, the padding shifts the group boundaries: other codes)
        unpadded, _ = generate(model, ids[2:, 23:], cache(), ours=True, do_sample=False)
        assert torch.equal(got[2, 40:], unpadded[0, 17:]), "padding changed the sequence"


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_generate(model, penalty):
    """The penalty (prompt tokens included) inside the loop: the same greedy tokens as
    transformers' processor; it changes them (the tiny model repeats itself)."""
    ids = prompt(33, 2)
    free, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False,
                       repetition_penalty=penalty)
    assert not torch.equal(want, free), "the penalty changed nothing: the test checks nothing"
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, do_sample=False,
                           repetition_penalty=penalty)
    assert not warned, warned
    assert torch.equal(got, want)


def test_repetition_penalty_of_a_left_padded_batch_matches_generate(model):
    """transformers' penalty ignores each sequence's left padding (``prompt_ignore_length``):
    the loop serves it, its padding not counted either. It used to count the padding's ids
    as seen (GreedyDecoder: another token where the padding id was the favourite), and
    graph_generate fell back to transformers' loop, warning that it served the penalty."""
    ids = prompt(40, 2)
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    kw = {"do_sample": False, "attention_mask": mask, "repetition_penalty": 5.0,
          "max_new_tokens": 8}
    first, _ = generate(model, ids, kvbits_cache(model, "fp16"), ours=False, **kw)
    pad = int(first[1, 40])  # the padded sequence's first choice: its padding's id now
    ids = ids.masked_fill(mask == 0, pad)
    want, _ = generate(model, ids, kvbits_cache(model, "fp16"), ours=False, pad_token_id=pad,
                       **kw)
    assert want[1, 40] == pad, "the padding's id is not the favourite: the test checks nothing"
    got, warned = generate(model, ids, kvbits_cache(model, "fp16"), ours=True, pad_token_id=pad,
                           **kw)
    assert not warned, warned
    assert torch.equal(got, want)
    dec = GreedyDecoder(model, kvbits_cache(model, "fp16"), graphs=False, repetition_penalty=5.0)
    assert torch.equal(dec.generate(ids, 8, attention_mask=mask), want[:, 40:])


def test_decode_refuses_a_penalty_without_the_prompt(model):
    dec = GreedyDecoder(model, kvbits_cache(model), graphs=False, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="repetition_penalty needs the prompt"):
        dec.decode(torch.ones(1, 1, dtype=torch.long), 10, 5)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        GreedyDecoder(model, kvbits_cache(model), repetition_penalty=0)


@pytest.mark.parametrize("case,reason", [
    ("no_repeat_ngram", "NoRepeatNGramLogitsProcessor"),
    ("dynamic_cache", "DynamicCache"),
    ("left_padding", "pads the batch"),
    ("scores", "output_scores"),
    ("batched_streamer", "streamer with a batch"),
    ("two_gpus", "spread over cuda:0, cuda:1"),
])
def test_falls_back_with_the_reason(model, case, reason, monkeypatch):
    """What the loop does not serve runs transformers' own loop, with the same result."""
    ids = prompt(30, 2)
    kw = {"do_sample": False}
    cache = kvbits_cache
    if case == "two_gpus":  # (parameters as a device_map over two GPUs would place them)
        monkeypatch.setattr(generate_loop, "model_gpus", lambda m: ["cuda:0", "cuda:1"])
    elif case == "no_repeat_ngram":
        kw["no_repeat_ngram_size"] = 3
    elif case == "dynamic_cache":
        cache = lambda m: DynamicCache()
    elif case == "left_padding":  # (served with a KVBitsCache)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        kw["attention_mask"] = mask
        cache = lambda m: StaticCache(config=m.config, max_cache_len=30 + NEW + 8)
    elif case == "batched_streamer":
        kw["streamer"] = Collect()
    else:
        kw.update(output_scores=True, return_dict_in_generate=True)
    want, _ = generate(model, ids, cache(model), ours=False, **kw)
    got, warned = generate(model, ids, cache(model), ours=True, **kw)
    assert len(warned) == 1 and reason in warned[0], warned
    if case == "scores":
        assert torch.equal(got.sequences, want.sequences) and len(got.scores) == NEW
    else:
        assert torch.equal(got, want)


def test_continuing_a_padded_batch_falls_back(model):
    """A padded batch continued on the cache that holds its start: transformers' loop serves
    it (the graph loop masks padding only from an empty cache), with the same tokens."""
    ids = prompt(30, 2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    results = []
    for ours in (False, True):
        cache = kvbits_cache(model)
        first, _ = generate(model, ids, cache, ours=False, do_sample=False, attention_mask=mask)
        more = torch.cat([mask, torch.ones(2, first.shape[1] - ids.shape[1], dtype=mask.dtype)],
                         1)
        got, warned = generate(model, first, cache, ours=ours, do_sample=False,
                               attention_mask=more)
        results.append(got)
    assert len(warned) == 1 and "already holds tokens" in warned[0], warned
    assert torch.equal(results[0], results[1])


def test_deep_copied_prefix_cache_decodes_like_generate(model):
    """transformers' prefix-reuse recipe, ``copy.deepcopy(prompt_cache)`` and generate from
    the copy: the copy's layers answer to the copy (a weak reference is copied as is, so they
    read the original's step flags: the loop never flushed and ran past its buffers), and the
    loop gives generate's tokens; the original keeps its prefix."""
    import copy
    ids = prompt(60, 1)

    def prefix():
        cache = kvbits_cache(model)
        with torch.no_grad():
            model(input_ids=ids[:, :40], use_cache=True, **cache_kwargs(model, cache))
        return cache
    want, _ = generate(model, ids, prefix(), ours=False, do_sample=False)
    original = prefix()
    copied = copy.deepcopy(original)
    assert all(layer._cache is copied for layer in copied.layers)
    got, warned = generate(model, ids, copied, ours=True, do_sample=False)
    assert not warned, warned
    assert torch.equal(got, want)
    assert original.get_seq_length() == 40 and copied.get_seq_length() == 60 + NEW - 1


def test_the_function_not_its_module():
    """``custom_generate`` must get the function: a module there is silently ignored by
    ``generate`` (neither a string nor a callable), which would make every test above vacuous."""
    assert callable(graph_generate) and graph_generate.__name__ == "graph_generate"


def test_refuses_beam_search(model):
    with pytest.raises(ValueError, match="graph_generate: decodes greedily.*num_beams=2"):
        generate(model, prompt(30, 1), kvbits_cache(model), ours=True, num_beams=2,
                 do_sample=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kivi-2", "fp16"])
def test_gpu_generate_replays_graphs(preset, monkeypatch):
    """On a GPU the steps are captured (a plain and a flushing step for kivi-2; FP16 layers
    flush nothing: one) and the tokens equal GreedyDecoder's own captured run."""
    m = tiny_llama(0, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=1024
                   ).half().cuda()
    ids = prompt(300, 2).cuda()
    want = GreedyDecoder(m, kvbits_cache(m, preset)).generate(ids, 150)
    captures = []
    real = GreedyDecoder._capture
    monkeypatch.setattr(GreedyDecoder, "_capture", lambda self: captures.append(1) or real(self))
    got, warned = generate(m, ids, kvbits_cache(m, preset), ours=True, do_sample=False,
                           max_new_tokens=150)
    assert not warned, warned
    assert len(captures) == (2 if preset != "fp16" else 1), captures
    assert torch.equal(got[:, 300:], want)


@pytest.mark.parametrize("preset,kw", [("kivi-2", {"residual_length": 4}), ("fp16", {}),
                                       ("kvquant-3", {"calibration": "uniform"}),
                                       ("kivi-2-had", {"sink_tokens": 2}),
                                       ("fp8-dynamic", {})])
@pytest.mark.parametrize("how", ["generate", "graph_generate"])
def test_a_used_cache_is_freed_without_the_cycle_collector(model, preset, kw, how):
    """A cache and its buffers go when the last reference does: a reference cycle (each layer
    held its cache) kept GPU memory until the cyclic garbage collector ran, and generate in a
    loop with fresh caches at long contexts ran out of memory (session 32, the H200)."""
    import gc
    import weakref
    cache = KVBitsCache(model, preset, **kw)
    generate(model, prompt(37, 2), cache, ours=how == "graph_generate", do_sample=False,
             max_new_tokens=40)
    refs = [weakref.ref(cache), weakref.ref(cache.layers[0].store.res_k)]
    was = gc.isenabled()
    gc.disable()
    try:
        del cache
        assert [r() is None for r in refs] == [True, True]
    finally:
        if was:
            gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_rules_inside_the_graph(monkeypatch):
    """The repetition penalty, the EOS ban of min_new_tokens and the EOS stop run inside the
    captured steps: the tokens equal the same loop's eager steps (both on the captured calls'
    FP16 route, as the decode-loop tests pin it)."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", 0)
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")  # and merge in the finish kernel
    m = tiny_llama(0, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=1024
                   ).half().cuda()
    ids = prompt(300, 1).cuda()
    free = GreedyDecoder(m, kvbits_cache(m, "kivi-2")).generate(ids, 150)
    eos = int(free[0, 5])  # met early: banned until 40 new tokens
    want = GreedyDecoder(m, kvbits_cache(m, "kivi-2"), graphs=False,
                         repetition_penalty=1.3).generate(ids, 150, stop_tokens=[eos],
                                                          min_new_tokens=40)
    got, warned = generate(m, ids, kvbits_cache(m, "kivi-2"), ours=True, do_sample=False,
                           max_new_tokens=150, repetition_penalty=1.3, min_new_tokens=40,
                           eos_token_id=eos)
    assert not warned, warned
    assert torch.equal(got[:, 300:], want)
    assert eos not in want[0, :39].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_deep_copied_prefix_cache_replays_like_a_fresh_one():
    """A copied prefix cache on the GPU, where the steps are captured (a flushing step among
    them) and the layers read the capture flag from their cache: the copy's tokens are a fresh
    cache's with the same prefix, and the original keeps its prefix."""
    import copy
    m = tiny_llama(0, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=1024
                   ).half().cuda()
    ids = prompt(300, 1).cuda()

    def prefix():
        cache = kvbits_cache(m)
        with torch.no_grad():
            m(input_ids=ids[:, :200], use_cache=True, **cache_kwargs(m, cache))
        return cache
    want, _ = generate(m, ids, prefix(), ours=True, do_sample=False, max_new_tokens=150)
    original = prefix()
    got, warned = generate(m, ids, copy.deepcopy(original), ours=True, do_sample=False,
                           max_new_tokens=150)
    assert not warned, warned
    assert torch.equal(got, want)
    assert original.get_seq_length() == 200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_fp8_prefix_grown_by_eager_steps_replays():
    """An fp8 prefix cache whose buffers grew by 1/8 in eager decode steps (capacities between
    whole groups: the captured view once bounded its body by the raw capacity, which
    decode_attention refuses): the captured loop runs and gives transformers' own tokens."""
    import copy
    m = tiny_llama(0, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=1024
                   ).half().cuda()
    ids = prompt(380, 1).cuda()
    cache = KVBitsCache(m, "fp8-dynamic", step_graphs=False)  # (steps that grow by 1/8)
    with torch.no_grad():
        m(input_ids=ids[:, :270], use_cache=True, **cache_kwargs(m, cache))
        for t in range(270, 330):  # one token at a time: the buffers grow by 1/8
            m(input_ids=ids[:, t:t + 1], use_cache=True, **cache_kwargs(m, cache))
    G = cache.spec.group_size
    assert any(layer.store.k_codes.shape[2] % G for layer in cache.layers)  # the premise
    want, _ = generate(m, ids, copy.deepcopy(cache), ours=False, do_sample=False,
                       max_new_tokens=30)
    got, warned = generate(m, ids, cache, ours=True, do_sample=False, max_new_tokens=30)
    assert not warned, warned
    assert torch.equal(got, want)


def _gemma(n: int):
    """Gemma2 (softcapping, sliding and full layers) or Gemma3 (sliding and full layers, per
    layer-type RoPE), tiny."""
    import transformers as tf
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "sliding_window": 24, "pad_token_id": 0}
    if n == 2:
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(
            layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0, final_logit_softcapping=30.0, **common))
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        layer_types=["sliding_attention"] * 3 + ["full_attention"], **common))


@pytest.mark.parametrize("arch", ["mistral-sliding", "qwen3", "phi3", "phi-partial-rotary",
                                  "gemma", "olmo2", "cohere", "starcoder2", "smollm3-nope",
                                  "glm4", "gemma2", "gemma3"])
def test_other_architectures_match_generate(arch):
    """The loop behind generate on decoder classes beyond Llama (tiny random configs, output
    distribution made peaked so greedy tokens are stable under float order): the same tokens as
    generate's own loop through the same kind of cache, past the sliding windows."""
    from test_architectures import ARCHS
    torch.manual_seed(0)
    try:
        m = (_gemma(int(arch[-1])) if arch in ("gemma2", "gemma3") else ARCHS[arch]()).eval()
    except AttributeError as e:  # a class this transformers version does not have
        pytest.skip(f"{arch}: {e}")
    with torch.no_grad():
        m.get_output_embeddings().weight.mul_(8.0)
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(2))

    def cache():
        return KVBitsCache(m, "kivi-4", residual_length=8)
    want, _ = generate(m, ids, cache(), ours=False, do_sample=False, max_new_tokens=40)
    got, warned = generate(m, ids, cache(), ours=True, do_sample=False, max_new_tokens=40)
    assert not warned, warned
    assert torch.equal(got, want)


def test_attention_mask_of_another_shape_is_refused(model):
    """GreedyDecoder.generate's attention mask must be ``[batch, tokens]`` like the input: an
    all-ones mask one token short (or of another batch) was dropped, and the loop generated as
    if none was given."""
    ids = prompt(20, 2)
    for shape in ((2, 19), (1, 20)):
        dec = GreedyDecoder(model, kvbits_cache(model), graphs=False)
        with pytest.raises(ValueError, match=re.escape(f"attention_mask {shape} must have "
                                                       "input_ids' shape (2, 20)")):
            dec.generate(ids, 4, attention_mask=torch.ones(shape, dtype=torch.long))


def test_inputs_embeds_fall_back_to_generate(model):
    """``generate(inputs_embeds=...)``: the loop feeds token ids only, so transformers' loop
    serves it (it failed: 'the cache holds 0 tokens, the input 0')."""
    emb = model.get_input_embeddings()(prompt(20, 2)).detach()
    outs = []
    for ours in (False, True):
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs.append(model.generate(
                inputs_embeds=emb, max_new_tokens=6, do_sample=False, pad_token_id=0,
                **({"custom_generate": graph_generate} if ours else {}),
                **cache_kwargs(model, kvbits_cache(model))))
    warned = [str(w.message) for w in caught if "graph_generate" in str(w.message)]
    assert len(warned) == 1 and "inputs_embeds" in warned[0], warned
    assert torch.equal(outs[0], outs[1])


def test_static_cache_too_short_is_refused_by_name(model):
    """A StaticCache shorter than the prompt plus the new tokens (less the last, never fed) is
    refused before the prefill, naming max_cache_len: the loop failed with an index error deep
    in transformers' cache (on a GPU, a device-side assert inside a replayed graph)."""
    ids = prompt(29, 2)

    def static(n):
        return StaticCache(config=model.config, max_cache_len=n)
    want, _ = generate(model, ids, static(29 + NEW + 8), ours=False, do_sample=False)
    got, warned = generate(model, ids, static(29 + NEW - 1), ours=True, do_sample=False)
    assert not warned and torch.equal(got, want)
    with pytest.raises(ValueError, match=r"max_cache_len=87 .* need 88"):
        generate(model, ids, static(29 + NEW - 2), ours=True, do_sample=False)
    dec = GreedyDecoder(model, static(29 + NEW - 2), graphs=False)
    with pytest.raises(ValueError, match="max_cache_len"):
        dec.generate(ids, NEW)


@pytest.mark.parametrize("criterion", ["other_eos", "same_eos", "max_length"])
def test_stopping_criteria_of_other_values_fall_back(model, criterion):
    """A ``stopping_criteria`` given to ``generate`` takes the place of the one of its type
    that the config makes: an EOS criterion with other ids, or a max length other than the
    config's, stops transformers' loop elsewhere. The loop read the config only (and ran on
    to max_new_tokens, silently): now transformers' loop serves those, with the reason; a
    criterion equal to the config's is served."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
    ids = prompt(30, 2)
    free, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False,
                       max_new_tokens=20)
    eos = [int(free[0, 30 + 4]), int(free[1, 30 + 9])]
    crit = MaxLengthCriteria(30 + 6) if criterion == "max_length" else EosTokenCriteria(eos)
    kw = {"do_sample": False, "max_new_tokens": 20,
          "stopping_criteria": StoppingCriteriaList([crit]),
          **({"eos_token_id": eos} if criterion == "same_eos" else {})}
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, **kw)
    assert want.shape[1] < 30 + 20, "no early stop: the test checks nothing"
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, **kw)
    if criterion == "same_eos":
        assert not warned, warned
    else:
        assert len(warned) == 1 and type(crit).__name__ in warned[0], warned
    assert torch.equal(got, want)


def test_processors_in_another_order_fall_back(model):
    """The loop applies the penalty and the EOS ban before the warpers (temperature, top-k,
    top-p), the order ``generate`` makes them in; processors given to ``generate`` come in the
    order given, and a top-k before a penalty keeps other tokens. That order ran as the loop's
    own (other tokens, no warning): now transformers' loop serves it."""
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TopKLogitsWarper)
    ids = prompt(33, 2)

    def procs(*p):
        return {"do_sample": False, "logits_processor": LogitsProcessorList(p)}
    penalty_first = procs(RepetitionPenaltyLogitsProcessor(5.0), TopKLogitsWarper(2))
    top_k_first = procs(TopKLogitsWarper(2), RepetitionPenaltyLogitsProcessor(5.0))
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, **top_k_first)
    other, _ = generate(model, ids, kvbits_cache(model), ours=False, **penalty_first)
    assert not torch.equal(want, other), "the order changes nothing: the test checks nothing"
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, **top_k_first)
    assert len(warned) == 1 and "order" in warned[0], warned
    assert torch.equal(got, want)
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, **penalty_first)
    assert not warned and torch.equal(got, other), warned


def test_min_new_tokens_processor_of_another_prompt_length(model):
    """A ``MinNewTokensLengthLogitsProcessor`` given to ``generate`` counts new tokens from its
    own ``prompt_length_to_skip``: the loop banned EOS for ``min_new_tokens`` past the prompt
    whatever it was (EOS banned 10 steps too long here)."""
    from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor
    ids = prompt(41, 2)
    free, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    eos = [int(free[0, 41 + 3]), int(free[1, 41 + 6])]
    proc = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=41 - 10, min_new_tokens=25,
                                             eos_token_id=eos)
    kw = {"do_sample": False, "eos_token_id": eos,
          "logits_processor": LogitsProcessorList([proc])}
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, **kw)
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, **kw)
    assert not warned, warned
    assert torch.equal(got, want)


def test_top_p_zero_keeps_the_most_likely_token(model):
    """``top_p=0.0`` (transformers' processor accepts [0, 1] and keeps the most likely token):
    the loop raised 'Sampling: top_p must be in (0, 1]' from inside ``generate``; now it draws
    from the one token, generate's greedy tokens."""
    ids = prompt(33, 2)
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    ref, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=True, top_p=0.0,
                      temperature=1.5)
    assert torch.equal(ref, want)
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, do_sample=True,
                           top_p=0.0, temperature=1.5)
    assert not warned, warned
    assert torch.equal(got, want)


def test_use_cache_false_falls_back(model):
    """``use_cache=False``: transformers' loop feeds the whole sequence at every step (another
    result with a cache given); the loop, which decodes from the cache, ignored it silently."""
    ids = prompt(30, 2)
    kw = {"do_sample": False, "max_new_tokens": 8, "use_cache": False}
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, **kw)
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, **kw)
    assert len(warned) == 1 and "use_cache=False" in warned[0], warned
    assert torch.equal(got, want)


def test_repetition_penalty_on_bf16_logits_matches_generate():
    """transformers applies its processors to float32 logits; the loop applied the penalty in
    the model's dtype, whose rounding (bf16: 8 bits of mantissa) changed close choices."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16)).eval()
    m = m.to(torch.bfloat16)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.5)  # a flat distribution: close choices
    ids = prompt(20, 4)
    kw = {"do_sample": False, "max_new_tokens": 30, "repetition_penalty": 1.3}
    want, _ = generate(m, ids, kvbits_cache(m, "fp16"), ours=False, **kw)
    got, warned = generate(m, ids, kvbits_cache(m, "fp16"), ours=True, **kw)
    assert not warned, warned
    assert torch.equal(got, want)


def test_dict_output_names_the_cache_as_transformers_does(model, monkeypatch):
    """The output was built with ``past_key_values=``, which transformers from 5.2x renamed
    ``cache``: every ``return_dict_in_generate`` call logged its deprecation notice."""
    from transformers.utils import generic
    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: logged.append(msg))
    cache = kvbits_cache(model)
    got, warned = generate(model, prompt(30, 2), cache, ours=True, do_sample=False,
                           max_new_tokens=5, return_dict_in_generate=True)
    assert not warned, warned
    assert not [m for m in logged if "deprecated" in m], logged
    assert got.sequences.shape == (2, 35) and got.get("cache", None) is cache


def test_a_warper_given_besides_the_configs_falls_back(model):
    """A ``TopKLogitsWarper`` given to ``generate`` while sampling joins the one the config
    makes (top_k=50 by default; the warpers are made after the given processors are merged):
    transformers applies both, top-1 here, its greedy tokens. The loop kept the config's
    top-k only and sampled from 50 tokens, silently."""
    from transformers import LogitsProcessorList, TopKLogitsWarper
    ids = prompt(33, 2)
    kw = {"do_sample": True, "temperature": 1.5,
          "logits_processor": LogitsProcessorList([TopKLogitsWarper(1)])}
    greedy, _ = generate(model, ids, kvbits_cache(model), ours=False, do_sample=False)
    want, _ = generate(model, ids, kvbits_cache(model), ours=False, **kw)
    assert torch.equal(want, greedy)
    torch.manual_seed(0)
    got, warned = generate(model, ids, kvbits_cache(model), ours=True, **kw)
    assert len(warned) == 1 and "TopKLogitsWarper twice" in warned[0], warned
    assert torch.equal(got, want)
