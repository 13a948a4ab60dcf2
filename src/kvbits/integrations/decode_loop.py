"""Greedy or sampled decoding of a transformers causal LM, each decode step replayed from a
CUDA graph.

Why: at batch 1, eager ``generate`` is bound by host time (20-60 ms of Python and launches per
step against 3-4 ms of GPU work on an H200 for a 7-8B model; ``benchmarks/results/e2e.md``), so
neither FP16 nor kvbits shows its GPU speed. A captured step replays every kernel of the forward
without the host. Steps of the same *kind* launch the same kernels with the same arguments, so
each kind is captured once (after one eager run, which compiles its kernels) and replayed:

* :class:`~kvbits.integrations.hf.KVBitsCache`: the lengths live on the device
  (:meth:`~kvbits.integrations.hf.KVBitsCache.begin_device_lengths`; the flush is of a fixed
  size at a device offset), so there are two kinds, a plain step and a flushing step (every G
  steps, known on the host); a cache that cannot yet (a sink not full) decodes eagerly;
* transformers' ``StaticCache`` (the FP16 baseline): one kind;
* any other cache: every step eagerly (same loop, for comparisons).

The next token is chosen inside the graph (``argmax``, or a draw with ``sampling=``:
:mod:`~kvbits.integrations.sampling`) and feeds the next step's input, so a replayed step does
not touch the host. ``graphs=False`` runs the same steps eagerly (CPU, tests).
``fuse="inductor"`` also compiles the step's norms, MLP activations and RoPE application
(:mod:`~kvbits.integrations.fused_pointwise`) while decoding: fewer, fused kernels per step.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .fused_pointwise import check_backend, fused_pointwise
from .hf import KVBitsCache, cache_kwargs
from .sampling import Sampling, next_token


def model_gpus(model) -> list[str]:
    """The CUDA devices that hold ``model``'s parameters, sorted."""
    return sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})


def check_one_gpu(model) -> None:
    """CUDA graphs capture one device's stream: a model spread over GPUs
    (``device_map="auto"``) cannot be captured whole. Refuse it clearly instead of failing
    inside the capture."""
    devices = model_gpus(model)
    if len(devices) > 1:
        raise ValueError(f"GreedyDecoder: graphs=True needs the model on one GPU, got its "
                         f"parameters on {', '.join(devices)}; pass graphs=False (eager steps) "
                         "or load the model on one device")


def is_stop(tokens: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """Whether each of ``tokens`` is one of the ``stop`` ids (a 1-D tensor): a bool tensor of
    ``tokens``' shape (fixed-shape device ops, so a captured step can hold it)."""
    return (tokens[..., None] == stop).any(-1)


class GreedyDecoder:
    """``GreedyDecoder(model, cache).generate(input_ids, n)`` -> ``[B, n]`` new token ids.

    ``step_done`` (optional callable) is called after every step with the number of tokens
    produced so far (timing hooks); ``captures`` counts the CUDA graphs captured. ``fuse``: a
    ``torch.compile`` backend for the decode steps' elementwise work (``"inductor"``), or None
    (the model as it is). ``sampling``: a :class:`~kvbits.integrations.sampling.Sampling`
    (temperature, top-k, top-p; seed with ``torch.manual_seed``) instead of greedy choice.
    ``repetition_penalty``: transformers' (the tokens seen, prompt included, its left padding
    not, as a device mask updated inside the step). Stop tokens, a minimum of new tokens and
    left padding are arguments of :meth:`generate` (``model.generate(...,
    custom_generate=graph_generate)``, :mod:`~kvbits.integrations.generate_loop`, maps
    ``generate``'s options onto them)."""

    def __init__(self, model, cache, *, graphs: bool = True, step_done=None,
                 fuse: str | None = None, sampling: Sampling | None = None,
                 repetition_penalty: float = 1.0):
        if fuse is not None:
            check_backend(fuse, "GreedyDecoder: fuse (or None)")
        if not repetition_penalty > 0:
            raise ValueError(f"GreedyDecoder: repetition_penalty must be > 0 (1: none), got "
                             f"{repetition_penalty}")
        self.repetition_penalty = float(repetition_penalty)
        self.model, self.cache = model, cache
        self.graphs = graphs
        self.fuse = fuse
        self.sampling = sampling
        self.step_done = step_done
        self.captures = 0
        self._kw = cache_kwargs(model, cache)
        self._stop = None  # stop token ids of the current decode (decode's stop_tokens)
        self._min_new = 0  # ... not chosen before this many new tokens (min_new_tokens)
        self._seen = None  # [B, V] tokens of the prompt and so far (repetition_penalty)

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def _step(self) -> None:
        """One token for every sequence, reading and writing only device buffers."""
        out = self.model(input_ids=self._ids, position_ids=self._pos, cache_position=self._cpos,
                         use_cache=True, logits_to_keep=1, **self._kw)
        nxt = next_token(self._shaped(out.logits[:, -1], self._count), self.sampling)
        if self._stop is not None:  # sequences that produced a stop token are done
            self._live &= ~is_stop(nxt, self._stop)
        if self._seen is not None:
            self._seen.scatter_(1, nxt, True)
        self._ids.copy_(nxt)
        self.tokens.scatter_(1, self._count.expand(nxt.shape[0], 1), nxt)
        self._count.add_(1)
        self._pos.add_(1)
        self._cpos.add_(1)

    def _shaped(self, logits: torch.Tensor, produced) -> torch.Tensor:
        """``logits`` as transformers' processors leave them before the choice: tokens already
        in the sequence (prompt included) divided by ``repetition_penalty`` where positive,
        multiplied where negative (in float32); the stop tokens at -inf while fewer than
        ``min_new_tokens`` tokens were produced before this one (``produced``: an int, or a
        ``[1, 1]`` device count inside the captured step)."""
        if self._seen is not None:  # (in float32, as transformers' processors: in the model's
            p = self.repetition_penalty  # half precision the rounding changes close choices)
            logits = logits.float()
            logits = torch.where(self._seen[:, :-1],
                                 torch.where(logits < 0, logits * p, logits / p), logits)
        if self._min_new <= 0 or self._stop is None:
            return logits
        banned = logits.index_fill(-1, self._stop, float("-inf"))
        if isinstance(produced, int):
            return banned if produced < self._min_new else logits
        return torch.where(produced < self._min_new, banned, logits)

    def _capture(self):
        graph = torch.cuda.CUDAGraph()
        kvbits = isinstance(self.cache, KVBitsCache)
        if kvbits:
            self.cache._capturing = True  # the Python runs, the step does not: no host counts
        try:
            with torch.cuda.graph(graph):  # own pool per graph: the kinds replay in any order
                self._step()
        finally:
            if kvbits:
                self.cache._capturing = False
        self.captures += 1
        return graph

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 stop_tokens: torch.Tensor | None = None, min_new_tokens: int = 0,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill ``input_ids [B, T]``, then ``max_new_tokens`` greedy tokens. A cache that
        already holds the first tokens of ``input_ids`` (a loaded prefix,
        :meth:`~kvbits.integrations.hf.KVBitsCache.load`) gets only the rest, as ``generate``
        does. ``attention_mask [B, T]``: left padding (a ``KVBitsCache``, which masks it by
        each sequence's start; positions count from a sequence's first real token, as
        ``generate``'s do). ``stop_tokens``, ``min_new_tokens``: see :meth:`decode`."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            # (an all-ones mask of another shape would be dropped below, unnoticed)
            raise ValueError(f"GreedyDecoder.generate: attention_mask "
                             f"{tuple(attention_mask.shape)} must have input_ids' shape "
                             f"{tuple(input_ids.shape)} ([batch, tokens])")
        self._check_room(input_ids.shape[1], max_new_tokens)
        held = self.cache.get_seq_length()
        if held >= input_ids.shape[1]:
            raise ValueError(f"GreedyDecoder.generate: the cache holds {held} tokens, the input "
                             f"{input_ids.shape[1]}: at least one input token must be new")
        pad, kw = None, {}
        if attention_mask is not None and not bool(attention_mask.all()):
            if not isinstance(self.cache, KVBitsCache) or held:
                raise ValueError("GreedyDecoder.generate: a padded attention_mask needs an "
                                 "empty KVBitsCache (it masks padding by each sequence's start)")
            mask = attention_mask.to(input_ids.device).long()
            kw = {"attention_mask": mask,
                  "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)}
            pad = (mask == 0).sum(-1, keepdim=True)  # [B, 1]: left padding per sequence
        out = self.model(input_ids[:, held:], use_cache=True, logits_to_keep=1, **kw,
                         **self._kw)
        logits = out.logits[:, -1]
        self._set_stops(stop_tokens, min_new_tokens, logits.device)
        self._seen = None
        if self.repetition_penalty != 1:  # one column more: prompt ids past the logits' vocab
            B, V = logits.shape
            self._seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
            seen = input_ids.to(logits.device).clamp(max=V)
            if pad is not None:  # padding is not a token of its sequence (as transformers'
                # processor ignores it): its ids go to the spare column
                seen = seen.masked_fill(kw["attention_mask"].to(seen.device) == 0, V)
            self._seen.scatter_(1, seen, True)
        first = next_token(self._shaped(logits, 0), self.sampling)
        if self._seen is not None:
            self._seen.scatter_(1, first, True)
        return self._run(first, input_ids.shape[1], max_new_tokens, pad)

    def _set_stops(self, stop_tokens, min_new_tokens: int, dev) -> None:
        if min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
        self._stop = None if stop_tokens is None else torch.as_tensor(
            stop_tokens, device=dev).reshape(-1)
        self._min_new = min_new_tokens

    @torch.no_grad()
    def decode(self, first: torch.Tensor, position: int, n: int,
               stop_tokens: torch.Tensor | None = None, min_new_tokens: int = 0,
               ) -> torch.Tensor:
        """``[B, n]`` tokens: ``first [B, 1]`` (the token at ``position``, the cache holding the
        ``position`` tokens before it), then ``n - 1`` greedy ones, one decode step each.

        ``stop_tokens`` (token ids, e.g. the EOS ids): decoding ends early, after the step in
        which the last sequence produced one (``[B, m]``, m <= n; a sequence's tokens after its
        own stop token are whatever it decoded: the caller masks them). Whether every sequence
        is done is read on the host before each step: one small synchronisation per step.
        ``min_new_tokens``: the stop tokens cannot be chosen before that many tokens (``first``
        counting as one), as ``generate``'s ``min_new_tokens``. (A ``repetition_penalty`` needs
        the prompt: :meth:`generate`.)"""
        if self.repetition_penalty != 1:
            raise ValueError("GreedyDecoder.decode: repetition_penalty needs the prompt's "
                             "tokens; use generate")
        self._check_room(position, n)
        self._set_stops(stop_tokens, min_new_tokens, first.device)
        self._seen = None
        return self._run(first, position, n)

    def _check_room(self, position: int, n: int) -> None:
        """Refuse a ``StaticCache`` too short for ``position`` tokens and ``n`` new ones (the
        last never fed back): past its ``max_cache_len`` the cache's index copy fails deep in
        transformers, on a GPU as a device-side assert inside a replayed graph."""
        if type(self.cache).__name__ != "StaticCache":
            return
        caps = [layer.max_cache_len for layer in getattr(self.cache, "layers", ())
                if not getattr(layer, "is_sliding", False)  # (sliding layers roll over)
                and isinstance(getattr(layer, "max_cache_len", None), int)]
        need = position + n - 1
        if caps and need > min(caps):
            raise ValueError(f"GreedyDecoder: the StaticCache holds max_cache_len={min(caps)} "
                             f"tokens; {position} tokens and {n} new ones need {need} (the last "
                             "new token is not stored): make the cache longer or ask for fewer "
                             "tokens")

    def _run(self, first: torch.Tensor, position: int, n: int,
             pad: torch.Tensor | None = None) -> torch.Tensor:
        """The loop of :meth:`decode`, its rules (stops, minimum, penalty) already set.
        ``pad [B, 1]``: each sequence's left padding (its positions start that much later)."""
        B = first.shape[0]
        dev = first.device
        if self._stop is not None:
            self._live = ~is_stop(first, self._stop)  # [B, 1]
        self.tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
        self.tokens[:, :1] = first
        self._ids = first.clone()
        self._pos = torch.full((B, 1), position, dtype=torch.long, device=dev)
        if pad is not None:
            self._pos -= pad.to(dev)
        self._cpos = torch.full((1,), position, dtype=torch.long, device=dev)
        self._count = torch.ones(1, 1, dtype=torch.long, device=dev)
        cache = self.cache
        device_lengths = isinstance(cache, KVBitsCache) and cache.device_lengths_ok()
        if device_lengths:
            cache.begin_device_lengths(position + n + 1)
            kind_of_next = cache.prepare_device_step  # True: the step flushes
        elif type(cache).__name__ == "StaticCache":
            kind_of_next = lambda: "step"  # noqa: E731
        else:
            kind_of_next = lambda: None  # noqa: E731  (not replayable: always eager)
        capture = self.graphs and dev.type == "cuda"
        if capture:
            check_one_gpu(self.model)
        graphs: dict = {}
        fused = (fused_pointwise(self.model, self.fuse) if self.fuse is not None
                 else contextlib.nullcontext())
        try:
            with fused:
                for done in range(2, n + 1):
                    if self._stop is not None and not bool(self._live.any()):
                        return self.tokens[:, :done - 1]  # (the cache ends as generate's does)
                    kind = kind_of_next()
                    graph = graphs.get(kind)
                    if graph is not None:
                        graph.replay()
                    else:
                        self._step()
                    if device_lengths:
                        cache.device_step_done(replayed=graph is not None)
                    self._tick(done)
                    if capture and kind is not None and graph is None and done < n:
                        try:
                            graphs[kind] = self._capture()
                        except RuntimeError as e:  # e.g. a host sync in the model's forward
                            warnings.warn(f"CUDA graph capture failed ({e}); decoding eagerly",
                                          stacklevel=2)
                            capture = False
        finally:
            if device_lengths:
                cache.end_device_lengths()
        return self.tokens

    def _tick(self, done: int) -> None:
        if self.step_done is not None:
            self.step_done(done)
