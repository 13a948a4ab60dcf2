"""Numerical edge cases of LayerStore's quantized append path (session QA of the numerics).

* K/V beyond what the body stores (float16 scales and zeros: +-65504; float8: 448 x scale)
  saturate when quantized: the layer's first flush says so (a warning naming the layer, the
  side and the largest magnitude); no later flush reads the device for it.
* Hadamard-rotated float16 keys can pass 65504 (a rotated channel sums up to a block of
  channels / sqrt(block)): they saturate instead of becoming inf.
* A non-finite element stays within its own group / head: other sequences and heads of the
  batch quantize as without it, and dynamic FP8 scales come from the finite elements.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kvbits.cache.store import LayerStore
from kvbits.reference.attention import dequantize_layer
from kvbits.spec import resolve_spec

B, H, T, D = 2, 2, 64, 32


@pytest.fixture(autouse=True)
def _reference_quantizer(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNELS", "reference")


def _kv(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g).to(dtype),
            torch.randn(B, H, T, D, generator=g).to(dtype))


def _store(preset, dtype=torch.bfloat16, **fields):
    spec = resolve_spec(preset).replace(**{"residual_length": 0, "group_size": 32, **fields})
    scales = None
    if spec.method == "fp8" and spec.fp8_scale == "calibrated":
        scales = (torch.full((H,), 0.01), torch.full((H,), 0.01))
    return LayerStore(spec, B, H, D, dtype, "cpu", fp8_scales=scales, layer_idx=7)


def _range_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "beyond" in str(w.message)
            or "saturat" in str(w.message)]


@pytest.mark.parametrize(("preset", "big"), [("kivi-2", 2e5), ("kivi-4", -1e6),
                                             ("uniform-int4", 3e5), ("fp8-dynamic", 1e6)])
def test_prompt_beyond_the_stored_range_warns_once(preset, big):
    """bf16 keys of 2e5 (int methods: beyond FP16's 65504; dynamic fp8: beyond 448 x a scale
    whose amax saturates at 65504, i.e. 131008) were clipped silently."""
    st = _store(preset)
    k, v = _kv()
    k[1, 0, 9, 4] = big

    got = _range_warnings(lambda: st.append(k, v))
    assert len(got) == 1, got
    assert "layer 7" in got[0] and "keys" in got[0] and "values" not in got[0], got[0]
    assert f"magnitude {abs(k[1, 0, 9, 4].item()):.4g}" in got[0], got[0]
    keys, _ = dequantize_layer(st.view())
    assert torch.isfinite(keys).all()
    # once per layer: a second flush with values beyond too is not read
    v[0, 1, 3, 3] = 1e7
    assert _range_warnings(lambda: st.append(k, v)) == []


def test_values_side_and_calibrated_fp8_limit_named():
    st = _store("fp8")  # calibrated: scale 0.01 -> saturates beyond 4.48
    k, v = _kv()
    v = v * 0.5
    v[0, 1, 5, 2] = -9.0
    got = _range_warnings(lambda: st.append(k * 0.1, v))
    assert len(got) == 1 and "values" in got[0] and "magnitude 9," in got[0], got
    assert "448 x scale = 4.48" in got[0], got


@pytest.mark.parametrize(("preset", "dtype", "big"), [
    ("kivi-2", torch.bfloat16, 6e4), ("kivi-2", torch.float16, 65504.0),
    ("fp8-dynamic", torch.bfloat16, 1e5),  # stored: 448 x scale is 131008 there
    ("fp8", torch.bfloat16, 4.0),  # calibrated scale 0.01: 4.48
])
def test_in_range_prompt_does_not_warn(preset, dtype, big):
    st = _store(preset, dtype)
    k, v = _kv(dtype)
    k, v = k * 0.01, v * 0.01
    k[0, 0, 1, 1] = big
    assert _range_warnings(lambda: st.append(k, v)) == []


def test_padding_and_decode_flushes_are_not_checked():
    """Left padding is excluded (it is excluded from min / max too), and a decode step's
    one-group flush is never checked (a host read there would stall every step)."""
    st = _store("kivi-2")
    k, v = _kv()
    k[0, :, :5] = 1e6  # padding of sequence 0
    st.append(k, v, flush=False)
    st.set_padding(torch.tensor([5, 0]))
    assert _range_warnings(st.flush) == []
    st2 = _store("kivi-2")
    st2.append(*_kv())
    tok_k = torch.full((B, H, 32, D), 1e6, dtype=torch.bfloat16)
    assert _range_warnings(lambda: [st2.append(tok_k[:, :, i:i + 1], tok_k[:, :, i:i + 1])
                                    for i in range(32)]) == []


@pytest.mark.parametrize("preset", ["kivi-4-had", "fp8-dynamic"])
def test_hadamard_rotation_beyond_fp16_saturates_not_inf(preset):
    """float16 keys of 20000 in every channel: a rotated channel is 64 x 20000 / 8 = 160000,
    inf in the float16 store (the residual held inf keys, the quantized body 65504)."""
    spec = resolve_spec(preset).replace(hadamard=True, residual_length=32)
    st = LayerStore(spec, B, H, 64, torch.float16, "cpu")
    k = torch.full((B, H, T, 64), 20000.0, dtype=torch.float16)
    v = torch.randn(B, H, T, 64).half()
    got = _range_warnings(lambda: st.append(k, v))
    assert torch.isfinite(st.res_k[:, :, :st.res_len]).all()
    keys, _ = dequantize_layer(st.view())
    assert torch.isfinite(keys).all()
    assert len(got) == 1 and "keys" in got[0] and "Hadamard" in got[0], got
    q = torch.full((B, H, 1, 64), 3000.0, dtype=torch.float16)
    assert torch.isfinite(st.rotate_query(q)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_fp8_dynamic_scale_ignores_a_non_finite_element(bad, granularity):
    """One NaN / inf key element set the dynamic scale of its head (or, per tensor, of every
    head of its sequence) for the whole generation: NaN -> scale 1 (values beyond 448
    saturated, small ones flushed to 0), inf -> 65504 x 2 / 448 (a ~1 head kept ~1 bit). The
    scale now comes from the finite elements; the element itself stays NaN or saturates."""
    k, v = _kv(torch.float32)
    clean = _store("fp8-dynamic", torch.float32, fp8_granularity=granularity)
    clean.append(k, v)
    k[0, 1, 10, 3] = bad
    st = _store("fp8-dynamic", torch.float32, fp8_granularity=granularity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st.append(k, v)
    assert torch.equal(st.k_scale, clean.k_scale)
    keys, _ = dequantize_layer(st.view())
    want, _ = dequantize_layer(clean.view())
    other = torch.ones_like(keys, dtype=torch.bool)
    other[0, 1, 10, 3] = False
    assert torch.equal(keys[other], want[other])
    if bad != bad:
        assert keys[0, 1, 10, 3].isnan()
    else:
        assert keys[0, 1, 10, 3].item() == pytest.approx(
            448 * st.k_scale[0, 1].item() * (1 if bad > 0 else -1))


@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4-had", "uniform-int4", "kvquant-4-post", "fp8",
                                    "fp8-tensor"])
def test_a_nan_stays_in_its_sequence_and_head(preset):
    """A NaN key and a NaN value of sequence 0, head 0: every other sequence and head
    dequantizes bit for bit as without them (a NaN poisons only its own quantization group,
    which FP16 attention over that head would propagate anyway)."""
    spec = resolve_spec(preset)
    if spec.method == "fp8" and spec.fp8_scale == "calibrated":
        spec = spec.replace(fp8_scale="dynamic")
    k, v = _kv(torch.float16)
    spec = spec.replace(residual_length=0, group_size=32)
    clean = LayerStore(spec, B, H, D, torch.float16, "cpu")
    clean.append(k, v)
    k[0, 0, 12, 5] = v[0, 0, 40, 7] = float("nan")
    st = LayerStore(spec, B, H, D, torch.float16, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st.append(k, v)
    for got, want in zip(dequantize_layer(st.view()), dequantize_layer(clean.view())):
        assert torch.equal(got[1], want[1]) and torch.equal(got[0, 1], want[0, 1])
        assert got[0, 0].isnan().any()


def test_cache_layers_name_their_decoder_layer():
    """KVBitsCache gives each layer's store its index, which the range warning names."""
    import transformers as tf

    from kvbits.integrations.hf import KVBitsCache
    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight.mul_(1e7)
        cache = KVBitsCache(model, "kivi-2:R=0")
        got = _range_warnings(lambda: model(torch.arange(32)[None], past_key_values=cache))
    assert [layer.store.layer_idx for layer in cache.layers] == [0, 1, 2]
    assert len(got) == 1 and got[0].startswith("kvbits: layer 2: values"), got
