"""Tests for kvbits.integrations.hf: KVBitsCache + the registered "kvbits" attention.

Unit tests use tiny configs and call ``Cache.update`` directly; the rest run the real
SmolLM2-135M (float32, CPU) on short prompts for a few new tokens. Quantized runs use small
residual windows and prompts longer than a group so the packed body is really attended.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvbits.formats.layout import body_bytes_per_token
from kvbits.formats.packing import packed_length
from kvbits.integrations.hf import (
    ATTN_IMPLEMENTATION,
    KVBitsCache,
    kvbits_attention_forward,
    padding_starts,
)
from kvbits.spec import PRESETS

TEXT = (
    "The economy is growing again, and the jobs of the future are being created here at home. "
    "We have cut the deficit, invested in our schools and roads, and made health care more "
    "affordable for working families across the country. But the work is not finished. Too many "
    "Americans still feel that the rules are stacked against them, that hard work no longer "
    "guarantees a decent living, and that their children will not have the chances they had. "
    "Tonight I want to talk about what we can do together, as one people, to build an economy "
    "that works for everyone, to keep our country safe, and to protect the planet we leave to "
    "our grandchildren."
)
NEW = 6  # new tokens per generate call


# ------------------------------------------------------------------------------- helpers
def cache_kwarg(model) -> str:
    """The name this transformers version's forward/generate use for the cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prompt(tok, n: int) -> torch.Tensor:
    ids = tok(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] >= n, f"TEXT has only {ids.shape[1]} tokens"
    return ids[:, :n]


def forward(model, input_ids, cache, **kwargs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model(input_ids=input_ids, use_cache=True, **{cache_kwarg(model): cache}, **kwargs)


def generate(model, input_ids, cache, attention_mask=None, **kwargs):
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    kwargs.setdefault("do_sample", False)
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              max_new_tokens=NEW, min_new_tokens=NEW, **kwargs)


def tiny_config(**kw) -> LlamaConfig:
    cfg = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    cfg.update(kw)
    return LlamaConfig(**cfg)


def kv(batch=2, heads=2, tokens=5, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, tokens, dim, generator=g),
            torch.randn(batch, heads, tokens, dim, generator=g))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integrations/conftest.py


@pytest.fixture
def lm(smollm2):
    """The shared SmolLM2, with its attention implementation restored after the test."""
    model, tok = smollm2
    before = model.config._attn_implementation
    yield model, tok
    if model.config._attn_implementation != before:
        model.set_attn_implementation(before)


@pytest.fixture(scope="module")
def greedy_ref(smollm2):
    """Greedy continuation of a 70-token prompt with transformers' DynamicCache."""
    model, tok = smollm2
    x = prompt(tok, 70)
    return x, generate(model, x, DynamicCache())


# ------------------------------------------------------------------------- registration / API
def test_registered_attention_and_mask():
    assert AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] is kvbits_attention_forward
    # Without the mask function, sliding-window layers silently become full attention.
    assert AttentionMaskInterface._global_mapping[ATTN_IMPLEMENTATION] is sdpa_mask


def test_unknown_preset_names_presets():
    with pytest.raises(ValueError, match="unknown preset") as err:
        KVBitsCache(tiny_config(), "kivi-5")
    for name in PRESETS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="residual_length"):
        KVBitsCache(tiny_config(), "kivi-2", residual_length=-1)
    with pytest.raises(TypeError, match="PreTrainedModel or its config"):
        KVBitsCache(object(), "kivi-2")


def test_bad_overrides_and_calibrations_name_the_argument(tmp_path):
    # Were a TypeError from QuantSpec.__init__, FileNotFoundError / SafetensorError from the
    # kvquant loader, and a TypeError from pathlib for a calibration of the wrong type.
    with pytest.raises(ValueError, match=r"unknown QuantSpec override\(s\) foo; fields are"):
        KVBitsCache(tiny_config(), "kivi-2", foo=1)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("xx")
    for path in (tmp_path / "missing.safetensors", garbage, "Auto"):
        with pytest.raises(ValueError, match="cannot read a kvquant calibration from .*'auto'"):
            KVBitsCache(tiny_config(), "kvquant-2", calibration=path)
    with pytest.raises(ValueError, match="calibration= for method 'kvquant' must be 'auto'"):
        KVBitsCache(tiny_config(), "kvquant-2", calibration=3)
    for preset, what in (("fp8", "fp8 calibration"), ("kivi-2-hadc", "Hadamard calibration")):
        with pytest.raises(ValueError, match=f"{what}: calibration= must be 'auto', a list"):
            KVBitsCache(tiny_config(), preset, calibration=3)


def test_cache_of_a_shallower_model_is_refused_by_name():
    """A cache built for a model with fewer layers, given to a deeper one: a ValueError that
    says which layer and how many the cache has (was an IndexError from the layer list)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    deep = LlamaForCausalLM(tiny_config(num_hidden_layers=3)).eval()
    cache = KVBitsCache(tiny_config(num_hidden_layers=2), "kivi-2")
    with pytest.raises(ValueError, match="layer 2, .*KVBitsCache has 2 layers"):
        forward(deep, torch.randint(0, 64, (1, 8)), cache)


def test_layers_from_config_and_overrides():
    cache = KVBitsCache(tiny_config(num_hidden_layers=3), "kivi-4", residual_length=0)
    assert len(cache.layers) == 3
    assert cache.spec.key_bits == 4 and cache.spec.residual_length == 0
    assert cache.is_compileable is False and cache.is_croppable is False
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0 and cache.fp16_nbytes() == 0
    # transformers < 5.4 ask the mask sizes with cache_position (a tensor), later ones with
    # the query length (an int)
    assert cache.layers[0].get_mask_sizes(torch.arange(5)) == (5, 0)
    assert cache.layers[0].get_mask_sizes(5) == (5, 0)


def test_sliding_layers_from_gemma3_config():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512)
    cache = KVBitsCache(cfg, "kivi-2")
    want = [512 if t == "sliding_attention" else None for t in cfg.layer_types]
    assert [layer.sliding_window for layer in cache.layers] == want
    assert cache.is_sliding == [w is not None for w in want]
    assert None in want and 512 in want


def test_unsupported_layer_type():
    cfg = tiny_config(num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        KVBitsCache(cfg, "kivi-2")


def test_config_without_what_the_layers_need_is_refused():
    """A config whose layer_types is shorter than num_hidden_layers gave a cache of fewer
    layers, silently; one without num_hidden_layers failed with an AttributeError, a string
    sliding_window was kept as the window. Refused by name."""
    class Bare:
        def get_text_config(self, decoder=True):
            return self

    with pytest.raises(ValueError, match="num_hidden_layers, a positive integer; Bare has None"):
        KVBitsCache(Bare(), "kivi-2")
    cfg = tiny_config(num_hidden_layers=2)
    cfg.layer_types = ["full_attention"]
    with pytest.raises(ValueError, match="layer_types names 1 layers, but num_hidden_layers is 2"):
        KVBitsCache(cfg, "kivi-2")
    cfg = tiny_config(num_hidden_layers=2)
    object.__setattr__(cfg, "sliding_window", "24")  # (past the config's own type check)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer.*'24'"):
        KVBitsCache(cfg, "kivi-2")


# --------------------------------------------------------------------------- cache mechanics
def test_update_prefill_tags_and_defers_quantization():
    cache = KVBitsCache(tiny_config(), "kivi-2", residual_length=0)
    k, v = kv(tokens=40)
    rk, rv = cache.update(k, v, 0)
    assert rk is k and rv is v and rk._kvbits.prefill and rk._kvbits.layer is cache.layers[0]
    store = cache.layers[0].store
    assert store.body_len == 0 and store.res_len == 40  # waits for the padding to be known
    assert cache.get_seq_length(0) == 40 and cache.get_mask_sizes(1, 0) == (41, 0)


def test_slow_path_returns_dequantized_history():
    """Without the kvbits attention, the second update returns the whole history (and warns)."""
    cache = KVBitsCache(tiny_config(), "kivi-4", residual_length=0)
    k, v = kv(tokens=40)
    cache.update(k, v, 0)  # prefill: nobody marks it attended
    k1, v1 = kv(tokens=1, seed=1)
    with pytest.warns(UserWarning, match="slow path"):
        rk, _ = cache.update(k1, v1, 0)
    assert rk.shape == (2, 2, 41, 32) and not hasattr(rk, "_kvbits")
    store = cache.layers[0].store
    assert store.body_len == 32 and store.res_len == 9
    torch.testing.assert_close(rk[:, :, 32:], torch.cat([k, k1], 2)[:, :, 32:])  # FP residual
    err = (rk[:, :, :32] - k[:, :, :32]).abs().max()
    assert 0 < err < 0.5  # quantized body, 4 bits


def test_reorder_repeat_select_crop_reset():
    cache = KVBitsCache(tiny_config(num_hidden_layers=1), "kivi-2", residual_length=0)
    cache.batch_repeat_interleave(2)  # before any update: nothing to do
    k, v = kv(batch=2, tokens=40)
    cache.update(k, v, 0)
    store = cache.layers[0].store
    store.set_padding(torch.tensor([0, 3]))
    store.flush()
    res_before = store.res_k[:, :, :store.res_len].clone()
    cache.batch_repeat_interleave(2)
    assert store.batch == 4 and store.starts.tolist() == [0, 0, 3, 3]
    torch.testing.assert_close(store.res_k[:, :, :store.res_len], res_before.repeat_interleave(2, 0))
    cache.reorder_cache(torch.tensor([3, 0, 0, 1]))
    assert store.starts.tolist() == [3, 0, 0, 0]
    torch.testing.assert_close(store.res_k[0, :, :store.res_len], res_before[1])
    cache.batch_select_indices(torch.tensor([0, 1]))
    assert store.batch == 2 and store.starts.tolist() == [3, 0]
    cache.crop(-3)  # inside the FP residual
    assert cache.get_seq_length() == 37
    cache.crop(0)
    assert cache.get_seq_length() == 37
    with pytest.raises(ValueError, match="group"):
        cache.crop(-20)  # into the middle of a quantized group
    cache.crop(32)  # legacy: keep 32 tokens, a group boundary
    assert cache.get_seq_length() == 32
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0].store is None


def test_crop_is_all_layers_or_none():
    """A cut one layer cannot make (inside a quantized group of layer 1, while layer 0 is FP16)
    raises before any layer is cut; removing more tokens than the cache holds says so."""
    cache = KVBitsCache(tiny_config(num_hidden_layers=2), "kivi-2", residual_length=0,
                        skip_layers=(0,))
    k, v = kv(batch=1, tokens=240)
    for i in range(2):
        cache.update(k, v, i)
    cache.layers[1].store.flush()
    with pytest.raises(ValueError, match="quantized in groups of 32"):
        cache.crop(-30)
    assert [ly.store.total_len for ly in cache.layers] == [240, 240]
    with pytest.raises(ValueError, match="cannot remove 1000 tokens: the cache holds 240"):
        cache.crop(-1000)
    assert [ly.store.total_len for ly in cache.layers] == [240, 240]
    cache.crop(-48)  # a group boundary for both
    assert [ly.store.total_len for ly in cache.layers] == [192, 192]


# ------------------------------------------------------------------ speculative decoding
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                             reason="needs a CUDA device")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA),
                                    pytest.param("cuda-gluon", marks=_CUDA)])
def test_rejected_drafts_leave_no_trace(device, monkeypatch, request):
    """Speculative verification is one chunk (the last accepted token and the drafts), then
    transformers crops the rejected drafts. The drafts sit in the FP16 residual (R >= draft
    length), so the accepted rows' logits, the stored state and every later logit are those of
    a run that never saw the drafts; a group flush happens inside the chunk. On CUDA (FP16
    model) up to the FP16 GEMMs' rounding: through the Triton kernel's multi-row path, and
    ("cuda-gluon", size limits lifted) with the chunk's rows as columns of the Gluon body."""
    calls = []
    if device == "cuda-gluon":
        calls = request.getfixturevalue("gluon_calls")
        device = "cuda"
    cuda = device == "cuda"
    model = tiny_model("llama", device, torch.float16 if cuda else torch.float32)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (1, 96), generator=g).to(device)
    drafts = torch.randint(0, 256, (1, 3), generator=g).to(device)

    def run(with_drafts: bool):
        cache = KVBitsCache(model, "kivi-2", residual_length=8)  # G = 32: flush at 40 held
        forward(model, x[:, :70], cache)  # prompt: 32 quantized, 38 in the residual
        chunk = torch.cat([x[:, 70:74], drafts], 1) if with_drafts else x[:, 70:74]
        rows = forward(model, chunk, cache).logits[:, :4]
        if with_drafts:
            assert cache.layers[0].store.body_len == 64  # flushed by the chunk's third row
            cache.crop(-3)
        later = torch.cat([forward(model, x[:, t:t + 1], cache).logits for t in range(74, 96)], 1)
        return rows, later, cache.layers[0].store

    rows_a, later_a, store_a = run(True)
    rows_b, later_b, store_b = run(False)
    atol = 1e-2 * rows_b.float().abs().max().item() if cuda else 1e-5
    torch.testing.assert_close(rows_a.float(), rows_b.float(), atol=atol, rtol=0)
    torch.testing.assert_close(later_a.float(), later_b.float(), atol=atol, rtol=0)
    assert (store_a.body_len, store_a.res_len) == (store_b.body_len, store_b.res_len)
    n = store_a.body_len // 32 * packed_length(32, 2)
    agree = (store_a.k_codes[:, :, :n] == store_b.k_codes[:, :, :n]).float().mean().item()
    assert agree > (0.99 if cuda else 0.999), agree  # the same tokens (up to rounding ties)
    rows_seen = [q.shape[2] for q, _, _ in calls]
    assert not rows_seen or max(rows_seen) > 1, rows_seen  # gluon: the chunk's rows went there


@pytest.mark.parametrize("preset,prompt", [("kivi-2", 69), ("fp8-dynamic", 37),
                                           ("kivi-2-had", 37), ("uniform-int4", 69)])
def test_a_flush_by_rejected_drafts_is_undone(preset, prompt):
    """The last accepted token leaves the residual two short of R + G, the drafts bring it
    there: a group is flushed during the verification that a run which never saw the drafts
    flushes only two tokens later. The crop of the rejected drafts puts that group back (FP16),
    so the stored state and every later logit are that run's (they were quantized two steps
    early: 0.09 apart for kivi-2; fp8-dynamic: its first flush, the scales taken from the
    drafts)."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (1, 96), generator=g)
    drafts = torch.randint(0, 256, (1, 3), generator=g)

    def run(with_drafts: bool):
        cache = KVBitsCache(model, preset, residual_length=8)  # flush at R + G = 40 (G = 32)
        forward(model, x[:, :prompt], cache)
        chunk = torch.cat([x[:, prompt:prompt + 1], drafts], 1) if with_drafts \
            else x[:, prompt:prompt + 1]
        rows = forward(model, chunk, cache).logits[:, :1]
        store = cache.layers[0].store
        if with_drafts:
            assert store.body_len > (prompt - 8) // store.spec.group_size * store.spec.group_size
            cache.crop(-3)
        state = (store.body_len, store.res_len)
        later = torch.cat([forward(model, x[:, t:t + 1], cache).logits
                           for t in range(prompt + 1, 96)], 1)
        return rows, state, later

    rows_a, state_a, later_a = run(True)
    rows_b, state_b, later_b = run(False)
    assert state_a == state_b
    torch.testing.assert_close(rows_a, rows_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(later_a, later_b, atol=1e-4, rtol=0)


def test_fp8_dynamic_scales_in_chunks_are_those_of_generation():
    """fp8-dynamic takes its scales from the tokens held at the first flush. Inside a chunk
    that flush happens at the row generation would flush it, and must see only the tokens
    there by then: the later rows of the chunk took part (the chunked logits were as far from
    the one-at-a-time ones as FP8 is from FP16)."""
    model = tiny_model("llama")
    x = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(2))

    def run(step, preset="fp8-dynamic"):
        cache = KVBitsCache(model, preset, residual_length=8)
        cuts = [0, 20, *range(20 + step, 150, step), 150]
        return torch.cat([forward(model, x[:, a:b], cache).logits
                          for a, b in itertools.pairwise(cuts)], 1), cache

    one, cache_one = run(1)
    quant_err = (one - run(1, "fp16")[0]).abs().mean()
    for step in (19, 64):
        chunked, cache_chunked = run(step)
        assert (chunked - one).abs().mean() < 0.01 * quant_err, step
        for a, b in zip(cache_one.stores, cache_chunked.stores):
            torch.testing.assert_close(a.k_scale, b.k_scale, atol=0, rtol=1e-4)
            torch.testing.assert_close(a.v_scale, b.v_scale, atol=0, rtol=1e-4)


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_speculative_generate_through_the_cache(mode):
    """transformers' prompt-lookup and assisted decoding with a KVBitsCache: FP16 gives
    DynamicCache's tokens; kivi-4 generates with the drafts cropped from its residual (the cache
    ends holding exactly the output); without a residual window the layer is not croppable
    and transformers refuses before decoding."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(6)
    x = torch.randint(0, 256, (1, 16), generator=g).repeat(1, 6)  # repeats: lookups find drafts
    if mode == "prompt_lookup":
        kw = {"prompt_lookup_num_tokens": 4}
    else:  # a draft model that disagrees now and then: the same one with noisy weights
        draft = tiny_model("llama")
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        kw = {"assistant_model": draft}
    ref = generate(model, x, DynamicCache())
    assert generate(model, x, KVBitsCache(model, "fp16"), **kw).tolist() == ref.tolist()
    cache = KVBitsCache(model, "kivi-4", residual_length=16)
    cuts = []  # (length before, after) of each crop: transformers >= 5.14 pass -n (remove n),
    crop = cache.crop  # older ones +n (keep n)

    def counted(n, *a, **k):
        before = cache.get_seq_length()
        crop(n, *a, **k)
        cuts.append((before, cache.get_seq_length()))
    cache.crop = counted
    out = generate(model, x, cache, **kw)
    assert any(after < before for before, after in cuts), cuts  # drafts rejected and cropped
    assert out.shape[1] == x.shape[1] + NEW and cache.get_seq_length() == out.shape[1] - 1
    assert cache.layers[0].store.body_len > 0  # the history really was quantized
    no_residual = KVBitsCache(model, "kivi-4", residual_length=0)
    assert not no_residual.layers[0].is_croppable
    import transformers.generation.utils as gen_utils
    # recent transformers check is_croppable before drafting; older ones (5.17) crop anyway, and
    # a crop the layer cannot make raises (test_draft_longer_than_the_residual_is_explained)
    if "requires a cache that can be cropped" in inspect.getsource(gen_utils):
        with pytest.raises(ValueError, match="crop"):
            generate(model, x, no_residual, **kw)


def test_draft_longer_than_the_residual_is_explained():
    """A crop into a quantized group names the residual window as the cause."""
    cache = KVBitsCache(tiny_config(num_hidden_layers=1), "kivi-2", residual_length=4)
    k, v = kv(batch=1, tokens=70)
    cache.update(k, v, 0)
    cache.layers[0].store.flush()  # 64 quantized, 6 in the residual
    with pytest.raises(ValueError, match="residual_length=4"):
        cache.crop(-10)


def test_a_crop_into_a_padded_sequence_s_sink_names_the_sink_alone():
    """A crop into the sink of a left-padded sequence is refused for that reason alone: the
    residual's advice (raise residual_length) was appended to it too, wrong where nothing was
    quantized (R=512 here). Found by a differential fuzzer against DynamicCache."""
    cache = KVBitsCache(tiny_config(num_hidden_layers=1), "kivi-2:R=512,S=2")
    k, v = kv(batch=2, tokens=20)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :10] = False
    cache.update(k, v, 0)
    cache.layers[0].store.set_padding(padding_starts(mask[:, None, None, :].expand(2, 1, 20, 20),
                                                     2, 20, "cpu"))
    with pytest.raises(ValueError, match="own sink tokens") as err:
        cache.crop(-15)
    assert "residual_length" not in str(err.value)
    assert cache.get_seq_length() == 20  # left whole


def test_padding_starts_from_mask():
    B, L = 3, 6
    starts = torch.tensor([0, 2, 5])
    t = torch.arange(L)
    causal = t[None, :] <= t[:, None]
    valid = t[None, :] >= starts[:, None]  # [B, L]
    mask = (causal[None] & valid[:, None, :] & valid[:, :, None])[:, None]  # padded rows see nothing
    assert padding_starts(mask, B, L, "cpu").tolist() == [0, 2, 5]
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert padding_starts(additive, B, L, "cpu").tolist() == [0, 2, 5]
    assert padding_starts(None, B, L, "cpu").tolist() == [0, 0, 0]
    right = mask.flip(-1).flip(-2)  # padding at the end of the sequence
    with pytest.raises(ValueError, match="left padding"):
        padding_starts(right, B, L, "cpu")


def test_softcap_without_cache_is_eager_attention(monkeypatch):
    """Tensors of another cache with ``softcap`` (Gemma2): the capped eager attention, GQA and
    the causal mask included (SDPA has no cap); the scale 3 makes the cap bite."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    out, _ = kvbits_attention_forward(torch.nn.Module(), q, k, v, None, scaling=3.0,
                                      softcap=2.0)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = 2.0 * torch.tanh(q @ kk.transpose(2, 3) * 3.0 / 2.0)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -torch.inf)
    want = (s.softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out, want)
    s = (q @ kk.transpose(2, 3) * 3.0).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(),
                                                    -torch.inf)
    assert ((s.softmax(-1) @ vv).transpose(1, 2) - want).abs().max() > 1e-2  # the cap bites
    # in blocks of query rows (2 here: 4 x 4 heads x 5 keys x 2 rows bytes), with a bool mask
    import kvbits.methods.model_calls as model_calls
    monkeypatch.setattr(model_calls, "EAGER_SCORE_BYTES", 4 * 2 * 4 * 5 * 2)
    blocked, _ = kvbits_attention_forward(torch.nn.Module(), q, k, v, None, scaling=3.0,
                                          softcap=2.0)
    torch.testing.assert_close(blocked, want)
    pad = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    pad[1, :, :, :2] = False  # sequence 1: two padding keys
    masked, _ = kvbits_attention_forward(torch.nn.Module(), q, k, v, pad, scaling=3.0,
                                         softcap=2.0)
    s = (2.0 * torch.tanh(q @ kk.transpose(2, 3) * 3.0 / 2.0)).masked_fill(~pad, -torch.inf)
    torch.testing.assert_close(masked, (s.softmax(-1).nan_to_num(0.0) @ vv).transpose(1, 2))


# ------------------------------------------------------------- tiny random models (CPU, CUDA)
def tiny_model(arch: str, device="cpu", dtype=torch.float32):
    """A randomly initialised model: Llama with GQA, Gemma3 with 16-token sliding layers, or
    Gemma2 (sliding and full layers in turn, attention logits capped at 0.05, so the cap
    changes the logits by ~0.2)."""
    torch.manual_seed(0)
    if arch == "llama":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(tiny_config(vocab_size=256, hidden_size=384, num_hidden_layers=3,
                                             num_attention_heads=6, num_key_value_heads=2,
                                             head_dim=64, intermediate_size=512))
    elif arch == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        model = Gemma2ForCausalLM(Gemma2Config(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=64,
            attn_logit_softcapping=0.05, final_logit_softcapping=30.0,
            attn_implementation="eager"))  # the reference forward must cap (SDPA would not)
    else:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"]))
    return model.to(device=device, dtype=dtype).eval()


def stepwise_logits(model, x, mask, cache):
    """Prefill all but 10 tokens, a chunk of 4 over the history, then 6 single steps."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    P, T = x.shape[1] - 10, x.shape[1]
    cuts = [0, P, P + 4, *range(P + 5, T + 1)]
    return torch.cat([forward(model, x[:, a:b], cache, attention_mask=mask[:, :b],
                              position_ids=pos[:, a:b]).logits
                      for a, b in itertools.pairwise(cuts)], 1)


def padded_batch(device, length=48, pad=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, length), generator=g).to(device)
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    return x, mask


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2"])
def test_tiny_model_stepwise_equals_full_forward(arch):
    """fp16 spec, left padding, sliding window 16 < 48 tokens: the decode path == one forward."""
    model = tiny_model(arch)
    x, mask = padded_batch("cpu")
    with torch.no_grad():
        full = model(input_ids=x, attention_mask=mask,
                     position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    cache = KVBitsCache(model, "fp16")
    got = stepwise_logits(model, x, mask, cache)
    real = mask.bool()
    torch.testing.assert_close(got[real], full[real], atol=1e-5, rtol=1e-4)
    # left padding as recorded by a layer that keeps every token (sliding ones shift it)
    store = next(s for s, layer in zip(cache.stores, cache.layers) if not layer.is_sliding)
    assert store.starts.tolist() == [0, 8]


@pytest.mark.parametrize("chunk", [5, 19, 64])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2"])
def test_chunks_see_what_generation_sees(arch, chunk, monkeypatch):
    """kivi-2 with R=8, G=32: feeding new tokens in chunks gives the logits of feeding them one
    at a time (every row sees the quantized/FP16 split of its own decode step).

    Float32 sums in another order can flip a 2-bit code that sits on a rounding boundary, so the
    check is relative: the chunked run must be far closer to the one-at-a-time run than the
    quantization error itself (an append-everything-then-attend chunk is not)."""
    from kvbits.cache.store import LayerStore

    # layer 0 (sliding in the Gemmas) keeps its groups to be compared: eviction has its own test
    monkeypatch.setattr(LayerStore, "evict", lambda self, upto: 0)
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (1, 150), generator=g)

    def run(step, preset="kivi-2"):
        cache = KVBitsCache(model, preset, residual_length=8)
        cuts = [0, 40, *range(40 + step, 150, step), 150]
        with torch.no_grad():
            return torch.cat([forward(model, x[:, a:b], cache).logits
                              for a, b in itertools.pairwise(cuts)], 1), cache

    one, cache_one = run(1)
    chunked, cache_chunked = run(chunk)
    quant_err = (one - run(1, "fp16")[0]).abs().mean()
    chunk_err = (chunked - one).abs().mean()
    assert chunk_err < 0.01 * quant_err, (chunk_err, quant_err)
    assert cache_one.stores[0].body_len == cache_chunked.stores[0].body_len > 0
    assert torch.equal(cache_one.stores[0].k_codes[:, :, :8],
                       cache_chunked.stores[0].k_codes[:, :, :8])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch,sinks,gluon", [("llama", 0, False), ("gemma3", 0, False),
                                              ("gemma2", 0, False), ("llama", 3, False),
                                              ("gemma3", 2, False), ("gemma2", 0, True),
                                              ("gemma3", 2, True)])
def test_cuda_kernels_in_model_match_reference(arch, sinks, gluon, monkeypatch, request):
    """On CUDA the cache runs the Triton kernels: same logits as the PyTorch reference ops
    (with ``sinks``: each left-padded row's sink holds its own first tokens). ``gluon``: the
    single-row steps' bodies through the Gluon kernel at these small sizes, with Gemma2's
    softcapping and both Gemmas' sliding windows applied there."""
    from kvbits.kernels import decode_gluon
    calls = []
    if gluon:
        if decode_gluon.gluon is None:
            pytest.skip("this Triton has no Gluon")
        calls = request.getfixturevalue("gluon_calls")
    model = tiny_model(arch, "cuda", torch.float16)
    x, mask = padded_batch("cuda", length=80)
    real = mask.bool()
    with torch.no_grad():
        full = model(input_ids=x, attention_mask=mask,
                     position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    scale = full[real].abs().max().item()
    fp = stepwise_logits(model, x, mask, KVBitsCache(model, "fp16")).float()
    assert (fp[real] - full[real]).abs().max().item() <= 1e-2 * scale
    kw = dict(residual_length=0, sink_tokens=sinks)
    kernel = stepwise_logits(model, x, mask, KVBitsCache(model, "kivi-4", **kw))
    if gluon:  # both kinds of layer went through it
        used = [k.get("window") for _, _, k in calls]
        assert None in used and 16 in used, used
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    ref = stepwise_logits(model, x, mask, KVBitsCache(model, "kivi-4", **kw))
    assert (kernel.float() - ref.float())[real].abs().max().item() <= 1e-2 * scale


# --------------------------------------------------------------------------- real model: fp16
def test_model_switched_to_kvbits(lm):
    model, _ = lm
    KVBitsCache(model, "fp16")
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_fp16_stepwise_logits_match_full_forward(lm):
    """Prefill, a chunk of 4 over the history, then token by token == one full forward."""
    model, tok = lm
    x = prompt(tok, 44)
    with torch.no_grad():
        full = model(input_ids=x).logits
    cache = KVBitsCache(model, "fp16")
    parts = [forward(model, x[:, :30], cache).logits, forward(model, x[:, 30:34], cache).logits]
    parts += [forward(model, x[:, t:t + 1], cache).logits for t in range(34, 44)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
    assert cache.get_seq_length() == 44


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_fp16_generate_equals_dynamic_cache(lm, mode):
    model, tok = lm
    x = prompt(tok, 40)
    kw = {"greedy": {}, "sample": {"do_sample": True, "top_k": 50},
          "beam": {"num_beams": 2}}[mode]
    torch.manual_seed(0)
    ref = generate(model, x, DynamicCache(), **kw)
    cache = KVBitsCache(model, "fp16")
    torch.manual_seed(0)
    out = generate(model, x, cache, **kw)
    assert out.tolist() == ref.tolist()
    assert cache.get_seq_length() == out.shape[1] - 1  # our cache really was the one used


@pytest.mark.parametrize("kw", ["past_key_values", "cache"])
def test_cache_argument_spellings(lm, greedy_ref, kw):
    model, _ = lm
    if kw == "cache" and cache_kwarg(model) != "cache":
        pytest.skip("this transformers version has no `cache=` argument")
    x, ref = greedy_ref
    cache = KVBitsCache(model, "fp16")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=NEW, min_new_tokens=NEW, **{kw: cache})
    assert out.tolist() == ref.tolist()
    assert cache.get_seq_length() == out.shape[1] - 1


# ---------------------------------------------------------------------- real model: quantized
@pytest.mark.parametrize("spec,residual", [("kivi-4", 0), ("kivi-2", 16)])
@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_quantized_generate(lm, greedy_ref, spec, residual, mode):
    model, _ = lm
    x, ref = greedy_ref  # 70-token prompt: at least two groups of 32 in the body
    kw = {"greedy": {}, "sample": {"do_sample": True, "top_k": 50},
          "beam": {"num_beams": 2}}[mode]
    cache = KVBitsCache(model, spec, residual_length=residual)
    torch.manual_seed(0)
    out = generate(model, x, cache, **kw)
    assert out.shape == (1, 70 + NEW) and out[:, :70].tolist() == x.tolist()
    assert cache.get_seq_length() == 70 + NEW - 1
    for store in cache.stores:
        assert store.batch == kw.get("num_beams", 1)
        assert store.body_len >= 32 and store.res_len <= residual + 31
    if spec == "kivi-4" and mode == "greedy":
        assert out[0, 70:73].tolist() == ref[0, 70:73].tolist()  # 4 bits: same first tokens
    if mode == "sample":  # sampling through the cache is reproducible with a seed
        torch.manual_seed(0)
        again = generate(model, x, KVBitsCache(model, spec, residual_length=residual), **kw)
        assert again.tolist() == out.tolist()


@pytest.mark.parametrize("preset", ["fp16", "kivi-2:R=8"])
@pytest.mark.parametrize("more", [1, 5])
def test_a_cache_continued_by_another_model_hands_it_the_history(preset, more):
    """A cache built for one model and then continued by another of the same shape that still
    runs its own SDPA attention (the same checkpoint loaded twice) gives that one the whole
    history (the slow path): its logits are those of continuing on the first model. Before,
    the first call took the kvbits fast path (the new tokens only) and SDPA saw no history."""
    a = tiny_model("llama")
    b = copy.deepcopy(a)  # before a cache switches ``a`` to the kvbits attention
    x = padded_batch("cpu", length=64)[0][:1]
    steps = [x[:, 40:40 + more]] + [x[:, t:t + 1] for t in range(40 + more, 44 + more)]
    got, want = KVBitsCache(a, preset), KVBitsCache(a, preset)
    forward(a, x[:, :40], got)
    forward(a, x[:, :40], want)
    assert b.config._attn_implementation != ATTN_IMPLEMENTATION
    with pytest.warns(UserWarning, match="slow path"):
        on_b = torch.cat([forward(b, ids, got).logits for ids in steps], 1)
    on_a = torch.cat([forward(a, ids, want).logits for ids in steps], 1)
    torch.testing.assert_close(on_b, on_a, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset,kw", [("fp16", {}), ("kivi-4:R=8", {}),
                                       ("kivi-4:R=8", {"skip_layers": (1,)})])
def test_a_sliding_cache_that_evicted_is_continued_by_another_model(preset, kw):
    """The same hand-over after Gemma3's sliding layers dropped tokens (LayerStore.evict): the
    mask transformers builds for the sliding layers (from the first one's ``get_mask_sizes``)
    covers every token seen, so the slow path must hand SDPA as many keys, the dropped ones as
    stand-ins that the window hides, whatever each layer dropped (an FP16 layer among kivi
    ones drops other counts). It handed the tokens held: SDPA failed on a mask of 57 columns
    for keys of 20 (QA, session 59)."""
    a = tiny_model("gemma3")
    b = copy.deepcopy(a)
    x, mask = padded_batch("cpu", length=64, pad=8)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    got, want = KVBitsCache(a, preset, **kw), KVBitsCache(a, preset, **kw)

    def step(model, cache, t0, t1):
        return forward(model, x[:, t0:t1], cache, attention_mask=mask[:, :t1],
                       position_ids=pos[:, t0:t1]).logits

    for cache in (got, want):
        step(a, cache, 0, 40)
        for t in range(40, 56):
            step(a, cache, t, t + 1)
    evicted = [layer.store.evicted for layer in got.layers]
    assert min(evicted[:3]) > 0 and evicted[3] == 0
    assert len(set(evicted[:3])) == (2 if kw else 1)
    with pytest.warns(UserWarning, match="slow path"):
        on_b = torch.cat([step(b, got, t, t + 1) for t in range(56, 60)], 1)
    on_a = torch.cat([step(a, want, t, t + 1) for t in range(56, 60)], 1)
    torch.testing.assert_close(on_b, on_a, atol=1e-4, rtol=0)
    assert got.get_seq_length() == want.get_seq_length() == 60


def test_slow_path_matches_fast_path(lm):
    """A config-built cache on an SDPA model dequantizes the history: same logits, same store."""
    model, tok = lm
    assert model.config._attn_implementation != ATTN_IMPLEMENTATION
    x = prompt(tok, 40)

    def run(cache):
        out = [forward(model, x[:, :36], cache).logits]
        out += [forward(model, x[:, t:t + 1], cache).logits for t in range(36, 40)]
        return torch.cat(out, 1)

    slow = KVBitsCache(model.config, "kivi-4", residual_length=0)
    with pytest.warns(UserWarning, match="slow path"):
        slow_logits = run(slow)
    fast = KVBitsCache(model, "kivi-4", residual_length=0)
    fast_logits = run(fast)
    torch.testing.assert_close(slow_logits, fast_logits, atol=1e-4, rtol=0)
    for a, b in zip(slow.stores, fast.stores):
        assert a.body_len == b.body_len == 32
        assert torch.equal(a.k_codes[:, :, :a.k_words], b.k_codes[:, :, :b.k_words])


def _left_pad(rows, pad_id):
    n = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("preset,kw", [("kivi-4", {}), ("kivi-4", {"sink_tokens": 3}),
                                       ("kvquant-3", {"calibration": "uniform"})],
                         ids=["kivi-4", "kivi-4-S3", "kvquant-3-S1"])
def test_left_padded_batch_equals_single_runs(lm, preset, kw):
    """Padding of exactly one group: the short prompt's groups line up with its solo run, and
    its sink holds its own first tokens (not padding), so generation is identical."""
    model, tok = lm
    x = prompt(tok, 70)[0].tolist()
    long, short = x[:70], x[:38]
    ids, mask = _left_pad([long, short], tok.pad_token_id)

    def cache():
        return KVBitsCache(model, preset, residual_length=0, **kw)
    padded = cache()
    out = generate(model, ids, padded, attention_mask=mask, pad_token_id=tok.pad_token_id)
    alone_long = generate(model, torch.tensor([long]), cache())
    alone_short = generate(model, torch.tensor([short]), cache())
    assert out[0, 70:].tolist() == alone_long[0, 70:].tolist()
    assert out[1, 70:].tolist() == alone_short[0, 38:].tolist()
    S = padded.stores[0].sink_len
    assert S == padded.stores[0].spec.sink_tokens
    if S:  # the short prompt's sink: its own first S keys, bit for bit (the solo run's sink)
        solo = cache()
        forward(model, torch.tensor([short]), solo)
        for a, b in zip(padded.stores, solo.stores):
            assert torch.equal(a.sink_k[1, :, :S], b.sink_k[0, :, :S])
    if preset != "kivi-4":
        return
    for store in padded.stores:
        assert store.starts.tolist() == [0, 32]
        # The all-padding group 0 of the short prompt holds no valid token: scale = zero = 0.
        assert not store.k_scale[1, :, 0].any() and not store.k_zero[1, :, 0].any()
        assert not store.v_scale[1, :, :32].any() and store.v_scale[1, :, 32:64].all()


@pytest.mark.parametrize("short", [1, 2])
def test_short_prompt_in_a_padded_batch_leaves_the_others_their_sink(short):
    """sink_tokens=4 and a left-padded batch whose shortest prompt holds fewer real tokens
    than the sink, the prompt step quantizing a group (R=0): every sequence decodes as it does
    alone. The long prompt keeps its own first 4 tokens in FP16 (the sink used to close with
    the shortest prompt's count of slots, so the long prompt's tokens ``short..3`` were
    quantized: padding changed another sequence's logits), and the short one's sink slots
    take its tokens as they come (padding of two groups: its groups line up with its solo
    run's)."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(7)
    long = torch.randint(0, 256, (1, 64 + short), generator=g)
    brief = torch.randint(0, 256, (1, short), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 64, dtype=torch.long), brief], 1)])
    mask = torch.ones_like(ids)
    mask[1, :64] = 0

    def logits(x, m, cache):
        out = generate(model, x, cache, attention_mask=m, pad_token_id=0, output_logits=True,
                       return_dict_in_generate=True)
        return out.sequences[:, x.shape[1]:], torch.stack(out.logits, 1)

    def cache():
        return KVBitsCache(model, "kivi-4", residual_length=0, sink_tokens=4)
    padded = cache()
    tokens, scores = logits(ids, mask, padded)
    solo = []
    for b, x in enumerate((long, brief)):
        solo.append(cache())
        want_tokens, want = logits(x, torch.ones_like(x), solo[-1])
        assert tokens[b].tolist() == want_tokens[0].tolist(), b
        torch.testing.assert_close(scores[b], want[0], atol=1e-4, rtol=0)
    for store, *alone in zip(padded.stores, *(c.stores for c in solo)):
        assert store.sink_len == 4 and store.body_len > 0 and store.starts.tolist() == [0, 64]
        for b in (0, 1):  # each sequence's sink: its own first 4 keys, as alone
            torch.testing.assert_close(store.sink_k[b], alone[b].sink_k[0], atol=1e-5, rtol=0)


def test_padding_never_enters_min_max(lm):
    """10 tokens of padding share group 0 with 22 real tokens: its key range is theirs alone."""
    model, tok = lm
    x = prompt(tok, 60)[0].tolist()
    ids, mask = _left_pad([x[:60], x[:50]], tok.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    quant = KVBitsCache(model, "kivi-4", residual_length=0)
    forward(model, ids, quant, attention_mask=mask, position_ids=positions)
    dense = KVBitsCache(model, "fp16")  # full-precision keys of the same padded batch
    forward(model, ids, dense, attention_mask=mask, position_ids=positions)
    solo = KVBitsCache(model, "fp16")
    forward(model, torch.tensor([x[:50]]), solo)

    for layer in (0, 1):
        q, d, s = quant.stores[layer], dense.stores[layer], solo.stores[layer]
        assert q.starts.tolist() == [0, 10] and q.body_len == 32
        real = s.res_k[0, :, :22].float()  # [H, 22, D]: the real tokens of group 0, solo run
        torch.testing.assert_close(d.res_k[1, :, 10:32], s.res_k[0, :, :22], atol=1e-4, rtol=0)
        lo, hi = real.amin(1), real.amax(1)
        zero = q.k_zero[1, :, 0].float()
        torch.testing.assert_close(zero, lo.half().float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(q.k_scale[1, :, 0].float(), (hi - zero) / 15, atol=2e-3, rtol=2e-3)
        # The check has teeth: with the padding keys the range would be visibly different.
        pad = d.res_k[1, :, :10].float()
        assert max((torch.minimum(lo, pad.amin(1)) - lo).abs().max(),
                   (torch.maximum(hi, pad.amax(1)) - hi).abs().max()) > 0.05
        assert not q.v_scale[1, :, :10].any() and q.v_scale[1, :, 10:32].all()


def test_nbytes_formula_and_savings(lm):
    model, tok = lm
    x = prompt(tok, 100)
    cache = KVBitsCache(model, "kivi-2", residual_length=16)
    forward(model, x, cache)
    forward(model, x[:, -1:], cache)
    total = 0
    for s in cache.stores:
        assert s.body_len == 64 and s.res_len == 37
        fp = 2 * (s.sink_len + s.res_len) * s.head_dim * s.res_k.element_size()
        body = s.body_len * body_bytes_per_token(s.head_dim, 2, 2, 32, s.value_group)
        total += s.batch * s.kv_heads * (fp + body)
    assert cache.nbytes() == round(total)
    dense = sum(2 * s.batch * s.kv_heads * 101 * s.head_dim * s.res_k.element_size()
                for s in cache.stores)
    assert cache.fp16_nbytes() == dense
    assert cache.nbytes() < 0.5 * cache.fp16_nbytes()
    fp16 = KVBitsCache(model, "fp16")
    forward(model, x[:, :40], fp16)
    assert fp16.nbytes() == fp16.fp16_nbytes()


# --------------------------------------------------------------------- Gemma3: sliding layers
@pytest.mark.model
def test_gemma3_sliding_window_chunked_decode_matches_full_forward():
    """600 tokens of real prose (> the 512 window): prefill 520, then chunks of 20 go through
    the decode path, whose window must match the mask of a full forward (without the window the
    PPL of these 80 tokens goes from 13.9 to 16.3)."""
    from kvbits.data import load_model, load_text

    try:
        model, tok = load_model("gemma3-270m", dtype=torch.float32)
        text = load_text("sotu-2010-2016")
    except Exception as exc:  # noqa: BLE001 (no network and no cached copy)
        pytest.skip(f"gemma3-270m or the SOTU text is not available: {exc}")
    assert model.config.get_text_config().sliding_window == 512
    x = tok(text[:6000], return_tensors="pt").input_ids[:, :600]
    assert x.shape[1] == 600
    with torch.no_grad():
        ref = model(input_ids=x, logits_to_keep=81).logits  # predictions of tokens 520..599
    cache = KVBitsCache(model, "fp16")
    parts = [forward(model, x[:, :520], cache, logits_to_keep=1).logits]
    parts += [forward(model, x[:, t:t + 20], cache).logits for t in range(520, 600, 20)]
    got = torch.cat(parts, 1)
    assert all(layer.store.seq_len == 600 for layer in cache.layers)  # sliding layers keep all

    def ppl(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 520:]).exp().item()

    assert abs(ppl(got) / ppl(ref) - 1) < 1e-3
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- sliding-window eviction
@pytest.mark.parametrize("preset", ["kivi-2:S=2", "kivi-4", "fp8-dynamic", "fp16",
                                    "kvquant-3"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_sliding_layers_evict_what_no_query_sees(arch, preset, monkeypatch):
    """Sliding layers (window 16) drop the groups no later query can see: the logits of a
    left-padded batch fed as a prompt, a chunk and 90 single tokens equal those of a cache
    that keeps everything, while those layers hold a bounded number of tokens and the cache
    still reports the whole length."""
    from kvbits.cache.store import LayerStore
    from kvbits.spec import resolve_spec

    name, _, over = preset.partition(":")
    spec = resolve_spec(name, **({"sink_tokens": int(over[2:])} if over else {}))
    if spec.quantized and spec.method != "fp8":
        spec = spec.replace(residual_length=8)
    model = tiny_model(arch)
    x, mask = padded_batch("cpu", length=140, pad=5)

    def run():
        # kvquant: pre-RoPE keys and outliers on KIVI's uniform codes (no calibration)
        cache = KVBitsCache(model, spec, **({"calibration": "uniform"}
                                            if spec.method == "kvquant" else {}))
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cuts = [0, 40, 47, *range(48, 141)]
        logits = torch.cat([forward(model, x[:, a:b], cache, attention_mask=mask[:, :b],
                                    position_ids=pos[:, a:b]).logits
                            for a, b in itertools.pairwise(cuts)], 1)
        return logits, cache

    got, cache = run()
    monkeypatch.setattr(LayerStore, "evict", lambda self, upto: 0)
    want, full = run()
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == full.get_seq_length() == 140
    for layer, kept in zip(cache.layers, full.layers):
        if layer.is_sliding:
            assert layer.store.evicted > 0
            assert layer.store.seq_len < kept.store.seq_len // 2, layer  # window 16 of 140
            assert layer.store.nbytes() < kept.store.nbytes()
        else:
            assert layer.store.evicted == 0 and layer.store.seq_len == 140
    assert cache.nbytes() < full.nbytes()


@pytest.mark.parametrize("preset", ["fp16", "kivi-4"])
def test_crop_is_refused_below_a_sliding_window_s_reach(preset):
    """A sliding layer (window 16) dropped the tokens no later query could see, as long as the
    cache only grows. A crop further back than the window's reach would leave the next token
    without part of its window (silently: it attended to what was left): it is refused, the
    cache left whole, and the deepest crop allowed continues exactly as a run that never went
    past it."""
    model = tiny_model("gemma3")
    x = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(8))

    def decode(cache, a, b):
        return torch.cat([forward(model, x[:, t:t + 1], cache).logits for t in range(a, b)], 1)

    def cache():
        return KVBitsCache(model, preset, **({"residual_length": 16} if preset != "fp16" else {}))
    long = cache()
    forward(model, x[:, :40], long)
    decode(long, 40, 90)
    evicted = max(s.evicted for s in long.stores)
    assert evicted > 0
    lowest = evicted + 15  # the next token's window starts at the first token still held
    with pytest.raises(ValueError, match="keep at least"):
        long.crop(lowest - 1 - 90)
    assert long.get_seq_length() == 90
    long.crop(lowest - 90)
    short = cache()
    forward(model, x[:, :40], short)
    decode(short, 40, lowest)
    torch.testing.assert_close(decode(long, lowest, 100), decode(short, lowest, 100),
                               atol=1e-5, rtol=0)


def test_beam_search_with_eviction_equals_keep_everything(monkeypatch):
    """Beam search reorders the evicted sliding layers like any other (tiny Gemma3, window 16,
    left padding, 60 new tokens): the same tokens as a cache that keeps everything."""
    from kvbits.cache.store import LayerStore

    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (2, 40), generator=g)
    mask = torch.ones_like(x)
    mask[1, :4] = 0

    def run():
        cache = KVBitsCache(model, "kivi-2", residual_length=8)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            out = model.generate(input_ids=x, attention_mask=mask, num_beams=2,
                                 max_new_tokens=60, min_new_tokens=60, do_sample=False,
                                 **{cache_kwarg(model): cache})
        return out, cache

    got, cache = run()
    assert max(s.evicted for s in cache.stores) > 0
    monkeypatch.setattr(LayerStore, "evict", lambda self, upto: 0)
    want, _ = run()
    assert torch.equal(got, want)


def test_partial_rotary_pre_rope_keys_generate():
    """A model with partial rotary embeddings (Phi-3 with partial_rotary_factor 0.5) takes
    pre-RoPE keys, which the store keeps in its own channel order
    (reference.rope.partial_rotary_layout), as well as the post-RoPE preset: greedy generate
    runs with both (test_kvquant_hf holds the exact checks of the pre-RoPE keys)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=2, partial_rotary_factor=0.5,
                                       pad_token_id=0)).eval()
    ids = torch.randint(1, 64, (1, 12))
    for preset in ("kvquant-3", "kvquant-3-post"):
        cache = KVBitsCache(model, preset, calibration="uniform")
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 16)
        assert (cache.stores[0].key_order is not None) == (preset == "kvquant-3")


def _chunk_padded_batch(preset, chunk, pad=100, **kw):
    """A tiny random Llama's left-padded batch (row 1: ``pad`` tokens of padding in 150),
    generated with the prompt prefilled in chunks of ``chunk``: the scores and the cache."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=256, hidden_size=64, head_dim=16)).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 256, (2, 150))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    cache = KVBitsCache(model, preset, **kw) if preset else DynamicCache()
    extra = {"prefill_chunk_size": chunk} if chunk else {}
    out = generate(model, ids, cache, attention_mask=mask, pad_token_id=0, output_scores=True,
                   return_dict_in_generate=True, **extra)
    return torch.stack(out.scores, 1), cache


def test_chunked_prefill_with_padding_longer_than_a_chunk():
    """Row 1 is all padding in the prompt's first three 32-token chunks: its padding must keep
    growing past the prompt step (it attended to 68 padding tokens before the fix)."""
    ref, _ = _chunk_padded_batch(None, 0)
    scores, cache = _chunk_padded_batch("fp16", 32)
    torch.testing.assert_close(scores, ref, atol=1e-4, rtol=0)
    assert all(s.starts.tolist() == [0, 100] for s in cache.stores)
    dense, _ = _chunk_padded_batch(None, 32)  # the check has teeth: DynamicCache, same chunks
    torch.testing.assert_close(dense, ref, atol=1e-4, rtol=0)
    # Quantized, with a sink: the padded row's sink holds its own first tokens (regathered
    # when its padding grows: the chunk's append gathered it at the old padding), and no
    # group's range holds padding (the all-padding groups of row 1 have scale = zero = 0). Its
    # logits at the prompt's end are those of the unchunked run: its real tokens are all still
    # FP16 there (R = 96 > 50).
    for pad in (100, 96):  # 96: the padding ends where a chunk begins
        ref, _ = _chunk_padded_batch(None, 0, pad)
        scores, cache = _chunk_padded_batch("kivi-4", 32, pad, residual_length=96,
                                            sink_tokens=2)
        first, want = scores[1, 0], ref[1, 0]  # the prompt's last logits (then tokens differ)
        seen = torch.isfinite(want)  # (min_new_tokens bans EOS with -inf)
        assert torch.equal(torch.isfinite(first), seen)
        torch.testing.assert_close(first[seen], want[seen], atol=1e-4, rtol=0)
        for store in cache.stores:
            assert store.starts.tolist() == [0, pad] and store.sink_len == 2 and store.body_len
            assert not store.k_scale[1, :, 0].any() and not store.v_scale[1, :, :64].any()


def test_chunked_padding_after_a_sink_flush_is_refused():
    """With a sink, a row still all padding after the layer quantized tokens cannot regather
    its sink: a clear error names the way out."""
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        _chunk_padded_batch("kivi-4", 32, residual_length=0, sink_tokens=2)


@pytest.mark.parametrize("chunks", [[1] * 30, [5, 1, 1, 23]])
def test_one_token_steps_through_left_padding_like_dynamic_cache(chunks):
    """A left-padded batch fed one token at a time (a hand-written loop, or
    ``prefill_chunk_size=1``) while a row is still all padding: those one-token steps are
    padding too. They were taken for real tokens (only steps of 2 or more read the mask):
    silently wrong logits for the padded row, or a chunk after them refused as right padding."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (2, 30), generator=g)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :12] = 0
    pos = (mask.cumsum(1) - 1).clamp(0)

    def run(cache):
        out, t = [], 0
        for n in chunks:
            out.append(forward(model, ids[:, t:t + n], cache, attention_mask=mask[:, :t + n],
                               position_ids=pos[:, t:t + n]).logits)
            t += n
        return torch.cat(out, 1)

    want = run(DynamicCache())
    # kivi-4: the padding stays out of the groups; step_graphs=True: one-token steps taken as
    # replayed layer steps (eager on the CPU) read the mask too
    for preset, graphs in itertools.product(("fp16", "kivi-4:R=8"), (False, True)):
        cache = KVBitsCache(model, preset, step_graphs=graphs)
        got = run(cache)
        assert all(s.starts.tolist() == [0, 12] for s in cache.stores)
        if preset == "fp16":
            torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", ["fp16", "kivi-4"])
def test_crop_into_left_padding_then_continue_like_dynamic_cache(preset):
    """A crop that keeps fewer tokens than a sequence's left padding (no sink of its own): what
    comes next is that sequence's own (transformers' mask after the cut says so), not more
    padding. Its start moved to the cut; the tokens after it were hidden (it saw nothing, its
    outputs zeros) before the fix. A later chunk's leading padding extends its padding from
    the cut on. Session 49 QA (tests/cache/test_store_stateful.py)."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (2, 30), generator=g)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :20] = 0
    more = torch.randint(1, 256, (2, 9), generator=g)

    def run(cache):
        forward(model, ids, cache, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(0))
        cache.crop(-20)  # keep 10 tokens: sequence 1 keeps padding only
        m, out = mask[:, :10], []
        for t in range(4):  # decode steps
            m = torch.cat([m, torch.ones(2, 1, dtype=torch.long)], 1)
            out.append(forward(model, more[:, t:t + 1], cache, attention_mask=m,
                               position_ids=(m.cumsum(1) - 1)[:, -1:]).logits)
        cache.crop(-4)  # back to the cut, then a chunk whose first 2 tokens pad sequence 1
        step = torch.ones(2, 5, dtype=torch.long)
        step[1, :2] = 0
        m = torch.cat([mask[:, :10], step], 1)
        out.append(forward(model, more[:, 4:], cache, attention_mask=m,
                           position_ids=(m.cumsum(1) - 1).clamp(0)[:, -5:]).logits[:, 2:])
        return torch.cat(out, 1)

    cache = KVBitsCache(model, preset, residual_length=32)
    torch.testing.assert_close(run(cache), run(DynamicCache()), atol=1e-4, rtol=0)
    assert all(s.starts.tolist() == [0, 12] for s in cache.stores)
