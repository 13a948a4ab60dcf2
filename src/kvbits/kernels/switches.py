"""On/off environment switches of the kernel modules (``KVBITS_GLUON_*``, ``KVBITS_SIDE_*``):
read once at import, ``'0'`` or ``'1'``, anything else refused there with the variable named,
so that a mistyped switch never silently measures the other variant."""

from __future__ import annotations

import os


def env_switch(var: str, default: str) -> bool:
    """``os.environ[var]`` (``default`` when unset) as a bool; a value other than ``'0'`` or
    ``'1'`` raises ``ValueError`` naming ``var``."""
    value = os.environ.get(var, default)
    if value not in ("0", "1"):
        raise ValueError(f"{var} must be '0' or '1', got {value!r}")
    return value == "1"
