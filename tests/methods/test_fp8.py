"""FP8 (e4m3) KV: round trip vs torch's own cast, dynamic and calibrated scales, layout."""

from __future__ import annotations

import pytest
import torch

from kvbits.cache.store import LayerStore
from kvbits.methods import fp8
from kvbits.reference import quant as rq
from kvbits.reference.attention import dequantize_layer
from kvbits.spec import resolve_spec

B, H, T, D = 2, 3, 64, 32


def _kv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g) * 5, torch.randn(B, H, T, D, generator=g)


def test_round_trip_matches_torch_cast():
    x, _ = _kv()
    scale = torch.full((B, H, 1, 1), 0.05)
    codes = rq.quantize_fp8(x, scale)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.float(), (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    back = rq.dequantize_fp8(codes, scale)
    assert torch.equal(back, (x / scale).to(torch.float8_e4m3fn).float() * scale)
    # e4m3: 3 mantissa bits, relative error <= 2^-4 in the normal range
    normal = (x / scale).abs() > 2 ** -6
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + 1e-7)[normal].all()


def test_saturates_instead_of_nan():
    codes = rq.quantize_fp8(torch.tensor([[[[1e6, -1e6]]]]), torch.ones(1, 1, 1, 1))
    assert codes.float().tolist() == [[[[448.0, -448.0]]]]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), 1e30])
def test_an_infinite_element_does_not_make_the_head_nan(bad):
    """Session 41 QA: the amax of a prompt holding inf made the dynamic scale inf and every
    element of that head NaN (0 * inf); a huge finite amax saturates at FP16's range like the
    integer methods, and +-inf is left out of the amax (the finite elements set the scale)."""
    k, v = _kv()
    finite = rq.fp8_scale_from_amax(k[0, 0].abs().amax()).item()
    k[0, 0, 10, 3] = bad
    st = LayerStore(resolve_spec("fp8-dynamic").replace(residual_length=0), B, H, D,
                    torch.float32, "cpu")
    with pytest.warns(UserWarning, match=r"keys \(sequence 0, KV head 0\) reach magnitude"):
        st.append(k, v)
    assert torch.isfinite(st.k_scale).all()
    want = finite if abs(bad) == float("inf") else rq.FP16_MAX * rq.FP8_HEADROOM / 448
    assert st.k_scale[0, 0].item() == pytest.approx(want)
    keys, _ = dequantize_layer(st.view())
    assert torch.isfinite(keys).all()
    assert keys[0, 0, 10, 3].item() == pytest.approx(448 * st.k_scale[0, 0].item() * (
        1 if bad > 0 else -1), rel=1e-6)


def test_dynamic_store_layout_and_scale():
    k, v = _kv()
    st = LayerStore(resolve_spec("fp8-dynamic"), B, H, D, torch.float32, "cpu")
    st.append(k, v)
    kv = st.view_raw()
    assert kv.fp8 and kv.key_bits == 8 and not kv.is_plain
    assert kv.k_codes.dtype == torch.float8_e4m3fn and kv.k_codes.shape[2] >= T
    assert kv.k_scale.shape == (B, H, 1, 1) and kv.k_scale.dtype == torch.float32
    assert kv.k_zero is None and kv.v_zero is None
    want = k.abs().amax(dim=(2, 3), keepdim=True) * rq.FP8_HEADROOM / 448
    assert torch.allclose(kv.k_scale, want)
    keys, values = dequantize_layer(st.view())
    assert torch.equal(keys[:, :, :st.body_len],
                       rq.dequantize_fp8(rq.quantize_fp8(k, want), want)[:, :, :st.body_len])
    assert ((values - v).abs() <= v.abs() / 16 + 1e-3).all()
    # the scale stays fixed after the prompt: a 4x larger token saturates at 448 * scale
    big = torch.full((B, H, 32, D), 1.0) * want * 448 * 4
    st.append(big, big)
    keys, _ = dequantize_layer(st.view())
    assert torch.allclose(keys[:, :, -32:], (want * 448).expand(B, H, 32, D))
    st.reorder(torch.tensor([1, 0]))
    assert torch.equal(st.k_scale[0], want[1])


def test_tensor_granularity_and_calibrated_scales():
    k, v = _kv()
    st = LayerStore(resolve_spec("fp8-dynamic", fp8_granularity="tensor"), B, H, D,
                    torch.float32, "cpu")
    st.append(k, v)
    assert torch.equal(st.k_scale, st.k_scale[:, :1].expand_as(st.k_scale))
    scales = (torch.arange(1, H + 1).float(), torch.ones(H))
    st = LayerStore(resolve_spec("fp8"), B, H, D, torch.float32, "cpu", fp8_scales=scales)
    st.append(k, v)
    assert torch.equal(st.k_scale[1, :, 0, 0], scales[0])
    with pytest.raises(ValueError, match="calibrated"):
        LayerStore(resolve_spec("fp8"), B, H, D, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"kv_heads=3"):
        LayerStore(resolve_spec("fp8"), B, H, D, torch.float32, "cpu",
                   fp8_scales=(torch.ones(2), torch.ones(2)))


def test_scale_file_round_trip(tmp_path):
    scales = [(torch.rand(4), torch.rand(4)) for _ in range(3)]
    fp8.save_fp8_scales(tmp_path / "s.safetensors", scales, text="x")
    back = fp8.load_fp8_scales(tmp_path / "s.safetensors")
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(scales, back))
    with pytest.raises(ValueError, match="cannot read fp8 scales"):
        fp8.load_fp8_scales(tmp_path / "missing.safetensors")


def test_nbytes_counts_one_byte_per_element():
    k, v = _kv()
    st = LayerStore(resolve_spec("fp8-dynamic"), B, H, D, torch.float32, "cpu")
    st.append(k, v)
    body = B * H * st.body_len * 2 * D + B * H * 8
    assert st.nbytes() == body + B * H * 2 * st.res_len * D * 4


@pytest.mark.parametrize("name", ["fp8-dynamic", "uniform-int2"])
def test_presize_store_keeps_layout(name):
    from kvbits.eval.cachefill import presize_store

    k, v = _kv()
    spec = resolve_spec(name, residual_length=0) if name == "fp8-dynamic" else resolve_spec(
        name, residual_length=0, q_group_size=32)
    a = LayerStore(spec, B, H, D, torch.float32, "cpu")
    b = LayerStore(spec, B, H, D, torch.float32, "cpu")
    presize_store(b, 256, residual=64)
    a.append(k, v)
    b.append(k, v)
    ka, va = dequantize_layer(a.view())
    kb, vb = dequantize_layer(b.view())
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("gran", ["head", "tensor"])
def test_dynamic_scale_of_a_sequence_whose_first_group_is_padding(gran):
    """Left padding fills sequence 1's first flushed group: that flush sets no scale of its
    (once it was 1, fixed for good: its keys of ~1000 saturated at 448; then it came from the 8
    real tokens still in the residual). Its first own group sets it, as the run of that
    sequence alone does; sequence 0's comes from the first flush."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, H, 64, D, generator=g) * 1000
    spec = resolve_spec("fp8-dynamic", fp8_granularity=gran)
    st = LayerStore(spec, 2, H, D, torch.float32, "cpu")
    assert st.spec.residual_length == 0 and st.spec.group_size == 32
    st.append(k[:, :, :40], k[:, :, :40], flush=False)
    st.set_padding(torch.tensor([0, 32]))  # sequence 1: 32 padding tokens, then 8 real ones
    st.flush()
    first = k[0, :, :40].abs().amax(dim=(1, 2) if gran == "head" else (0, 1, 2))
    torch.testing.assert_close(st.k_scale[0].flatten(), (first * rq.FP8_HEADROOM / 448)
                               .flatten().expand(H), rtol=1e-6, atol=0)
    st.append(k[:, :, 40:], k[:, :, 40:])
    alone = LayerStore(spec, 1, H, D, torch.float32, "cpu")
    alone.append(k[1:, :, 32:40], k[1:, :, 32:40])
    assert alone.body_len == 0
    alone.append(k[1:, :, 40:], k[1:, :, 40:])
    own = k[1, :, 32:64].abs().amax(dim=(1, 2) if gran == "head" else (0, 1, 2))
    torch.testing.assert_close(alone.k_scale[0].flatten(), (own * rq.FP8_HEADROOM / 448)
                               .flatten().expand(H), rtol=1e-6, atol=0)
    torch.testing.assert_close(st.k_scale[1], alone.k_scale[0], rtol=0, atol=0)
    keys, _ = dequantize_layer(st.view(), starts=st.starts)
    kept = k[1, :, 32:st.body_len]
    assert ((keys[1, :, 32:st.body_len] - kept).abs() <= kept.abs() / 16 + 1e-3).all()


def test_beam_selection_of_the_sequences_whose_scales_are_set():
    """A padded batch waits for its unset sequence's dynamic scales (no eviction, no device
    lengths); selecting only the set ones (beam search, batch selection) ends the wait at once,
    as for a batch of those sequences alone (it waited for the next flush: found by the state
    machine, whose model evicted while the store did not)."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(2, H, 40, D, generator=g)
    st = LayerStore(resolve_spec("fp8-dynamic"), 2, H, D, torch.float32, "cpu")
    st.append(k, k, flush=False)
    st.set_padding(torch.tensor([0, 40]))  # sequence 1: nothing of its own yet
    st.flush()
    assert st.body_len == 32 and not st.device_lengths_ok()
    st.reorder(torch.tensor([0, 0]))
    assert st.device_lengths_ok()
    scale = st.k_scale.clone()
    st.reorder(torch.tensor([1]))  # (a copy of sequence 0)
    assert st.device_lengths_ok() and torch.equal(st.k_scale, scale[1:])


def test_device_length_view_bounds_whole_groups_after_growth(monkeypatch):
    """A captured loop over an fp8 layer whose buffers grew by 1/8 in eager decode steps (a
    second ``generate`` on the same cache): the view's body bound must be whole groups of G
    (the kernels' contract), not the raw capacity (8496 rows here, refused by decode_attention),
    and still hold every stored token."""
    from kvbits import ops

    monkeypatch.setenv("KVBITS_KERNELS", "triton")  # view_dev's kernel bounds (no launch)
    st = LayerStore(resolve_spec("fp8"), 1, 1, 64, torch.float16, "cpu",
                    fp8_scales=(torch.ones(1), torch.ones(1)))
    g = torch.Generator().manual_seed(0)
    st.append(torch.randn(1, 1, 7571, 64, generator=g).half(),
              torch.randn(1, 1, 7571, 64, generator=g).half())
    for _ in range(40):
        st.append(torch.randn(1, 1, 1, 64, generator=g).half(),
                  torch.randn(1, 1, 1, 64, generator=g).half())
    G = st.spec.group_size
    assert st.k_codes.shape[2] % G  # the premise: a capacity between whole groups
    st.begin_device_lengths(st.seq_len + 8)
    kv = st.view_dev()
    assert kv.body_len % G == 0 and st.body_len <= kv.body_len <= st.k_codes.shape[2]
    ops._check_call(torch.zeros(1, 1, 1, 64, dtype=torch.float16), kv, 0.125, None)


@pytest.mark.parametrize("pair,match", [
    ((torch.full((2,), float("nan")), torch.ones(2)), "layer 0 k_scale must be finite and > 0"),
    ((torch.ones(2), torch.full((2,), float("inf"))), "layer 0 v_scale must be finite and > 0"),
    ((torch.zeros(2), torch.ones(2)), "k_scale must be finite and > 0"),
    ((-torch.ones(2), torch.ones(2)), "k_scale must be finite and > 0"),
    ((1.0, 1.0), r"layer 0 k_scale must be a float \[kv_heads\] tensor"),
    (torch.ones(2), r"layer 0 must be a \(k_scale, v_scale\) pair"),
])
def test_calibrated_scales_are_checked_up_front(pair, match):
    """Session 41 QA: NaN / inf scales gave NaN keys, 0 zeroed them, -1 flipped their sign, a
    float failed with an AttributeError at the first forward."""
    spec = resolve_spec("fp8")
    with pytest.raises(ValueError, match=match):
        fp8.layer_scales(None, spec, [pair, pair], 2)


def test_tensor_granularity_refuses_per_head_scales():
    """fp8-tensor (one scale per layer) given a per-head calibration (a file or list made for
    'fp8') kept the per-head scales without a word; one value repeated per layer is taken."""
    spec = resolve_spec("fp8-tensor")
    per_head = [(torch.tensor([0.5, 1.0]), torch.ones(2)), (torch.ones(2), torch.ones(2))]
    with pytest.raises(ValueError, match=r"layer 0 k_scale .* fp8_granularity='tensor'"):
        fp8.layer_scales(None, spec, per_head, 2)
    same = [(torch.full((2,), 0.5), torch.ones(2))] * 2
    assert fp8.layer_scales(None, spec, same, 2) == same
    assert fp8.layer_scales(None, resolve_spec("fp8"), per_head, 2) == per_head


@pytest.mark.parametrize("tiny", [1e-45, 1e-43])
def test_a_subnormal_amax_gives_no_nan(tiny):
    """A float32 head whose amax is a deep subnormal: amax * 2 / 448 underflowed to a scale of
    0, and every 0 of the head quantized as 0 / 0 = NaN (then NaN attention). The scale is 1
    where it underflows, as for an amax of 0."""
    k, v = _kv()
    k[0, 1] = 0.0
    k[0, 1, 3, 4], k[0, 1, 7, 0] = tiny, -tiny
    st = LayerStore(resolve_spec("fp8-dynamic").replace(residual_length=0), B, H, D,
                    torch.float32, "cpu")
    st.append(k, v)
    assert (st.k_scale > 0).all()
    keys, _ = dequantize_layer(st.view())
    assert torch.isfinite(keys).all() and keys[0, 1].abs().max() <= tiny
    assert rq.fp8_scale_from_amax(torch.tensor([tiny, 0.0, 448.0])).tolist() == [1.0, 1.0, 2.0]


def test_calibration_takes_the_finite_elements_and_says_so():
    """A NaN in the model's K/V on the calibration text made that head's scale 1, an inf 292,
    with no word; now the scale comes from the finite elements and a warning names the layer."""
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    spec = resolve_spec("fp8")
    with torch.no_grad():
        clean = fp8.calibrate_fp8(model, ids, spec, window=40)
        proj = model.model.layers[1].self_attn.k_proj
        proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features))
        proj.bias[3] = float("nan")  # head 0 of layer 1: every token's channel 3
        with pytest.warns(UserWarning, match=r"layer\(s\) \[1\]"):
            got = fp8.calibrate_fp8(model, ids, spec, window=40)
    assert torch.isfinite(got[1][0]).all() and got[1][0][0] != 1.0
    torch.testing.assert_close(got[0][0], clean[0][0])
    torch.testing.assert_close(got[1][0][1], clean[1][0][1])
