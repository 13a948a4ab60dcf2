"""Method "uniform": transformers' QuantizedCache knobs (axis_key / axis_value) on kvbits."""

from __future__ import annotations

import pytest
import torch

from kvbits.cache.store import LayerStore
from kvbits.formats.packing import packed_length
from kvbits.reference import quant as rq
from kvbits.reference.attention import dequantize_layer
from kvbits.spec import resolve_spec

B, H, T, D = 1, 2, 128, 64


@pytest.fixture(autouse=True)
def _reference_quantizer(monkeypatch):
    monkeypatch.setenv("KVBITS_KERNELS", "reference")


def _kv(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.2, 3, D)
    return k, torch.randn(B, H, T, D, generator=g)


@pytest.mark.parametrize("axis_key", [0, -1])
@pytest.mark.parametrize("axis_value", [0, -1])
def test_layout_per_axis(axis_key, axis_value):
    spec = resolve_spec("uniform", nbits=2, axis_key=axis_key, axis_value=axis_value,
                        q_group_size=32, residual_length=0)
    k, v = _kv()
    st = LayerStore(spec, B, H, D, torch.float32, "cpu")
    st.append(k, v)
    kv = st.view_raw()
    G, Gq = 32, 32
    shape = {"channel": (B, H, T // G, D), "token": (B, H, T, D // Gq)}
    assert kv.key_axis == ("token" if axis_key == 0 else "channel")
    assert kv.value_axis == ("token" if axis_value == 0 else "channel")
    assert kv.is_plain == (kv.key_axis == "channel" and kv.value_axis == "token")
    assert tuple(kv.k_scale[:, :, :shape[kv.key_axis][2]].shape) == shape[kv.key_axis]
    assert tuple(kv.v_scale[:, :, :shape[kv.value_axis][2]].shape) == shape[kv.value_axis]
    # codes packed along tokens in blocks of G, for K and V, whatever the axis
    assert kv.k_codes.shape[2] >= T // G * packed_length(G, 2) and kv.k_codes.dtype == torch.int32
    # exactly the reference quantizer of that axis, on the original tokens
    for x, axis, got in ((k, kv.key_axis, dequantize_layer(st.view())[0]),
                         (v, kv.value_axis, dequantize_layer(st.view())[1])):
        if axis == "channel":
            want = rq.dequantize_keys(*rq.quantize_keys(x, 2, G), 2, G)
        else:
            want = rq.dequantize_values(*rq.quantize_values(x, 2, Gq, G), 2, Gq, G)
        assert torch.equal(got, want)


@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("nbits", [2, 4])
def test_axis_means_what_quanto_means(axis, nbits):
    """Same knobs, same groups: >99% of elements dequantize like transformers' quanto layer
    (the rest differ by a rounding tie / FP16 scale), the other axis agrees on < 50%."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantoQuantizedLayer

    x, _ = _kv(3)
    layer = QuantoQuantizedLayer(nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=64)
    theirs = layer._dequantize(layer._quantize(x, axis)).float()
    step = (x.amax() - x.amin()) / (2 ** nbits - 1)

    def ours(axis_key):
        spec = resolve_spec("uniform", nbits=nbits, axis_key=axis_key, q_group_size=64,
                            residual_length=0)
        st = LayerStore(spec, B, H, D, torch.float32, "cpu")
        st.append(x, x)
        return dequantize_layer(st.view())[0]

    agree = ((ours(axis) - theirs).abs() < 0.05 * step).float().mean()
    other = ((ours(-1 - axis) - theirs).abs() < 0.05 * step).float().mean()
    assert agree > 0.99 and other < 0.5, (agree, other)


def test_history_quantized_once():
    """Appending token by token gives the same body as one append (no re-quantization)."""
    spec = resolve_spec("uniform-int2", residual_length=16, q_group_size=32)
    k, v = _kv(1)
    one = LayerStore(spec, B, H, D, torch.float32, "cpu")
    one.append(k, v)
    step = LayerStore(spec, B, H, D, torch.float32, "cpu")
    for t in range(T):
        step.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert one.body_len == step.body_len > 0
    a, b = dequantize_layer(one.view()), dequantize_layer(step.view())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("axes", ["", ",key_axis=channel,value_axis=channel"])
def test_pre_rope_keys_are_turned_back(axes):
    """``uniform:P=1`` stores keys before RoPE; attention must turn them back. The reference
    (the CPU path, and the GPU's where the kernel does not read the layer) returned them
    unturned: 0.86 off exact attention here at 8 bits; now 0.006-0.007, as the kernel."""
    from kvbits import ops

    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(B, H, 200, D, generator=g) for _ in range(2))
    q = torch.randn(B, H, 1, D, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    exact = torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5, -1) @ v
    store = LayerStore(resolve_spec(f"uniform:P=1,bits=8,R=16,G=32{axes}"), B, H, D,
                       torch.float32, "cpu", inv_freq=inv_freq)
    store.append(k, v)
    assert store.body_len > 0
    out = ops.decode_attention(q, store.view(), scale=D ** -0.5)
    assert ((out - exact).norm() / exact.norm()).item() < 2e-2


def test_hqq_axis_number_is_explained():
    """The axis numbers are quanto's (0 per token, -1 per channel). hqq numbers its per-token
    axis 1: a user switching from ``QuantizedCache(backend="hqq", axis_key=1)`` was told only
    that 0 is per-token, not that hqq's 1 is this 0."""
    for name in ("axis_key", "axis_value"):
        with pytest.raises(ValueError, match=rf"hqq backend's per-token axis 1 is {name}=0"):
            resolve_spec("uniform", **{name: 1})
    with pytest.raises(ValueError) as bad:  # another bad value gets no hqq advice
        resolve_spec("uniform", axis_key=2)
    assert "hqq" not in str(bad.value)


@pytest.mark.parametrize("R, G, prompt", [(64, 64, 100), (128, 32, 300), (0, 64, 100)])
def test_residual_window_against_transformers(R, G, prompt):
    """What README and QuantSpec.residual_length say of the same ``residual_length``:
    transformers' quanto layer quantizes the whole prompt and then holds 0 to R - 1 new tokens
    in full precision; kvbits holds R to R + G - 1 recent tokens, the prompt's included."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantoQuantizedLayer

    spec = resolve_spec("uniform", residual_length=R, q_group_size=G)
    store = LayerStore(spec, B, H, D, torch.float32, "cpu")
    theirs = QuantoQuantizedLayer(residual_length=R, q_group_size=G)
    x = torch.randn(B, H, prompt + 2 * G + R, D, generator=torch.Generator().manual_seed(7))

    def step(chunk):
        store.append(chunk, chunk)
        theirs.update(chunk.contiguous(), chunk.contiguous())
        return store.res_len, (theirs.keys.shape[-2] if theirs.keys.dim() == 4 else 0)

    ours_fp, theirs_fp = step(x[:, :, :prompt])
    assert theirs_fp == 0 and ours_fp == (R + (prompt - R) % G if prompt >= R else prompt)
    held = [step(x[:, :, t:t + 1]) for t in range(prompt, x.shape[2])]
    assert {o for o, _ in held} <= set(range(R, R + G)) and max(o for o, _ in held) == R + G - 1
    assert {t for _, t in held} <= set(range(max(R, 1))) and max(t for _, t in held) == max(R - 1, 0)
