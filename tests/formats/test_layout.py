"""Tests for kvbits.formats.layout's helpers (the layout itself is exercised by the packing,
reference and kernel tests)."""

from __future__ import annotations

import pytest

from kvbits.formats.layout import body_bytes_per_token


@pytest.mark.parametrize("edit,match", [
    ({"key_axis": "chanel"}, "key_axis must be 'channel' or 'token', got 'chanel'"),
    ({"value_axis": None}, "value_axis must be 'channel' or 'token', got None"),
    ({"group_size": 0}, "group_size must be a positive int, got 0"),
    ({"value_group": 0}, r"value_group must be an int in \[1, head_dim=64\], got 0"),
    ({"value_group": 65}, r"value_group must be an int in \[1, head_dim=64\], got 65"),
    ({"outliers": -1}, "outliers must be an int >= 0"),
])
def test_body_bytes_per_token_refuses_bad_arguments_by_name(edit, match):
    """Were a KeyError ('chanel'), a ZeroDivisionError (group 0) or a smaller byte count than
    the plain layer's (outliers=-1: 42 bytes, not the 48 of no outliers)."""
    args = {"head_dim": 64, "key_bits": 2, "value_bits": 2, "group_size": 32, "value_group": 32}
    assert body_bytes_per_token(**args) == 48.0
    assert body_bytes_per_token(**args, outliers=1) == 54.0
    with pytest.raises(ValueError, match="body_bytes_per_token: " + match):
        body_bytes_per_token(**{**args, **edit})


@pytest.mark.parametrize("edit,match", [
    ({"key_bits": 5}, "key_bits must be one of 2, 3, 4, 8, got 5"),
    ({"value_bits": 1}, "value_bits must be one of 2, 3, 4, 8, got 1"),
    ({"key_bits": 2.0}, "key_bits must be one of 2, 3, 4, 8, got 2.0"),
    ({"value_bits": True}, "value_bits must be one of 2, 3, 4, 8, got True"),
    ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
    ({"fp8": True}, "fp8 needs key_bits == value_bits == 8, got 2 / 2"),
])
def test_body_bytes_per_token_names_bad_bits_and_head_dim(edit, match):
    """A bad width failed in packed_length as 'bits must be one of (2, 3, 4, 8), got 5' (key or
    value? from where?); head_dim 0 as a bad value_group; fp8 with 2-bit widths was counted as
    8-bit elements, silently."""
    args = {"head_dim": 64, "key_bits": 2, "value_bits": 2, "group_size": 32, "value_group": 32}
    assert body_bytes_per_token(**{**args, "key_bits": 8, "value_bits": 8, "fp8": True}) == 128
    with pytest.raises(ValueError, match="body_bytes_per_token: " + match):
        body_bytes_per_token(**{**args, **edit})
