"""Fill a cache with given K/V without running the model over the prompt.

Benchmarks need caches holding a long context (a real prompt's K/V, or random K/V when only speed
matters) in every cache type they compare, without paying a model prefill per variant. These
helpers put K/V into each cache through the same calls a model prefill makes:

* :class:`~kvbits.integrations.hf.KVBitsCache`: ``layer.update(k, v)`` (the prefill update: the
  tokens are appended unquantized), then ``store.flush()`` and the "consumed by the kvbits
  attention" flag, exactly what the ``"kvbits"`` attention does after a prefill
  (``kvbits_attention_forward``; no padding). The quantization therefore runs through the real
  append path (``LayerStore.append`` / ``flush``: the Triton ``quantize_pack`` kernels on CUDA).
  Long contexts can be appended in chunks; each chunk is quantized as it arrives (whole groups,
  the last R..R+G-1 tokens stay FP16), as in chunked prefill.
* any other transformers ``Cache`` (``DynamicCache``, ``QuantizedCache``): ``cache.update(k, v,
  layer_idx)``, which is what its model calls at prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..checks import require_count

__all__ = ["append_kv", "compact_residual", "copy_dense_cache", "fill_random", "presize_store"]


def append_kv(cache, layer_idx: int, k: torch.Tensor, v: torch.Tensor, first: int = 0) -> None:
    """Append ``k, v [B, H_kv, T, D]`` to layer ``layer_idx`` as a prefill (chunk) would;
    ``first``: the position of the chunk's first token (transformers caches that index by
    ``cache_position``, e.g. ``StaticCache`` on older versions)."""
    layers = getattr(cache, "layers", None)
    # (a DynamicCache() without config makes its layers at their first update)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    if layer is not None and hasattr(layer, "store") and hasattr(layer, "_attended"):
        # KVBitsLayer: update (fast path: appended without quantizing, tagged for the attention),
        # then what kvbits_attention_forward does once it has consumed the update.
        if layer.store is not None and layer.store.seq_len:
            layer._attended = True  # the previous chunk was consumed: stay on the fast path
        layer.update(k, v)
        layer.store.flush()
        layer._attended = True
        return
    positions = torch.arange(first, first + k.shape[2], device=k.device)
    cache.update(k, v, layer_idx, {"cache_position": positions})


def copy_dense_cache(dense, cache) -> None:
    """Put the K/V held by a ``DynamicCache`` (e.g. after a real prefill) into ``cache``.

    For a :class:`KVBitsCache` the result is the state a prefill of the same tokens through the
    ``"kvbits"`` attention leaves (same K/V, quantized in one call, no padding). ``dense`` must
    hold every token of every layer: a ``DynamicCache(config=...)`` of a model with sliding
    layers (Mistral, Gemma 2/3) keeps only a window of them there, and copied as if they were the
    first tokens they would sit at wrong positions; prefill with ``DynamicCache()`` (full
    layers; the model still masks its windows), and the kvbits cache evicts by itself.
    """
    for i, layer in enumerate(dense.layers):
        seen = getattr(layer, "cumulative_length", None)
        if seen is not None and seen > layer.keys.shape[-2]:
            raise ValueError(
                f"copy_dense_cache: layer {i} of the dense cache is a sliding-window layer that "
                f"holds {layer.keys.shape[-2]} of its {seen} tokens; prefill with "
                "DynamicCache() (no config: full layers) to copy the whole history")
        append_kv(cache, i, layer.keys.clone(), layer.values.clone())


def fill_random(cache, num_layers: int, batch: int, kv_heads: int, head_dim: int, tokens: int,
                dtype=torch.float16, device="cuda", chunk: int = 8192,
                progress: Callable[[int], None] | None = None, seed: int = 0) -> None:
    """Fill every layer of ``cache`` with ``tokens`` random K/V tokens, ``chunk`` at a time.

    Speed does not depend on the values; the K/V are standard normal (keys get a few large
    channels, like real keys, so that per-channel quantization sees realistic ranges). Memory
    is bounded by one chunk of FP16 K/V of one layer on top of the cache.
    """
    for name, value, low in (("num_layers", num_layers, 1), ("tokens", tokens, 0),
                             ("chunk", chunk, 1)):  # (chunk=0 failed in range())
        require_count(f"fill_random: {name}", value, low)
    gen = torch.Generator(device=device).manual_seed(seed)
    for i in range(num_layers):
        for t0 in range(0, tokens, chunk):
            n = min(chunk, tokens - t0)
            shape = (batch, kv_heads, n, head_dim)
            k = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            k[..., :4] *= 8
            v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            append_kv(cache, i, k, v, first=t0)
            del k, v
        if progress is not None:
            progress(i)


def presize_store(store, tokens: int, residual: int = 0) -> None:
    """Allocate the packed-body buffers of a kvbits ``LayerStore`` for ``tokens`` tokens, and the
    FP16 residual for ``residual`` tokens, up front (:meth:`LayerStore.reserve`).

    ``LayerStore`` grows a buffer by 1/8 when an append does not fit (each growth copies it); a
    serving engine that knows the final length allocates once, and this is that allocation. The
    values still go through ``append``/``flush`` unchanged.
    """
    store.reserve(tokens, residual)


def compact_residual(store) -> None:
    """Shrink the FP16 residual buffers of a ``LayerStore`` to ``R + G`` tokens of capacity (what
    decoding one token at a time ever needs) when they are larger, e.g. after a pre-sized fill."""
    store.compact_residual()


def chunks(n: int, size: int) -> Iterable[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of at most ``size`` covering ``range(n)``."""
    for s in range(0, n, size):
        yield s, min(n, s + size)
