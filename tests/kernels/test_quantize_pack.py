"""Tests for kvbits.kernels.quantize_pack: the fused quantize + pack kernels against the PyTorch
oracle ``kvbits.reference.quant``. The kernels are meant to be bit-exact (IEEE divisions,
round-half-to-even, FP16 rounding of scale and zero before the codes), so codes, scales and zeros
are compared with ``torch.equal``: no tolerance.

Without CUDA the kernels run under ``TRITON_INTERPRET=1``, whose cost is per program (~50 ms), so
the CPU shapes use one or a few programs per call; ``test_gpu_tiles_*`` runs the GPU block sizes
on CPU to cover the multi-program splits.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbits.formats.packing import packed_length, unpack_bits
from kvbits.kernels import quantize_pack as qp
from kvbits.reference import quant as ref
from kvbits.spec import QuantSpec

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NAMES = ("codes", "scale", "zero")


def hostile(shape, dtype=torch.float16, seed=0, device=DEVICE):
    """Random K/V with an outlier channel and a few large tokens, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 1] *= 20.0  # outlier channel
    x[..., ::7, :] *= 4.0
    return x.to(dtype).to(device)


def left_padding(B, T, pads, device=DEVICE):
    """``[B, T]`` bool: row ``b`` starts with ``pads[b]`` padding tokens."""
    return (torch.arange(T)[None, :] >= torch.tensor(pads)[:, None]).to(device)


def assert_same(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what} {name}: {a.dtype} {tuple(a.shape)} != reference {b.dtype} {tuple(b.shape)}")
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            i = tuple(bad[0].tolist())
            raise AssertionError(f"{what} {name}: {len(bad)} of {a.numel()} differ; first at {i}: "
                                 f"kernel {a[i].item()} vs reference {b[i].item()}")


def check_keys(k, bits, G, valid=None, what=""):
    before = k.clone()
    got = qp.quantize_keys(k, bits, G, valid)
    assert torch.equal(k, before), "quantize_keys modified its input"
    assert all(t.is_contiguous() for t in got)
    assert_same(got, ref.quantize_keys(k, bits, G, valid), f"keys {what}")
    return got


def check_values(v, bits, Gv, G, valid=None, what=""):
    before = v.clone()
    got = qp.quantize_values(v, bits, Gv, G, valid)
    assert torch.equal(v, before), "quantize_values modified its input"
    assert all(t.is_contiguous() for t in got)
    assert_same(got, ref.quantize_values(v, bits, Gv, G, valid), f"values {what}")
    return got


@pytest.mark.parametrize("D", [64, 80, 100, 128, 256])  # 80, 100: a shorter last value group
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bits_groups_head_dims(bits, G, D):
    x = hostile((1, 1, G, D), seed=bits * G + D)
    check_keys(x, bits, G, what=f"bits={bits} G={G} D={D}")
    for Gv in {QuantSpec(group_size=G).value_group(D), math.gcd(G, D)}:  # the spec's, a divisor
        check_values(x, bits, Gv, G, what=f"bits={bits} G={G} D={D} Gv={Gv}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dtypes(bits, dtype):
    x = hostile((1, 2, 32, 80), dtype, seed=bits)
    check_keys(x, bits, 32, what=str(dtype))
    check_values(x, bits, 16, 32, what=str(dtype))


@pytest.mark.parametrize("G", [32, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_left_padding(bits, G):
    # Row 0 unpadded, row 1 padded inside group 0, row 2 through all of group 0 and into group 1.
    B, T, D = 3, 2 * G, 64
    valid = left_padding(B, T, [0, 5, G + 3])
    x = hostile((B, 1, T, D), seed=bits + G)
    x[~valid[:, None, :, None].expand_as(x)] = 1e4  # padding must never enter min/max
    kc, ks, kz = check_keys(x, bits, G, valid)
    assert (ks[2, :, 0] == 0).all() and (kz[2, :, 0] == 0).all()  # a whole group of padding
    assert (kc[2, :, : packed_length(G, bits)] == 0).all()
    _, vs, vz = check_values(x, bits, 32, G, valid)
    assert (vs[~valid[:, None, :].expand(B, 1, T)] == 0).all()
    assert (vz[~valid[:, None, :].expand(B, 1, T)] == 0).all()


@pytest.mark.parametrize("c", [0.375, -2.5, 0.0, 60000.0])
@pytest.mark.parametrize("bits", [2, 3, 8])
def test_constant_group(bits, c):
    x = hostile((1, 2, 64, 64), seed=3)
    x[:, :, :32, 5] = c  # one constant key group (channel 5, first 32 tokens)
    x[:, :, 40, :32] = c  # one constant value group (token 40, first 32 channels)
    kc, ks, kz = check_keys(x, bits, 32)
    vc, vs, vz = check_values(x, bits, 32, 32)
    assert (ks[:, :, 0, 5] <= 0).all() and (vs[:, :, 40, 0] <= 0).all()
    k = ref.dequantize_keys(kc, ks, kz, bits, 32)
    v = ref.dequantize_values(vc, vs, vz, bits, 32, 32)
    assert not k.isnan().any() and not v.isnan().any()
    fp16_c = torch.tensor(c, dtype=torch.float16).float()
    assert (k[:, :, :32, 5] == fp16_c).all() and (v[:, :, 40, :32] == fp16_c).all()


@pytest.mark.parametrize("bits", [2, 3])
def test_beyond_fp16_range_saturates_like_reference(bits):
    """FP32 K/V beyond FP16's range: the kernels saturate min/max at +-65504 as the reference
    does (bit-exact), so no scale or zero is infinite."""
    x = hostile((1, 2, 64, 64), dtype=torch.float32, seed=5)
    x[:, :, :32, 5] = 1e6  # a constant key group beyond the range
    x[:, :, 32:, 7] = torch.linspace(-2e5, 2e5, 32)  # a key group spanning it
    x[:, :, 40, :32] = -1e6  # a constant value group
    x[:, :, 41, :32] = float("inf")
    _, ks, kz = check_keys(x, bits, 32)
    _, vs, vz = check_values(x, bits, 32, 32)
    for t in (ks, kz, vs, vz):
        assert torch.isfinite(t).all()
    assert (kz[:, :, 0, 5] == 65504).all() and (vz[:, :, 40, 0] == -65504).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_top_code_within_fp16_like_reference(bits, dtype):
    """Groups ending at FP16's max: the kernels step the scale down as the reference does
    (bit-exact), so ``code * scale + zero`` stays finite in float16 (session 47 QA: inf, then
    NaN attention, in the decode kernel)."""
    x = hostile((1, 2, 64, 64), dtype=dtype, seed=7)
    x[:, :, :32, 0] = torch.linspace(0, 65504, 32).to(dtype)
    x[:, :, :32, 1] = torch.linspace(-65504, 65504, 32).to(dtype)
    x[:, :, 40, :32] = torch.linspace(-7, 65504, 32).to(dtype)
    for _, scale, zero in (check_keys(x, bits, 32), check_values(x, bits, 32, 32)):
        assert (((1 << bits) - 1) * scale.float() + zero.float() <= 65504).all()


@pytest.mark.parametrize("bits", [2, 8])
def test_ties_round_half_to_even(bits):
    # Group [0, MAXQ, 0.5, 1.5, 2.5, ...]: scale 1, zero 0 exactly, every other code a tie.
    maxq = (1 << bits) - 1
    G, D = 32, 32
    seq = torch.tensor([0.0, maxq] + [(i % maxq) + 0.5 for i in range(G - 2)])
    k = seq[None, None, :, None].expand(1, 1, G, D).contiguous().half().to(DEVICE)
    kc, ks, _ = check_keys(k, bits, G)
    assert (ks == 1).all()
    expect = torch.round(seq).clamp(0, maxq)  # half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    codes = unpack_bits(kc.cpu(), bits, G, dim=2)[0, 0, :, 0]
    assert torch.equal(codes.float(), expect)
    v = seq[None, None, None, :].expand(1, 1, G, G).contiguous().half().to(DEVICE)
    check_values(v, bits, G, G)


def test_non_contiguous_inputs():
    # A slice of a bigger buffer (offset in every dim), and a [B, T, H, D] tensor viewed as
    # [B, H, T, D], the layout attention projections produce.
    buf = hostile((3, 5, 160, 96), seed=7)
    x = buf[1:3, 1:4, 16:144, 8:88]  # [2, 3, 128, 80]
    assert not x.is_contiguous()
    valid = left_padding(2, 128, [0, 40])
    check_keys(x, 4, 64, valid, what="slice")
    check_values(x, 2, 16, 64, valid, what="slice")
    y = hostile((2, 64, 4, 64), seed=8).transpose(1, 2)  # [B, H, T, D] with stride_t = H * D
    check_keys(y, 3, 32, what="transposed")
    check_values(y, 8, 32, 32, what="transposed")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gpu_tiles_split_channels_and_columns(bits, monkeypatch):
    # The GPU block sizes on CPU: keys split D into channel blocks; values split the columns of
    # a group and its channel groups, both with partial last blocks (D = 80 + 96 = 176).
    monkeypatch.setitem(qp._TILES, "cpu", qp._TILES["cuda"])
    x = hostile((1, 1, 128, 176), seed=bits)
    valid = left_padding(1, 128, [37])
    check_keys(x, bits, 128, valid)
    check_values(x, bits, 16, 128, valid)


@st.composite
def cases(draw):
    """Random shapes, including groups that are not powers of two or smaller than a word."""
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    G = draw(st.sampled_from([8, 16, 24, 32, 48, 64, 96, 128]))
    D = draw(st.sampled_from([16, 32, 40, 48, 64, 80, 96, 100, 112, 128]))
    # value groups that divide D or leave a shorter last group (25 of 40: 25 + 15)
    Gv = draw(st.sampled_from([d for d in (4, 8, 16, 24, 25, 32, 48, 64, 128) if d <= D]))
    B, H, NG = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    pads = draw(st.none() | st.lists(st.integers(0, NG * G), min_size=B, max_size=B))
    return bits, G, D, Gv, B, H, NG, dtype, pads


@settings(max_examples=30, deadline=None)
@given(c=cases())
def test_random_cases(c):
    bits, G, D, Gv, B, H, NG, dtype, pads = c
    x = hostile((B, H, NG * G, D), dtype, seed=sum(map(hash, (bits, G, D, B, H))) % 1000)
    valid = None if pads is None else left_padding(B, NG * G, pads)
    check_keys(x, bits, G, valid, what=str(c))
    check_values(x, bits, Gv, G, valid, what=str(c))


def test_empty_token_axis():
    x = torch.zeros(2, 3, 0, 64, dtype=torch.float16, device=DEVICE)
    codes, scale, zero = qp.quantize_keys(x, 2, 32)
    assert codes.shape == (2, 3, 0, 64) and scale.shape == zero.shape == (2, 3, 0, 64)
    codes, scale, zero = qp.quantize_values(x, 2, 32, 32)
    assert codes.shape == (2, 3, 0, 64) and scale.shape == zero.shape == (2, 3, 0, 2)


def test_channel_stride_past_int32():
    """A ``[B, H, T, D]`` view of a ``[B, H, D, T]`` buffer whose channel offsets ``d * stride``
    pass int32 (2**24 + 2**20 tokens at head_dim 128): the kernels compute that term in int32 and
    read out of bounds (a segmentation fault under the interpreter; QA pass). Such a view is
    copied first, and only such a view."""
    D, G, T = 128, 32, 2**24 + 2**20
    meta = torch.empty_strided((1, 1, G, D), (D * T, D * T, 1, T), device="meta")
    assert qp._channels_in_int32(meta).is_contiguous()
    fits = torch.empty_strided((1, 1, G, D), (D * 1000, D * 1000, 1, 1000), device="meta")
    assert qp._channels_in_int32(fits) is fits
    if CUDA:
        return  # (the buffer below would be allocated for real)
    try:
        buf = torch.empty(1, 1, D, T, dtype=torch.float16)  # untouched pages stay uncommitted
    except RuntimeError as exc:
        pytest.skip(f"no 4.25 GiB of address space: {exc}")
    buf[0, 0, :, :G] = hostile((1, 1, D, G), seed=3)[0, 0]
    x = buf.transpose(2, 3)[:, :, :G]  # [1, 1, G, D], channel stride T
    assert (D - 1) * x.stride(3) >= 2**31
    check_keys(x, 2, G, what="channel stride past int32")
    check_values(x, 4, 32, G, what="channel stride past int32")


def test_errors_name_the_parameter():
    x = torch.zeros(1, 2, 64, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="bits"):
        qp.quantize_keys(x, 5, 32)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 3, 4, 8\), got 2.0"):
        qp.quantize_keys(x, 2.0, 32)  # was a TypeError from torch.empty (session 41 QA)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        qp.quantize_keys(x, 2, True)  # was taken as 1
    with pytest.raises(ValueError, match="group_size"):
        qp.quantize_keys(x, 2, 48)
    with pytest.raises(ValueError, match="group_size"):
        qp.quantize_values(x, 2, 32, 0)
    with pytest.raises(ValueError, match=r"value_group must be an int in \[1, head_dim=64\]"):
        qp.quantize_values(x, 2, 65, 32)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        qp.quantize_keys(x.int(), 2, 32)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        qp.quantize_values(x[0], 2, 32, 32)
    with pytest.raises(ValueError, match="valid"):
        qp.quantize_keys(x, 2, 32, torch.ones(1, 63, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="valid"):
        qp.quantize_values(x, 2, 32, 32, torch.ones(1, 64, dtype=torch.int64, device=DEVICE))


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (realistic sizes)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,G", [(2, 32), (2, 128), (3, 64), (4, 128), (8, 32)])
def test_gpu_realistic_sizes(bits, G, dtype):
    x = hostile((2, 8, 8192, 128), dtype, seed=bits + G)
    valid = left_padding(2, 8192, [0, 1000])
    check_keys(x, bits, G, valid)
    check_values(x, bits, 32, G, valid)


@gpu
@pytest.mark.gpu
def test_gpu_offsets_past_int32():
    # The tail of an [1, 8, 2**22 + 256, 128] fp16 buffer (8.6 GB): head 7's last tokens sit
    # ~4.3e9 elements (8.6e9 bytes) from the base pointer, past 2**31 and 2**32.
    T = 2**22 + 256
    buf = torch.empty(1, 8, T, 128, dtype=torch.float16, device="cuda")
    buf[:, :, -256:] = hostile((1, 8, 256, 128), seed=1)
    x = buf[:, :, -256:]
    assert x.storage_offset() + 7 * x.stride(1) > 2**32
    valid = left_padding(1, 256, [70])
    check_keys(x, 2, 128, valid)
    check_values(x, 4, 32, 128, valid)
    del buf


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    # No host syncs in the launchers: the decode-step flush can live in a CUDA graph.
    x = hostile((4, 8, 128, 128), seed=2)
    qp.quantize_keys(x, 2, 128)  # compile outside the capture
    qp.quantize_values(x, 2, 32, 128)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keys = qp.quantize_keys(x, 2, 128)
        values = qp.quantize_values(x, 2, 32, 128)
    x.copy_(hostile((4, 8, 128, 128), seed=3))
    graph.replay()
    assert_same(keys, ref.quantize_keys(x, 2, 128), "graph keys")
    assert_same(values, ref.quantize_values(x, 2, 32, 128), "graph values")
