"""Integrations with other libraries.

``kvbits.integrations.hf``: transformers ``Cache`` subclass (:class:`KVBitsCache`) and the
registered ``attn_implementation="kvbits"``. Importing it (or accessing ``KVBitsCache`` here)
imports transformers and registers the attention; importing this package alone does not.
"""

from __future__ import annotations

__all__ = ["KVBitsCache"]


def __getattr__(name: str):
    if name == "KVBitsCache":
        from .hf import KVBitsCache

        return KVBitsCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
