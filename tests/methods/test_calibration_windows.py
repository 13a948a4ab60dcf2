"""Every calibration path (KVQuant codebooks, Hadamard channels, fp8 scales, tune) runs the text in
the same windows, kvbits.methods.calibration_chunks: each token once, a BOS in the first window
only (every window starting with it was measured in session 56 and not kept)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbits.methods import calibration_chunks, calibration_windows, hadamard, starts_with_bos, tune
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


@pytest.mark.parametrize("n,window", [(1100, 512), (1025, 512), (100, 512), (37, 4), (5, 2)])
@pytest.mark.parametrize("bos", [True, False])
def test_chunks_are_the_windows_and_cover_the_text_once(n, window, bos):
    ids = text_ids(n, bos=bos)
    chunks = calibration_chunks(ids, window)
    want = [ids[0, a:b] for a, b in calibration_windows(ids.shape[1], window)]
    assert len(chunks) == len(want) and all(torch.equal(c[0], w) for c, w in zip(chunks, want))
    assert all(c.shape[0] == 1 and 2 <= c.shape[1] <= window for c in chunks)
    covered = torch.cat([c[0] for c in chunks])
    assert torch.equal(covered, ids[0, :covered.numel()]) and ids.shape[1] - covered.numel() <= 1


def test_errors_are_those_of_the_windows():
    with pytest.raises(ValueError, match="at least 2 tokens of text, got 1"):
        calibration_chunks(torch.tensor([[BOS]]), 512)
    with pytest.raises(ValueError, match="got window=1"):
        calibration_chunks(text_ids(10, bos=True), 1)


def test_starts_with_bos(model):
    assert starts_with_bos(model, text_ids(5, bos=True))
    assert not starts_with_bos(model, text_ids(5, bos=False))
    assert not starts_with_bos(model, torch.zeros(1, 0, dtype=torch.long))


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
    starts = [int(c[0, 0]) for c in calibration_chunks(ids, 64)]
    assert len(starts) == 4  # 200 or 201 tokens, 64 per window
    assert set(first_tokens) == set(starts) and first_tokens[:len(starts)] == starts


def test_kvquant_fits_every_token_once(model):
    """collect_kv returns each window's keys and values in order, the BOS's with the rest (the
    fit's data as in every session before 56)."""
    from transformers import DynamicCache

    ids = text_ids(127, bos=True, seed=2)
    (k, v, gk, gv), _ = kvq.collect_kv(model, ids, window=64)
    assert k.shape[1] == v.shape[1] == gk.shape[1] == gv.shape[1] == 128
    for w in range(2):
        cache = DynamicCache()
        with torch.no_grad():
            model(ids[:, 64 * w:64 * (w + 1)], past_key_values=cache)
        torch.testing.assert_close(v[:, 64 * w:64 * (w + 1)], cache.layers[0].values[0])
