"""Eager ``generate()`` with each layer's one-token decode step replayed from a CUDA graph.

Why: at small batch an eager decode step is bound by host time. kvbits' append, flush and
attention cost ~250-300 us of Python and launches per layer and step on the H200's host against
~70 us for ``DynamicCache`` + flash SDPA (``benchmarks/results/layer_host_profile_s28.log``), so
transformers' own ``generate()`` decoded *slower* than FP16 at batch 1 although kvbits' GPU work
is smaller. With the lengths on the device (:meth:`~kvbits.cache.store.LayerStore.
begin_device_lengths`) a layer's step launches the same kernels with the same arguments every
time, in two kinds: a plain step and one that also flushes a group. Each kind of each layer runs
once eagerly (its kernels compile, lazily built tables are made outside any capture), is captured
the next time, and is replayed from then on: a step is then three input copies, one graph launch
and one output copy. Whole-model graphs (:mod:`.decode_loop`) also remove the host time of the
rest of the model, but need their own decoding loop; these work inside ``generate()``.

The graphs point at the layer's buffers, so the buffers are reserved ahead, a chunk at a time
(:data:`RESERVE_MIN` tokens, or 1/8 of what the layer holds); when a chunk is used up the layer
leaves the mode, grows and captures again. Any other use of the layer (a multi-row step, crop,
reorder, save, a whole-model decode loop) leaves the mode first. The host keeps its lengths in
step (:meth:`~kvbits.cache.store.LayerStore.device_step_done`), so leaving is free.

The graphs of one cache share a memory pool (taken from a live graph of the cache: a pool lives
only while a graph captured into it does): a layer's graphs replay one after another on one
stream and keep only their outputs alive, so their temporaries never overlap in time.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass

import torch

from .. import ops
from ..kernels.launch import device_index
from ..kernels.switches import env_choice

# KVBITS_STEP_GRAPHS: "auto" (default; on where the layer runs the CUDA kernels), "0" (off),
# "1" (on, also where it cannot capture: every step then runs eagerly in the same mode, as the
# CPU tests do). KVBitsCache(step_graphs=...) overrides it per cache.
DEFAULT = {"auto": "auto", "0": False, "1": True}[
    env_choice("KVBITS_STEP_GRAPHS", "auto", ("auto", "0", "1"))]

# Tokens reserved ahead when a layer enters the mode (or 1/8 of what it holds, if more): each
# re-entry copies the body into larger buffers and captures the layer's graphs again.
RESERVE_MIN = 512


def check_setting(value) -> None:
    if value not in ("auto", True, False):
        raise ValueError(f"KVBitsCache: step_graphs must be 'auto', True or False, got {value!r}")


@dataclass
class _Captured:
    graph: object  # torch.cuda.CUDAGraph
    q: torch.Tensor  # static inputs, copied in before each replay
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor  # static output, copied out after it


def layer_step(store, q, k, v, flush: bool, host: bool, scale: float, window, softcap):
    """One decode step of one layer with its lengths on the device: the token appended, the
    residual's first group quantized when ``flush``, attention of ``q`` over the result.
    Fixed shapes and device lengths only, so the same launches serve every step of its kind."""
    store.append_dev(k, v, host=host)
    if flush:
        store.flush_dev(host=host)
    return attend_dev(store, q, scale, window, softcap)


def attend_dev(store, q, scale: float, window, softcap) -> torch.Tensor:
    """Attention of ``q`` over a layer whose lengths live on the device (here and in a
    whole-model decode loop): the kernels read the true lengths from ``lens_dev``."""
    return ops.decode_attention(store.rotate_query(q), store.view_dev(), scale=scale,
                                starts=store.starts, window=window, lens_dev=store.lens_dev,
                                softcap=softcap)


def flushes(store) -> bool:
    """Whether the next one-token step flushes: it brings the residual to R + G tokens."""
    s = store.spec
    return s.quantized and store.res_len + 1 == s.residual_length + s.group_size


class StepGraphs:
    """The captured decode steps of one layer, by kind (module docstring). ``capture``: False
    runs every step eagerly in the device-lengths mode (no CUDA: tests of the bookkeeping)."""

    def __init__(self, capture: bool, pool_of=None):
        self.capture = capture
        self.pool_of = pool_of  # () -> a memory pool to share (the cache's), or None
        self.graphs: dict = {}
        self.warm: set = set()  # kinds that ran once eagerly
        self.captures = 0

    def drop(self) -> None:
        """Forget the graphs: the buffers they point at are about to move. A kind is captured
        again only after it ran eagerly since: a layer that leaves the mode at every step (beam
        search's reorder, speculative verification) would otherwise capture at every step."""
        self.graphs.clear()
        self.warm.clear()

    def step(self, store, q, k, v, scale: float, window, softcap) -> torch.Tensor:
        flush = flushes(store)
        kind = (flush, tuple(q.shape), q.dtype, tuple(k.shape), k.dtype, v.dtype, scale,
                window, softcap)
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()  # (someone else's)
        if not self.capture or kind not in self.warm or capturing:
            self.warm.add(kind)
            return layer_step(store, q, k, v, flush, True, scale, window, softcap)
        g = self.graphs.get(kind)
        if g is None:
            try:
                g = self._capture(store, q, k, v, flush, scale, window, softcap)
            except RuntimeError as e:  # (torch.AcceleratorError too) nothing ran: go on eagerly
                self.capture = False
                warnings.warn(f"kvbits: capturing a layer's decode step failed ({e}); its steps "
                              "run eagerly (KVBitsCache(step_graphs=False) turns them off)",
                              stacklevel=2)
                return layer_step(store, q, k, v, flush, True, scale, window, softcap)
            self.graphs[kind] = g
        g.q.copy_(q)
        g.k.copy_(k)
        g.v.copy_(v)
        g.graph.replay()
        store.device_step_done(flush)
        # a copy: the static output is overwritten by the next replay, and a caller (a hook)
        # may keep what it was given
        return g.out.clone()

    def _capture(self, store, q, k, v, flush, scale, window, softcap) -> _Captured:
        """Record (not run) one step of this kind. ``torch.cuda.graph`` is not used: it
        collects garbage and empties the allocator's cache at every capture, ~0.1 s each in a
        process holding a model, and a generation captures two graphs per layer; the garbage
        collector is paused instead, so that nothing it frees (a graph) acts inside the
        capture."""
        sq, sk, sv = (torch.empty_like(x, memory_format=torch.contiguous_format)
                      for x in (q, k, v))
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(q.device)
        side = _capture_stream(q.device)
        side.wait_stream(main)
        collecting = gc.isenabled()
        gc.disable()  # a collection inside the capture could free a graph: illegal while capturing
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.pool_of() if self.pool_of is not None else None)
                try:
                    out = layer_step(store, sq, sk, sv, flush, False, scale, window, softcap)
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        main.wait_stream(side)
        self.captures += 1
        return _Captured(graph, sq, sk, sv, out)


def pool_of(cache_ref, device: torch.device):
    """The memory pool to capture into on ``device``: the cache's (``cache_ref``, a weak
    reference) shared pool, or None (a new one)."""
    cache = cache_ref()
    return None if cache is None else cache.graph_pool(device)


_STREAMS: dict = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream per device to capture on (capture cannot use the default stream; not
    decode_attention's side stream, which a captured call forks its FP16 splits onto)."""
    idx = device_index(device)
    if idx not in _STREAMS:
        _STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _STREAMS[idx]


def usable(store, setting) -> bool:
    """Whether a layer may ever run its decode steps in this mode (fixed for the layer):
    ``setting`` True, or "auto" with the layer on the CUDA kernels (a layout the decode kernel
    reads: the reference path dequantizes on the host's lengths) of the current device (a model
    spread over GPUs keeps its other layers eager: not yet run on several GPUs)."""
    if setting is False:
        return False
    if setting is True:
        return True
    return (store.device.type == "cuda" and ops.use_kernels(store.res_k)
            and store.device.index in (None, torch.cuda.current_device())
            and ops.kernel_reads(store.view_raw()))


def reserve_tokens(store) -> int:
    """Tokens to size the buffers for on entering the mode (module docstring)."""
    return store.seq_len + max(RESERVE_MIN, store.seq_len // 8)
