"""Perplexity through the cache: chunking and windows are exact, the cache is really read.

Two error budgets: FP16 through the cache vs one full forward (same math, only the order of float
operations differs: 1e-4 relative on a tiny random model, 1e-3 on SmolLM2), and quantized vs FP16
on a real model (documented, looser: kivi-4 within 2% on 300 tokens, within 1% on 2048 tokens).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbits.eval.frontier import effective_bits
from kvbits.eval.perplexity import cache_elements, cache_nbytes, perplexity, plan_windows
from kvbits.integrations.hf import KVBitsCache


# --------------------------------------------------------------------------------- windows
def test_plan_windows_non_overlapping_scores_each_token_once():
    plan = plan_windows(1000, 256)
    assert plan[0] == (0, 256, 1) and plan[-1] == (768, 1000, 769)
    scored = [t for _, end, frm in plan for t in range(frm, end)]
    starts = {s for s, _, _ in plan}
    assert scored == [t for t in range(1000) if t not in starts]


@pytest.mark.parametrize("n,window,stride", [(1000, 256, 128), (97, 10, 3), (5, 8, 2)])
def test_plan_windows_strided_scores_every_token_but_the_first_once(n, window, stride):
    plan = plan_windows(n, window, stride)
    scored = [t for _, end, frm in plan for t in range(frm, end)]
    assert scored == list(range(1, n))
    assert all(end - start <= window and frm > start for start, end, frm in plan)


def test_plan_windows_drops_a_last_window_of_one_token():
    assert plan_windows(9, 4) == [(0, 4, 1), (4, 8, 5)]


@pytest.mark.parametrize("window,stride", [(1, None), (8, 0), (8, 9)])
def test_plan_windows_rejects_bad_arguments(window, stride):
    with pytest.raises(ValueError, match="window|stride"):
        plan_windows(100, window, stride)


# ------------------------------------------------------------------------ tiny random model
@pytest.fixture(scope="module")
def tiny():
    """A 2-layer random Llama (GQA 4:2, head_dim 16): fast, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    return model, ids


def full_forward_nll(model, ids) -> float:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()


@pytest.mark.parametrize("chunk,n", [(1, 40), (7, 128), (64, 256), (300, 256)])
def test_fp16_through_the_cache_equals_one_full_forward(tiny, chunk, n):
    model, ids = tiny
    ids1 = ids[:, :n]  # one window (max_position_embeddings = 256)
    r = perplexity(model, ids1, lambda: KVBitsCache(model, "fp16"), chunk_size=chunk, progress=False)
    expected = full_forward_nll(model, ids1)
    assert r["tokens_scored"] == n - 1 and r["windows"] == 1 and r["window"] == 256
    assert r["nll_sum"] == pytest.approx(expected, rel=1e-4)
    assert r["ppl"] == pytest.approx(math.exp(expected / (n - 1)), rel=1e-4)


def test_windows_each_start_a_fresh_cache(tiny):
    model, ids = tiny
    r = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=50, window=128,
                   progress=False)
    expected = sum(full_forward_nll(model, ids[:, s:s + 128]) for s in (0, 128, 256))
    assert r["windows"] == 3 and r["tokens_scored"] == 300 - 3
    assert r["nll_sum"] == pytest.approx(expected, rel=1e-4)


def test_nll_blocks_are_the_per_token_nll_summed_in_scoring_order(tiny):
    """Blocks of NLL_BLOCK scored tokens across chunk and window edges (the last shorter): what
    the frontier's paired bootstrap resamples, so they must add up and follow the tokens."""
    from kvbits.eval.perplexity import NLL_BLOCK

    model, ids = tiny
    r = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=50, window=128,
                   progress=False)
    per_token = []
    for s in (0, 128, 256):
        seq = ids[:, s:s + 128]
        with torch.no_grad():
            logits = model(seq).logits[0, :-1].float()
        per_token += torch.nn.functional.cross_entropy(logits, seq[0, 1:],
                                                       reduction="none").tolist()
    assert r["nll_block"] == NLL_BLOCK and len(per_token) == r["tokens_scored"] == 297
    want = [sum(per_token[i:i + NLL_BLOCK]) for i in range(0, 297, NLL_BLOCK)]
    assert len(r["nll_blocks"]) == len(want) == 19  # 18 full blocks and one of 9 tokens
    assert r["nll_blocks"] == pytest.approx(want, rel=1e-4)
    assert sum(r["nll_blocks"]) == pytest.approx(r["nll_sum"], rel=1e-6)


def test_later_windows_of_a_text_that_starts_with_the_bos_start_with_it(tiny):
    """Gemma's texts start with the BOS and the model never runs without it: each later window
    gets it as unscored context, and the same tokens are scored as without it."""
    model, ids = tiny
    bos = torch.tensor([[model.config.bos_token_id]])
    assert int(ids[0, 0]) != int(bos)  # (the other tests' text has no BOS)
    text = torch.cat([bos, ids[:, :299]], 1)
    r = perplexity(model, text, lambda: KVBitsCache(model, "fp16"), chunk_size=50, window=128,
                   progress=False)
    expected = full_forward_nll(model, text[:, :128])
    for s in (128, 256):
        seq = torch.cat([bos, text[:, s:s + 128]], 1)
        with torch.no_grad():
            logits = model(seq).logits[0, 1:-1].float()  # predicts seq[2:], as the plan scores
        expected += torch.nn.functional.cross_entropy(logits, seq[0, 2:], reduction="sum").item()
    assert r["windows"] == 3 and r["tokens_scored"] == 300 - 3
    assert r["nll_sum"] == pytest.approx(expected, rel=1e-4)


def test_strided_windows_score_each_token_once(tiny):
    model, ids = tiny
    r = perplexity(model, ids[:, :150], lambda: KVBitsCache(model, "fp16"), chunk_size=32,
                   window=64, stride=32, progress=False)
    assert r["tokens_scored"] == 149 and r["stride"] == 32 and r["windows"] == 4


def test_quantized_cache_is_read(tiny):
    """kivi-2 with R=0 must change the perplexity (a full forward would not)."""
    model, ids = tiny
    ids = ids[:, :200]
    fp = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=32, progress=False)
    q = perplexity(model, ids, lambda: KVBitsCache(model, "kivi-2", residual_length=0),
                   chunk_size=32, progress=False)
    # A random model attends almost uniformly, so 2 bits move the NLL sum only slightly (~0.05
    # of ~915); float noise between two FP16-cache runs is ~1e-4.
    assert abs(q["nll_sum"] - fp["nll_sum"]) > 0.01
    assert q["cache_bytes_fp16"] < fp["cache_bytes_fp16"] == fp["fp16_cache_bytes"]
    # FP16 DynamicCache of 200 tokens: layers * 2 (K, V) * kv_heads * head_dim * 2 bytes
    assert fp["fp16_cache_bytes"] == 200 * 2 * 2 * 2 * 16 * 2


def test_bits_per_element_count_the_elements_a_sliding_cache_holds():
    """On a model with sliding-window layers a kvbits cache holds more tokens there than
    DynamicCache keeps (up to a chunk; quantized groups up to ~1.25 windows): bits per element
    divide by the elements it holds, so FP16 is 16 bits and kivi-4 below 16 * 5 / 16, where
    dividing by DynamicCache's elements put FP16 above 16 (the rows before session 59)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=64)).eval()
    ids = torch.randint(0, 97, (1, 300), generator=torch.Generator().manual_seed(1))
    fp = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=32,
                    progress=False)
    assert fp["cache_bytes_fp16"] > fp["fp16_cache_bytes"]  # it held more than DynamicCache
    assert 16 * fp["cache_bytes_fp16"] / fp["fp16_cache_bytes"] > 16.5  # the old measure
    assert effective_bits(fp) == 16
    q = perplexity(model, ids, lambda: KVBitsCache(model, "kivi-4", residual_length=32),
                   chunk_size=32, progress=False)
    assert effective_bits(q) < 16
    # the held elements, layer by layer: what each store holds, never more than it has seen
    cache = KVBitsCache(model, "kivi-4", residual_length=32)
    with torch.no_grad():
        for i in range(0, 300, 32):
            model(ids[:, i:i + 32], past_key_values=cache, use_cache=True)
    held = [s.seq_len for s in cache.stores]
    assert all(64 <= h < 300 for h in held)
    assert cache_elements(cache) == sum(held) * 2 * 2 * 16
    old = {k: v for k, v in q.items() if k != "cache_elements"}  # a row from before
    assert effective_bits(old) == 16 * q["cache_bytes_fp16"] / q["fp16_cache_bytes"]


def test_cache_nbytes_of_a_dynamic_cache(tiny):
    from transformers import DynamicCache

    model, ids = tiny
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
    assert cache_nbytes(cache) == 40 * 2 * 2 * 2 * 16 * 4  # float32 model
    assert cache_nbytes(cache, fp16=True) == 40 * 2 * 2 * 2 * 16 * 2
    assert cache_elements(cache) == 40 * 2 * 2 * 2 * 16


def test_hf_quantized_cache_factory(tiny):
    pytest.importorskip("optimum.quanto")
    from kvbits.eval.hf_baseline import hf_quantized_cache_factory

    model, ids = tiny
    ids = ids[:, :192]
    make = hf_quantized_cache_factory(model, backend="quanto", nbits=4, q_group_size=16)
    r = perplexity(model, ids, make, chunk_size=64, progress=False)
    fp = full_forward_nll(model, ids)
    assert r["tokens_scored"] == 191 and r["nll_sum"] != pytest.approx(fp, rel=1e-6)
    assert 0 < r["cache_bytes_fp16"] < r["fp16_cache_bytes"]


def test_hf_quantized_cache_factory_refuses_a_bad_spec(tiny):
    """A spec with keywords too ran the spec and dropped the keywords silently; a spec that is
    not an HFQuantSpec was an AttributeError inside."""
    from kvbits.eval.hf_baseline import HFQuantSpec, hf_quantized_cache_factory

    model, _ = tiny
    with pytest.raises(TypeError, match="give spec or its fields as keywords, not both"):
        hf_quantized_cache_factory(model, HFQuantSpec(nbits=4), nbits=2)
    with pytest.raises(TypeError, match="spec must be an HFQuantSpec or None, got dict"):
        hf_quantized_cache_factory(model, {"backend": "quanto", "nbits": 2})
    for bad in (None, "HuggingFaceTB/SmolLM2-135M"):
        with pytest.raises(TypeError, match="model must be a transformers model"):
            hf_quantized_cache_factory(bad, HFQuantSpec(nbits=4))


@pytest.mark.parametrize("kwargs,match", [
    ({"backend": "nope"}, "backend"), ({"backend": "quanto", "nbits": 3}, "nbits"),
    ({"backend": "quanto", "axis_key": 1}, "axis_key"), ({"backend": "hqq", "axis_value": -1}, "axis_value"),
    ({"backend": "hqq", "q_group_size": -2}, "q_group_size"),
    # passed `in` (True == 1, 2.0 == 2, False == 0) and reached the backend
    ({"backend": "hqq", "nbits": True}, "nbits"), ({"backend": "quanto", "nbits": 2.0}, "nbits"),
    ({"backend": "quanto", "axis_key": False}, "axis_key"),
    ({"backend": "hqq", "nbits": 2, "q_group_size": 6}, "q_group_size .* multiple of 4"),
    ({"backend": "hqq", "nbits": 3, "axis_key": 1}, "axis_key for backend 'hqq' int3 must be 0"),
    ({"backend": ["quanto"]}, "unknown QuantizedCache backend")])  # (was unhashable: a TypeError)
def test_hf_quant_spec_rejects_bad_arguments(kwargs, match):
    from kvbits.eval.hf_baseline import HFQuantSpec

    with pytest.raises(ValueError, match=match):
        HFQuantSpec(**kwargs)


def test_perplexity_rejects_bad_input(tiny):
    model, ids = tiny
    with pytest.raises(ValueError, match="input_ids"):
        perplexity(model, ids[0], lambda: KVBitsCache(model, "fp16"))
    with pytest.raises(ValueError, match="chunk_size"):
        perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=0)
    # True ran as chunks of 1 token; a float chunk or window failed in a slice, unnamed
    for kw, name in (({"chunk_size": True}, "chunk_size"), ({"chunk_size": 64.0}, "chunk_size"),
                     ({"window": 512.0}, "window"), ({"window": 64, "stride": 16.5}, "stride")):
        with pytest.raises(ValueError, match=rf"{name} must be an integer >= \d, got"):
            perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), **kw)


# ------------------------------------------------------------------------------ real model
@pytest.fixture
def smollm2_ids(smollm2):
    """SmolLM2 and 2048 tokens of SOTU 2010-2016; the attention implementation is put back."""
    from kvbits.data import load_text, tokenize_text

    model, tok = smollm2
    impl = model.config._attn_implementation
    try:
        ids = tokenize_text(tok, load_text("sotu-2010-2016"), 2048)
    except Exception as exc:  # noqa: BLE001 (no npm and no cached copy)
        pytest.skip(f"SOTU text is not available: {exc}")
    yield model, ids
    model.set_attn_implementation(impl)


@pytest.mark.model
def test_smollm2_fp16_through_cache_equals_full_forward_and_kivi4_is_close(smollm2_ids):
    model, ids = smollm2_ids
    ids = ids[:, :300]
    full = math.exp(full_forward_nll(model, ids) / 299)
    fp = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=64, progress=False)
    k4 = perplexity(model, ids, lambda: KVBitsCache(model, "kivi-4"), chunk_size=64, progress=False)
    assert fp["ppl"] == pytest.approx(full, rel=1e-3)
    assert k4["ppl"] == pytest.approx(fp["ppl"], rel=0.02)


@pytest.mark.model
def test_smollm2_kivi4_within_1_percent_of_fp16_on_2k_tokens(smollm2_ids):
    """Acceptance: kivi-4 (G=32, R=128) perplexity within 1% of FP16, both through the cache."""
    model, ids = smollm2_ids
    assert ids.shape[1] == 2048
    fp = perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=256, progress=False)
    k4 = perplexity(model, ids, lambda: KVBitsCache(model, "kivi-4"), chunk_size=256,
                    progress=False)
    assert k4["ppl"] <= fp["ppl"] * 1.01, (k4["ppl"], fp["ppl"])
    assert k4["ppl"] >= fp["ppl"] * 0.99, (k4["ppl"], fp["ppl"])


def test_warnings_name_the_caller_and_positions_past_training(tiny):
    """A window past max_position_embeddings ran silently (needle warns); the chunk warning
    pointed at torch's no_grad wrapper instead of the caller."""
    import warnings

    model, ids = tiny  # 256 trained positions, 300 tokens
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        perplexity(model, ids, lambda: KVBitsCache(model, "fp16"), chunk_size=300, window=300,
                   progress=False)
    messages = {str(w.message).split(":")[0]: w for w in caught}
    past = [w for m, w in messages.items() if m.startswith("window 300 is past the 256")]
    chunk = [w for m, w in messages.items() if m.startswith("chunk_size 300 covers")]
    assert past and chunk, [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in past + chunk)
