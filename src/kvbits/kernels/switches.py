"""Environment switches of the kernel and step modules (``KVBITS_GLUON_*``, ``KVBITS_SIDE_*``,
``KVBITS_MERGE``, ...): read once at import, each from its own set of values, anything else
refused there with the variable named, so that a mistyped switch never silently measures the
other variant."""

from __future__ import annotations

import os


def env_switch(var: str, default: str) -> bool:
    """``os.environ[var]`` (``default`` when unset) as a bool; a value other than ``'0'`` or
    ``'1'`` raises ``ValueError`` naming ``var``."""
    value = os.environ.get(var, default)
    if value not in ("0", "1"):
        raise ValueError(f"{var} must be '0' or '1', got {value!r}")
    return value == "1"


def env_choice(var: str, default: str, choices: tuple[str, ...]) -> str:
    """``os.environ[var]`` (``default`` when unset), one of ``choices``; another value raises
    ``ValueError`` naming ``var`` and the choices."""
    value = os.environ.get(var, default)
    if value not in choices:
        raise ValueError(f"{var} must be {', '.join(repr(c) for c in choices[:-1])} or "
                         f"{choices[-1]!r}, got {value!r}")
    return value


def env_count(var: str, default: int) -> int:
    """``os.environ[var]`` (``default`` when unset) as an integer >= 0; another value raises
    ``ValueError`` naming ``var``."""
    value = os.environ.get(var, str(default))
    if not value.isdigit():
        raise ValueError(f"{var} must be an integer >= 0, got {value!r}")
    return int(value)
