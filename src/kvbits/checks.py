"""Argument checks shared by the evaluation functions: a count that is not an integer (a float,
a bool, None) or below its least value fails here by name, not later in ``range`` or a reshape."""

from __future__ import annotations


def is_count(value, low: int = 1) -> bool:
    """Whether ``value`` is an integer (not a bool) >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def require_count(name: str, value, low: int = 1) -> None:
    """Raise ``ValueError`` naming ``name`` unless :func:`is_count`."""
    if not is_count(value, low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
