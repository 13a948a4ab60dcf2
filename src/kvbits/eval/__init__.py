"""Evaluation: perplexity through the cache, KV memory arithmetic, the HF QuantizedCache baseline.

* :func:`kvbits.eval.perplexity.perplexity` — text fed in chunks into a fresh cache per window.
* :func:`kvbits.eval.memory.kv_memory` — bytes per token, max context, max batch (no download).
* :func:`kvbits.eval.hf_baseline.hf_quantized_cache_factory` — transformers' ``QuantizedCache``
  (quanto / HQQ backends) as a ``make_cache`` for the same perplexity procedure.
"""

from __future__ import annotations

from .memory import MemoryReport, kv_memory, memory_table
from .perplexity import cache_nbytes, perplexity

__all__ = ["MemoryReport", "cache_nbytes", "kv_memory", "memory_table", "perplexity"]
