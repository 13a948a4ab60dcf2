"""KVBitsCache with the breadth methods on a tiny random Llama: per-layer specs (and spec files),
Hadamard keys through the real attention path, uniform knobs, FP8 scales."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvbits.integrations.hf import KVBitsCache, cache_kwargs
from kvbits.spec import QuantSpec, resolve_spec


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    m = LlamaForCausalLM(cfg).eval()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield m
    torch.set_num_threads(before)


def _logits(model, cache, ids, steps=((0, 60), (60, 64), (64, 65), (65, 66))):
    out = []
    with torch.no_grad():
        for a, b in steps:
            out.append(model(ids[:, a:b], use_cache=True, **cache_kwargs(model, cache)).logits)
    return torch.cat(out, dim=1)


def _ids(n=66):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))


def test_per_layer_bits_and_skip(model):
    spec = resolve_spec("k4v2-edge8", skip_layers=(1,))
    cache = KVBitsCache(model, spec)
    got = [(l.spec.method, l.spec.key_bits, l.spec.value_bits) for l in cache.layers]
    assert got == [("kivi", 8, 8), ("fp16", 2, 2), ("kivi", 4, 2), ("kivi", 8, 8)]
    assert spec.average_bits(4) == (16 + 32 + 6 + 16) / 8
    _logits(model, cache, _ids())
    assert cache.stores[1].body_len == 0 and cache.stores[2].body_len == 0  # R=128
    with pytest.raises(ValueError, match="layer 7 is out of range for a model with 4 layers"):
        KVBitsCache(model, resolve_spec("kivi-2", layer_bits=((7, 4, 4),)))


def test_spec_file_round_trip(model, tmp_path):
    spec = resolve_spec("kivi-2", layer_bits=((0, 4, 2), (-1, 8, 4)), skip_layers=(2,),
                        residual_length=16)
    path = tmp_path / "tuned.json"
    spec.save(path, note="test")
    assert resolve_spec(str(path)) == spec == QuantSpec.load(path)
    cache = KVBitsCache(model, str(path))
    assert [l.spec.key_bits for l in cache.layers] == [4, 2, 2, 8]
    assert cache.layers[2].spec.method == "fp16"
    _logits(model, cache, _ids())
    assert cache.stores[0].body_len > 0 and cache.stores[2].body_len == 0
    with pytest.raises(ValueError, match="does not exist"):
        resolve_spec(str(tmp_path / "nope.json"))


def test_hadamard_through_attention_is_exact_in_fp(model):
    """All tokens FP (large residual): rotated keys + rotated queries == DynamicCache."""
    ids = _ids()
    want = _logits(model, DynamicCache(config=model.config), ids)
    got = _logits(model, KVBitsCache(model, "kivi-2-had", residual_length=512), ids)
    assert (got - want).abs().max() < 1e-4
    # quantized: close to kivi-2 without the rotation, not identical
    a = _logits(model, KVBitsCache(model, "kivi-2-had", residual_length=0), ids)
    b = _logits(model, KVBitsCache(model, "kivi-2", residual_length=0), ids)
    assert not torch.allclose(a, b) and (a - want).abs().mean() < 3 * (b - want).abs().mean()


def test_uniform_knobs_like_quantized_cache(model):
    cache = KVBitsCache(model, "uniform", nbits=2, axis_key=-1, axis_value=0, q_group_size=32,
                        residual_length=0)
    assert (cache.spec.key_axis, cache.spec.value_axis, cache.spec.group_size) == (
        "channel", "token", 32)
    assert (cache.spec.key_bits, cache.spec.value_bits, cache.spec.residual_length) == (2, 2, 0)
    logits = _logits(model, cache, _ids())
    assert torch.isfinite(logits).all() and cache.stores[0].body_len == 64
    with pytest.raises(ValueError, match="axis_key must be 0 .* or -1"):
        KVBitsCache(model, "uniform", axis_key=1)


def test_fp8_cache(model):
    ids = _ids()
    want = _logits(model, DynamicCache(config=model.config), ids)
    dyn = _logits(model, KVBitsCache(model, "fp8-dynamic"), ids)
    assert (dyn - want).abs().max() < 0.05 * want.abs().max()
    scales = [(torch.full((2,), 0.01), torch.full((2,), 0.01))] * 4
    cal = KVBitsCache(model, "fp8", calibration=scales)
    _logits(model, cal, ids)
    assert torch.equal(cal.stores[0].k_scale, torch.full((1, 2, 1, 1), 0.01))
    with pytest.raises(ValueError, match="fp8_scale='calibrated' needs scales: "
                                         r"KVBitsCache\(model, 'fp8', calibration='auto'\)"):
        KVBitsCache(model, "fp8")
    with pytest.raises(ValueError, match=r"KVBitsCache\(model, 'fp8-tensor', calibration="):
        KVBitsCache(model, "fp8-tensor")  # (it named 'fp8', another preset)
    # scales of another head count: refused when the cache is built, not at its first update
    with pytest.raises(ValueError, match="layer 0 k_scale holds 3 scales, the model has 2 KV"):
        KVBitsCache(model, "fp8", calibration=[(torch.full((3,), 0.01), torch.ones(2))] * 4)
    with pytest.raises(ValueError, match="calibration= applies to fp8_scale='calibrated'"):
        KVBitsCache(model, "fp8-dynamic", calibration=scales)
    for spec in ("kivi-2", "kivi-2-had", "uniform-int4"):  # every taker named, kivi-N-hadc too
        with pytest.raises(ValueError, match=r"'kvquant' \(codebooks\) and hadamard_calibrated"
                                             r"=True \(presets 'kivi-N-hadc'\); the spec is"):
            KVBitsCache(model, spec, calibration=scales)


def test_hadamard_calibrated_cache(model, tmp_path):
    """kivi-2-hadc: channel subsets from calibration (post-RoPE q/k through the attention
    interface); exact with every token FP; channels as a list, a file or refused when absent."""
    from kvbits.methods.hadamard import (
        calibrate_hadamard,
        load_hadamard_channels,
        save_hadamard_channels,
    )

    ids = _ids()
    spec = resolve_spec("kivi-2-hadc")
    chans = calibrate_hadamard(model, _ids(128), spec, window=64)
    assert len(chans) == 4 and all(len(layer) == 2 for layer in chans)
    for layer in chans:
        for c in layer:
            assert len(c) in (0, 8, 16, 32) and len(set(c)) == len(c)
    assert model.config._attn_implementation != "kvbits_hadamard_calibrate"
    want = _logits(model, DynamicCache(config=model.config), ids)
    forced = [[list(range(16)), []] for _ in range(4)]  # make sure something rotates
    got = _logits(model, KVBitsCache(model, spec, calibration=forced, residual_length=512), ids)
    assert (got - want).abs().max() < 1e-4
    q = _logits(model, KVBitsCache(model, spec, calibration=forced, residual_length=0), ids)
    assert torch.isfinite(q).all()
    assert (q - want).abs().mean() < 3 * (_logits(
        model, KVBitsCache(model, "kivi-2", residual_length=0), ids) - want).abs().mean()
    path = save_hadamard_channels(tmp_path / "c.json", chans, text="test")
    assert load_hadamard_channels(path) == chans
    KVBitsCache(model, spec, calibration=str(path))
    with pytest.raises(ValueError, match="hadamard_calibrated needs the channel subsets"):
        KVBitsCache(model, spec)
    with pytest.raises(ValueError, match="Hadamard calibration has 3 layers"):
        KVBitsCache(model, spec, calibration=chans[:3])


def test_calibration_files_refuse_another_model_or_spec(model, tmp_path):
    """fp8 scale and Hadamard channel files record the model and spec they were made for
    (session 53: only the layer count was checked, so another checkpoint of this depth, or
    per-head scales made with Hadamard keys, were used silently); the same weights in another
    dtype, and files without the record, still load."""
    import copy

    from kvbits.methods.fp8 import save_fp8_scales
    from kvbits.methods.hadamard import save_hadamard_channels

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    scales = [(torch.full((2,), 0.01), torch.full((2,), 0.02)) for _ in range(4)]
    fp8_spec = resolve_spec("fp8")
    path = tmp_path / "s.safetensors"
    save_fp8_scales(path, scales, model, fp8_spec, text="test")
    KVBitsCache(model, fp8_spec, calibration=str(path))
    KVBitsCache(copy.deepcopy(model).to(torch.bfloat16), fp8_spec, calibration=str(path))
    KVBitsCache(model.config, fp8_spec, calibration=str(path))  # a config: its shape only
    with pytest.raises(ValueError, match="fp8 scale file .* another model of this shape"):
        KVBitsCache(other, fp8_spec, calibration=str(path))
    with pytest.raises(ValueError, match="made for hadamard=False, this spec has hadamard=True"):
        KVBitsCache(model, fp8_spec.replace(hadamard=True), calibration=str(path))
    deeper = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32))
    with pytest.raises(ValueError, match=r"made for a llama-L4-H2-D32 model, not this "
                                         r"llama-L4-H4-D32 one"):
        KVBitsCache(deeper, fp8_spec, calibration=str(path))
    save_fp8_scales(tmp_path / "plain.safetensors", scales)  # no record: counted only
    KVBitsCache(other, fp8_spec, calibration=str(tmp_path / "plain.safetensors"))

    spec = resolve_spec("kivi-2-hadc")
    chans = [[list(range(16)), []] for _ in range(4)]
    hpath = save_hadamard_channels(tmp_path / "c.json", chans, model, spec)
    KVBitsCache(model, spec, calibration=str(hpath))
    with pytest.raises(ValueError, match="Hadamard channel file .* another model of this shape"):
        KVBitsCache(other, spec, calibration=str(hpath))
    with pytest.raises(ValueError, match="made for group_size=32, this spec has group_size=64"):
        KVBitsCache(model, spec.replace(group_size=64), calibration=str(hpath))
