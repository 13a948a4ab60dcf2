"""transformers ``generate()`` features through a ``KVBitsCache``, against ``DynamicCache``.

Tiny random decoders (a Llama and a Mistral whose 24-token sliding window the runs cross): the
FP16 preset stores the exact history, so every feature must give ``DynamicCache``'s tokens
(and scores); quantized presets are checked against themselves where a feature must not change
the result (drafts that are verified and cropped, a conversation continued on the same cache,
``generate`` against a hand-written decode loop)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from kvbits.integrations.hf import KVBitsCache, cache_kwargs

COMMON = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 512, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}
NEW = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integrations/conftest.py


def tiny(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    else:  # every layer slides over 24 tokens: the prompts and outputs below are longer
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=24, **COMMON))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request):
    return tiny(request.param)


def prompt(n=50, seed=1):
    """``n`` tokens that repeat a 20-token phrase, so that prompt lookup finds drafts."""
    phrase = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(seed))
    return phrase.repeat(1, -(-n // 20))[:, :n]


def generate(model, ids, cache, mask=None, **kw):
    kw.setdefault("do_sample", False)
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("min_new_tokens", kw["max_new_tokens"])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None
                              else mask, **cache_kwargs(model, cache), **kw)


def draft_of(model):
    """The same model with noisy weights: an assistant that is right now and then."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    return draft


class Tokens(BaseStreamer):
    def __init__(self):
        self.got = []

    def put(self, value):
        self.got.append(value.tolist())

    def end(self):
        self.got.append("end")


def left_padded():
    g = torch.Generator().manual_seed(4)
    ids, mask = torch.zeros(3, 50, dtype=torch.long), torch.zeros(3, 50, dtype=torch.long)
    for row, n in enumerate((50, 37, 44)):
        ids[row, 50 - n:] = torch.randint(3, 256, (n,), generator=g)
        mask[row, 50 - n:] = 1
    return ids, mask


def run_feature(model, feature, make_cache):
    """What ``generate`` returns for ``feature`` with caches from ``make_cache()``: tensors to
    compare."""
    x = prompt()
    if feature == "sample":
        torch.manual_seed(3)
        return generate(model, x, make_cache(), do_sample=True, top_k=20, temperature=0.7)
    if feature == "beam-sample":
        torch.manual_seed(3)
        return generate(model, x, make_cache(), num_beams=2, do_sample=True)
    kw = {"greedy": {}, "beam": {"num_beams": 3},
          "beam-early-stop": {"num_beams": 4, "early_stopping": True, "num_return_sequences": 2,
                              "min_new_tokens": 0},
          "prompt-lookup": {"prompt_lookup_num_tokens": 4},
          "assistant": {"assistant_model": draft_of(model)}}.get(feature)
    if kw is not None:
        return generate(model, x, make_cache(), **kw)
    if feature == "scores":
        out = generate(model, x, make_cache(), return_dict_in_generate=True, output_scores=True,
                       output_logits=True)
        return out.sequences, torch.stack(out.scores, 1), torch.stack(out.logits, 1)
    if feature == "streamer":
        streamer = Tokens()
        out = generate(model, x, make_cache(), streamer=streamer)
        return out, streamer.got
    if feature == "left-padded":
        ids, mask = left_padded()
        return generate(model, ids, make_cache(), mask=mask)
    if feature == "two-turns":  # the second call: the first's output and a new message
        cache = make_cache()
        first = generate(model, x, cache)
        reply = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
        return first, generate(model, torch.cat([first, reply], 1), cache), \
            torch.tensor(cache.get_seq_length())
    raise AssertionError(feature)


FEATURES = ["greedy", "sample", "beam", "beam-early-stop", "beam-sample", "prompt-lookup",
            "assistant", "scores", "streamer", "left-padded", "two-turns"]


@pytest.mark.parametrize("feature", FEATURES)
def test_fp16_preset_equals_dynamic_cache(model, feature):
    """Each feature, FP16 preset against DynamicCache: the same tokens, scores to rounding."""
    want = run_feature(model, feature, DynamicCache)
    got = run_feature(model, feature, lambda: KVBitsCache(model, "fp16"))
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:
            assert (a.tolist() if isinstance(a, torch.Tensor) else a) == \
                (b.tolist() if isinstance(b, torch.Tensor) else b), feature


# ------------------------------------------------------------------ drafts in the prompt's forward
@pytest.mark.parametrize("preset", ["kivi-2:R=8,S=2", "kivi-4:R=16",
                                    "kvquant-3:R=8"])
def test_drafts_verified_with_the_prompt_leave_no_trace(preset):
    """Assisted and prompt-lookup decoding verify their first drafts in the prompt's forward
    (one prefill of prompt + drafts), then crop the rejected ones. The groups that the drafts
    brought due went back to FP16 with the crop, so the store holds what a prefill of the prompt
    alone holds, and decoding goes on with its logits. Before, those groups stayed quantized
    (kivi-2 R=8 S=2: 64 body tokens instead of 32; the next logits 0.07 apart). transformers
    announces the crops first (``activate_past_recording``); a plain prompt keeps no FP16
    copies of what it flushed."""
    model = tiny("llama")
    extra = {"calibration": "uniform"} if preset.startswith("kvquant") else {}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 256, (1, 82), generator=g)  # a 70-token prompt and 12 drafts
    steps = torch.randint(3, 256, (1, 6), generator=g)

    def run(prefill):
        cache = KVBitsCache(model, preset, **extra)
        kw = cache_kwargs(model, cache)
        with torch.no_grad():
            if prefill > 70:
                cache.activate_past_recording()
            model(x[:, :prefill], use_cache=True, **kw)
            assert all((s._undo is not None) == (prefill > 70) for s in cache.stores)
            if prefill > 70:
                cache.crop(70 - prefill)
            logits = [model(steps[:, i:i + 1], use_cache=True, **kw).logits for i in range(6)]
        return cache, torch.cat(logits, 1)

    with_drafts, got = run(82)
    alone, want = run(70)
    for a, b in zip(with_drafts.stores, alone.stores):
        assert (a.sink_len, a.body_len, a.res_len) == (b.sink_len, b.body_len, b.res_len)
    assert alone.stores[0].res_len > 8  # the crop really did put groups back
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["prompt-lookup", "assistant"])
def test_drafting_gives_the_greedy_tokens_of_the_same_preset(mode):
    """Prompt lookup and an assistant model with a quantized cache give the tokens of plain
    greedy decoding with that cache (drafts longer than R: what they flush is put back)."""
    model = tiny("llama")
    x = prompt(70)
    kw = {"prompt_lookup_num_tokens": 12} if mode == "prompt-lookup" else \
        {"assistant_model": draft_of(model), "num_assistant_tokens": 12}
    preset = "kivi-2:R=8,S=2"
    want = generate(model, x, KVBitsCache(model, preset), max_new_tokens=30)
    cache = KVBitsCache(model, preset)
    got = generate(model, x, cache, max_new_tokens=30, **kw)
    assert got.tolist() == want.tolist()
    assert cache.get_seq_length() == got.shape[1] - 1


def test_an_uncroppable_cache_is_refused_before_the_prompt():
    """Without an FP16 residual (fp8 presets: R=0) a rejected draft is already quantized:
    assisted / prompt-lookup decoding is refused before the prompt runs, naming the cause and
    the way out (transformers' own refusal, after the prompt, says only that the cache cannot
    be cropped)."""
    if not hasattr(tf.Cache, "activate_past_recording"):
        pytest.skip("this transformers does not announce its crops (activate_past_recording)")
    model = tiny("llama")
    cache = KVBitsCache(model, "fp8-dynamic")
    with pytest.raises(ValueError, match=r"(?s)prompt-lookup.*residual_length=0.*"
                                         r"residual_length=32"):
        generate(model, prompt(), cache, prompt_lookup_num_tokens=4)
    assert cache.get_seq_length() == 0
    # a residual window makes it croppable: drafting then runs
    generate(model, prompt(), KVBitsCache(model, "fp8-dynamic", residual_length=16),
             prompt_lookup_num_tokens=4)


# ------------------------------------------------------------------ quantized against itself
def test_two_turns_and_boundaries_equal_a_hand_written_loop(model):
    """kivi-2 with R=32, G=32: a first turn of 40 new tokens crosses the residual and group
    boundaries, the second turn feeds the last token and a 9-token message as one chunk; the
    logits of both ``generate`` calls are those of ``model(...)`` steps on a fresh cache."""
    preset = "kivi-2:R=32,G=32"
    x = prompt(50)
    reply = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    cache = KVBitsCache(model, preset)
    first = generate(model, x, cache, max_new_tokens=40, return_dict_in_generate=True,
                     output_logits=True)
    second = generate(model, torch.cat([first.sequences, reply], 1), cache,
                      return_dict_in_generate=True, output_logits=True)
    store = cache.layers[-1].store
    assert store.body_len + store.evicted > 0  # groups were quantized (a sliding layer drops them)
    want = torch.cat([torch.stack(first.logits, 1), torch.stack(second.logits, 1)], 1)

    hand = KVBitsCache(model, preset)
    kw = cache_kwargs(model, hand)
    seq = second.sequences
    feeds = [x] + [seq[:, t:t + 1] for t in range(50, 89)] + [torch.cat([seq[:, 89:90], reply], 1)]
    feeds += [seq[:, t:t + 1] for t in range(99, seq.shape[1] - 1)]
    with torch.no_grad():
        got = torch.cat([model(ids, use_cache=True, **kw).logits[:, -1:] for ids in feeds], 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert hand.get_seq_length() == cache.get_seq_length() == seq.shape[1] - 1
