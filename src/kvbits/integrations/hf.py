"""Hugging Face transformers integration: a quantized ``Cache`` and the ``"kvbits"`` attention.

One line switches a model's KV cache to kvbits::

    import kvbits.integrations.hf  # registers attn_implementation="kvbits" (done on import)
    from kvbits.integrations.hf import KVBitsCache

    cache = KVBitsCache(model, "kivi-2", residual_length=64)   # also switches the model to "kvbits"
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)   # or cache=cache

How it works
------------
:class:`KVBitsCache` holds one :class:`~kvbits.cache.store.LayerStore` per decoder layer (FP16
sink | packed body | FP16 residual, in the model's dtype for the FP parts), created lazily on the
first ``update`` from the shape, dtype and device of that layer's key states.

``update`` appends the new K/V to the store *without* quantizing them and returns the new key and
value tensors, tagged (a Python attribute) with the layer they belong to. The attention function
registered as ``"kvbits"`` reads the tag:

* **prefill** (the store was empty): attention over the prompt runs at full precision through
  transformers' own SDPA path, with the mask transformers built. The left padding of every
  sequence is read off that mask (a key no query row attends to is padding; padding must be a
  prefix), recorded in the store, and only then is the prompt quantized, in one call, so padding
  never enters a group's min/max.
* **decode / chunked prefill** (history present): the store flushes whole groups, then
  :func:`kvbits.ops.decode_attention` attends the new query rows over the packed store directly
  (the Triton kernel on CUDA; no FP16 copy of the history is built). The 4D mask is not used
  there: padding comes from the store's ``starts`` (set at prefill; later tokens are all real, as
  ``generate`` produces them), causality from the positions, and the sliding window from the
  layer (``sliding_window`` passed by the model, or the config's for sliding layers).
* untagged tensors (e.g. ``attn_implementation="kvbits"`` with a ``DynamicCache``): plain SDPA.

Using the cache without the ``"kvbits"`` attention (``KVBitsCache(config)`` on a model loaded with
another ``attn_implementation``) still gives correct results through a **slow path**: the prompt
step returns the prompt's K/V unchanged, and from the next step on ``update`` notices that its
tensors were not consumed by the kvbits attention and returns the whole history dequantized (like
transformers' ``QuantizedCache``; a warning is emitted once). The padding of the prompt is then
unknown to the cache and takes part in the first groups' min/max.

Known limits
------------
* Sliding-window layers (Gemma3, Mistral-style) drop the groups no later query can see
  (:meth:`LayerStore.evict`): they hold about 1.25 windows instead of the whole history,
  except on the slow path and while lengths live on the device (CUDA-graph decoding; with
  the per-layer step graphs, until a layer's reserved buffers fill, 1/8 more tokens or 512);
  after ``activate_past_recording`` they also keep the tokens since the last crop, as
  ``DynamicCache``'s sliding layers do, so that a crop can roll those back.
* Attention-logit softcapping (Gemma2): the prompt step runs an eager attention with the cap
  (SDPA has none; it builds the ``[B, H, Lq, Lk]`` scores), decode caps the scores inside the
  kernels' online softmax.
* Layer types other than full and sliding attention (chunked, linear/SSM, KV sharing) are rejected,
  and so are learned attention sinks (gpt-oss's ``s_aux``), at the first step.
* Not ``torch.compile``-able (``is_compileable`` is False). CUDA graphs instead:
  :meth:`KVBitsCache.begin_device_lengths` (lengths on the device, fixed-size flushes) makes
  decode steps replayable; :mod:`kvbits.integrations.decode_loop` captures and replays them.
* Crop can only cut quantized history at a group boundary. Assisted and prompt-lookup
  decoding (transformers crops the rejected drafts) work while a draft fits in the FP16 residual
  (``residual_length`` >= draft tokens: drafts are never quantized before they are verified);
  a quantized layer without a residual window is not croppable (``is_croppable``; drafting is
  refused with that reason before the prompt runs). A group that the drafts brought due during
  their verification goes back to FP16 with the crop (:meth:`LayerStore.track_flushes`), so
  decoding goes on as if the rejected drafts had never been seen; a crop reaching back past
  the last forward keeps what earlier steps flushed quantized. The first drafts are verified
  in the prompt's own forward (transformers prefills prompt and drafts at once): their rows
  attend the prompt at full precision, as its own rows do, and what they flush goes back with
  the crop too (dynamic FP8 scales excepted: that first flush may have set them with the
  drafts). A sliding-window layer that dropped tokens refuses a crop that would leave the
  next token's window short (as ``DynamicCache`` does without ``activate_past_recording``).
* ``output_attentions=True`` returns no attention weights: the fused kernels never form
  the probability matrix (transformers warns that its SDPA path has none; run a
  ``DynamicCache`` with ``attn_implementation="eager"`` to inspect them).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import ops
from ..cache.store import CropInGroupError, LayerStore
from ..checks import as_int, is_count
from ..methods.model_calls import cache_kwargs, full_attention
from ..reference.attention import dequantize_layer
from ..spec import CALIBRATION_USES, QuantSpec, resolve_spec
from . import step_graphs as steps_mod  # (KVBitsCache takes an argument step_graphs)

__all__ = ["ATTN_IMPLEMENTATION", "KVBitsCache", "KVBitsLayer", "cache_kwargs",
           "kvbits_attention_forward", "layer_windows", "padding_starts", "register"]

ATTN_IMPLEMENTATION = "kvbits"

_SLIDING_TYPES = ("sliding_attention",)
_FULL_TYPES = ("full_attention",)


@dataclass
class _Tag:
    """What ``update`` attaches to the key tensor it returns (as ``key._kvbits``)."""

    layer: KVBitsLayer
    prefill: bool
    device: bool = False  # a step with the lengths on the device (begin_device_lengths)
    step: bool = False  # a one-token step the attention runs as a replayed layer step


# --------------------------------------------------------------------------------------- layer
class KVBitsLayer(CacheLayerMixin):
    """The cache of one decoder layer: a :class:`LayerStore`, created on the first ``update``.

    ``keys`` / ``values`` stay ``None``: the data lives in ``store``.
    """

    is_compileable = False
    layer_idx: int | None = None  # (class default: a layer pickled before it existed loads)

    @property
    def is_croppable(self) -> bool:
        """Whether transformers may crop this layer (assisted and prompt-lookup decoding): the
        rejected drafts sit in the FP16 residual, never quantized, while a draft is at most
        ``residual_length`` tokens, so a quantized layer needs a residual window."""
        return not self.spec.quantized or self.spec.residual_length > 0

    def __init__(self, spec: QuantSpec, sliding_window: int | None = None, cache=None,
                 codebooks=None, inv_freq: torch.Tensor | None = None, fp8_scales=None,
                 hadamard_channels=None, layer_idx: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx  # the decoder layer (its store's warnings name it)
        self.hadamard_channels = hadamard_channels  # hadamard_calibrated: channels per KV head
        self.spec = spec
        self.codebooks = codebooks  # kvquant: this layer's LayerCodebooks
        self.fp8_scales = fp8_scales  # fp8 calibrated: this layer's (k_scale, v_scale) [H]
        self.inv_freq = inv_freq  # pre_rope: this layer's RoPE frequencies
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # transformers' rollback flag (DynamicSlidingWindowLayer.record_past, set by
        # activate_past_recording): a sliding layer then keeps the tokens since the last crop
        # (at most _hold_cap of them where transformers says how far it will crop), which
        # _mark counts from
        self.record_past = False
        self._hold_cap: int | None = None
        self._mark = 0
        self.store: LayerStore | None = None
        # The owning KVBitsCache, weakly: a strong reference would put every cache in a
        # reference cycle, whose GPU buffers only the cyclic garbage collector frees, late
        # (generate in a loop with fresh caches then runs out of memory).
        self._cache_ref = None if cache is None else weakref.ref(cache)
        # Set by the kvbits attention when it consumed this layer's last update.
        self._attended = False
        # Decode steps replayed from CUDA graphs (integrations.step_graphs): whether this layer
        # may (None: not yet known), the graphs, whether the mode is on, and the (key, value)
        # of an update whose attention runs them.
        self._steps_ok: bool | None = None
        self._steps: steps_mod.StepGraphs | None = None
        self._steps_on = False
        self._pending = None

    @property
    def _cache(self):
        return None if self._cache_ref is None else self._cache_ref()

    def __getstate__(self):
        """For ``pickle`` / ``torch.save``: the weak reference to the cache and the step graphs
        do not pickle; the owning cache points its layers at itself again on load
        (:meth:`KVBitsCache.__setstate__`), and graphs are captured again when needed."""
        self._leave_steps()
        state = self.__dict__.copy()
        state.update(_cache_ref=None, _steps=None, _steps_ok=None)
        return state

    def __repr__(self):
        n = 0 if self.store is None else self.store.total_len
        win = f", window={self.sliding_window}" if self.is_sliding else ""
        return f"KVBitsLayer({self.spec.describe()}{win}, tokens={n})"

    # ------------------------------------------------------------------ CacheLayerMixin API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.store = LayerStore(self.spec, B, H, D, key_states.dtype, key_states.device,
                                codebooks=self.codebooks, inv_freq=self.inv_freq,
                                fp8_scales=self.fp8_scales,
                                hadamard_channels=self.hadamard_channels,
                                layer_idx=self.layer_idx)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.store is None:
            if value_states.shape[1::2] != key_states.shape[1::2]:
                raise ValueError(
                    f"KVBitsCache: this model caches keys of {key_states.shape[1]} heads x "
                    f"{key_states.shape[-1]} channels and values of {value_states.shape[1]} x "
                    f"{value_states.shape[-1]} (multi-head latent attention, DeepSeek-V2/V3 "
                    "style); kvbits stores keys and values of one shape per layer: use "
                    "transformers' DynamicCache for this model")
            self.lazy_initialization(key_states, value_states)
        store = self.store
        if self._pending is not None:  # the last update's attention never ran (not kvbits')
            self._leave_steps()
        if store.lens_dev is not None and not self._steps_on:  # a whole-model decode loop:
            # lengths on the device; append, flush if due, attend
            host = self._cache is None or not self._cache._capturing
            store.append_dev(key_states, value_states, host=host)
            if self._cache is not None and self._cache._flush_now and store.spec.quantized:
                store.flush_dev(host=host)
            key_states._kvbits = _Tag(self, False, device=True)
            return key_states, value_states
        prefill = store.seq_len == 0
        # the packed path when kvbits' attention reads this update: the calling module says so,
        # or the last step's result was read by it (a cache loaded from a file for a config is
        # known by the caller alone: its first step has no last one)
        fast = (prefill or getattr(self._cache, "_caller_impl", None) == ATTN_IMPLEMENTATION
                or (self._attended and self._impl_is_kvbits()))
        self._attended = False
        if fast and not prefill and self._take_step(key_states):
            self._pending = (key_states, value_states)  # the attention appends and attends
            key_states._kvbits = _Tag(self, False, step=True)
            return key_states, value_states
        self._leave_steps()
        if fast and self.is_sliding:  # what no later query can see goes (LayerStore.evict)
            self._evict_unseen()
        store.append(key_states, value_states, flush=False)
        if fast:
            key_states._kvbits = _Tag(self, prefill)
            return key_states, value_states
        # Slow path: nothing reads the packed store, so hand back the whole history.
        if self._cache is not None:
            self._cache._warn_slow_path()
        store.flush()
        keys, values = dequantize_layer(store.view(), key_states.dtype, starts=store.starts)
        keys = store.model_keys(keys)
        if store.evicted:  # a sliding layer whose fast path dropped tokens: zeros stand in for
            # them, as the mask covers every token seen (get_mask_sizes); its window hides them
            keys, values = (torch.cat([x.new_zeros(*x.shape[:2], store.evicted, x.shape[3]), x],
                                      2) for x in (keys, values))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask covers the whole history (the kvbits attention reads it only at the prompt
        # step, before any eviction, and for a chunk's own keys, its last columns; the slow
        # path hands over stand-ins for what the fast path evicted). Every token seen, not
        # those held from the first not evicted: transformers builds one mask for all sliding
        # layers, from the first one's sizes, and layers of other specs evict other counts.
        if isinstance(query_length, torch.Tensor):  # transformers < 5.4 pass cache_position
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if self.store is None:
            return 0
        # a step taken for the step graphs is appended by its attention: it counts already
        return self.store.total_len + (0 if self._pending is None else self._pending[0].shape[2])

    def get_max_length(self) -> int:
        """As transformers' dynamic layers: the window for a sliding layer, else -1 (no limit)."""
        return self.sliding_window if self.is_sliding else -1

    def get_max_cache_shape(self) -> int:  # get_max_length's older name (called up to 5.19;
        # -1 as before there: the window, as their DynamicCache said, is untried on them)
        return -1

    def reset(self) -> None:
        self.store = None
        self.is_initialized = False
        self._attended = False
        self._mark = 0
        self._steps_ok, self._steps, self._steps_on, self._pending = None, None, False, None

    def offload(self):  # offloading is not supported: the store stays where it is
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None:
            self._leave_steps()
            self.store.reorder(beam_idx)  # (checked there: integer rows of the batch)

    def batch_repeat_interleave(self, repeats: int) -> None:
        n = as_int(repeats)
        if n is None or n < 1:  # (0 left an empty batch that still counted its tokens)
            raise ValueError(f"batch_repeat_interleave: repeats must be a positive integer "
                             f"(copies of each sequence), got {repeats!r}")
        if self.store is not None:
            self._leave_steps()
            index = torch.arange(self.store.batch, device=self.store.device)
            self.store.reorder(index.repeat_interleave(n))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """As ``DynamicCache`` indexes its tensors: a boolean mask over the batch, or rows
        (negative ones from the end)."""
        if self.store is not None:
            self._leave_steps()
            batch = self.store.batch
            indices = torch.as_tensor(indices, device=self.store.device)
            if indices.dtype == torch.bool:
                if tuple(indices.shape) != (batch,):  # (nonzero() of a shorter mask selected
                    # other rows than asked, silently)
                    raise ValueError(f"batch_select_indices: a boolean mask must have one entry "
                                     f"per sequence ({batch}), got shape {tuple(indices.shape)}")
                indices = indices.nonzero().flatten()
            elif not indices.is_floating_point() and not indices.is_complex():
                indices = torch.where((indices < 0) & (indices >= -batch), indices + batch,
                                      indices)
            self.store.reorder(indices)

    def crop(self, tokens_to_remove: int = 0, **kwargs) -> None:
        """Negative: drop that many tokens; positive (legacy): keep that many; 0: nothing
        (while recording, a sliding layer may drop what it held for a crop, as
        ``DynamicSlidingWindowLayer.crop(0)`` does)."""
        keep = self.crop_target(tokens_to_remove, **kwargs)  # (leaves the step graphs' mode)
        if keep is not None:
            self.store.crop(keep)
        self._mark = self.get_seq_length()  # a later crop reaches back to here

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None,
                                **kwargs) -> None:
        """transformers' notice that the cache will be cropped (``Cache.activate_past_recording``;
        user code calls it before rolling a sliding-window model back): as
        ``DynamicSlidingWindowLayer``, a sliding layer keeps from now on the tokens since the
        last crop (at most ``recurrent_states_to_keep`` of them, where transformers says how
        many it will crop) besides its window, so that a crop back to it works. Full
        layers keep everything anyway."""
        if self.is_sliding:
            self.record_past = True
            self._hold_cap = recurrent_states_to_keep
            self._mark = self.get_seq_length()

    def _evict_unseen(self) -> None:
        """Before a sliding layer's update: drop what the next token's window cannot see
        (:meth:`LayerStore.evict`), keeping, while recording, the tokens since the last crop."""
        store = self.store
        seen = store.total_len
        if self.record_past:
            held = max(0, seen - self._mark)
            if self._hold_cap is not None:
                held = min(held, self._hold_cap)
            seen -= held
        store.evict(seen - self.sliding_window + 1 - store.evicted)

    def dequantized(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The tokens this layer holds as full-precision ``(keys, values)`` ``[B, H, tokens
        held, D]`` in the model's dtype and key space (a dequantized copy: the store is not
        changed; ``(None, None)`` before the first update). A sliding layer holds the tokens
        from ``store.evicted`` on, as ``DynamicCache``'s holds its last ``window - 1``.
        ``keys`` / ``values`` themselves stay ``None``: the data lives in ``store``."""
        if self.store is None:
            return None, None
        self._leave_steps()
        store = self.store
        keys, values = dequantize_layer(store.view(), store.dtype, starts=store.starts)
        return store.model_keys(keys), values

    def crop_target(self, tokens_to_remove: int = 0, **kwargs) -> int | None:
        """The store length :meth:`crop` would keep (None: nothing to do), checked without
        changing anything: ValueError where the cut is impossible."""
        if "max_length" in kwargs:  # crop's keyword before transformers 5.15
            tokens_to_remove = kwargs.pop("max_length")
        n = as_int(tokens_to_remove)  # (None failed on a comparison; a float: the drafts' advice)
        if n is None:
            raise ValueError(f"crop: tokens_to_remove must be an integer (a negative number of "
                             f"tokens to drop; positive: tokens to keep), got {tokens_to_remove!r}")
        tokens_to_remove = n
        if self.store is None or tokens_to_remove == 0:
            return None
        self._leave_steps()  # the checks read the host lengths (in step: leaving costs nothing)
        n = self.store.total_len
        if tokens_to_remove < -n:
            raise ValueError(f"crop: cannot remove {-tokens_to_remove} tokens: the cache holds {n}")
        keep = n + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        evicted = self.store.evicted
        if evicted and keep - self.sliding_window + 1 < evicted:
            # the next token sees the window - 1 tokens before it, and some of those are gone
            # (transformers' DynamicCache refuses such a crop too)
            raise ValueError(
                f"crop: cannot keep {keep} tokens: the first {evicted} left this sliding-window "
                f"layer already, and the next token's window (the {self.sliding_window - 1} "
                f"tokens before it) needs tokens from {keep - self.sliding_window + 1} on; keep "
                f"at least {evicted + self.sliding_window - 1}")
        try:
            self.store.check_crop(keep - self.store.evicted)
        except CropInGroupError as e:  # (a cut into a padded sequence's sink is another
            # refusal: its message alone, not the residual's advice, which does not apply)
            raise ValueError(
                f"{e}. If this came from assisted or prompt-lookup decoding: a draft longer than "
                f"the FP16 residual (residual_length={self.spec.residual_length}) is quantized "
                "before it is verified; draft fewer tokens (num_assistant_tokens, "
                "prompt_lookup_num_tokens) or raise residual_length") from None
        return keep - self.store.evicted

    # ------------------------------------------------------------------ step graphs
    def _take_step(self, key_states: torch.Tensor) -> bool:
        """Whether this update is a one-token step that the attention runs as a replayed layer
        step (:mod:`~kvbits.integrations.step_graphs`), entering that mode where it can: the
        layer may (the cache's ``step_graphs``), its lengths can live on the device, and the
        buffers hold the step (else it leaves the mode, grows them and enters again)."""
        store = self.store
        if key_states.shape[2] != 1 or (store.lens_dev is not None and not self._steps_on):
            return False
        if not store.all_hold_real_tokens():  # a sequence may hold only padding: this step may
            # be padding too, which the eager path reads off the mask
            return False
        if self._steps_ok is None:
            cache = self._cache
            setting = steps_mod.DEFAULT if cache is None else cache.step_graphs
            self._steps_ok = steps_mod.usable(store, setting)
        if not self._steps_ok:
            return False
        if self._steps_on:
            if store.device_room(steps_mod.flushes(store)):
                return True
            self._leave_steps()
            if self.is_sliding:  # held back while the buffers could not move
                self._evict_unseen()
        if not store.device_lengths_ok():
            return False
        store.begin_device_lengths(steps_mod.reserve_tokens(store))
        if self._steps is None:
            cache = self._cache
            # only where "auto" would take the layer (the reference path reads the host
            # lengths: a graph would freeze them)
            capture = steps_mod.usable(store, "auto")
            # the cache weakly: a strong reference would be a cycle (cache -> layer -> graphs ->
            # cache) that only the cyclic collector frees, late, and inside a capture
            ref, dev = self._cache_ref, store.device
            self._steps = steps_mod.StepGraphs(
                capture, (lambda: steps_mod.pool_of(ref, dev)) if capture and ref is not None
                else None)
        self._steps_on = True
        return True

    def _run_step(self, query: torch.Tensor, scale: float, window, softcap) -> torch.Tensor:
        """The attention's half of a step that :meth:`_take_step` took."""
        if self._pending is None:
            raise RuntimeError("kvbits: a layer step reached the attention without its update")
        k, v = self._pending
        self._pending = None
        return self._steps.step(self.store, query, k, v, scale, window, softcap)

    def _leave_steps(self) -> None:
        """End the replayed-steps mode (the host lengths are in step) before anything else
        touches the store; an update whose attention never ran is appended now."""
        if self._steps_on:
            self._steps_on = False
            self.store.end_device_lengths()
            self._steps.drop()
        if self._pending is not None:
            k, v = self._pending
            self._pending = None
            self.store.append(k, v, flush=False)

    # ------------------------------------------------------------------ helpers
    def _impl_is_kvbits(self) -> bool:
        """Whether the attention reading this update's result is kvbits' (which reads the
        packed store itself): the calling module's, where the cache saw one, else that of the
        model the cache was built for; True for a cache built from a config alone."""
        cache = self._cache
        impl = None if cache is None else getattr(cache, "_caller_impl", None)
        if impl is None:
            config = None if cache is None else cache._model_config
            if config is None:
                return True
            impl = getattr(config, "_attn_implementation", None)
        return impl == ATTN_IMPLEMENTATION

    def dense_nbytes(self) -> int:
        """Bytes ``DynamicCache`` would hold for this layer's tokens (same dtype; sliding layers
        keep ``window - 1`` tokens there)."""
        s = self.store
        if s is None:
            return 0
        tokens = s.total_len
        if self.is_sliding:
            tokens = min(tokens, self.sliding_window - 1)
        return 2 * s.batch * s.kv_heads * tokens * s.head_dim * s.res_k.element_size()


# --------------------------------------------------------------------------------------- cache
class KVBitsCache(Cache):
    """A transformers ``Cache`` that stores K/V in 2-8 bits (kvbits ``LayerStore`` per layer).

    Args:
        model_or_config: a ``PreTrainedModel`` (its attention is switched to ``"kvbits"`` with
            ``set_attn_implementation``, in place) or its config (then load the model with
            ``attn_implementation="kvbits"`` yourself, or every step after the prompt takes the
            slow path described in the module docstring). Layers come from
            ``config.get_text_config()``: ``num_hidden_layers``, ``layer_types`` and
            ``sliding_window``.
        spec: a preset name (see :data:`kvbits.spec.PRESETS`), a spec file (``.json``, e.g.
            written by ``kvbits tune``: per-layer bits) or a :class:`QuantSpec`. A spec with
            ``layer_bits`` / ``skip_layers`` gives each layer its own bits (or FP16).
        calibration: for ``method="kvquant"`` presets: a :class:`kvbits.methods.kvquant.
            Calibration`, the path of a file written by ``kvbits calibrate``, or ``"auto"``
            (calibrate on SOTU 1900-1999 once, cached under the kvbits cache folder; needs a
            model loaded by :func:`kvbits.data.load_model`). A calibration made for another
            model or spec is refused (``ValueError``). ``"uniform"`` uses KIVI's uniform codes
            (kvquant's outliers and pre-RoPE keys without codebooks). For ``fp8`` presets with
            calibrated scales: ``"auto"`` (per-head amax on SOTU 1900-1999, once per model),
            the path of a file from :func:`kvbits.methods.fp8.save_fp8_scales`, or the list of
            per-layer ``(k_scale, v_scale)``. For ``hadamard_calibrated`` specs (``kivi-N-hadc``):
            ``"auto"`` (channel subsets chosen on SOTU 1900-1999, once per model), a file from
            :func:`kvbits.methods.hadamard.save_hadamard_channels` or the per-layer lists.
        step_graphs: ``"auto"`` (default, or ``KVBITS_STEP_GRAPHS``): on CUDA, each layer's
            one-token decode steps inside ``generate()`` are replayed from CUDA graphs
            (:mod:`~kvbits.integrations.step_graphs`: about a tenth of the host time of
            launching them); ``False``: launched eagerly; ``True``: the same bookkeeping
            everywhere (on the CPU the steps then run eagerly in that mode).
        **overrides: :class:`QuantSpec` fields replacing the preset's (``residual_length=0``, ...),
            or transformers' QuantizedCache names: ``KVBitsCache(model, "uniform", nbits=4,
            axis_key=0, axis_value=0, q_group_size=64, residual_length=128)``.

    ``generate(..., past_key_values=cache)`` (or ``cache=cache`` on transformers versions that take
    it) uses it like any other cache: greedy, sampling, beam search (``reorder_cache``), left-padded
    batches. ``nbytes()`` is the exact storage of the tokens held; ``fp16_nbytes()`` what
    ``DynamicCache`` would hold for them.
    """

    is_compileable = False

    def __init__(self, model_or_config, spec: str | QuantSpec = "kivi-2", calibration=None,
                 step_graphs=None, **overrides):
        self.spec = resolve_spec(spec, **overrides)
        if step_graphs is None:
            step_graphs = steps_mod.DEFAULT
        steps_mod.check_setting(step_graphs)
        self.step_graphs = step_graphs
        model = None
        if hasattr(model_or_config, "set_attn_implementation") and hasattr(model_or_config, "config"):
            model = model_or_config
            config = model.config
        elif hasattr(model_or_config, "get_text_config"):
            config = model_or_config
        else:
            raise TypeError(
                "KVBitsCache needs a transformers PreTrainedModel or its config, got "
                f"{type(model_or_config).__name__}")
        text_config = config.get_text_config(decoder=True)
        windows = layer_windows(text_config)
        n_layers = len(windows)
        layer_specs = [self.spec.for_layer(i, n_layers) for i in range(n_layers)]
        fp8_scales = [None] * n_layers
        if self.spec.method == "fp8":
            from ..methods import fp8 as fp8_method

            fp8_scales = fp8_method.layer_scales(model_or_config, self.spec, calibration, n_layers)
            calibration = None
        had_channels = [None] * n_layers
        if self.spec.hadamard_calibrated:
            from ..methods import hadamard as had_method

            had_channels = had_method.layer_channels(model_or_config, self.spec, calibration,
                                                     n_layers)
            calibration = None
        inv_freqs = [None] * len(windows)
        if self.spec.pre_rope and self.spec.quantized:  # checked here, before any calibration
            from ..reference.rope import model_inv_freqs

            # refuses neighbour-pair rotary embeddings, with the way out (partial ones: the
            # stores reorder their channels, reference.rope.partial_rotary_layout)
            inv_freqs = model_inv_freqs(model_or_config)
            # a model without RoPE (GPT-2, OPT, StarCoder): its keys are position-free already
            # and are stored as they come, as pre_rope=False stores them
            layer_specs = [ls.replace(pre_rope=False) if inv is None else ls
                           for ls, inv in zip(layer_specs, inv_freqs)]
        codebooks = _layer_codebooks(model_or_config, self.spec, calibration,
                                     spec if isinstance(spec, str) else "", len(windows))
        layers = [KVBitsLayer(ls, window, cache=self, codebooks=cb, inv_freq=inv, fp8_scales=f8,
                              hadamard_channels=hc, layer_idx=i)
                  for i, (ls, window, cb, inv, f8, hc) in enumerate(zip(
                      layer_specs, windows, codebooks, inv_freqs, fp8_scales, had_channels))]
        super().__init__(layers=layers)
        self.config = text_config
        self._model_config = None
        self._caller_impl = None  # during update: the calling attention's implementation
        self._warned_slow = False
        self._recording = False  # transformers will crop drafts (activate_past_recording)
        self._flush_now = False  # lengths on the device: this step flushes
        self._capturing = False  # a CUDA graph is being captured: no host bookkeeping
        # the model, weakly: save() samples its weights so that a file made with other weights
        # of the same shape is refused on load (persist)
        self._model_ref = weakref.ref(model) if model is not None else None
        if model is not None:
            _use_kvbits_attention(model)
            self._model_config = model.config.get_text_config(decoder=True)

    def __repr__(self):
        return f"KVBitsCache({self.spec.describe()}, layers={len(self.layers)})"

    @property
    def is_croppable(self) -> bool:
        """Every layer is (transformers' own ``Cache.is_croppable`` from 5.17; defined here for
        the versions before it)."""
        return all(layer.is_croppable for layer in self.layers)

    def activate_past_recording(self, **kwargs) -> None:
        """transformers' notice (5.2x) that it will crop this cache: assisted and prompt-lookup
        decoding call it before the prompt's forward. A cache with layers that cannot be cropped
        is refused here with the reason and the way out (transformers itself would refuse it
        after the prompt, saying only that the cache cannot be cropped)."""
        stuck = [i for i, layer in enumerate(self.layers)
                 if isinstance(layer, KVBitsLayer) and not layer.is_croppable]
        if stuck:
            some = stuck if len(stuck) <= 8 else f"{stuck[:8]} and {len(stuck) - 8} more"
            raise ValueError(
                f"KVBitsCache({self.spec.describe()}) cannot be cropped, and transformers is "
                "about to crop it (assisted or prompt-lookup decoding crops the rejected "
                f"drafts): layers {some} keep no FP16 residual window (residual_length=0), "
                "so a rejected draft would already be quantized. Give the cache an FP16 "
                "residual window at least as long as a draft, e.g. KVBitsCache(model, spec, "
                "residual_length=32), or generate without assistant_model / "
                "prompt_lookup_num_tokens")
        self._recording = True
        # the layers' notice, as Cache.activate_past_recording gives it from 5.2x on (before,
        # it took no arguments: a caller's recurrent_states_to_keep reaches them here)
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    def __deepcopy__(self, memo):
        """A copy (transformers' prefix reuse: ``copy.deepcopy(prompt_cache)``) whose layers
        point at the copy: ``deepcopy`` keeps a weak reference as it is, so they would read the
        original's step flags (the decode loop's flushes and captures). The model's config is
        shared, not copied: the copy follows the model's attention implementation."""
        self.end_step_graphs()  # graphs are not copied; the copy enters the mode itself
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        if self._model_config is not None:
            memo[id(self._model_config)] = self._model_config
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        for layer in new.layers:
            if isinstance(layer, KVBitsLayer):
                layer._cache_ref = weakref.ref(new)
                layer._steps = None  # its own graphs, in its own pool, when it decodes
        return new

    def __getstate__(self):
        """For ``pickle`` / ``torch.save`` (as a ``DynamicCache`` pickles): the weak reference
        to the model does not pickle, and is dropped (a file that a cache loaded from the
        pickle :meth:`save` s then lacks the weight probe that refuses other weights of the
        same shape); the layers leave the step graphs' mode (:meth:`KVBitsLayer.__getstate__`)."""
        state = self.__dict__.copy()
        state["_model_ref"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        for layer in self.layers:
            if isinstance(layer, KVBitsLayer):
                layer._cache_ref = weakref.ref(self)

    def __iter__(self):
        """``DynamicCache``'s iteration: per layer ``(keys, values, window)``, the keys and
        values a dequantized copy of the tokens the layer holds (:meth:`KVBitsLayer.
        dequantized`), ``window`` a tensor for a sliding layer, else ``None``."""
        for layer in self.layers:
            keys, values = layer.dequantized()
            window = None
            if layer.is_sliding:
                window = torch.tensor(layer.sliding_window, dtype=torch.long,
                                      device=None if keys is None else keys.device)
            yield keys, values, window

    def save(self, path, **info):
        """Write this cache to ``path`` (safetensors: packed buffers, lengths, spec, the model's
        shape; ``info`` kept in the metadata), e.g. a prefilled document for later sessions
        (:mod:`kvbits.integrations.persist`). Returns the path."""
        from .persist import save_cache

        return save_cache(self, path, **info)

    @classmethod
    def load(cls, path, model_or_config, device=None, dtype=None) -> KVBitsCache:
        """A cache holding what :meth:`save` wrote, for ``model_or_config`` (a model of another
        shape is refused); each layer's store goes to that layer's device (a model spread over
        GPUs) and the model's dtype unless ``device`` / ``dtype`` say otherwise. Codebooks, FP8 scales and Hadamard channels come from the
        file: nothing is calibrated again."""
        from .persist import load_cache

        return load_cache(cls, path, model_or_config, device=device, dtype=dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """transformers' ``update``; a layer the cache was not built with (a cache made for a
        shallower model) is refused by name, not with an ``IndexError``."""
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"KVBitsCache: the model updates layer {layer_idx}, but this KVBitsCache has "
                f"{len(self.layers)} layers (built for another model?): build it from this "
                "model or its config, KVBitsCache(model, spec)")
        # The attention module calling (transformers' attention layers call update as a method
        # of theirs): its config says which attention reads what update returns. A cache built
        # for one model and handed to another that was not switched to kvbits (the same
        # checkpoint loaded twice) must give that one the whole history, not the new tokens.
        caller = sys._getframe(1).f_locals.get("self")
        self._caller_impl = getattr(getattr(caller, "config", None), "_attn_implementation",
                                    None)
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        finally:
            self._caller_impl = None

    def crop(self, *args, **kwargs) -> None:
        """transformers' ``crop``, all layers or none: every layer's cut is checked
        (:meth:`KVBitsLayer.crop_target`) before any layer is cut, so a cut that one layer
        cannot make (inside a quantized group, past a sliding window) leaves the cache whole."""
        for layer in self.layers:
            if isinstance(layer, KVBitsLayer):
                layer.crop_target(*args, **kwargs)
        super().crop(*args, **kwargs)

    # ------------------------------------------------------------------ lengths on the device
    def device_lengths_ok(self) -> bool:
        """Whether every layer can keep its lengths on the device (:meth:`LayerStore.
        device_lengths_ok`), so that two CUDA graphs, a plain and a flushing step, serve a whole
        generation."""
        quantized = {(ly.store.spec.residual_length, ly.store.spec.group_size)
                     for ly in self.layers if ly.store is not None and ly.store.spec.quantized}
        return (len(quantized) <= 1 and all(ly.store is not None for ly in self.layers)
                and all(ly.store.device_lengths_ok() for ly in self.layers))

    def begin_device_lengths(self, tokens: int) -> None:
        """Size every buffer for ``tokens`` tokens in all and move the lengths to the device.
        Before each step call :meth:`prepare_device_step`, after it :meth:`device_step_done`."""
        self.end_step_graphs()
        if not self.device_lengths_ok():
            raise ValueError("begin_device_lengths: some layer cannot keep its lengths on the "
                             "device (see KVBitsCache.device_lengths_ok)")
        for layer in self.layers:
            layer.store.begin_device_lengths(tokens)
        self._flush_now = False

    def prepare_device_step(self) -> bool:
        """Whether the next step flushes (its token brings the residual to R + G): the host
        knows, so it picks the graph to replay."""
        self._flush_now = any(ly.store.spec.quantized and ly.store.res_len + 1 ==
                              ly.store.spec.residual_length + ly.store.spec.group_size
                              for ly in self.layers)
        return self._flush_now

    def device_step_done(self, replayed: bool) -> None:
        """After each step: a replayed graph did not run the Python that counts the token (and
        the flushed group) on the host, so count them here; an eager step already did."""
        if replayed:
            for layer in self.layers:
                layer.store.device_step_done(self._flush_now and layer.store.spec.quantized)

    def end_device_lengths(self) -> None:
        for layer in self.layers:
            layer.store.end_device_lengths()
        self._flush_now = False

    def end_step_graphs(self) -> None:
        """Leave the replayed-steps mode in every layer (:mod:`~kvbits.integrations.
        step_graphs`) and drop their graphs: before editing the stores by hand. Later one-token
        steps enter it again."""
        for layer in self.layers:
            if isinstance(layer, KVBitsLayer):
                layer._leave_steps()

    def graph_pool(self, device: torch.device):
        """The memory pool of a live layer-step graph of this cache on ``device``, for the next
        capture to share (None: none is alive, and the capture starts a pool). A pool lives
        only while a graph captured into it does (a kept handle would outlive it: torch then
        fails an internal assertion), so it is taken from such a graph."""
        for layer in self.layers:
            steps = getattr(layer, "_steps", None)
            for g in (steps.graphs.values() if steps is not None else ()):
                if g.out.device == device:
                    return g.graph.pool()
        return None

    # generate() / masking only need what Cache implements on top of the layers; these are the
    # kvbits-specific extras.
    def nbytes(self) -> int:
        """Exact bytes held by all layers: codes + scales + zeros + FP sink and residual."""
        return sum(layer.store.nbytes() for layer in self.layers if layer.store is not None)

    def fp16_nbytes(self) -> int:
        """Bytes ``DynamicCache(config=...)`` would hold for the same tokens, in the model dtype
        (2 bytes per element for FP16/BF16 models)."""
        return sum(layer.dense_nbytes() for layer in self.layers)

    @property
    def stores(self) -> list[LayerStore | None]:
        """The per-layer stores (``None`` before a layer's first update)."""
        return [layer.store for layer in self.layers]

    def _warn_slow_path(self) -> None:
        if not self._warned_slow:
            self._warned_slow = True
            warnings.warn(
                "KVBitsCache is used without attn_implementation='kvbits': every step dequantizes "
                "the whole history (slow path) and prompt padding is not excluded from "
                "quantization. Pass the model to KVBitsCache(model, ...) or load it with "
                "attn_implementation='kvbits'.", stacklevel=3)


def _layer_codebooks(model_or_config, spec: QuantSpec, calibration, preset: str, n: int) -> list:
    """Per layer: the kvquant codebooks (None for other methods or ``calibration="uniform"``)."""
    if spec.method != "kvquant":
        if calibration is not None:
            raise ValueError(f"{CALIBRATION_USES}; the spec is {spec.describe()!r}")
        return [None] * n
    from ..methods import kvquant as kvq

    if calibration is None:
        raise ValueError(
            "method 'kvquant' needs codebooks: KVBitsCache(model, spec, calibration=PATH) with a "
            "file from `kvbits calibrate --model M --preset P -o PATH`, calibration='auto' "
            "(calibrate once and cache), or calibration='uniform' (no codebooks)")
    if isinstance(calibration, str) and calibration == "uniform":
        return [None] * n
    if isinstance(calibration, str) and calibration == "auto":
        if not hasattr(model_or_config, "named_parameters"):
            raise ValueError("calibration='auto' needs the model, not its config")
        calibration = kvq.auto_calibration(model_or_config, spec, preset=preset)
    elif isinstance(calibration, (str, os.PathLike)):
        calibration = kvq.Calibration.load(calibration)
    elif not isinstance(calibration, kvq.Calibration):
        raise ValueError("calibration= for method 'kvquant' must be 'auto', 'uniform', the path "
                         "of a file from `kvbits calibrate` or a kvbits.methods.kvquant."
                         f"Calibration; got {type(calibration).__name__}")
    calibration.check(model_or_config, spec)
    if len(calibration.layers) != n:
        raise ValueError(f"calibration has {len(calibration.layers)} layers, the model {n}")
    return list(calibration.layers)


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: the sliding window, or None for full attention."""
    n = getattr(config, "num_hidden_layers", None)
    if not is_count(n, 1):  # (an AttributeError, or a
        # TypeError inside a list product)
        raise ValueError(f"KVBitsCache needs the config's num_hidden_layers, a positive "
                         f"integer; {type(config).__name__} has {n!r}")
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        # Without layer_types a set sliding_window means every layer slides (Mistral-style).
        use = getattr(config, "use_sliding_window", True)
        return [_window(window) if (window is not None and use) else None] * n
    if len(types) < n:  # (the cache had fewer layers than the model, silently)
        raise ValueError(f"config.layer_types names {len(types)} layers, but num_hidden_layers "
                         f"is {n}")
    out = []
    for i, t in enumerate(types[:n]):
        if t in _FULL_TYPES:
            out.append(None)
        elif t in _SLIDING_TYPES:
            if window is None:
                raise ValueError(f"layer {i} is {t!r} but the config has no sliding_window")
            out.append(_window(window))
        else:
            raise NotImplementedError(
                f"KVBitsCache supports full and sliding-window attention layers; layer {i} is {t!r}")
    return out


def _window(window) -> int:
    """A sliding layer's window (tokens), as a positive int: a string was kept as is."""
    w = as_int(window)
    if w is None or w < 1:
        raise ValueError(f"config.sliding_window must be a positive integer (tokens), got "
                         f"{window!r}")
    return w


def _use_kvbits_attention(model) -> None:
    """Switch ``model`` (and its sub-models) to the registered ``"kvbits"`` attention."""
    register()
    if getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    impl = model.config.get_text_config(decoder=True)._attn_implementation
    if impl != ATTN_IMPLEMENTATION:
        raise RuntimeError(
            f"{type(model).__name__} did not switch to attn_implementation='kvbits' (it uses "
            f"{impl!r}); it must follow transformers' AttentionInterface")


# ------------------------------------------------------------------------------------ attention
def padding_starts(attention_mask: torch.Tensor | None, batch: int, kv_len: int,
                   device) -> torch.Tensor:
    """Left padding per sequence from a prefill's 4D mask: ``starts [B] int32``.

    Key ``j`` is padding iff no query row (of any head) attends to it. Padding must be a prefix
    of each sequence, otherwise a ``ValueError`` is raised (kvbits supports left padding only).
    ``None`` (the causal fast path of SDPA) means no padding.
    """
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    mask = attention_mask
    if mask.dim() != 4:
        raise ValueError(f"kvbits expects a 4D attention mask at prefill, got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        attend = mask
    else:  # additive float mask: 0 where attended, a large negative number (or -inf) elsewhere
        attend = mask > torch.finfo(mask.dtype).min / 2
    attend = attend[..., -kv_len:].expand(batch, -1, -1, -1)
    is_pad = ~attend.any(dim=2).any(dim=1)  # [B, kv_len]
    starts = is_pad.int().cumprod(dim=-1).sum(dim=-1)
    if bool((is_pad.sum(dim=-1) != starts).any()):
        raise ValueError(
            "kvbits supports left padding only: the attention mask hides tokens that are not a "
            "prefix of their sequence (right padding or holes). Use tokenizer.padding_side='left'.")
    return starts.to(torch.int32)


def _grow_padding(store, attention_mask: torch.Tensor | None, lq: int) -> None:
    """Left padding that continues past the prompt step: a prompt prefilled in chunks
    (``prefill_chunk_size``, down to one token a step) whose first chunk held only padding for
    some sequences. A key of the step that no row attends to is padding (a real token attends at
    least to itself, in a sliding window too); a sequence that held only padding before the step
    extends its padding by the step's leading padding keys, before anything of the step is
    quantized (and a padded batch's sink is regathered, ``LayerStore.set_padding``). Padding
    after a sequence's real tokens is refused, as at the prompt step."""
    if attention_mask is None:
        return
    if lq < 2 and store.all_hold_real_tokens(ahead=lq):  # before this step: a one-token step is
        # then real, as generate's are (no check, no host sync)
        return
    step = padding_starts(attention_mask, store.starts.shape[0], lq, store.device)
    if not bool(step.any()):
        return
    all_pad = store.starts >= store.seq_len - lq  # held only padding before this step
    if bool((step.bool() & ~all_pad).any()):
        raise ValueError(
            "kvbits supports left padding only: the attention mask hides tokens of this step "
            "that come after real tokens of their sequence (right padding or holes).")
    try:
        store.set_padding(torch.where(all_pad, store.starts + step, store.starts))
    except ValueError as err:  # a sink, and the layer already quantized tokens
        raise ValueError(
            "A sequence of this batch is still all padding after the prompt's first chunk, and "
            "this layer (attention sink) has already quantized tokens: prefill the prompt in "
            "chunks longer than its longest left padding (prefill_chunk_size), or in one step."
        ) from err


def kvbits_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs):
    """The ``"kvbits"`` attention: ``query [B, Hq, Lq, D]`` -> ``([B, Lq, Hq, D], None)``."""
    if kwargs.get("s_aux") is not None:  # (SDPA and the kernels ignored it: wrong, silently)
        raise NotImplementedError(
            f"{type(module).__name__} adds learned attention sinks (s_aux, gpt-oss style) to "
            "its softmax, which the kvbits attention does not apply: use transformers' "
            "DynamicCache with the model's own attention implementation (eager) for this model")
    softcap = kwargs.get("softcap")
    tag = getattr(key, "_kvbits", None)
    if tag is None:  # not a KVBitsCache tensor (no cache, DynamicCache, slow path)
        return full_attention(module, query, key, value, attention_mask, dropout,
                                         scaling, is_causal, **kwargs)
    layer: KVBitsLayer = tag.layer
    store = layer.store
    layer._attended = True
    if tag.prefill:
        B = query.shape[0]
        store.set_padding(padding_starts(attention_mask, B, key.shape[2], query.device))
        if store.inv_freq is not None:
            _check_positions(store, kwargs.get("position_ids"), query.shape[2])
        out = full_attention(module, query, key, value, attention_mask, dropout,
                                        scaling, is_causal, **kwargs)
        # Assisted / prompt-lookup decoding verifies its first drafts in the prompt's forward:
        # the groups they bring due are put back by the crop of the rejected ones, which then
        # leaves the split that a prefill without them makes (only then: the FP16 copies would
        # otherwise stay in memory, and in a file saved after the prompt, until the next step)
        cache = layer._cache
        if layer.is_croppable and cache is not None and cache._recording:
            store.track_flushes()
        store.flush()  # the prompt is quantized in one call, padding excluded
        return out
    window = kwargs.get("sliding_window")
    if window is None:
        window = layer.sliding_window
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if tag.step:
        out = layer._run_step(query, scale, window, softcap)
    elif tag.device:
        out = steps_mod.attend_dev(store, query, scale, window, softcap)
    else:
        # the chunk's padding first: a left padding longer than the first prefill chunk is
        # known only now, and the positions are checked against it (session 41 QA)
        _grow_padding(store, attention_mask, query.shape[2])
        if store.inv_freq is not None:
            _check_positions(store, kwargs.get("position_ids"), query.shape[2])
        out = _attend_as_generated(query, store, scale, window, softcap)
    return out.transpose(1, 2).contiguous(), None


def _check_positions(store, position_ids, q_len: int) -> None:
    """Pre-RoPE keys are re-rotated at position ``t - starts[b]``: refuse other position ids."""
    if position_ids is None:
        return
    pos = position_ids.to(store.device).long()
    t = store.seq_len - q_len + torch.arange(q_len, device=store.device)
    want = t[None, :] - store.starts[:, None].long()  # [B, Lq]
    pos = pos.expand_as(want)
    real = want >= 0
    if not bool((pos[real] == want[real]).all()):
        raise ValueError(
            "pre_rope: the model's position_ids are not token index minus left padding, which "
            "is where the cache re-rotates its pre-RoPE keys; use pre_rope=False for custom "
            "position ids")


def _attend_as_generated(query: torch.Tensor, store, scale: float, window,
                         softcap: float | None = None) -> torch.Tensor:
    """Attention of ``Lq`` new rows over the store, each row seeing exactly the quantized / FP16
    split it would see if the tokens had been generated one at a time.

    Row ``i`` (position ``p``) is decoded when the sequence holds ``p + 1`` tokens; the groups
    flushed by then are quantized, later tokens are still FP16. Rows are processed in runs that
    share one flush state (at most G rows each), flushing in between; ``lengths`` hides the
    tokens after each run's last row, so causality holds inside the run.
    """
    query = store.rotate_query(query)  # Hadamard keys: queries in the same (rotated) space
    total, lq = store.seq_len, query.shape[2]
    spec = store.spec
    if lq == 1 or not spec.quantized:
        store.flush()
        return ops.decode_attention(query, store.view(), scale=scale, starts=store.starts,
                                    window=window, softcap=softcap)
    first = total - lq  # tokens before the first new row
    outs, i0 = [], 0
    while i0 < lq:
        store.flush(upto=first + i0 + 1)
        if i0 == 0:  # what the later rows (drafts) flush, a crop of them puts back
            store.track_flushes()
        next_flush = store.sink_len + store.body_len + spec.residual_length + spec.group_size
        i1 = min(lq, next_flush - first - 1)
        outs.append(ops.decode_attention(query[:, :, i0:i1], store.view(), scale=scale,
                                         starts=store.starts, lengths=first + i1, window=window,
                                         softcap=softcap))
        i0 = i1
    store.flush()
    return torch.cat(outs, dim=2)


def register() -> None:
    """Register ``"kvbits"`` in transformers' attention and attention-mask interfaces.

    The mask function is SDPA's: without it, models would get no mask for ``"kvbits"`` and
    sliding-window layers would silently attend to everything. Idempotent; runs on import.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbits_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
