"""Calibrated Hadamard channel subsets (kivi-N-hadc) that the cache cannot use, and calibration
text too short for them: refused up front, naming the file (or list), the layer and head, or
what the user controls (a QA pass: refused at the first forward inside the cache store, or by
an internal function's name)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbits.integrations.hf import KVBitsCache, cache_kwargs
from kvbits.methods import hadamard
from kvbits.spec import resolve_spec

SPEC = resolve_spec("kivi-2-hadc")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32)).eval()


GOOD = [[list(range(16)), []], [[3, 9], [0]]]
BAD = {  # channels -> what the error says (after the file / list and the layer and head)
    "count": ([[list(range(16)), []], [[1, 2, 3], []]],
              r"layer 1 head 0 lists 3 channels, not a power of two"),
    "range": ([[list(range(16)), [32]], [[], []]],
              r"layer 0 head 1: channel 32 is not a channel index .*0 \.\. 31"),
    "negative": ([[[-1], []], [[], []]], r"layer 0 head 0: channel -1 is not a channel index"),
    "float": ([[[0.5], []], [[], []]], r"layer 0 head 0: channel 0.5 is not a channel index"),
    "duplicate": ([[[], []], [[4, 4], []]],
                  r"layer 1 head 0 lists channel\(s\) \[4\] more than once"),
    "heads": ([[[], [], []], [[], []]], r"layer 0 has 3 channel lists, the model 2 KV heads"),
    "layers": ([[[], []]] * 3, r"has 3 layers, the model 2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unusable_channel_files_are_refused_when_the_cache_is_built(model, tmp_path, case):
    channels, want = BAD[case]
    path = hadamard.save_hadamard_channels(tmp_path / f"{case}.json", channels, model, SPEC)
    named = rf"Hadamard channel file '.*{case}\.json'"
    with pytest.raises(ValueError, match=rf"{named}:? {want}"):
        KVBitsCache(model, SPEC, calibration=str(path))
    with pytest.raises(ValueError, match=rf"{named}:? {want}"):
        hadamard.load_hadamard_channels(path, model.config)  # against a config too
    assert hadamard.load_hadamard_channels(path) == channels  # no model: read as it is
    with pytest.raises(ValueError, match=rf"Hadamard calibration:? {want}"):
        KVBitsCache(model, SPEC, calibration=channels)  # the lists themselves


def test_usable_channels_still_load_and_run(model, tmp_path):
    path = hadamard.save_hadamard_channels(tmp_path / "good.json", GOOD, model, SPEC)
    assert hadamard.load_hadamard_channels(path, model, SPEC) == GOOD
    for calibration in (str(path), GOOD):
        cache = KVBitsCache(model, SPEC, calibration=calibration, residual_length=0)
        with torch.no_grad():
            out = model(torch.arange(40)[None], use_cache=True, **cache_kwargs(model, cache))
        assert torch.isfinite(out.logits).all()


def test_calibration_text_shorter_than_a_group_names_the_text(model):
    """Was "rotation_cost: need at least group_size=32 key tokens", after the forward."""
    ids = torch.arange(20)[None]
    with pytest.raises(ValueError, match=r"needs at least 32 tokens of calibration text .*got "
                                         r"20: .*--calib-text / --calib-tokens"):
        hadamard.calibrate_hadamard(model, ids, SPEC)
    with pytest.raises(ValueError, match="needs at least 64 tokens .*got 40"):
        hadamard.calibrate_hadamard(model, torch.arange(41)[None], SPEC.replace(group_size=64),
                                    window=2)  # windows of 2: every token counted once
    assert len(hadamard.calibrate_hadamard(model, torch.arange(32)[None], SPEC)) == 2
