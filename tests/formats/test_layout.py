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
