"""Integrations with other libraries.

``kvbits.integrations.hf``: transformers ``Cache`` subclass (:class:`KVBitsCache`) and the
registered ``attn_implementation="kvbits"``. Importing it (or accessing ``KVBitsCache`` here)
imports transformers and registers the attention; importing this package alone does not.
``kvbits.integrations.graph_generate`` (module ``generate_loop``): ``model.generate(...,
custom_generate=graph_generate)``, ``generate`` with its decoding loop replayed from CUDA graphs.
"""

from __future__ import annotations

__all__ = ["KVBitsCache", "graph_generate"]


def __getattr__(name: str):
    if name == "KVBitsCache":
        from .hf import KVBitsCache

        return KVBitsCache
    if name == "graph_generate":
        from .generate_loop import graph_generate

        return graph_generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
