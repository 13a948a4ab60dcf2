"""Argument checks shared across the package: an integer argument given as a float, a bool, a
string or None fails here by name, not later in ``range``, a reshape or a comparison (and a float
is never truncated silently)."""

from __future__ import annotations

import operator


def as_int(value) -> int | None:
    """``value`` as an int when it is an integer (Python, numpy or 0-d torch integer; not a
    bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_count(value, low: int = 1) -> bool:
    """Whether ``value`` is an integer (not a bool) >= ``low``."""
    n = as_int(value)
    return n is not None and n >= low


def require_count(name: str, value, low: int = 1) -> int:
    """``value`` as an int >= ``low``, else ``ValueError`` naming ``name``."""
    if not is_count(value, low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return as_int(value)


def repeated(values) -> list:
    """The values given more than once, sorted: a repeated item ran its cells twice (a needle
    length counted its trials twice, a preset came out as a second identical row)."""
    values = list(values)
    return sorted({v for v in values if values.count(v) > 1})
