"""Tests for kvbits.reference.quant: KIVI min-max quantization, the oracle for the kernels.

Error budget of one quantize -> dequantize round trip (per element x of a group):

    |x - deq| <= scale / 2 + |lo - zero| + slack

* ``scale / 2``: rounding to the nearest code. The stored FP16 scale is
  ``fp16((hi - zero) / (2**bits - 1))``; when FP16 rounds it *down* (relative error <= 2**-11),
  the top element needs code ``(2**bits - 1) * (1 + 2**-10) < 2**bits - 1/2`` for bits <= 8, so
  ``round`` never has to be clamped at the top and the scale/2 bound still holds.
* ``|lo - zero|``: the FP16 zero may round above the group minimum; elements below it clamp to
  code 0. It is 0 for FP16 inputs and for BF16 inputs in FP16's normal range (their 8-bit mantissa
  fits in FP16's 11 bits), and up to half an FP16 ulp of ``lo`` for FP32 inputs.
* ``slack``: float32 arithmetic of ``x - zero``, ``/ scale`` (which may push a value across a
  .5 boundary) and ``code * scale + zero``: a few float32 roundings, bounded by
  ``2**-20 * (|x| + |zero|)``; plus ``(2**bits - 1) * 2**-25`` for a subnormal FP16 scale whose
  absolute rounding (<= 2**-25) the codes multiply.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbits.formats.packing import pack_bits, packed_length
from kvbits.reference.quant import (
    dequantize_keys,
    dequantize_values,
    dequantize_with,
    fp8_amax,
    minmax_qparams,
    quantize_keys,
    quantize_values,
    quantize_with,
)

BITS = (2, 3, 4, 8)
GROUPS = (32, 64, 128)
HEAD_DIMS = (64, 80, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _hostile(shape, dtype, seed):
    """Random keys with channel scales spread over 4 decades, an offset outlier channel and a
    constant channel: the data KIVI's per-channel key groups exist for."""
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = torch.randn(shape, generator=g) * 10 ** (torch.rand(D, generator=g) * 4 - 2)
    x[..., 3] += 50.0  # offset outlier channel: all-positive groups
    x[..., 5] = -7.25  # constant channel (exact in every dtype)
    return x.to(dtype)


def _bound(x, deq, lo, zero, scale, bits):
    """Per-element error budget from the module docstring (all float32, broadcast)."""
    slack = 2.0**-20 * (x.abs() + zero.abs()) + ((1 << bits) - 1) * 2.0**-25
    return scale / 2 + (lo - zero).abs() + slack


def _check_bound(x, deq, lo, zero, scale, bits, what):
    err = (x - deq).abs()
    budget = _bound(x, deq, lo, zero, scale, bits)
    bad = err > budget
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {x.numel()} elements exceed |x - deq| <= scale/2 + "
            f"|lo - zero| + slack; first at {i}: x={x[i].item():.6g} deq={deq[i].item():.6g} "
            f"err={err[i].item():.3g} scale={scale[i].item():.3g} "
            f"|lo-zero|={(lo - zero).abs()[i].item():.3g} budget={budget[i].item():.3g}")


def _expected_qparams(xf, bits, dim):
    lo = xf.amin(dim, keepdim=True)
    hi = xf.amax(dim, keepdim=True)
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / ((1 << bits) - 1)).to(torch.float16)
    return lo, scale, zero


# ----------------------------------------------------------------------------- keys
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_keys_round_trip_error_bound(bits, G, D, dtype):
    B, H, NG = 1, 2, 2
    k = _hostile((B, H, NG * G, D), dtype, seed=bits * 1000 + G + D)
    before = k.clone()
    codes, scale, zero = quantize_keys(k, bits, G)
    assert torch.equal(k, before), "quantize_keys modified its input"
    assert codes.dtype == torch.int32 and codes.shape == (B, H, NG * packed_length(G, bits), D)
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.shape == zero.shape == (B, H, NG, D)

    kg = k.float().reshape(B, H, NG, G, D)
    lo, want_scale, want_zero = _expected_qparams(kg, bits, dim=3)
    assert torch.equal(zero, want_zero.squeeze(3)), "zero != fp16(group min)"
    assert torch.equal(scale, want_scale.squeeze(3)), "scale != fp16((max - zero) / (2^b - 1))"

    deq = dequantize_keys(codes, scale, zero, bits, G)
    assert deq.dtype == torch.float32 and deq.shape == k.shape
    assert torch.isfinite(deq).all()
    _check_bound(kg, deq.reshape(B, H, NG, G, D), lo, want_zero.float(), want_scale.float(),
                 bits, f"keys bits={bits} G={G} D={D} {dtype}")
    # The constant channel has scale 0 and dequantizes exactly.
    assert (scale[..., 5] == 0).all()
    assert (deq[..., 5] == -7.25).all()


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_values_round_trip_error_bound(bits, G, D, dtype):
    B, H, NG = 1, 2, 2
    T = NG * G
    Gv = math.gcd(G, D)  # what QuantSpec.value_group gives
    g = torch.Generator().manual_seed(bits * 7 + G + D)
    # Per-token magnitudes over 4 decades; one constant token.
    v = torch.randn(B, H, T, D, generator=g) * 10 ** (torch.rand(T, 1, generator=g) * 4 - 2)
    v[:, :, 7] = 0.5
    v = v.to(dtype)
    before = v.clone()
    codes, scale, zero = quantize_values(v, bits, Gv, G)
    assert torch.equal(v, before), "quantize_values modified its input"
    # Codes packed along tokens within blocks of G tokens, like the keys.
    assert codes.dtype == torch.int32 and codes.shape == (B, H, NG * packed_length(G, bits), D)
    assert scale.shape == zero.shape == (B, H, T, D // Gv)

    vg = v.float().reshape(B, H, T, D // Gv, Gv)
    lo, want_scale, want_zero = _expected_qparams(vg, bits, dim=4)
    assert torch.equal(zero, want_zero.squeeze(4)), "zero != fp16(group min)"
    assert torch.equal(scale, want_scale.squeeze(4)), "scale != fp16((max - zero) / (2^b - 1))"

    deq = dequantize_values(codes, scale, zero, bits, Gv, G)
    assert deq.shape == v.shape and torch.isfinite(deq).all()
    _check_bound(vg, deq.reshape(vg.shape), lo, want_zero.float(), want_scale.float(), bits,
                 f"values bits={bits} Gv={Gv} D={D} {dtype}")
    assert (scale[:, :, 7] == 0).all() and (deq[:, :, 7] == 0.5).all()


@pytest.mark.parametrize("bits", BITS)
def test_value_codes_packed_along_tokens(bits):
    # The layout contract (kvbits.formats.layout): value codes of block g of G tokens are rows
    # [g * Wv, (g + 1) * Wv), packed along tokens exactly like pack_bits(codes, dim=tokens).
    G, D = 32, 64
    v = torch.randn(1, 1, 2 * G, D, generator=torch.Generator().manual_seed(bits))
    codes, scale, zero = quantize_values(v, bits, 32, G)
    raw = quantize_with(v.reshape(1, 1, 2 * G, 2, 32), scale.unsqueeze(-1), zero.unsqueeze(-1),
                        bits).reshape(1, 1, 2, G, D)
    assert torch.equal(codes, pack_bits(raw, bits, dim=3).reshape(1, 1, -1, D))


@pytest.mark.parametrize("bits", BITS)
def test_bound_is_tight_enough_to_matter(bits):
    # The round-trip error must actually use the codes: on a ramp, error <= scale/2 (not 0 and not
    # the whole range). A quantizer returning all-zero codes fails the bound by ~range.
    x = torch.linspace(-3, 5, 64, dtype=torch.float32).view(1, 1, 64, 1).expand(1, 1, 64, 4)
    codes, scale, zero = quantize_keys(x.contiguous(), bits, 32)
    deq = dequantize_keys(codes, scale, zero, bits, 32)
    err = (deq - x).abs().max().item()
    assert err <= scale.float().max().item() / 2 + 1e-5, (err, scale.max().item())
    assert err > 0 or bits == 8


@pytest.mark.parametrize("bits", BITS)
def test_codes_survive_requantization(bits):
    # quantize_with is an exact inverse of dequantize_with on the codes (scale not tiny vs zero).
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (4, 8, 32), generator=g).to(torch.uint8)
    scale = (torch.rand(4, 8, 1, generator=g) * 0.5 + 0.01).half()
    zero = (torch.randn(4, 8, 1, generator=g) * 3).half()
    x = dequantize_with(q, scale, zero)
    assert torch.equal(quantize_with(x, scale, zero, bits), q)


# ----------------------------------------------------------------------------- constant groups
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("c", [0.0, -3.5, 1e-3, 6e4, -6e4])
def test_constant_group_exact_no_nan(bits, dtype, c):
    k = torch.full((1, 2, 64, 16), c).to(dtype)
    codes, scale, zero = quantize_keys(k, bits, 32)
    assert (scale == 0).all(), scale.unique()
    deq = dequantize_keys(codes, scale, zero, bits, 32, dtype=dtype)
    assert not deq.isnan().any()
    assert torch.equal(deq, k), f"constant {c} -> {deq.unique().tolist()}"
    v_codes, v_scale, v_zero = quantize_values(k, bits, 16, 32)
    assert (v_scale == 0).all()
    assert torch.equal(dequantize_values(v_codes, v_scale, v_zero, bits, 16, 32, dtype=dtype), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_beyond_fp16_range_saturates_no_nan(bits, dtype):
    """A BF16/FP32 group beyond FP16's range (FP16 scales and zeros) saturates at +-65504:
    constant groups of +-1e6 and a group spanning +-1e5 dequantize finite, the in-range
    elements of that group within one step of their values."""
    k = torch.randn(1, 2, 96, 16, generator=torch.Generator().manual_seed(bits)).to(dtype)
    k[:, :, :32] = 1e6
    k[:, :, 32:64, :8] = -1e6
    k[:, :, 64:, 0] = torch.linspace(-1e5, 1e5, 32).to(dtype)
    for quant, deq, args in ((quantize_keys, dequantize_keys, (bits, 32)),
                             (quantize_values, dequantize_values, (bits, 16, 32))):
        codes, scale, zero = quant(k, *args)
        assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
        out = deq(codes, scale, zero, *args, dtype=torch.float32)
        assert torch.isfinite(out).all()
        assert (out[:, :, :32] == 65504).all()  # saturated, not inf
    out = dequantize_keys(*quantize_keys(k, bits, 32), bits, 32, dtype=torch.float32)
    inside = k[:, :, 64:, 0].float().abs() <= 65504
    step = 131008 / ((1 << bits) - 1)
    assert ((out[:, :, 64:, 0] - k[:, :, 64:, 0].float()).abs()[inside] <= step / 2 + 1).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_top_code_stays_within_fp16(bits, dtype):
    """Groups whose max is FP16's max (what a BF16/FP32 value beyond the range saturates to):
    the FP16 scale, rounded to nearest, could put the top code past 65504, and the kernels'
    one-rounding float16 dequantization made it inf (NaN in attention; session 47 QA). The
    scale steps down instead: every code dequantizes finite in float16, within the group."""
    k = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(bits)).to(dtype)
    k[:, :, :32, 0] = torch.linspace(0, 65504, 32).to(dtype)  # spans [0, 65504]
    k[:, :, :32, 1] = torch.linspace(-65504, 65504, 32).to(dtype)
    k[:, :, 32:, 2] = 65504  # constant at the top
    k[:, :, 32:, 3] = torch.linspace(-3, 65504, 32).to(dtype)
    k[:, :, 40, :] = torch.linspace(-7, 65504, 32).to(dtype)  # a value group
    for quant, args in ((quantize_keys, (bits, 32)), (quantize_values, (bits, 32, 32))):
        codes, scale, zero = quant(k, *args)
        levels = torch.arange(1 << bits, dtype=torch.float32)
        # every code of every group, as the kernels compute it: one float16 rounding
        top = (levels[-1] * scale.float() + zero.float()).half()
        assert torch.isfinite(top).all() and torch.isfinite(scale).all()
        assert (levels[-1] * scale.float() + zero.float() <= 65504).all()
        deq = (dequantize_keys if quant is quantize_keys else dequantize_values)(
            codes, scale, zero, *args, dtype=torch.float16)
        assert torch.isfinite(deq).all()


@pytest.mark.parametrize("bits", BITS)
def test_near_constant_group_no_nan(bits):
    # Range below FP16's smallest subnormal step: scale rounds to 0 or a subnormal.
    base = torch.full((1, 1, 32, 8), 0.25)
    base[:, :, 1] += torch.tensor([1e-9, 1e-8, 3e-8, 6e-8, 1e-7, 1e-6, 1e-5, 1e-4])
    codes, scale, zero = quantize_keys(base, bits, 32)
    deq = dequantize_keys(codes, scale, zero, bits, 32)
    assert torch.isfinite(deq).all()
    lo = base.amin(2, keepdim=True)
    _check_bound(base, deq, lo, zero.float().unsqueeze(2), scale.float().unsqueeze(2), bits,
                 f"near-constant bits={bits}")


# ----------------------------------------------------------------------------- padding
@pytest.mark.parametrize("poison", [6e4, -6e4, float("inf"), float("nan")])
@pytest.mark.parametrize("bits", BITS)
def test_key_padding_excluded_from_minmax(bits, poison):
    B, H, G, D = 3, 2, 32, 16
    T = 3 * G
    k = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(bits)).half()
    starts = torch.tensor([0, 5, 70])  # seq 2: group 0 all padding, group 2 partly padding
    valid = torch.arange(T)[None, :] >= starts[:, None]  # [B, T]
    clean = k.clone()
    k[~valid[:, None, :, None].expand_as(k)] = poison
    before = k.clone()
    codes, scale, zero = quantize_keys(k, bits, G, valid)
    assert torch.equal(k.view(torch.int16), before.view(torch.int16)), "input modified"
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all(), "padding leaked in"
    # Valid tokens' groups: same scale/zero as a min/max over the valid tokens only.
    for b in range(B):
        for g in range(T // G):
            sl = slice(g * G, (g + 1) * G)
            ok = valid[b, sl]
            if not ok.any():
                assert (scale[b, :, g] == 0).all() and (zero[b, :, g] == 0).all(), (
                    f"fully padded group b={b} g={g}: scale {scale[b, :, g].unique()}, "
                    f"zero {zero[b, :, g].unique()}")
                continue
            x = clean[b, :, sl][:, ok].float()  # [H, n_valid, D]
            _lo, want_scale, want_zero = _expected_qparams(x, bits, dim=1)
            assert torch.equal(zero[b, :, g], want_zero.squeeze(1)), f"zero b={b} g={g}"
            assert torch.equal(scale[b, :, g], want_scale.squeeze(1)), f"scale b={b} g={g}"
    # Codes of valid tokens are those of the clean tensor with the same mask; padding -> 0.
    clean_codes = quantize_keys(clean, bits, G, valid)[0]
    assert torch.equal(codes, clean_codes), "padding values changed codes"
    assert torch.isfinite(dequantize_keys(codes, scale, zero, bits, G)).all()
    # Raw codes (scale 1, zero 0): padding tokens hold code 0.
    raw = dequantize_keys(codes, torch.ones_like(scale), torch.zeros_like(zero), bits, G)
    padded = ~valid[:, None, :, None].expand_as(raw)
    assert (raw[padded] == 0).all(), f"padding codes {raw[padded].unique().tolist()}"


@pytest.mark.parametrize("bits", BITS)
def test_value_padding_gives_zero_params(bits):
    B, H, T, D, G = 2, 2, 32, 64, 32
    v = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(bits)).bfloat16()
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :4] = False
    poisoned = v.clone()
    poisoned[1, :, :4] = float("inf")
    codes, scale, zero = quantize_values(poisoned, bits, 32, G, valid)
    assert (scale[1, :, :4] == 0).all() and (zero[1, :, :4] == 0).all()
    ref_codes, ref_scale, _ref_zero = quantize_values(v, bits, 32, G)
    assert torch.equal(scale[0], ref_scale[0]) and torch.equal(scale[1, :, 4:], ref_scale[1, :, 4:])
    assert torch.equal(codes[0], ref_codes[0])
    # Raw codes (scale 1, zero 0): padding tokens hold 0, valid tokens the unpadded codes.
    ones, zeros = torch.ones_like(scale), torch.zeros_like(zero)
    raw = dequantize_values(codes, ones, zeros, bits, 32, G)
    ref_raw = dequantize_values(ref_codes, ones, zeros, bits, 32, G)
    assert (raw[1, :, :4] == 0).all(), raw[1, :, :4].unique()
    assert torch.equal(raw[1, :, 4:], ref_raw[1, :, 4:])


def test_minmax_qparams_all_invalid():
    x = torch.randn(2, 8)
    scale, zero = minmax_qparams(x, 4, dim=1, valid=torch.zeros(2, 1, dtype=torch.bool))
    assert (scale == 0).all() and (zero == 0).all()


# ----------------------------------------------------------------------------- dtypes/errors
@pytest.mark.parametrize("bits", BITS)
def test_dtypes_agree_on_fp16_representable_input(bits):
    # The same numbers in fp16, bf16-representable fp16 and fp32 give identical codes and params.
    k = (torch.randint(-64, 64, (1, 2, 64, 32)).float() / 8)  # exact in all three dtypes
    outs = [quantize_keys(k.to(dt), bits, 32) for dt in DTYPES]
    for dt, o in zip(DTYPES[1:], outs[1:]):
        for a, b, name in zip(outs[0], o, ("codes", "scale", "zero")):
            assert torch.equal(a, b), f"{name} differ between float16 and {dt}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_dtype(dtype):
    k = torch.randn(1, 1, 32, 64)
    out = dequantize_keys(*quantize_keys(k, 4, 32), 4, 32, dtype=dtype)
    assert out.dtype == dtype
    out = dequantize_values(*quantize_values(k, 4, 32, 32), 4, 32, 32, dtype=dtype)
    assert out.dtype == dtype


def test_key_token_count_not_multiple_of_group():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quantize_keys(torch.randn(1, 1, 33, 64), 2, 32)


@pytest.mark.parametrize("D,Gv", [(80, 32), (100, 32), (40, 32), (24, 16), (100, 64)])
def test_values_with_a_shorter_last_group(D, Gv):
    """Gv not dividing D (KIVI's 32-channel groups at head_dim 80 or 100): ceil(D / Gv) groups,
    each, the short last one included, exactly what quantizing its channels alone gives (its
    min / max never see the zero padding), padding tokens excluded as before."""
    torch.manual_seed(D + Gv)
    v = torch.randn(2, 2, 64, D) * torch.linspace(0.5, 4.0, D) + 20.0  # > 0: a padded 0 would
    valid = torch.ones(2, 64, dtype=torch.bool)                        # set the last group's min
    valid[1, :20] = False
    codes, scale, zero = quantize_values(v, 4, Gv, 32, valid)
    n = -(-D // Gv)
    assert scale.shape == zero.shape == (2, 2, 64, n)
    deq = dequantize_values(codes, scale, zero, 4, Gv, 32)
    for j in range(n):
        part = v[..., j * Gv:(j + 1) * Gv].contiguous()
        c1, s1, z1 = quantize_values(part, 4, part.shape[-1], 32, valid)
        assert torch.equal(scale[..., j], s1[..., 0]) and torch.equal(zero[..., j], z1[..., 0])
        assert torch.equal(deq[..., j * Gv:(j + 1) * Gv],
                           dequantize_values(c1, s1, z1, 4, part.shape[-1], 32))
    err = (deq - v)[valid[:, None, :, None].expand_as(v)].abs().max()
    assert err <= 0.6 * scale.float().max() + 1e-3  # half a step (+ FP16 rounding)


def test_value_token_count_not_multiple_of_group():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        quantize_values(torch.randn(1, 1, 33, 64), 2, 32, 32)


def test_zero_tokens_give_empty_outputs():
    """T = 0 is a multiple of G: keys gave empty codes / scales / zeros, values raised "cannot
    reshape tensor of 0 elements" (ungroup's reshape to -1 was ambiguous with no elements)."""
    x = torch.randn(2, 3, 0, 80)
    codes, scale, zero = quantize_keys(x, 2, 32)
    assert codes.shape == scale.shape == zero.shape == (2, 3, 0, 80)
    assert dequantize_keys(codes, scale, zero, 2, 32).shape == (2, 3, 0, 80)
    codes, scale, zero = quantize_values(x, 2, 32, 32, torch.ones(2, 0, dtype=torch.bool))
    assert codes.shape == (2, 3, 0, 80) and scale.shape == zero.shape == (2, 3, 0, 3)
    assert dequantize_values(codes, scale, zero, 2, 32, 32).shape == (2, 3, 0, 80)


# Were ZeroDivisionError, a reshape RuntimeError or a tuple-unpacking error (the kernels named
# the argument already; on the CPU ops take this path).
@pytest.mark.parametrize("call,match", [
    (lambda: quantize_keys(torch.randn(1, 1, 32, 64), 2, 0), "group_size must be a positive int"),
    (lambda: quantize_keys(torch.randn(1, 1, 32, 64), 2, -32),
     "group_size must be a positive int"),
    (lambda: quantize_keys(torch.randn(1, 32, 64), 2, 32), r"k must be \[B, H, T, D\]"),
    (lambda: quantize_keys(torch.randn(1, 1, 32, 64), 2, 32, torch.ones(1, 16, dtype=torch.bool)),
     r"valid must be a bool \[B, T\] = \[1, 32\]"),
    (lambda: quantize_keys(torch.randn(1, 1, 32, 64), 5, 32), r"bits must be one of \(2, 3, 4, 8\)"),
    (lambda: quantize_keys(torch.randn(1, 1, 32, 64), 2.0, 32),
     r"bits must be one of \(2, 3, 4, 8\), got 2.0"),
    (lambda: quantize_values(torch.randn(1, 1, 32, 64), 2, 0, 32),
     r"value_group must be an int in \[1, head_dim=64\], got 0"),
    (lambda: quantize_values(torch.randn(1, 1, 32, 64), 2, 65, 32),
     r"value_group must be an int in \[1, head_dim=64\], got 65"),
    (lambda: quantize_values(torch.randn(1, 1, 32, 64), 2, 32, 0),
     "group_size must be a positive int"),
    (lambda: dequantize_keys(torch.zeros(1, 1, 2, 64, dtype=torch.int32), torch.zeros(1, 1, 1, 64),
                             torch.zeros(1, 1, 1, 64), 2, 0), "group_size must be a positive int"),
    (lambda: dequantize_values(torch.zeros(1, 1, 2, 64, dtype=torch.int32),
                               torch.zeros(1, 1, 32, 2), torch.zeros(1, 1, 32, 2), 2, 0, 32),
     r"value_group must be an int in \[1, head_dim=64\]"),
], ids=["keys-G0", "keys-G-32", "keys-3d", "keys-valid-shape", "keys-bits5", "keys-bits-float", "values-Gv0",
        "values-Gv65", "values-G0", "dequant-keys-G0", "dequant-values-Gv0"])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_scales_of_another_shape_are_refused_by_name():
    """dequantize_*'s scale / zero must match the codes: a keys' zero of one group broadcast
    over two silently, value scales of another channel grouping (value_group 16 against 8)
    likewise, as did another batch; fewer code rows than the scales need, or value scales of
    a token count that is not whole groups, failed in a reshape."""
    x = torch.randn(1, 2, 64, 16)
    kc, ks, kz = quantize_keys(x, 4, 32)
    vc, vs, vz = quantize_values(x, 4, 8, 32)
    for call, match in (
            (lambda: dequantize_keys(kc, ks, kz[:, :, :1], 4, 32),
             (r"dequantize_keys: zero must be \[1, 2, 2, 16\] for codes \[1, 2, 8, 16\], got "
              r"\[1, 2, 1, 16\]")),
            (lambda: dequantize_keys(kc, ks[..., :8], kz[..., :8], 4, 32), "scale must be"),
            (lambda: dequantize_keys(kc, ks[0], kz[0], 4, 32), r"scale must be \[1, 2, n, 16\]"),
            (lambda: dequantize_keys(kc, ks.repeat(1, 1, 2, 1), kz.repeat(1, 1, 2, 1), 4, 32),
             "codes hold 8 rows of words, the 4 scale rows need 16"),
            (lambda: dequantize_values(vc, vs, vz, 4, 16, 32),
             r"scale must be \[1, 2, 64, 1\] for codes \[1, 2, 8, 16\], got \[1, 2, 64, 2\]"),
            (lambda: dequantize_values(vc, vs.expand(3, -1, -1, -1), vz.expand(3, -1, -1, -1), 4,
                                       8, 32), "scale must be"),
            (lambda: dequantize_values(vc, vs[:, :, :40], vz[:, :, :40], 4, 8, 32),
             "scale holds 40 tokens, not whole groups of group_size 32"),
            (lambda: dequantize_values(vc, vs.repeat(1, 1, 2, 1), vz.repeat(1, 1, 2, 1), 4, 8, 32),
             "codes hold 8 rows of words, the 128 scale rows need 16")):
        with pytest.raises(ValueError, match=match):
            call()
    spare = torch.cat([kc, torch.zeros_like(kc)], 2)  # codes with spare capacity still serve
    assert torch.equal(dequantize_keys(spare, ks, kz, 4, 32), dequantize_keys(kc, ks, kz, 4, 32))


def test_fp8_amax_refuses_an_unknown_granularity():
    """"tensr" (or "layer") was taken as "head" silently: one scale per head instead of one."""
    x = torch.randn(1, 2, 4, 8)
    for bad in ("tensr", "layer", None):
        with pytest.raises(ValueError, match="fp8_amax: granularity must be 'head' or 'tensor'"):
            fp8_amax(x, granularity=bad)
    assert (fp8_amax(x, granularity="tensor") == x.abs().max()).all()
