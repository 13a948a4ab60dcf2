"""Perplexity measured *through* a KV cache, the way generation uses it.

A perplexity from one full forward pass per window would never read the cache: every token would
attend to its history in full precision. Here the text is fed in chunks (``chunk_size`` tokens,
256 by default, down to 1) into a fresh cache per window, so every scored token attends to the
history exactly as the cache stores it (quantized body, FP16 residual and sink). The logits of a
chunk score the tokens that follow each of its positions (the last logit of a chunk scores the
first token of the next chunk); the first token of a window is never scored. FP16 goes through the
same procedure (the ``"fp16"`` preset of :class:`kvbits.integrations.hf.KVBitsCache`).

How a chunk sees its own tokens depends on the cache. :class:`KVBitsCache` attends each query row
of a chunk with the FP16/quantized split that row would see in token-by-token decoding, so the
chunk size barely matters (SmolLM2, kivi-2, 1024 tokens: 26.51 with chunks of 256, 26.44 with 64,
26.45 token by token); only the first chunk of a window is a prefill at full precision.
transformers' ``QuantizedCache`` attends a chunk's own keys in full precision and quantizes them
afterwards, which favours it more the larger the chunk.

Windows: a text longer than ``window`` tokens (default: the model's ``max_position_embeddings``,
capped at 8192) is cut into windows, each with its own fresh cache. By default they do not overlap
(``stride = window``), so every token but the first of each window is scored once, with between 1
and ``window - 1`` tokens of context. With ``stride < window`` windows start every ``stride``
tokens and each scores only the tokens that no earlier window scored (the classic strided
evaluation: more context per token, ``window / stride`` times the compute). A text that starts
with the model's BOS (Gemma) gets it before every later window as well, as context that is not
scored (such a model never runs without it), so those windows feed ``window + 1`` tokens.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import torch

from ..checks import require_count
from ..methods import starts_with_bos

__all__ = [ "cache_nbytes", "default_window", "perplexity", "plan_windows", "trained_positions"]

WINDOW_CAP = 8192  # the default window's upper bound (kvbits ppl --window)
# Scored tokens per recorded NLL sum (``nll_blocks``): the unit a paired bootstrap between two
# caches resamples (kvbits.eval.frontier.gap_interval), long enough to carry most of the
# correlation between neighbouring tokens, short enough for hundreds of blocks per table.
NLL_BLOCK = 16


def trained_positions(model) -> int | None:
    """The model's ``max_position_embeddings`` (text config), or None where it has none."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def default_window(model, cap: int = WINDOW_CAP) -> int:
    """The model's ``max_position_embeddings`` (text config), capped at ``cap``."""
    return int(min(trained_positions(model) or cap, cap))


def plan_windows(n_tokens: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """``(start, end, score_from)`` per window: tokens ``[start, end)`` are fed, and the tokens at
    positions ``[score_from, end)`` are scored (``score_from > start``: a window's first token has
    no context).

    >>> plan_windows(10, 4)
    [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    >>> plan_windows(10, 4, stride=2)
    [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    out, scored_to, start = [], 0, 0
    while True:
        end = min(start + window, n_tokens)
        if end - start < 2 and out:
            break
        out.append((start, end, max(start + 1, scored_to)))
        scored_to = end
        if end >= n_tokens:
            break
        start += stride
    return out


def reads_cache(n_tokens: int, chunk_size: int, window: int, stride: int | None = None) -> bool:
    """Whether any scored token comes from a chunk after its window's first, i.e. attends to
    history read back from the cache (the first chunk of a window is a full-precision prefill,
    so with one chunk per window every cache scores like FP16).

    A window's last token scores nothing, so a second chunk that holds only it reads the cache
    for no scored token (``chunk_size + 1`` tokens do not; QA, session 59).

    >>> reads_cache(256, 256, 8192), reads_cache(257, 256, 8192), reads_cache(1024, 256, 8192)
    (False, False, True)
    """
    return any(end - start > chunk_size + 1
               for start, end, _ in plan_windows(n_tokens, window, stride))


@torch.no_grad()
def perplexity(model, input_ids: torch.Tensor, make_cache: Callable[[], object],
               chunk_size: int = 256, window: int | None = None, stride: int | None = None,
               progress: bool = True, desc: str | None = None) -> dict:
    """Perplexity of ``input_ids`` with the KV cache that ``make_cache()`` returns.

    Args:
        model: a transformers causal LM (eval mode).
        input_ids: ``[1, T]`` int64 token ids.
        make_cache: called once per window for a fresh cache, e.g.
            ``lambda: KVBitsCache(model, "kivi-2")`` or an HF ``QuantizedCache`` factory
            (:func:`kvbits.eval.hf_baseline.hf_quantized_cache_factory`).
        chunk_size: tokens fed per forward pass (1 = token by token, as in decoding).
        window, stride: see the module docstring; ``window=None`` uses :func:`default_window`.
        progress: show a tqdm bar over chunks.

    Returns:
        a dict with ``ppl``, ``nll_sum`` (natural log), ``tokens_scored``, ``tokens``,
        ``windows``, ``window``, ``stride``, ``chunk_size``, ``cache_bytes`` (exact bytes the
        cache held at the end of the first window, in the model's dtype),
        ``cache_bytes_fp16`` (the same cache if the model ran in FP16: FP parts at 2 bytes per
        element), ``fp16_cache_bytes`` (what an FP16 ``DynamicCache`` would hold for the first
        window), ``cache_elements`` (the K/V elements the cache held then:
        :func:`cache_elements`), ``nll_blocks`` (the NLL summed over each ``nll_block`` =
        :data:`NLL_BLOCK` scored tokens in scoring order, the last block shorter: the same
        tokens, so the same blocks, for every cache of one text), ``seconds`` and
        ``tokens_per_second``.

    >>> perplexity(model, ids, lambda: KVBitsCache(model, "kivi-4"))["ppl"]  # doctest: +SKIP
    20.395...
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    require_count("chunk_size", chunk_size)  # (True ran as 1; a float failed in a slice)
    for name, value, low in (("window", window, 2), ("stride", stride, 1)):
        if value is not None:
            require_count(name, value, low)
    n = input_ids.shape[1]
    if n < 2:
        raise ValueError(f"need at least 2 tokens to score one, got {n}")
    window = default_window(model) if window is None else window
    plan = plan_windows(n, window, stride)
    # (stacklevel 3: the caller's line, past torch.no_grad's wrapper)
    if not reads_cache(n, chunk_size, window, stride):
        warnings.warn(f"chunk_size {chunk_size} covers every window ({n} tokens, window "
                      f"{window}): each is one full-precision prefill, so the cache is never read "
                      "back and every cache scores like FP16; use smaller chunks", stacklevel=3)
    trained = trained_positions(model)
    if trained and min(window, n) > trained:  # scored anyway, as needle does
        warnings.warn(f"window {window} is past the {trained} positions the model was trained "
                      "for: perplexity there measures the model's extrapolation as much as the "
                      "cache", stacklevel=3)
    input_ids = input_ids.to(model.device)
    from ..integrations.hf import cache_kwargs

    # a text that starts with the BOS (Gemma) has it before every later window too: the model
    # never runs without it (kvbits.methods.starts_with_bos); it is context, never scored
    lead = input_ids[:, :1] if starts_with_bos(model, input_ids) else None
    seqs = [input_ids[:, s:e] if lead is None or s == 0
            else torch.cat([lead, input_ids[:, s:e]], 1) for s, e, _ in plan]
    n_chunks = sum(math.ceil(seq.shape[1] / chunk_size) for seq in seqs)
    bar = _progress(n_chunks, progress, desc)
    nll, scored, first, token_nll = 0.0, 0, {}, []
    t0 = time.perf_counter()
    for w, ((start, end, score_from), seq) in enumerate(zip(plan, seqs)):
        cache = make_cache()
        kw = cache_kwargs(model, cache)
        length, first_scored = seq.shape[1], score_from - end + seq.shape[1]  # in seq's places
        for c0 in range(0, length, chunk_size):
            c1 = min(c0 + chunk_size, length)
            logits = model(seq[:, c0:c1], use_cache=True, **kw).logits
            # logits[:, i] predicts seq's token c0 + i + 1: score those from first_scored on
            lo, hi = max(first_scored, c0 + 1), min(c1 + 1, length)
            if hi > lo:
                pred = logits[0, lo - 1 - c0:hi - 1 - c0].float()
                token_nll.append(torch.nn.functional.cross_entropy(
                    pred, seq[0, lo:hi], reduction="none").double().cpu())
                nll += token_nll[-1].sum().item()
                scored += hi - lo
            if scored:
                bar.set_postfix(ppl=f"{math.exp(nll / scored):.3f}", refresh=False)
            bar.update(1)
        if w == 0:
            first = _cache_sizes(cache, model, end - start)
        del cache
    bar.close()
    seconds = time.perf_counter() - t0
    return {
        "ppl": math.exp(nll / scored), "nll_sum": nll, "tokens_scored": scored, "tokens": n,
        "windows": len(plan), "window": window, "stride": stride or window,
        "chunk_size": chunk_size, **first, "nll_block": NLL_BLOCK,
        "nll_blocks": [round(b.sum().item(), 5) for b in torch.cat(token_nll).split(NLL_BLOCK)],
        "seconds": seconds,
        "tokens_per_second": sum(seq.shape[1] for seq in seqs) / seconds,
    }


def _progress(total: int, enabled: bool, desc: str | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc or "perplexity", unit="chunk",
                leave=False, dynamic_ncols=True)


def _cache_sizes(cache, model, tokens: int) -> dict:
    """Bytes held by ``cache`` (see :func:`cache_nbytes`) and by an FP16 DynamicCache
    (:func:`kvbits.eval.memory.fp16_cache_bytes`: ``window - 1`` tokens in a sliding layer)."""
    from .memory import fp16_cache_bytes

    return {"cache_bytes": cache_nbytes(cache), "cache_bytes_fp16": cache_nbytes(cache, fp16=True),
            "fp16_cache_bytes": fp16_cache_bytes(model.config, tokens),
            "cache_elements": cache_elements(cache)}


def cache_elements(cache) -> int | None:
    """K/V elements a cache holds (tokens held x KV heads x head dim x 2, layer by layer): the
    denominator of bits per element. Not tokens seen x layers: a sliding-window layer holds
    fewer, and a kvbits one more than ``DynamicCache`` keeps (up to a chunk, and its quantized
    groups ~1.25 windows). A KVBitsCache or a cache of dense ``keys``/``values``; None for
    others (transformers' ``QuantizedCache`` keeps its history packed)."""
    if hasattr(cache, "stores"):  # KVBitsCache
        return sum(2 * s.batch * s.kv_heads * s.seq_len * s.head_dim
                   for s in cache.stores if s is not None)
    layers = getattr(cache, "layers", [])
    if any(hasattr(layer, "_quantized_keys") for layer in layers):
        return None
    return sum(getattr(layer, name).numel() for layer in layers for name in ("keys", "values")
               if isinstance(getattr(layer, name, None), torch.Tensor))


def cache_nbytes(cache, fp16: bool = False) -> int:
    """Bytes held by a transformers cache: KVBitsCache, QuantizedCache (quanto, HQQ) or dynamic.

    ``fp16=True`` counts every floating-point element at 2 bytes (the size the cache would have
    in an FP16 model); integer codes are counted as stored.
    """
    if hasattr(cache, "stores"):  # KVBitsCache
        return _kvbits_nbytes(cache, fp16)
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += _tensor_bytes(getattr(layer, name, None), fp16)
    return total


def _kvbits_nbytes(cache, fp16: bool) -> int:
    if not fp16:
        return cache.nbytes()
    return sum(s.nbytes(fp_itemsize=2) for s in cache.stores if s is not None)


def _tensor_bytes(obj, fp16: bool) -> int:
    """Bytes of the tensors in ``obj``: a tensor (quanto QTensors through their inner tensors),
    or a tuple / list / dict of them (HQQ keeps ``(codes, meta)``)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = flatten()
            return sum(_tensor_bytes(getattr(obj, name), fp16) for name in names)
        size = 2 if fp16 and obj.is_floating_point() else obj.element_size()
        return obj.numel() * size
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, fp16) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(v, fp16) for v in obj)
    return 0
