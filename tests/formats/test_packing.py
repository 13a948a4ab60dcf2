"""Tests for kvbits.formats.packing: the int32 slot-major layout every part of kvbits shares.

The layout contract is pinned twice: by hand-computed words for tiny inputs, and by an
independent pure-Python packer written from the module docstring (element ``e`` -> column
``e % W``, slot ``e // W``; fields for 2/4/8 bits, three bit planes for 3 bits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbits.formats.packing import pack_bits, packed_length, slots_per_column, unpack_bits

BITS = (2, 3, 4, 8)
LENGTHS = (1, 5, 16, 31, 32, 33, 97, 128, 1027)


def _to_int32(u: int) -> int:
    """Unsigned 32-bit word -> the int32 value torch stores."""
    return u - (1 << 32) if u >= 1 << 31 else u


def _pack_py(codes: list[int], bits: int) -> list[int]:
    """The layout contract in plain Python ints, independent of the torch implementation."""
    slots = 32 if bits == 3 else 32 // bits
    cols = -(-len(codes) // slots)
    if bits == 3:
        words = [0] * (3 * cols)
        for e, c in enumerate(codes):
            w, s = e % cols, e // cols
            for j in range(3):
                words[j * cols + w] |= ((c >> j) & 1) << s
    else:
        words = [0] * cols
        for e, c in enumerate(codes):
            words[e % cols] |= c << ((e // cols) * bits)
    return [_to_int32(w) for w in words]


def _random_codes(shape, bits, seed=0, dtype=torch.uint8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=g).to(dtype)


def _assert_equal_codes(got, want, what):
    if not torch.equal(got, want):
        diff = (got.long() != want.long()).nonzero()
        first = tuple(diff[0].tolist())
        raise AssertionError(
            f"{what}: {diff.shape[0]} of {want.numel()} codes differ; first at {first}: "
            f"got {int(got[first])}, want {int(want[first])}")


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_round_trip_every_axis(bits, n, axis):
    shape = [3, 2, 4]
    shape[axis] = n
    codes = _random_codes(shape, bits, seed=n * 10 + bits)
    before = codes.clone()
    words = pack_bits(codes, bits, dim=axis)
    assert words.dtype == torch.int32, words.dtype
    want_shape = list(shape)
    want_shape[axis] = packed_length(n, bits)
    assert list(words.shape) == want_shape, f"packed shape {list(words.shape)} != {want_shape}"
    assert words.is_contiguous()
    back = unpack_bits(words, bits, n, dim=axis)
    assert back.dtype == torch.uint8
    _assert_equal_codes(back, codes, f"round trip bits={bits} n={n} axis={axis}")
    assert torch.equal(codes, before), "pack_bits modified its input"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_any_integer_dtype_packs_the_same(bits, dtype):
    codes = _random_codes((2, 97), bits, seed=bits)
    want = pack_bits(codes, bits)
    if dtype == torch.int8 and bits == 8:
        # Codes >= 128 wrap to negative int8 values: out of range, not silently repacked.
        with pytest.raises(ValueError, match="must lie in"):
            pack_bits(codes.to(dtype), bits)
        return
    got = pack_bits(codes.to(dtype), bits)
    assert torch.equal(got, want), f"{dtype} packs differently from uint8"


@settings(max_examples=60, deadline=None)
@given(data=st.data(), bits=st.sampled_from(BITS), ndim=st.integers(1, 4))
def test_round_trip_random_shapes(data, bits, ndim):
    shape = data.draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim), label="shape")
    axis = data.draw(st.integers(-ndim, ndim - 1), label="axis")
    shape[axis] = data.draw(st.integers(1, 300), label="n")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    codes = _random_codes(shape, bits, seed=seed)
    words = pack_bits(codes, bits, dim=axis)
    n = shape[axis]
    assert words.shape[axis] == packed_length(n, bits)
    other = [s for i, s in enumerate(words.shape) if i != axis % ndim]
    assert other == [s for i, s in enumerate(shape) if i != axis % ndim], "other dims changed"
    _assert_equal_codes(unpack_bits(words, bits, n, dim=axis), codes,
                        f"round trip shape={shape} axis={axis} bits={bits}")


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BITS), n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_words_match_python_reference_layout(bits, n, seed):
    codes = _random_codes((n,), bits, seed=seed)
    got = pack_bits(codes, bits).tolist()
    want = _pack_py(codes.tolist(), bits)
    assert got == want, f"bits={bits} n={n}: words {got} != contract {want}"


# ----------------------------------------------------------------------------- lengths
@pytest.mark.parametrize("n,bits,want", [
    (1, 2, 1), (16, 2, 1), (17, 2, 2), (32, 2, 2), (97, 2, 7), (1027, 2, 65),
    (1, 4, 1), (8, 4, 1), (9, 4, 2), (128, 4, 16), (1027, 4, 129),
    (1, 8, 1), (4, 8, 1), (5, 8, 2), (128, 8, 32), (1027, 8, 257),
    (1, 3, 3), (32, 3, 3), (33, 3, 6), (64, 3, 6), (97, 3, 12), (128, 3, 12), (1027, 3, 99),
])
def test_packed_length(n, bits, want):
    assert packed_length(n, bits) == want, f"packed_length({n}, {bits})"


@pytest.mark.parametrize("bits,want", [(2, 16), (3, 32), (4, 8), (8, 4)])
def test_slots_per_column(bits, want):
    assert slots_per_column(bits) == want


@pytest.mark.parametrize("bits", BITS)
def test_exact_bits_per_element_for_full_columns(bits):
    # 32 * slots codes fill whole words exactly: bits per element == bits.
    n = 32 * slots_per_column(bits)
    assert packed_length(n, bits) * 32 == n * bits


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 5, 31, 33, 97])
def test_padding_slots_are_zero(bits, n):
    codes = torch.full((n,), (1 << bits) - 1, dtype=torch.uint8)
    words = pack_bits(codes, bits)
    full = slots_per_column(bits) * (packed_length(n, bits) // (3 if bits == 3 else 1))
    back = unpack_bits(words, bits, full)
    assert torch.equal(back[:n], codes)
    assert not back[n:].any(), f"padding slots hold {back[n:].tolist()}"


# ----------------------------------------------------------------------------- sign bit
@pytest.mark.parametrize("bits", BITS)
def test_top_slot_sign_bit_round_trips(bits):
    slots = slots_per_column(bits)
    cols = 2
    n = slots * cols
    top = 1 << (bits - 1)  # only the code's top bit: lands in bit 31 of its word
    codes = torch.zeros(n, dtype=torch.uint8)
    codes[(slots - 1) * cols] = top  # last slot of column 0
    codes[-1] = (1 << bits) - 1  # last slot of column 1: all ones at the top
    words = pack_bits(codes, bits)
    assert words.dtype == torch.int32
    if bits == 3:
        # Plane 2 of column 0 holds the top bit of slot 31 at bit 31.
        assert words[2 * cols + 0].item() == -(2**31), words.tolist()
    else:
        assert words[0].item() == -(2**31), f"word 0 = {words[0].item()}, expected INT32_MIN"
        assert words[1].item() < 0
    assert torch.equal(unpack_bits(words, bits, n), codes)


@pytest.mark.parametrize("bits", BITS)
def test_all_ones_is_minus_one(bits):
    n = slots_per_column(bits)  # one column: 1 word, or 3 bit planes for 3 bits
    codes = torch.full((n,), (1 << bits) - 1, dtype=torch.uint8)
    words = pack_bits(codes, bits)
    assert (words == -1).all(), words.tolist()
    assert torch.equal(unpack_bits(words, bits, n), codes)


# ----------------------------------------------------------------------------- hand examples
def test_hand_example_2bit():
    # N = 20 two-bit codes: 16 slots per word -> W = 2 columns; element e -> word e % 2,
    # slot e // 2 at bits [2 * slot, 2 * slot + 2).
    codes = torch.zeros(20, dtype=torch.uint8)
    codes[0], codes[1], codes[2], codes[19] = 1, 2, 3, 1
    # word 0: e=0 slot 0 -> 1; e=2 slot 1 -> 3 << 2 = 12            => 13
    # word 1: e=1 slot 0 -> 2; e=19 slot 9 -> 1 << 18 = 262144       => 262146
    assert pack_bits(codes, 2).tolist() == [13, 262146]
    assert torch.equal(unpack_bits(torch.tensor([13, 262146], dtype=torch.int32), 2, 20), codes)


def test_hand_example_2bit_sign():
    # N = 16: one word; e=15 (slot 15, bits 30-31) = 0b10 -> bit 31 only = INT32_MIN.
    codes = torch.zeros(16, dtype=torch.uint8)
    codes[15] = 2
    assert pack_bits(codes, 2).tolist() == [-(2**31)]


def test_hand_example_4bit_and_8bit():
    # 4 bits, N = 9: 8 slots -> W = 2; e=8 -> word 0, slot 4 -> 15 << 16.  e=3 -> word 1, slot 1.
    codes = torch.zeros(9, dtype=torch.uint8)
    codes[8], codes[3] = 15, 7
    assert pack_bits(codes, 4).tolist() == [15 << 16, 7 << 4]
    # 8 bits, N = 6: 4 slots -> W = 2; e=5 -> word 1 slot 2 -> 0xAB << 16; e=0 -> word 0 slot 0.
    codes = torch.zeros(6, dtype=torch.uint8)
    codes[5], codes[0] = 0xAB, 0xFF
    assert pack_bits(codes, 8).tolist() == [0xFF, 0xAB << 16]


def test_hand_example_3bit_one_column():
    # N = 32: one column of 32 slots stored as 3 bit-plane words; word j holds bit j of code s
    # at bit position s.
    codes = torch.zeros(32, dtype=torch.uint8)
    codes[0], codes[1], codes[31] = 5, 2, 7  # 0b101, 0b010, 0b111
    # plane 0: bit 0 of codes 0 and 31 -> 1 + 2^31; plane 1: codes 1, 31 -> 2 + 2^31;
    # plane 2: codes 0, 31 -> 1 + 2^31.
    want = [_to_int32(1 + 2**31), _to_int32(2 + 2**31), _to_int32(1 + 2**31)]
    assert want == [-2147483647, -2147483646, -2147483647]
    assert pack_bits(codes, 3).tolist() == want
    assert torch.equal(unpack_bits(torch.tensor(want, dtype=torch.int32), 3, 32), codes)


def test_hand_example_3bit_two_columns():
    # N = 40: W = 2 columns, 6 words; plane j of column w is word j * 2 + w;
    # element e -> column e % 2, slot e // 2.
    codes = torch.zeros(40, dtype=torch.uint8)
    codes[3] = 4   # 0b100: column 1, slot 1 -> plane 2 (word 5), bit 1 -> 2
    codes[38] = 3  # 0b011: column 0, slot 19 -> planes 0 and 1 (words 0 and 2), bit 19
    assert pack_bits(codes, 3).tolist() == [2**19, 0, 2**19, 0, 0, 2]


def test_pack_along_dim0_keeps_columns_contiguous():
    # Packing along tokens (dim -2) of [T, D] must pack each channel independently.
    codes = torch.zeros(20, 3, dtype=torch.uint8)
    codes[19, 2] = 1
    words = pack_bits(codes, 2, dim=0)
    assert words.shape == (2, 3)
    assert words.tolist() == [[0, 0, 0], [0, 0, 1 << 18]]


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", ["negative", "too_big"])
def test_codes_out_of_range(bits, bad):
    codes = torch.zeros(40, dtype=torch.int32)
    codes[17] = -1 if bad == "negative" else 1 << bits
    with pytest.raises(ValueError, match=rf"\[0, {1 << bits}\)"):
        pack_bits(codes, bits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32,
                                   torch.complex64])
def test_float_codes_rejected(dtype):
    with pytest.raises(TypeError, match="integer"):
        pack_bits(torch.zeros(16, dtype=dtype), 2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_word_count(bits, delta):
    n = 97
    words = torch.zeros(2, packed_length(n, bits) + delta, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"{n} codes of {bits} bits need"):
        unpack_bits(words, bits, n)


def test_unpack_rejects_non_int32_words():
    with pytest.raises(TypeError, match="int32"):
        unpack_bits(torch.zeros(4, dtype=torch.int64), 2, 64)


@pytest.mark.parametrize("bad", [0, 1, 5, 6, 7, 16, 32, 2.0, 4.0, True, "2", None])
def test_bad_bits(bad):
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), bad)
    with pytest.raises(ValueError, match="bits must be one of"):
        unpack_bits(torch.zeros(1, dtype=torch.int32), bad, 1)
    with pytest.raises(ValueError, match="bits must be one of"):
        packed_length(8, bad)


def test_empty_axis_rejected():
    with pytest.raises(ValueError, match="empty"):
        pack_bits(torch.zeros(3, 0, dtype=torch.uint8), 2, dim=1)


def test_axis_out_of_range_is_refused():
    """``dim=5`` on a 2-d tensor packed axis 1 silently; a 0-d tensor divided by zero."""
    codes = torch.zeros(4, 8, dtype=torch.uint8)
    for dim in (5, -3):
        with pytest.raises(ValueError, match=r"pack_bits: dim must be in \[-2, 2\)"):
            pack_bits(codes, 2, dim=dim)
    with pytest.raises(ValueError, match="for a 0-d tensor"):
        pack_bits(torch.tensor(1, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match=r"unpack_bits: dim must be in \[-2, 2\)"):
        unpack_bits(pack_bits(codes, 2), 2, 8, dim=2)


def test_bad_counts_and_axes_are_refused_by_name():
    """A negative code count gave 0 words (``unpack_bits`` then returned an empty axis for
    ``n=-1``), a float count a float length or a slicing TypeError, a float dim a tuple-index
    TypeError, and bits=2.0 a shift TypeError; all refused naming the parameter now."""
    for n in (-1, -33, 2.5, 8.0, True, None):
        with pytest.raises(ValueError, match=r"packed_length: n must be a non-negative int"):
            packed_length(n, 2)
        with pytest.raises(ValueError, match=r"unpack_bits: n must be a non-negative int"):
            unpack_bits(torch.zeros(2, 0 if n == -1 else 1, dtype=torch.int32), 2, n)
    codes = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pack_bits: dim must be in \[-2, 2\)"):
        pack_bits(codes, 2, dim=1.0)
    with pytest.raises(ValueError, match=r"unpack_bits: dim must be in \[-2, 2\)"):
        unpack_bits(pack_bits(codes, 2), 2, 8, dim=1.0)
    assert packed_length(0, 3) == 0 and packed_length(np.int64(33), 3) == 6  # NumPy ints count
