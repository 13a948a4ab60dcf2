"""Hadamard rotation of keys: orthonormal, scores unchanged, block-diagonal head dims."""

from __future__ import annotations

import pytest
import torch

from kvbits.cache.store import LayerStore
from kvbits.reference.attention import decode_attention, dequantize_layer
from kvbits.reference.hadamard import block_size, hadamard_matrix, rotate
from kvbits.spec import resolve_spec


@pytest.mark.parametrize("d", [64, 128, 256, 80, 96])
def test_matrix_is_symmetric_orthonormal(d):
    h = hadamard_matrix(d).double()
    assert torch.allclose(h, h.T)
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-6)
    assert block_size(d) == {64: 64, 128: 128, 256: 256, 80: 16, 96: 32}[d]
    # every entry of a block is +-1/sqrt(block): outliers spread over the whole block
    n = block_size(d)
    assert torch.allclose(h[:n, :n].abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


@pytest.mark.parametrize("d", [6, 12, 1])
def test_head_dim_without_block_is_refused(d):
    with pytest.raises(ValueError, match="hadamard: head_dim"):
        hadamard_matrix(d)


@pytest.mark.parametrize("d", [64, 96])
def test_scores_invariant(d):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 5, d, generator=g), torch.randn(3, 7, d, generator=g) * 4
    h = hadamard_matrix(d)
    s0 = q @ k.transpose(-1, -2)
    s1 = rotate(q, h) @ rotate(k, h).transpose(-1, -2)
    assert (s0 - s1).abs().max() < 1e-5 * s0.abs().max()
    assert torch.allclose(rotate(rotate(k, h), h), k, atol=1e-5)


def test_store_attention_equals_unrotated_attention_in_fp():
    """Everything in the FP residual: rotated keys + rotated queries give the exact attention."""
    B, H, Hq, T, D = 2, 2, 4, 40, 64
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(B, H, T, D, generator=g) * 3, torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, Hq, 3, D, generator=g)
    st = LayerStore(resolve_spec("kivi-2-had", residual_length=64), B, H, D, torch.float32, "cpu")
    st.append(k, v)
    assert st.body_len == 0
    keys, _ = dequantize_layer(st.view())
    assert not torch.allclose(keys, k, atol=1e-3)  # stored rotated
    assert torch.allclose(st.model_keys(keys), k, atol=1e-5)
    out = decode_attention(st.rotate_query(q), st.view(), scale=D ** -0.5)
    ref = LayerStore(resolve_spec("kivi-2", residual_length=64), B, H, D, torch.float32, "cpu")
    ref.append(k, v)
    want = decode_attention(q, ref.view(), scale=D ** -0.5)
    assert (out - want).abs().max() < 1e-5


def test_rotation_shrinks_key_outlier_error():
    """A key channel 30x larger than the rest: 2-bit error of the model's keys is smaller
    with the rotation (the point of the method)."""
    B, H, T, D = 1, 2, 256, 64
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, H, T, D, generator=g)
    k[..., 3] += 30 * torch.randn(B, H, T, generator=g)  # token-varying outlier channel
    v = torch.randn(B, H, T, D, generator=g)
    err = {}
    for name in ("kivi-2", "kivi-2-had"):
        st = LayerStore(resolve_spec(name, residual_length=0), B, H, D, torch.float32, "cpu")
        st.append(k, v)
        keys, _ = dequantize_layer(st.view())
        err[name] = (st.model_keys(keys) - k).pow(2).mean().item()
    assert err["kivi-2-had"] < err["kivi-2"], err


# ------------------------------------------------------------------ calibrated channel subsets
@pytest.mark.parametrize("d", [64, 128, 256, 80, 96])
def test_subset_matrix_orthonormal_self_inverse(d):
    from kvbits.reference.hadamard import subset_matrix

    g = torch.Generator().manual_seed(d)
    for n in (0, 8, 16, 32):
        chans = torch.randperm(d, generator=g)[:n].tolist()
        m = subset_matrix(d, chans).double()
        assert torch.allclose(m, m.T) and torch.allclose(m @ m, torch.eye(d, dtype=torch.float64),
                                                         atol=1e-6)
        rest = sorted(set(range(d)) - set(chans))
        assert torch.equal(m[rest][:, rest], torch.eye(len(rest), dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two size"):
        subset_matrix(d, [0, 1, 2])
    with pytest.raises(ValueError, match="distinct integer indices"):
        subset_matrix(d, [0, 0])
    for bad in ([0.5, 1], [True, 1], ["0", "1"]):  # (0.5 was taken as channel 0)
        with pytest.raises(ValueError, match=r"distinct integer indices .*got \["):
            subset_matrix(d, bad)
    assert torch.equal(subset_matrix(d, torch.tensor([1, 0])), subset_matrix(d, [1, 0]))


def test_per_head_store_is_exact_in_fp_with_gqa():
    """Per-KV-head subsets (one head rotated, one not), 2 query heads per KV head: every token
    FP, so the attention equals plain attention; quantized, the rotated head's keys differ."""
    B, H, Hq, T, D = 1, 2, 4, 40, 64
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(B, H, T, D, generator=g) * 3, torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, Hq, 3, D, generator=g)
    chans = [list(range(8, 40)), []]
    spec = resolve_spec("kivi-2-hadc", residual_length=64)
    st = LayerStore(spec, B, H, D, torch.float32, "cpu", hadamard_channels=chans)
    st.append(k, v)
    keys, _ = dequantize_layer(st.view())
    assert torch.allclose(keys[:, 1], k[:, 1]) and not torch.allclose(keys[:, 0], k[:, 0])
    assert torch.allclose(st.model_keys(keys), k, atol=1e-5)
    out = decode_attention(st.rotate_query(q), st.view(), scale=D ** -0.5)
    ref = LayerStore(resolve_spec("kivi-2", residual_length=64), B, H, D, torch.float32, "cpu")
    ref.append(k, v)
    assert (out - decode_attention(q, ref.view(), scale=D ** -0.5)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="needs the channels of each of the 2 KV heads"):
        LayerStore(spec, B, H, D, torch.float32, "cpu")
    none = LayerStore(spec, B, H, D, torch.float32, "cpu", hadamard_channels=[[], []])
    assert none.hadamard is None  # nothing chosen: plain KIVI


def _qk(anti: bool, seed: int = 4, D: int = 64, T: int = 512):
    """Keys with 4 wide channels (range 30x the rest); queries weigh them (aligned) or weigh
    the narrow channels only (anti-aligned, like Qwen2.5's first layer)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, D, generator=g)
    k[:, :4] *= 30
    q = torch.randn(4 * T, D, generator=g)
    if anti:
        q[:, :4] *= 0.01
    else:
        q[:, 4:] *= 0.05
    return q, k


def test_choose_channels_rotates_only_when_it_lowers_the_error():
    from kvbits.methods.hadamard import choose_channels, rotation_cost
    from kvbits.reference.hadamard import subset_matrix

    D = 64
    for anti in (False, True):
        q, k = _qk(anti)
        chans = choose_channels(q, k, 32)
        plain = rotation_cost(q, k, torch.eye(D), 32)
        full = rotation_cost(q, k, hadamard_matrix(D), 32)
        chosen = rotation_cost(q, k, subset_matrix(D, chans), 32)
        assert chosen <= min(plain, full) + 1e-9
        if anti:  # a full rotation spreads the wide channels where the queries look: worse
            assert full > 2 * plain and not set(range(4)) & set(chans)
        else:  # the queries read the wide channels: spreading them helps
            assert full < plain and set(range(4)) <= set(chans) and chosen < 0.5 * plain


@pytest.mark.parametrize("D", [80, 100])
def test_head_dims_without_one_whole_block(D):
    """Session 41 QA: choose_channels costed the whole head as one Hadamard block and failed
    at head_dim 80; the store built the whole-head matrix before the calibrated subsets and
    refused head_dim 100. Subsets are powers of two, and a store takes them at either."""
    from kvbits.methods.hadamard import choose_channels

    q, k = _qk(False, D=D)
    chans = choose_channels(q, k, 32)
    assert chans and len(chans) & (len(chans) - 1) == 0 and set(range(4)) <= set(chans)
    B, H, T = 1, 2, 64
    g = torch.Generator().manual_seed(D)
    kk, vv = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    spec = resolve_spec("kivi-2-hadc", residual_length=0)
    st = LayerStore(spec, B, H, D, torch.float32, "cpu", hadamard_channels=[chans, []])
    st.append(kk, vv)
    keys, _ = dequantize_layer(st.view())
    assert torch.allclose(st.model_keys(keys)[:, 1], keys[:, 1])  # head 1 rotates nothing
    assert ((st.model_keys(keys) - kk).abs().max() < 1.5)  # 2-bit keys, back in model space


def test_measured_key_score_error_follows_the_choice():
    """The quantized store's real score error agrees with the proxy: on anti-aligned data the
    full rotation is worse than plain KIVI, the calibrated subset is not."""
    from kvbits.methods.hadamard import choose_channels

    q, k = _qk(True, seed=5)
    qc, kc = _qk(True, seed=6)  # calibration data: same statistics, other samples
    chans = choose_channels(qc, kc, 32)
    K = k[None, None]
    err = {}
    for name, kw in (("kivi-2", {}), ("kivi-2-had", {}),
                     ("kivi-2-hadc", {"hadamard_channels": [chans]})):
        st = LayerStore(resolve_spec(name, residual_length=0), 1, 1, 64, torch.float32, "cpu",
                        **kw)
        st.append(K, torch.zeros_like(K))
        keys = st.model_keys(dequantize_layer(st.view())[0])[0, 0]
        err[name] = ((q @ (keys - k).T) ** 2).mean().item()
    assert err["kivi-2-had"] > 2 * err["kivi-2"], err
    assert err["kivi-2-hadc"] <= 1.05 * err["kivi-2"], err


_ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", _ON_GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,chans", [(128, None), (96, None), (128, [list(range(3, 67)), []])])
def test_one_append_and_token_by_token_store_the_same_bits(dtype, D, chans, device):
    """The rotation of a token does not depend on how many tokens came with it: one prompt-sized
    append and token-by-token appends store the same codes, scales and residual, bit for bit
    (a float32 matmul blocked by the token count differed in the last bit at D = 128 / 96)."""
    B, H, T = 1, 2, 150
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(B, H, T, D, generator=g) * 3).to(device, dtype)
    v = torch.randn(B, H, T, D, generator=g).to(device, dtype)
    spec = resolve_spec("kivi-2-hadc" if chans else "kivi-2-had", residual_length=32)
    extra = {"hadamard_channels": chans} if chans else {}
    whole = LayerStore(spec, B, H, D, dtype, device, **extra)
    whole.append(k, v)
    steps = LayerStore(spec, B, H, D, dtype, device, **extra)
    for t in range(T):
        steps.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert whole.body_len == steps.body_len > 0
    for a, b in zip(dequantize_layer(whole.view()), dequantize_layer(steps.view())):
        assert torch.equal(a, b)
    x = torch.randn(B, 2 * H, 1, D, generator=g).to(device, dtype)
    assert torch.equal(whole.rotate_query(x), steps.rotate_query(x))


def test_channel_calibration_of_a_softcapped_model():
    """Gemma2 caps its attention logits, which SDPA refuses ("`sdpa` attention does not support
    `softcap`"): the channel calibration records the model's own queries and keys instead."""
    from tiny_decoders import tiny_gemma2
    from transformers import DynamicCache

    from kvbits.methods.hadamard import calibrate_hadamard, collect_qk

    model = tiny_gemma2()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    got = collect_qk(model, ids, window=64)
    assert len(got) == 2
    for layer, (q, k) in zip(cache.layers, got):
        assert q.shape == (4, 64, 16)
        torch.testing.assert_close(layer.keys[0], k)
    chans = calibrate_hadamard(model, ids, resolve_spec("kivi-2-hadc"), window=64)
    assert len(chans) == 2 and all(len(layer) == 2 for layer in chans)


def test_rotation_saturates_at_the_dtype_range():
    """A rotated channel sums a block / sqrt(block): float16 keys of 20000 in 64 channels
    rotate to 160000, which became inf; they saturate at 65504 (NaN stays NaN)."""
    x = torch.full((1, 1, 2, 64), 20000.0, dtype=torch.float16)
    x[0, 0, 1, 0] = float("nan")
    y = rotate(x, hadamard_matrix(64, x.device))
    assert y.dtype == torch.float16 and y[0, 0, 0, 0] == 65504 and torch.isfinite(y[0, 0, 0]).all()
    assert y[0, 0, 1].isnan().all()
    small = torch.randn(1, 1, 3, 64, dtype=torch.float16)  # in range: unchanged by the clamp
    h = hadamard_matrix(64, small.device)
    assert torch.equal(rotate(small, h), (small.double() @ h.double()).half())
