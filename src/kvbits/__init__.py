"""kvbits: 2-8 bit KV cache with fused Triton decode attention over the packed cache."""

from .spec import PRESETS, QuantSpec, resolve_spec

__all__ = ["PRESETS", "QuantSpec", "resolve_spec"]
__version__ = "0.1.0"
