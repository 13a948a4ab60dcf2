"""Greedy decoding of a transformers causal LM with its decode steps captured in CUDA graphs.

Why: at batch 1, eager ``generate`` is bound by host time (20-60 ms of Python and launches per
step against 3-4 ms of GPU work on an H200 for a 7-8B model; ``benchmarks/results/e2e.md``), so
neither FP16 nor kvbits shows its GPU speed. A captured step replays every kernel of the forward
without the host. This loop captures the step once and replays it, for

* :class:`~kvbits.integrations.hf.KVBitsCache`: the lengths live on the device
  (:meth:`~kvbits.integrations.hf.KVBitsCache.begin_device_lengths`; the flush is of a fixed
  size at a device offset), so two graphs, a plain step and a flushing step, serve the whole
  generation; where that is not possible yet (padding still in the residual, a sink not full)
  the steps between two flushes form a *static run*
  (:meth:`~kvbits.integrations.hf.KVBitsCache.begin_static`), one graph per run, the flushing
  step eager;
* transformers' ``StaticCache`` (the FP16 baseline): one graph serves every step;
* any other cache: every step eagerly (same loop, for comparisons).

Sampling is greedy and inside the graph (``argmax`` feeds the next step's input), so a replayed
run does not touch the host at all. ``graphs=False`` runs the same steps eagerly (CPU, tests).
"""

from __future__ import annotations

import warnings

import torch

from .hf import KVBitsCache, cache_kwargs


class GreedyDecoder:
    """``GreedyDecoder(model, cache).generate(input_ids, n)`` -> ``[B, n]`` new token ids.

    ``step_done`` (optional callable) is called after every step with the number of tokens
    produced so far (timing hooks); ``captures`` counts the CUDA graphs captured."""

    def __init__(self, model, cache, *, graphs: bool = True, step_done=None,
                 device_lengths: bool = True):
        self.model, self.cache = model, cache
        self.graphs = graphs
        # kvbits: keep the lengths on the device where every layer allows it (two graphs for the
        # whole generation); False: static runs between flushes (a capture per run)
        self.device_lengths = device_lengths
        self.step_done = step_done
        self.captures = 0
        self._kw = cache_kwargs(model, cache)
        self._pool = None
        self._warm = False  # a run has been stepped eagerly (its kernels are compiled)

    # ------------------------------------------------------------------ cache kinds
    def _room(self, left: int) -> int:
        """Steps that can share one captured graph from here (0: run the next one eagerly)."""
        if isinstance(self.cache, KVBitsCache):
            return min(left, self.cache.static_room())
        if type(self.cache).__name__ == "StaticCache":
            return left
        return 0

    def _begin(self, n: int) -> None:
        if isinstance(self.cache, KVBitsCache):
            self.cache.begin_static(n)

    def _advance(self) -> None:
        if isinstance(self.cache, KVBitsCache):
            self.cache.advance_static(1)

    def _end(self) -> None:
        if isinstance(self.cache, KVBitsCache):
            self.cache.end_static()

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def _step(self) -> None:
        """One token for every sequence, reading and writing only device buffers."""
        out = self.model(input_ids=self._ids, position_ids=self._pos, cache_position=self._cpos,
                         use_cache=True, logits_to_keep=1, **self._kw)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        self._ids.copy_(nxt)
        self.tokens.scatter_(1, self._count.expand(nxt.shape[0], 1), nxt)
        self._count.add_(1)
        self._pos.add_(1)
        self._cpos.add_(1)

    def _capture(self):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step()
        self._pool = graph.pool()
        self.captures += 1
        return graph

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prefill ``input_ids [B, T]`` (no padding), then ``max_new_tokens`` greedy tokens."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        out = self.model(input_ids, use_cache=True, logits_to_keep=1, **self._kw)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        return self.decode(first, input_ids.shape[1], max_new_tokens)

    @torch.no_grad()
    def decode(self, first: torch.Tensor, position: int, n: int) -> torch.Tensor:
        """``[B, n]`` tokens: ``first [B, 1]`` (the token at ``position``, the cache holding the
        ``position`` tokens before it), then ``n - 1`` greedy ones, one decode step each."""
        B = first.shape[0]
        dev = first.device
        self.tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
        self.tokens[:, :1] = first
        self._ids = first.clone()
        self._pos = torch.full((B, 1), position, dtype=torch.long, device=dev)
        self._cpos = torch.full((1,), position, dtype=torch.long, device=dev)
        self._count = torch.ones(1, 1, dtype=torch.long, device=dev)
        done = 1
        capture = self.graphs and dev.type == "cuda"
        if self.device_lengths and isinstance(self.cache, KVBitsCache) and \
                self.cache.device_lengths_ok():
            return self._decode_device_lengths(position, n, capture)
        while done < n:
            run = self._room(n - done)
            if run == 0:  # this step flushes: eagerly, through the cache's ordinary path
                self._step()
                done += 1
                self._tick(done)
                continue
            self._begin(run)
            try:
                graph, left = None, run
                if capture and self._warm and run > 1:
                    # the kernels of a run were compiled by an earlier one: capture right away
                    # (a capture that fails, e.g. on a first-time compile, only costs the try)
                    try:
                        graph = self._capture()
                    except RuntimeError:
                        graph = None
                if graph is None:
                    self._step()  # eagerly first: compiles whatever this run launches
                    self._advance()
                    done += 1
                    left -= 1
                    self._tick(done)
                    self._warm = True
                    if capture and left > 0:
                        try:
                            graph = self._capture()
                        except RuntimeError as e:  # e.g. a host sync in the model's forward
                            warnings.warn(f"CUDA graph capture failed ({e}); decoding eagerly",
                                          stacklevel=2)
                            capture = False
                for _ in range(left):
                    if graph is not None:
                        graph.replay()
                    else:
                        self._step()
                    self._advance()
                    done += 1
                    self._tick(done)
                del graph
            finally:
                self._end()
        return self.tokens

    def _decode_device_lengths(self, position: int, n: int, capture: bool) -> torch.Tensor:
        """Every step with the cache's lengths on the device: two graphs, a plain step and a
        flushing one, each captured after its first eager run, then replayed as the host's
        schedule says (the flush every G steps is known in advance)."""
        cache = self.cache
        cache.begin_device_lengths(position + n + 1)
        graphs: dict = {}
        try:
            for done in range(2, n + 1):
                flush = cache.prepare_device_step()
                graph = graphs.get(flush)
                if graph is not None:
                    graph.replay()
                else:
                    self._step()
                cache.device_step_done(replayed=graph is not None)
                self._tick(done)
                if capture and graph is None and done < n:
                    cache._capturing = True
                    try:  # own pool per graph: the two replay in any order
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            self._step()
                        graphs[flush] = graph
                        self.captures += 1
                    except RuntimeError as e:
                        warnings.warn(f"CUDA graph capture failed ({e}); decoding eagerly",
                                      stacklevel=2)
                        capture = False
                    finally:
                        cache._capturing = False
        finally:
            cache.end_device_lengths()
        return self.tokens

    def _tick(self, done: int) -> None:
        if self.step_done is not None:
            self.step_done(done)
