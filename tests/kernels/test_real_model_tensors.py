"""The kernels on a real model's own tensors: SmolLM2-135M's keys, values and queries (a float16
copy of the model, 300 tokens of real text through a ``KVBitsCache``) quantized and attended by
the Triton kernels and by the PyTorch reference. The other kernel tests draw random tensors; real
keys have outlier channels, near-constant groups and heavy-tailed scores that random ones lack.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (a few layers: the
interpreter's cost is per program); on a GPU, on every layer. Session 54 ran the same comparison
through whole perplexity runs on an H200 (``benchmarks/results/real_model_gpu_s54.md``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvbits import ops
from kvbits.integrations import hf
from kvbits.integrations.hf import KVBitsCache
from kvbits.kernels import quantize_pack as kernel_quant
from kvbits.reference import quant as ref_quant

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LAYERS = None if CUDA else (0, 14, 29)  # first, middle, last
TEXT = ("Madam Speaker, Mr. Vice President, members of Congress, my fellow Americans: tonight "
        "marks the eighth year that I have come here to report on the State of the Union. And "
        "for this final one, I am going to try to make it a little shorter. I know some of you "
        "are antsy to get back to Iowa. I have been there. I will be shaking hands afterwards if "
        "you want some tips. And I understand that because it is an election season, "
        "expectations for what we will achieve this year are low. But, Mister Speaker, I "
        "appreciate the constructive approach that you and other leaders took at the end of last "
        "year to pass a budget and make tax cuts permanent for working families. ") * 3


@pytest.fixture(scope="module")
def half_model(smollm2):
    """A float16 copy of the shared SmolLM2 (the fixture's model stays float32) on the device,
    and ``[1, T]`` ids of the text (T >= 300)."""
    model, tok = smollm2
    half = copy.deepcopy(model).to(device=DEVICE, dtype=torch.float16)
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :301].to(DEVICE)
    assert ids.shape[1] == 301
    yield half, ids
    del half


def _run(model, ids, preset, calibration=None):
    """Prefill 300 tokens into a fresh cache, then one decode step; returns the cache's spec, what
    each layer quantized through ``ops`` (keys in store space scaled per channel; values, and
    keys scaled per token, with their channel group) and each layer's ``(query, view, scale,
    starts)`` at that step."""
    cache = KVBitsCache(model, preset, calibration=calibration)
    keys, values, steps = [], [], []
    quantize, quantize_v, attend = ops.quantize_keys, ops.quantize_values, hf._attend_as_generated

    def keep_keys(k, bits, group, valid=None):
        keys.append(k.clone())
        return quantize(k, bits, group, valid)

    def keep_values(v, bits, value_group, group, valid=None):
        values.append((v.clone(), value_group))
        return quantize_v(v, bits, value_group, group, valid)

    def keep_step(query, store, scale, window, softcap=None):
        store.flush()
        steps.append((store.rotate_query(query).clone(), store.view(), scale, store.starts))
        return attend(query, store, scale, window, softcap)

    try:
        ops.quantize_keys, ops.quantize_values = keep_keys, keep_values
        with torch.no_grad():
            model(ids[:, :300], past_key_values=cache, use_cache=True)
            hf._attend_as_generated = keep_step
            model(ids[:, 300:], past_key_values=cache, use_cache=True)
    finally:
        ops.quantize_keys, ops.quantize_values = quantize, quantize_v
        hf._attend_as_generated = attend
    return cache.layers[0].store.spec, keys, values, steps


def _pick(items):
    return items if LAYERS is None else [items[i] for i in LAYERS if i < len(items)]


@pytest.mark.model
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "kivi-2-had", "uniform-int4"])
def test_kernels_match_the_reference_on_real_tensors(half_model, monkeypatch, preset):
    model, ids = half_model
    monkeypatch.setenv("KVBITS_KERNELS", "reference")  # the cache itself: the reference
    spec, keys, values, steps = _run(model, ids, preset)
    layers = model.config.num_hidden_layers
    per_token_keys = spec.key_axis == "token"  # (quantized as values are)
    assert len(steps) == layers and len(keys) == (0 if per_token_keys else layers)
    assert len(values) == layers * (2 if per_token_keys else 1)
    G = spec.group_size
    for k in _pick(keys):  # the fused quantize+pack: the reference's bits exactly
        for w, g in zip(ref_quant.quantize_keys(k, spec.key_bits, G),
                        kernel_quant.quantize_keys(k, spec.key_bits, G), strict=True):
            assert torch.equal(w, g)
    for v, vg in _pick(values):
        for w, g in zip(ref_quant.quantize_values(v, spec.value_bits, vg, G),
                        kernel_quant.quantize_values(v, spec.value_bits, vg, G), strict=True):
            assert torch.equal(w, g)
    for q, kv, scale, starts in _pick(steps):  # the fused decode: within its error budget
        assert kv.body_len >= 128  # (the step reads packed codes, not only the FP16 window)
        monkeypatch.setenv("KVBITS_KERNELS", "reference")
        want = ops.decode_attention(q, kv, scale=scale, starts=starts).float()
        monkeypatch.setenv("KVBITS_KERNELS", "triton")
        got = ops.decode_attention(q, kv, scale=scale, starts=starts).float()
        assert torch.isfinite(got).all()
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-3, err


@pytest.mark.model
@pytest.mark.parametrize("preset", ["kvquant-3", "fp8-dynamic"])
def test_decode_matches_the_reference_on_real_tensors(half_model, monkeypatch, preset):
    """KVQuant (codebooks calibrated on the same text, outliers, pre-RoPE keys turned back in
    the kernel) and FP8: the fused decode over each layer's real packed cache."""
    from kvbits.cli import parse_preset
    from kvbits.methods.kvquant import calibrate

    model, ids = half_model
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    spec = parse_preset(preset).spec
    cal = calibrate(model, ids[:, :256], spec, window=128) if spec.method == "kvquant" else None
    _, _, _, steps = _run(model, ids, preset, cal)
    for q, kv, scale, starts in _pick(steps):
        monkeypatch.setenv("KVBITS_KERNELS", "reference")
        want = ops.decode_attention(q, kv, scale=scale, starts=starts).float()
        monkeypatch.setenv("KVBITS_KERNELS", "triton")
        got = ops.decode_attention(q, kv, scale=scale, starts=starts).float()
        err = ((got - want).norm() / want.norm()).item()
        assert torch.isfinite(got).all() and err < 2e-3, err
