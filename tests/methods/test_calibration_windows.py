"""Calibration windows start as the model's texts do: with the BOS where the text has one (Gemma),
in every calibration path (KVQuant codebooks, Hadamard channels, fp8 scales, tune)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbits.methods import calibration_chunks, calibration_windows, hadamard, tune
from kvbits.methods import fp8 as fp8_mod
from kvbits.methods import kvquant as kvq
from kvbits.spec import resolve_spec

BOS = 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, bos_token_id=BOS)
    return LlamaForCausalLM(cfg).eval()


def text_ids(n: int, bos: bool, seed: int = 0) -> torch.Tensor:
    body = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor([BOS]), body])[None] if bos else body[None]


@pytest.mark.parametrize("n,window", [(1100, 512), (1023, 512), (1022, 512), (37, 4), (5, 2),
                                      (1, 2)])
def test_every_window_starts_with_the_bos_and_the_text_is_covered_once(model, n, window):
    ids = text_ids(n, bos=True)
    chunks = calibration_chunks(model, ids, window)
    assert all(c.shape[0] == 1 and 2 <= c.shape[1] <= window + 1 for c in chunks)
    assert all(int(c[0, 0]) == BOS for c in chunks)
    assert torch.equal(torch.cat([c[0, 1:] for c in chunks]), ids[0, 1:])  # each token once
    assert all(c.shape[1] == window + 1 for c in chunks[:-1])  # the BOS, then window tokens


@pytest.mark.parametrize("n,window", [(1100, 512), (1025, 512), (100, 512)])
def test_a_text_without_the_bos_is_cut_as_before(model, n, window):
    ids = text_ids(n, bos=False)
    got = [c[0] for c in calibration_chunks(model, ids, window)]
    want = [ids[0, a:b] for a, b in calibration_windows(n, window)]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_errors_are_those_of_the_windows(model):
    with pytest.raises(ValueError, match="at least 2 tokens of text, got 1"):
        calibration_chunks(model, torch.tensor([[BOS]]), 512)
    with pytest.raises(ValueError, match="got window=1"):
        calibration_chunks(model, text_ids(10, bos=True), 1)


@pytest.fixture
def first_tokens(model):
    """The first token of every sequence the model embeds (collect_kv passes embeddings, so the
    hook sits on the embedding, which every path goes through)."""
    seen: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: seen.append(int(args[0][0, 0])))
    yield seen
    hook.remove()


def run_kvquant(model, ids):
    kvq.calibrate(model, ids, resolve_spec("kvquant-3"), window=64)


def run_hadamard(model, ids):
    hadamard.calibrate_hadamard(model, ids, resolve_spec("kivi-2-hadc"), window=64)


def run_fp8(model, ids):
    fp8_mod.calibrate_fp8(model, ids, resolve_spec("fp8"), window=64)


def run_tune(model, ids):
    tune.layer_sensitivity(model, ids, resolve_spec("kivi-3"), (2, 4), window=64)


@pytest.mark.parametrize("run", [run_kvquant, run_hadamard, run_fp8, run_tune])
@pytest.mark.parametrize("bos", [True, False])
def test_every_calibration_path_runs_the_windows(model, first_tokens, run, bos):
    ids = text_ids(200, bos=bos, seed=1)
    run(model, ids)
    starts = [int(c[0, 0]) for c in calibration_chunks(model, ids, 64)]
    assert len(starts) == 4  # 200 tokens of text, 64 per window (after the BOS, if any)
    assert set(first_tokens) == set(starts) and first_tokens[:len(starts)] == starts
    assert all(t == BOS for t in first_tokens) == bos


class Tokenizer:
    """Puts ``bos_token_id`` first by itself where ``adds_bos`` (Gemma), else not (SmolLM2)."""

    bos_token_id = BOS

    def __init__(self, adds_bos: bool):
        self.adds_bos = adds_bos

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [BOS] * (add_special_tokens and self.adds_bos) + [5]}


def test_cached_calibrations_made_before_bos_windows_are_not_reused(model, monkeypatch):
    """A tokenizer that puts a BOS first gets a new cache key (its old fits ran windows
    without it); one that does not keeps its key, so those files still serve."""
    spec = resolve_spec("kvquant-3")
    plain = kvq.calibration_path(model, spec, "sotu-pre-2000", 4096)
    monkeypatch.setattr(model, "_kvbits_tokenizer", Tokenizer(adds_bos=False), raising=False)
    assert kvq.calibration_path(model, spec, "sotu-pre-2000", 4096) == plain
    monkeypatch.setattr(model, "_kvbits_tokenizer", Tokenizer(adds_bos=True))
    assert kvq.calibration_path(model, spec, "sotu-pre-2000", 4096) != plain


def test_kvquant_fits_the_text_not_the_bos(model):
    """The BOS before each window is context: the cache keeps it in FP16 as its sink, so its
    rows (with their large Fisher weights) are not fitted; every text token's are, once."""
    from transformers import DynamicCache

    ids = text_ids(128, bos=True, seed=2)
    (k, v, gk, gv), _ = kvq.collect_kv(model, ids, window=64)
    assert k.shape[1] == v.shape[1] == gk.shape[1] == gv.shape[1] == 128
    for w in range(2):
        cache = DynamicCache()
        with torch.no_grad():
            model(torch.cat([ids[:, :1], ids[:, 1 + 64 * w:65 + 64 * w]], 1), past_key_values=cache)
        torch.testing.assert_close(v[:, 64 * w:64 * (w + 1)], cache.layers[0].values[0, :, 1:])
    (k0, *_), _ = kvq.collect_kv(model, text_ids(128, bos=False, seed=2), window=64)
    assert k0.shape[1] == 128  # a text without the BOS: every token, as before
