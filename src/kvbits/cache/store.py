"""One layer's KV store: FP16 sink | packed body | FP16 residual, for a whole batch.

The store owns growing buffers in the layout of :mod:`kvbits.formats.layout`. ``append`` puts new
tokens in the sink until it holds S, then in the residual; once the residual holds R + G tokens
or more, its oldest whole groups of G are quantized in one call and moved to the body. Each token
is quantized exactly once, from its original values: history is never re-quantized.

Left padding is tracked per sequence (``starts``) so padding never enters a group's min/max.
In a left-padded batch each sequence's sink holds *its own* first S tokens (gathered at the
prompt, :meth:`LayerStore.set_padding`), so a shorter prompt keeps its attention sink in FP16
like an unpadded one: sequence ``b``'s sink token ``j`` sits at position ``starts[b] + j``, and
its body and residual are visible from index ``starts[b] + sink_len`` on (the copies of the sink
tokens there are hidden, and kept out of every group's min/max).

KVQuant (``spec.method == "kvquant"``): the store also holds the layer's codebooks and the
per-token outliers of the body (see :mod:`kvbits.methods.kvquant`); with ``spec.pre_rope`` the
keys are un-rotated (at position ``t - starts[b]``) right before they are quantized, and the
dequantized body keys are rotated back; under a partial rotary embedding every key (and each
query, :meth:`LayerStore.rotate_query`) is first put in the channel order that makes the
rotation a whole-head one (``key_order``, :func:`kvbits.reference.rope.partial_rotary_layout`).

Method breadth: "uniform" quantizes keys and values each per-channel or per-token
(``spec.key_axis`` / ``value_axis``; the quantize_pack kernels serve both axes: per-token keys
go through the per-token (value) quantizer and per-channel values through the per-channel (key)
one); "fp8" stores float8 e4m3 with a float32 scale per sequence and head (set from the first
quantized tokens' amax, or given by a calibration); ``spec.hadamard`` keeps every key rotated
(:mod:`kvbits.reference.hadamard`) and :meth:`LayerStore.rotate_query` rotates the queries.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .. import ops
from ..checks import as_int, require_count
from ..formats.layout import PackedKV, body_bytes_per_token, pre_rope_kernel_ok
from ..formats.packing import packed_length
from ..methods import kvquant as kvq
from ..reference import hadamard as ref_hadamard
from ..reference import quant as ref_quant
from ..reference import rope as ref_rope
from ..reference.attention import dequantize_body, place_sinks
from ..spec import QuantSpec


class CropInGroupError(ValueError):
    """:meth:`LayerStore.check_crop`'s refusal of a cut inside a quantized group (the cut tokens
    were quantized: only a longer FP16 residual keeps them croppable)."""


class LayerStore:
    """K/V of one decoder layer for ``batch`` sequences of ``kv_heads`` heads of ``head_dim``."""

    # (class defaults: a store pickled before they existed loads with them)
    layer_idx: int | None = None  # the decoder layer, for messages (None: unnamed)
    _range_checked = False  # _check_range has read this layer's first flush (it checks once)

    def __init__(self, spec: QuantSpec, batch: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str,
                 codebooks: kvq.LayerCodebooks | None = None,
                 inv_freq: torch.Tensor | None = None,
                 fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 hadamard_channels: list | None = None, layer_idx: int | None = None):
        """``codebooks``: the layer's kvquant tables (uniform = KIVI codes when None);
        ``inv_freq [head_dim / 2]``: the layer's RoPE frequencies, needed when ``spec.pre_rope``;
        ``fp8_scales``: float32 ``(k_scale, v_scale)`` of shape ``[kv_heads]`` (dequant
        multipliers) for ``fp8_scale="calibrated"``; ``hadamard_channels``: per KV head the
        channels to rotate, for ``spec.hadamard_calibrated`` (see
        :mod:`kvbits.methods.hadamard`); ``layer_idx``: the decoder layer's index, named by
        the warning of :meth:`_check_range`."""
        self.spec = spec
        self.layer_idx = layer_idx
        batch, kv_heads, head_dim = (require_count(f"LayerStore: {name}", n, 1) for name, n in
                                     (("batch", batch), ("kv_heads", kv_heads),
                                      ("head_dim", head_dim)))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            # (an integer store cast every appended token to integers, silently)
            raise ValueError(f"LayerStore: dtype must be the model's floating-point dtype "
                             f"(float16, bfloat16, float32, ...), got {dtype}")
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.value_group = spec.value_group(head_dim)
        if head_dim % spec.group_size and spec.method in ("kivi", "uniform", "kvquant"):
            how = (f"values are quantized in groups of {self.value_group} channels"
                   if self.value_group != spec.group_size else
                   f"the last value group holds {head_dim % self.value_group} channels")
            warnings.warn(f"group_size {spec.group_size} does not divide head_dim {head_dim}: "
                          f"{how} (spec.value_group)", stacklevel=2)
        self.starts = torch.zeros(batch, dtype=torch.int32, device=self.device)
        # host-side bound: no sequence has hidden tokens (padding, or copies of its sink) in
        # the body or residual at positions >= this
        self._pad_end = 0
        self._pad = 0  # max(starts) when the padding was set: the longest left padding
        self._pad_now = 0  # max(starts) now (eviction shifts them), or a bound above it
        self._row_sinks = False  # the sink holds each sequence's own first tokens (padded batch)
        self._sink_closed = False  # ... and takes no more (it is full, or tokens were quantized)
        self.lens_dev: torch.Tensor | None = None  # device lengths mode (begin_device_lengths)
        self._dev_valid = False  # that mode: flushes still need a padding mask
        self._dense = None  # reference path only: see _dense_body
        # track_flushes: FP16 (keys, values) of the newest groups flushed since, as they sat
        # in the residual (the end of the body); until the next append or edit
        self._undo = None
        self.sink_len = self.body_len = self.res_len = 0
        # Tokens dropped from the front by evict() (sliding-window layers): stored index i is
        # the sequence's token evicted + i. The sink goes with the first eviction, for good.
        self.evicted = 0
        B, H, D = batch, kv_heads, head_dim
        fp = dict(dtype=dtype, device=self.device)
        self.sink_k = torch.empty(B, H, spec.sink_tokens, D, **fp)
        self.sink_v = torch.empty(B, H, spec.sink_tokens, D, **fp)
        self.res_k = torch.empty(B, H, 0, D, **fp)
        self.res_v = torch.empty(B, H, 0, D, **fp)
        self.k_words = packed_length(spec.group_size, spec.key_bits)
        self.v_words = packed_length(spec.group_size, spec.value_bits)
        n_vgroups = spec.value_groups(D)  # the last one shorter when value_group does not divide D
        i32 = dict(dtype=torch.int32, device=self.device)
        f16 = dict(dtype=torch.float16, device=self.device)
        self.fp8 = spec.method == "fp8"
        self.key_axis, self.value_axis = spec.key_axis, spec.value_axis
        meta_width = {"channel": D, "token": n_vgroups}
        self.k_codes = torch.empty(B, H, 0, D, **i32)
        self.k_scale = torch.empty(B, H, 0, meta_width[self.key_axis], **f16)
        self.k_zero = torch.empty(B, H, 0, meta_width[self.key_axis], **f16)
        self.v_codes = torch.empty(B, H, 0, D, **i32)
        self.v_scale = torch.empty(B, H, 0, meta_width[self.value_axis], **f16)
        self.v_zero = torch.empty(B, H, 0, meta_width[self.value_axis], **f16)
        self._fp8_ready = False
        if self.fp8:
            f8 = dict(dtype=ref_quant.FP8_DTYPE, device=self.device)
            self.k_codes = torch.empty(B, H, 0, D, **f8)
            self.v_codes = torch.empty(B, H, 0, D, **f8)
            self.k_zero = self.v_zero = None
            self.k_scale = torch.ones(B, H, 1, 1, dtype=torch.float32, device=self.device)
            self.v_scale = torch.ones(B, H, 1, 1, dtype=torch.float32, device=self.device)
            if spec.fp8_scale == "calibrated":
                if fp8_scales is None:
                    raise ValueError("QuantSpec.fp8_scale='calibrated' needs the layer's scales "
                                     "(KVBitsCache(model, 'fp8', calibration='auto' or a file))")
                for name, sc in zip(("k", "v"), fp8_scales):
                    if tuple(sc.shape) != (H,):
                        raise ValueError(f"fp8 {name} scales have shape {tuple(sc.shape)}, this "
                                         f"layer needs [kv_heads={H}]")
                    setattr(self, f"{name}_scale", sc.float().to(self.device).view(1, H, 1, 1)
                            .expand(B, H, 1, 1).contiguous())
                self._fp8_ready = True
        # (the calibrated subsets never need the whole-head matrix, which head dims without a
        # power-of-two block of 8 channels cannot have: session 41 QA, head_dim 100)
        self.hadamard = (ref_hadamard.hadamard_matrix(D, self.device)
                         if spec.hadamard and spec.quantized and not spec.hadamard_calibrated
                         else None)
        if spec.hadamard and spec.quantized and spec.hadamard_calibrated:
            if hadamard_channels is None or len(hadamard_channels) != H:
                raise ValueError("QuantSpec.hadamard_calibrated needs the channels of each of the "
                                 f"{H} KV heads (KVBitsCache(model, spec, calibration='auto'))")
            # [H, D, D]; None when no head rotates anything (plain KIVI for this layer)
            self.hadamard = (ref_hadamard.head_matrices(D, hadamard_channels, self.device)
                             if any(len(c) for c in hadamard_channels) else None)
        # split once here: rotating on the decode path is then one matmul and one multiply
        self._rotation = None if self.hadamard is None else ref_hadamard.factor(self.hadamard)
        self.kvquant = spec.method == "kvquant"
        self.n_out = spec.n_outliers(D) if self.kvquant else 0
        self.codebooks = None
        if self.kvquant:
            cb = codebooks or kvq.uniform_codebooks(H, spec.key_bits, spec.value_bits)
            want = ((H, 1 << spec.key_bits), (H, 1 << spec.value_bits))
            got = (tuple(cb.k_codebook.shape), tuple(cb.v_codebook.shape))
            if got != want:
                raise ValueError(f"codebooks have shapes {got}, this layer needs {want} "
                                 "([kv_heads, 2**bits] for K and V)")
            self.codebooks = cb.to(self.device)
        # key_scales="calibrated": the layer's offline [H, D] key scale / zero, one fixed
        # [B, H, 1, D] row for every group (not grown, cut or evicted with the body)
        self.fixed_key_scales = self.kvquant and spec.key_scales == "calibrated"
        if self.fixed_key_scales:
            rows = (self.codebooks.k_scale, self.codebooks.k_zero)
            if any(r is None or tuple(r.shape) != (H, D) for r in rows):
                raise ValueError("QuantSpec.key_scales='calibrated' needs the layer's offline "
                                 f"key scale and zero rows [kv_heads={H}, head_dim={D}] from a "
                                 "calibration (KVBitsCache(model, spec, calibration='auto' or a "
                                 "file); 'uniform' has none)")
            self.k_scale, self.k_zero = (r.to(self.device, torch.float16).view(1, H, 1, D)
                                         .expand(B, H, 1, D).contiguous() for r in rows)
        idx_dtype = kvq.outlier_index_dtype(D)
        n = self.n_out
        self.k_out_idx = torch.empty(B, H, 0, n, dtype=idx_dtype, device=self.device)
        self.k_out_val = torch.empty(B, H, 0, n, **f16)
        self.v_out_idx = torch.empty(B, H, 0, n, dtype=idx_dtype, device=self.device)
        self.v_out_val = torch.empty(B, H, 0, n, **f16)
        self.inv_freq = None
        self.key_order = self._key_order_inv = None  # partial rotary: keys in that order
        if spec.pre_rope and spec.quantized:
            if inv_freq is None:
                raise ValueError("QuantSpec.pre_rope=True needs the layer's RoPE inv_freq "
                                 "(KVBitsCache reads it from the model)")
            # a partial rotary embedding (fewer than D/2 frequencies): keys and queries in the
            # channel order that makes it a whole-head one (reference.rope.partial_rotary_layout)
            order, inv_freq = ref_rope.partial_rotary_layout(inv_freq.float().cpu(), D)
            if order is not None:
                if self.hadamard is not None:
                    raise ValueError("pre_rope with a partial rotary embedding and hadamard keys "
                                     "cannot be combined; use one of them")
                self.key_order = order.to(self.device)
                self._key_order_inv = torch.argsort(order).to(self.device)
            self.inv_freq = inv_freq.to(self.device)

    # ------------------------------------------------------------------ state
    @property
    def seq_len(self) -> int:
        """Tokens stored (what the kernels index)."""
        return self.sink_len + self.body_len + self.res_len

    def all_hold_real_tokens(self, ahead: int = 0) -> bool:
        """Whether every sequence holds a token of its own among the stored ones before the
        last ``ahead``, read off host-side state (no device read, so a decode step can ask): False
        may also mean "not known" (a cache restored from a file after its padding was set)."""
        return self._pad_now < self.seq_len - ahead

    @property
    def total_len(self) -> int:
        """Tokens seen: those stored and those evicted."""
        return self.evicted + self.seq_len

    def view(self) -> PackedKV:
        """The storage as a :class:`PackedKV` (views, no copies)."""
        raw = self.view_raw()
        if not ops.use_kernels(self.res_k) or not ops.kernel_reads(raw):
            raw.dense_body = self._dense_body()
        return raw

    def _dense_body(self):
        """float32 (K, V) of the body for the reference path, dequantized once per group.

        Only the groups added since the last call are dequantized (the body is append-only), so
        a CPU decode step costs the attention itself, not a dequantization of all history.
        """
        if not self.body_len:
            return None
        done = 0 if self._dense is None else self._dense[0].shape[2]
        if done > self.body_len:  # the body shrank (crop, reset)
            self._dense, done = None, 0
        if done < self.body_len:
            k, v = dequantize_body(self.view_raw(), done, self.body_len, self.starts)
            if self._dense is not None:
                k = torch.cat([self._dense[0], k], dim=2)
                v = torch.cat([self._dense[1], v], dim=2)
            self._dense = (k, v)
        return self._dense

    def view_raw(self) -> PackedKV:
        """:meth:`view` without the dequantized body (what a kernel reads)."""
        s = self.spec
        n = self.n_out > 0
        return PackedKV(
            self.sink_k, self.sink_v, self.sink_len,
            self.k_codes, self.k_scale, self.k_zero,
            self.v_codes, self.v_scale, self.v_zero, self.body_len,
            self.res_k, self.res_v, self.res_len,
            s.key_bits, s.value_bits, s.group_size, self.value_group, None,
            k_codebook=self.codebooks.k_codebook if self.kvquant else None,
            v_codebook=self.codebooks.v_codebook if self.kvquant else None,
            k_out_idx=self.k_out_idx if n else None, k_out_val=self.k_out_val if n else None,
            v_out_idx=self.v_out_idx if n else None, v_out_val=self.v_out_val if n else None,
            rope_inv_freq=self.inv_freq,
            key_axis=self.key_axis, value_axis=self.value_axis, fp8=self.fp8,
            key_scales_fixed=self.fixed_key_scales, owner=self,
        )

    # ------------------------------------------------------------------ key space
    def _store_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The model's keys ``[B, H, T, D]`` in the key space of the store: rotated when
        ``spec.hadamard``, reordered under a partial rotary embedding (``key_order``)."""
        if self.hadamard is not None:
            return ref_hadamard.rotate(k, self._rotation)
        return k if self.key_order is None else k.index_select(-1, self.key_order)

    def rotate_query(self, query: torch.Tensor) -> torch.Tensor:
        """``query [B, Hq, Lq, D]`` in the key space of the store: rotated like the keys when
        ``spec.hadamard``, reordered like them under a partial rotary embedding (scores
        unchanged either way), else returned as is."""
        if self.hadamard is not None:
            if self.hadamard.dim() == 2:
                return ref_hadamard.rotate(query, self._rotation)
            B, Hq, Lq, D = query.shape  # per KV head: its group's query heads take its matrix
            if Hq % self.kv_heads:
                raise ValueError(f"hadamard: {Hq} query heads are not a multiple of "
                                 f"{self.kv_heads} KV heads")
            grouped = query.reshape(B, self.kv_heads, Hq // self.kv_heads * Lq, D)
            return ref_hadamard.rotate(grouped, self._rotation).view(B, Hq, Lq, D)
        return query if self.key_order is None else query.index_select(-1, self.key_order)

    def model_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys read from the store (e.g. :func:`dequantize_layer`) back in the model's space
        (undoes the Hadamard rotation, the matrix being its own inverse, or the reordering)."""
        if self.hadamard is not None:
            return ref_hadamard.rotate(keys, self._rotation)
        return keys if self.key_order is None else keys.index_select(-1, self._key_order_inv)

    def nbytes(self, fp_itemsize: int | None = None) -> int:
        """Exact bytes of the tokens held: codes + scales + zeros (+ outliers and the layer's
        codebooks for kvquant) + the FP sink and residual (``fp_itemsize`` bytes per element:
        default the model dtype's; 2 to count them as an FP16 model would)."""
        itemsize = self.res_k.element_size() if fp_itemsize is None else fp_itemsize
        fp = 2 * (self.sink_len + self.res_len) * self.head_dim * itemsize
        body = self.body_len * body_bytes_per_token(
            self.head_dim, self.spec.key_bits, self.spec.value_bits, self.spec.group_size,
            self.value_group, self.n_out, self.key_axis, self.value_axis, self.fp8,
            self.fixed_key_scales)
        tables = 0
        if self.fp8 and self.body_len:  # a float32 K and V scale per sequence and head
            fp += 2 * 4
        if self.fixed_key_scales and self.body_len:  # an FP16 key scale and zero per channel
            fp += 2 * 2 * self.head_dim
        if self.kvquant and self.body_len:
            tables = 4 * (self.codebooks.k_codebook.numel() + self.codebooks.v_codebook.numel())
        return int(round(self.batch * self.kv_heads * (fp + body) + tables))

    # ------------------------------------------------------------------ writes
    def set_padding(self, starts: torch.Tensor) -> None:
        """Record left padding: sequence ``b`` has padding at positions ``< starts[b]``.

        Set it before the prompt's tokens are quantized (the HF integration sets it between
        ``append(..., flush=False)`` and :meth:`flush`). With a sink, each padded sequence's
        sink then holds its *own* first tokens (positions ``starts[b] + j``,
        :meth:`_settle_sinks`), regathered if the padding grew after an earlier call (a prompt
        prefilled in chunks: the sink was gathered at the old ``starts``)."""
        self._host_lengths("set_padding")
        self._undo = None
        starts = torch.as_tensor(starts)
        if starts.dtype == torch.bool or starts.is_floating_point() or starts.is_complex():
            # (a float was truncated silently: 3.9 -> 3 tokens of padding)
            raise ValueError(f"set_padding: starts must be integers (padding tokens per "
                             f"sequence), got {starts.dtype}")
        starts = starts.to(device=self.device, dtype=torch.int32)
        if starts.shape != (self.batch,):
            raise ValueError(f"set_padding: starts must hold one position per sequence "
                             f"({self.batch}), got shape {tuple(starts.shape)}")
        # One host read here (at prefill) spares one per flush during decode.
        low, pad = torch.stack(torch.aminmax(starts)).tolist() if starts.numel() else (0, 0)
        if low < -self.evicted:  # (a sequence begins at or after the first token seen:
            # starts turn negative only as eviction shifts them; a sink gathered out of range)
            raise ValueError(f"set_padding: starts must be >= {-self.evicted} (padding tokens "
                             f"per sequence), got {low}")
        if pad > 0 and self.spec.sink_tokens and (self.body_len or self.evicted):
            raise ValueError("set_padding: this layer already holds quantized tokens; set the "
                             "padding before the prompt is flushed (append(..., flush=False), "
                             "set_padding, flush)")
        fp = None
        if pad > 0 and self.spec.sink_tokens:  # in position order by the old starts; reopened
            fp, self._sink_closed = self._fp_in_order(), False
        self.starts, self._pad = starts, pad
        self._pad_now = pad
        self._settle_sinks(fp)

    def _settle_sinks(self, fp=None) -> None:
        """In a left-padded batch whose sink is still open, (re)gather every sequence's first
        real tokens into the sink from the FP16 tokens held (the sink and the residual, ``fp``
        if given, in position order; nothing is quantized yet): ``min(S, tokens held)`` slots,
        as many as an unpadded sequence would hold. A shorter sequence's slots past its last
        token wait for their tokens (:meth:`_fill_row_sinks` copies them there as they come;
        until then no query sees those positions). The sink closes once it has S slots, or at
        the first flush. Keeps ``_pad_end`` (the host bound of hidden positions) in step."""
        if self._pad and self.spec.sink_tokens and not self._sink_closed:
            k, v = fp if fp is not None else self._fp_in_order()
            n = k.shape[2]
            # Slots for S tokens whatever the shortest sequence holds: fewer (the shortest's
            # count) would leave the first tokens of every longer sequence out of its sink,
            # quantized at the first flush, so padding would change the other sequences.
            keep = min(self.spec.sink_tokens, n)
            at = self.starts.long()[:, None] + torch.arange(keep, device=self.device)  # [B, keep]
            at = at.clamp(max=max(n - 1, 0))  # a slot whose token has not come yet: any value
            at = at[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
            self.sink_k[:, :, :keep] = torch.gather(k, 2, at)
            self.sink_v[:, :, :keep] = torch.gather(v, 2, at)
            self.res_k, self.res_v = (_write(x.new_empty(*x.shape[:2], 0, x.shape[3]), 0,
                                             x[:, :, keep:]) for x in (k, v))
            self.sink_len, self.res_len = keep, n - keep
            self._row_sinks = True
            self._sink_closed = keep == self.spec.sink_tokens
        self._pad_end = self._pad + self.sink_len if self._pad else 0

    def _fill_row_sinks(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """Tokens ``k, v [B, H, T, D]`` just stored at positions ``first ..``: copy those that
        are a sequence's own sink tokens (position ``starts[b] + j``, ``j < sink_len``) into its
        sink slot ``j`` (a sequence whose prompt held fewer real tokens than the sink's slots,
        :meth:`_settle_sinks`). Their copies in the body / residual stay hidden there."""
        T = k.shape[2]
        idx = (self.starts.long()[:, None] - first
               + torch.arange(self.sink_len, device=self.device))  # [B, S]: index in k
        due = (idx >= 0) & (idx < T)
        if not T or not bool(due.any()):
            return
        at = idx.clamp(0, T - 1)[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        due = due[:, None, :, None]
        S = self.sink_len
        self.sink_k[:, :, :S] = torch.where(due, torch.gather(k, 2, at), self.sink_k[:, :, :S])
        self.sink_v[:, :, :S] = torch.where(due, torch.gather(v, 2, at), self.sink_v[:, :, :S])

    def _fp_in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sink and residual (no body yet) as one ``[B, H, n, D]`` pair in position order:
        per-sequence sink tokens go back to their positions ``starts[b] + j``."""
        k = torch.cat([self.sink_k[:, :, :self.sink_len], self.res_k[:, :, :self.res_len]], 2)
        v = torch.cat([self.sink_v[:, :, :self.sink_len], self.res_v[:, :, :self.res_len]], 2)
        if self._row_sinks and self.sink_len:
            k, v = (place_sinks(x, self.starts, self.sink_len) for x in (k, v))
        return k, v

    def _close_sink(self) -> None:
        """No more sink tokens: the first group is about to be quantized."""
        self._sink_closed = self._sink_closed or bool(self._pad)

    def _visible_from(self) -> torch.Tensor:
        """``[B, 1]``: each sequence's first body/residual index that it sees (past its padding
        and the copies of its sink tokens)."""
        return (self.starts + self.sink_len)[:, None]

    def append(self, k: torch.Tensor, v: torch.Tensor, flush: bool = True) -> None:
        """Add ``k, v [B, H, T, D]`` at the end of every sequence.

        With ``flush=False`` the tokens wait in the residual until :meth:`flush` (the HF
        integration defers it until the prompt's padding is known).
        """
        self._host_lengths("append")
        self._undo = None  # a new step: what the last one flushed stays flushed
        self._check_input(k, v)
        k, v = self._store_keys(k.to(self.dtype)), v.to(self.dtype)
        # padded batch: the sink is gathered per sequence (_settle_sinks), not taken in order
        take = 0 if self.evicted or self._sink_closed or self._pad else \
            min(self.spec.sink_tokens - self.sink_len, k.shape[2])
        if take > 0:
            self.sink_k[:, :, self.sink_len:self.sink_len + take] = k[:, :, :take]
            self.sink_v[:, :, self.sink_len:self.sink_len + take] = v[:, :, :take]
            self.sink_len += take
            k, v = k[:, :, take:], v[:, :, take:]
        first = self.seq_len  # position of the first new token
        if k.shape[2]:
            self.res_k = _write(self.res_k, self.res_len, k)
            self.res_v = _write(self.res_v, self.res_len, v)
            self.res_len += k.shape[2]
        if self._row_sinks and self.sink_len and first < self._pad_end:
            self._fill_row_sinks(k, v, first)
        if self._pad and not self._sink_closed:
            self._settle_sinks()
        if flush:
            self.flush()

    # ------------------------------------------------------------------ lengths on the device
    # A replayable decode step that also flushes: the true lengths live in ``lens_dev`` (int32
    # [sink, body, residual]), every write goes to a device index, the flush is of a fixed size
    # (the residual's first G tokens, when it holds exactly R + G), and the buffers are sized for
    # the whole generation up front. Then two CUDA graphs, a plain step and a flushing step,
    # serve every step. The host keeps its lengths in step with :meth:`device_step_done`.
    def device_lengths_ok(self) -> bool:
        """Whether this layer can run with its lengths on the device: a full sink, a residual
        that flushes one group at a time, FP8 scales already set (dynamic ones are fixed by the
        first flush), and, where the kernels run, a layout the decode kernel reads (it reads the
        device lengths; the reference reads the host ones): pre-RoPE keys need an even
        head_dim >= 32 (:func:`~kvbits.formats.layout.pre_rope_kernel_ok`)."""
        s = self.spec
        if self.sink_len < s.sink_tokens and not (self.evicted or self._sink_closed):
            return False
        if self._row_sinks and self.sink_len and self.seq_len < self._pad_end:
            return False  # a sequence's sink slots still wait for its tokens (append fills them)
        if not s.quantized:
            return True
        D = self.head_dim
        return (self.res_len < s.residual_length + s.group_size
                and (not self.fp8 or self._fp8_ready)
                and (self.inv_freq is None or pre_rope_kernel_ok(D, self.key_axis)
                     or not ops.use_kernels(self.res_k)))

    def reserve(self, tokens: int, residual: int = 0) -> None:
        """Allocate the packed-body buffers for ``tokens`` tokens (0: leave them) and the FP16
        residual for ``residual`` tokens now (buffers only grow; contents kept): a serving engine
        that knows the final length allocates once, and a captured step must never reallocate."""
        self._host_lengths("reserve")
        tokens, residual = (require_count(f"reserve: {name}", n, 0) for name, n in
                            (("tokens", tokens), ("residual", residual)))
        groups = tokens // self.spec.group_size + 1
        caps = {name: groups * rows for name, rows in self._rows_per_group().items()} \
            if tokens else {}
        caps.update(res_k=residual, res_v=residual)
        for name, cap in caps.items():
            buf = getattr(self, name)
            if buf is not None and buf.shape[2] < cap:
                setattr(self, name, _realloc(buf, 0, buf.shape[2], _capacity(cap)))

    def _rows_per_group(self) -> dict:
        """Rows (dim 2) per quantized group of each packed-body buffer."""
        G = self.spec.group_size
        rows = {"channel": 1, "token": G}  # scale/zero rows per axis
        if self.fp8:  # float8 codes per token; [B, H, 1, 1] scales are not per group
            return {"k_codes": G, "v_codes": G}
        out = {"k_codes": self.k_words, "v_codes": self.v_words,
               "k_scale": rows[self.key_axis], "k_zero": rows[self.key_axis],
               "v_scale": rows[self.value_axis], "v_zero": rows[self.value_axis]}
        if self.n_out:
            out.update(dict.fromkeys(_OUTLIER_BUFFERS, G))
        if self.fixed_key_scales:  # one row for every group
            del out["k_scale"], out["k_zero"]
        return out

    def evict(self, upto: int) -> int:
        """Drop the stored tokens before index ``upto`` that no later query can see (a sliding
        window's past), in whole quantized groups (FP16 specs: residual tokens), with the sink
        before them; returns how many tokens went. Only once at least 1 / ``EVICT_RATIO`` as
        many go as stay, so copying the kept ones costs O(1) per token over a generation, and
        not while lengths live on the device (a captured step's buffers must not move).
        ``starts`` shift with the tokens and may turn negative: a sequence then began that far
        before the first stored token, which keeps every mask (relative to stored indices) and
        the pre-RoPE re-rotation (at ``index - starts``) exact with no offset in the kernels."""
        if self.lens_dev is not None:
            return 0
        n = as_int(upto)  # (a float failed inside narrow, None on a subtraction)
        if n is None:
            raise ValueError(f"evict: upto must be an integer (a stored index), got {upto!r}")
        upto = n
        if self.fp8 and not self._fp8_ready and self.body_len:
            return 0  # a padded sequence's dynamic scales wait for its first own token
        self._undo = None
        if self.sink_len and self._pad_end > upto:  # a sequence still sees its own sink
            return 0
        # A padded sequence's sink copies still in the residual: hidden by the sink now, not
        # once it went, so their flush would count them in their group's min/max (an attention
        # sink's outlier key over keys a window still reads). They go once quantized.
        if self.sink_len and self.spec.quantized and self._pad_end > self.sink_len + self.body_len:
            return 0
        if not self.spec.quantized:  # FP16 spec: every token is in the residual
            drop = min(max(0, upto - self.sink_len), self.res_len)
            if drop == 0 or EVICT_RATIO * drop < self.res_len - drop:
                return 0
            self._set_residual(drop, self.res_len - drop)
            gone = self.sink_len + drop
        else:
            G = self.spec.group_size
            groups = self.body_len // G
            drop = min(max(0, (upto - self.sink_len) // G), groups)
            if drop == 0 or EVICT_RATIO * drop < groups - drop:
                return 0
            for name, rows in self._rows_per_group().items():
                n = (groups - drop) * rows
                setattr(self, name, _realloc(getattr(self, name), drop * rows, n, _capacity(n)))
            gone = self.sink_len + drop * G
            if self._dense is not None:  # the reference path's dequantized body follows
                self._dense = tuple(x[:, :, drop * G:] for x in self._dense)
            self.body_len -= drop * G
        self.sink_k, self.sink_v = self.sink_k[:, :, :0], self.sink_v[:, :, :0]
        self.sink_len = 0
        self.starts = self.starts - gone
        self._pad_now -= gone
        self._pad_end = max(0, self._pad_end - gone)
        self.evicted += gone
        return gone

    def begin_device_lengths(self, tokens: int) -> torch.Tensor:
        """Enter the mode for a generation of up to ``tokens`` tokens in all: sizes every buffer,
        returns ``lens_dev``. Requires :meth:`device_lengths_ok`."""
        if not self.device_lengths_ok():
            raise ValueError("begin_device_lengths: this layer cannot keep its lengths on the "
                             "device (see LayerStore.device_lengths_ok)")
        s = self.spec
        self._undo = None
        fp_max = tokens if not s.quantized else s.residual_length + s.group_size
        self.reserve(tokens, max(fp_max, self.res_len))
        for buf in (self.res_k, self.res_v):
            # finite until written: the kernel hides these slots, but 0 * garbage may be NaN
            buf.narrow(2, self.res_len, buf.shape[2] - self.res_len).zero_()
        # left padding still in the residual: its groups flush with a validity mask (all True
        # past the padding, so the same graph serves every flush)
        self._dev_valid = self._pad_end > self.sink_len + self.body_len
        self.lens_dev = torch.tensor([self.sink_len, self.body_len, self.res_len],
                                     dtype=torch.int32, device=self.device)
        return self.lens_dev

    def append_dev(self, k: torch.Tensor, v: torch.Tensor, host: bool = True) -> None:
        """One token per sequence into the residual at the device length, which then grows.
        ``host``: count it on the host too (an eager step; not while a graph is captured, whose
        replays the host counts with :meth:`device_step_done`)."""
        self._check_input(k, v)
        k, v = self._store_keys(k.to(self.dtype)), v.to(self.dtype)
        index = self.lens_dev[2:3].long()
        self.res_k.index_copy_(2, index, k)
        self.res_v.index_copy_(2, index, v)
        self.lens_dev[2:3].add_(1)
        if host:
            self.res_len += 1

    def flush_dev(self, host: bool = True) -> None:
        """Quantize the residual's first G tokens into the body at the device body length (the
        residual holds exactly R + G tokens: the host calls this on the step that brings it
        there), shift the remaining R tokens down, and move the lengths. Fixed shapes only:
        the same launches whatever the lengths."""
        G, R = self.spec.group_size, self.spec.residual_length
        k, v = self.res_k[:, :, :G], self.res_v[:, :, :G]
        body = self.lens_dev[1:2].long()
        tokens = body + torch.arange(G, device=self.device)  # rows of per-token buffers
        first = self.lens_dev[0:1].long() + body  # sequence index of the group's first token
        valid = None
        if self._dev_valid:
            valid = (first + torch.arange(G, device=self.device))[None, :] >= self._visible_from()
        if self.inv_freq is not None:  # pre-RoPE keys: undo the model's rotation
            k = ref_rope.unrotate(k, ref_rope.token_positions(self.starts, first, G),
                                  self.inv_freq)
        if self.fp8:  # as bytes: index_copy_ has no float8 implementation
            for buf, x, sc in ((self.k_codes, k, self.k_scale), (self.v_codes, v, self.v_scale)):
                codes = ref_quant.quantize_fp8(x, sc, valid)
                buf.view(torch.uint8).index_copy_(2, tokens, codes.view(torch.uint8))
        else:
            (kc, ks, kz), (vc, vs, vz), outliers = self._quantize_layer(k, v, valid)
            if outliers is not None:
                for name, x in zip(_OUTLIER_BUFFERS, outliers):
                    getattr(self, name).index_copy_(2, tokens, x)
            group = body // G
            words = lambda n: group * n + torch.arange(n, device=self.device)
            self.k_codes.index_copy_(2, words(self.k_words), kc)
            self.v_codes.index_copy_(2, words(self.v_words), vc)
            rows = {"channel": group, "token": tokens}
            scales = [(self.v_scale, vs, self.value_axis), (self.v_zero, vz, self.value_axis)]
            if not self.fixed_key_scales:  # (else one fixed row for every group)
                scales += [(self.k_scale, ks, self.key_axis), (self.k_zero, kz, self.key_axis)]
            for buf, x, axis in scales:
                buf.index_copy_(2, rows[axis], x)
        if R:
            for buf in (self.res_k, self.res_v):
                buf.narrow(2, 0, R).copy_(buf.narrow(2, G, R).clone())
        self.lens_dev[1:2].add_(G)
        self.lens_dev[2:3].sub_(G)
        if host:
            self._close_sink()
            self.body_len += G
            self.res_len -= G

    def device_step_done(self, flushed: bool) -> None:
        """Host lengths after one replayed step in this mode (a token appended; a group
        flushed)."""
        self.res_len += 1
        if flushed:
            self._close_sink()  # as flush does: the sink takes no more tokens
            self.body_len += self.spec.group_size
            self.res_len -= self.spec.group_size

    def device_room(self, flush: bool) -> bool:
        """Whether the buffers sized by :meth:`begin_device_lengths` hold one more token and,
        with ``flush``, one more quantized group (a captured step must never reallocate)."""
        if self.res_len + 1 > self.res_k.shape[2]:
            return False
        if not flush:
            return True
        groups = min(getattr(self, name).shape[2] // rows  # every per-group buffer's room
                     for name, rows in self._rows_per_group().items())
        return self.body_len // self.spec.group_size + 1 <= groups

    def end_device_lengths(self) -> None:
        self.lens_dev = None

    def _host_lengths(self, op: str) -> None:
        """Refuse ``op`` while the lengths live on the device: it would change the host
        lengths or the buffers that captured steps point at, and leave ``lens_dev`` stale."""
        if self.lens_dev is not None:
            raise ValueError(f"{op}: this layer keeps its lengths on the device (captured "
                             "decode steps: begin_device_lengths, or a KVBitsCache's step "
                             "graphs); call end_device_lengths (KVBitsCache.end_step_graphs) "
                             "first")

    def view_dev(self) -> PackedKV:
        """The layer for a step with device lengths: on the kernels, the lengths are bounds
        (the buffers' capacities) and ``lens_dev`` has the true ones; on the reference path
        (CPU) the host lengths, kept in step, are the true ones."""
        kv = self.view()
        if ops.use_kernels(self.res_k) and ops.kernel_reads(kv):
            rows = self.k_codes.shape[2]  # float8: one per token; else k_words per group
            G = self.spec.group_size  # the bound in whole groups, as the kernels require
            kv.body_len = (rows // G * G if self.fp8 else rows // self.k_words * G) \
                if self.spec.quantized else 0
            kv.res_len = self.res_k.shape[2]
        return kv

    def track_flushes(self) -> None:
        """Remember, until the next :meth:`append` (or another edit), the FP16 tokens of the
        groups flushed from now on (the newest :meth:`_undo_limit` of them), so that
        :meth:`crop` can put back the groups that the tokens it keeps would not have flushed
        yet. The HF integration calls it after a multi-row step's first row (speculative
        verification: the rows after it are drafts): a draft that brought the residual to
        R + G flushed a group that a run which never saw the rejected drafts flushes later,
        and with the group put back the crop leaves no trace."""
        self._undo = ((self.res_k[:, :, :0].clone(), self.res_v[:, :, :0].clone())
                      if self.spec.quantized else None)

    def _undo_limit(self) -> int:
        """Tokens of flushed groups :meth:`track_flushes` keeps at most: enough for a crop of
        up to R tokens (``ceil(R / G)`` groups, and one more), so that a long chunk (a chunked
        prefill) keeps no FP16 copy of all it flushed."""
        G = self.spec.group_size
        return (-(-self.spec.residual_length // G) + 1) * G

    def _undone(self) -> int:
        """Tokens at the end of the body that :meth:`crop` would put back (0: none)."""
        return 0 if self._undo is None else self._undo[0].shape[2]

    def _put_back_flushed(self) -> bool:
        """Undo the flushes since :meth:`track_flushes` (their newest groups, up to
        :meth:`_undo_limit` tokens): they go back, as FP16 tokens, to the front of the
        residual (their codes are dropped). False if there were none."""
        k, v = self._undo
        self._undo = None
        if not k.shape[2]:
            return False
        n, held = k.shape[2], self.res_len
        body0 = self.body_len - n
        cap = self._residual_keep(n + held)
        for name, x in (("res_k", k), ("res_v", v)):
            buf = getattr(self, name)
            out = buf.new_empty(*buf.shape[:2], cap, *buf.shape[3:])
            out.narrow(2, 0, n).copy_(x)
            out.narrow(2, n, held).copy_(buf.narrow(2, 0, held))
            setattr(self, name, out)
        self.body_len, self.res_len = body0, n + held
        self._dense = None
        return True

    def flush(self, upto: int | None = None) -> None:
        """Quantize the oldest whole groups of the residual while it holds >= R + G tokens.

        ``upto``: flush as generation would have when the sequence held only its first ``upto``
        tokens (tokens past that wait in the residual). Chunked attention uses it so that every
        query row sees exactly the quantized/FP16 split it would see when decoded alone.
        """
        self._host_lengths("flush")
        s = self.spec
        if not s.quantized:
            return
        G = s.group_size
        waiting = self.res_len
        if upto is not None:
            waiting = min(waiting, upto - self.sink_len - self.body_len)
        n_groups = (waiting - s.residual_length) // G
        if n_groups <= 0:
            return
        n = n_groups * G
        if self._undo is not None:  # track_flushes: keep the newest FP16 tokens for crop
            lim = self._undo_limit()  # whole groups: so are n and every cut
            self._undo = tuple(torch.cat([u, r[:, :, max(0, n - lim):n]], 2)[:, :, -lim:]
                               for u, r in zip(self._undo, (self.res_k, self.res_v)))
        self._close_sink()
        k, v = self.res_k[:, :, :n], self.res_v[:, :, :n]
        first = self.sink_len + self.body_len
        valid = None  # past every sequence's padding: no mask, and no device->host sync
        if first < self._pad_end:
            positions = first + torch.arange(n, device=self.device)
            valid = positions[None, :] >= self._visible_from()  # [B, n]
        if self.inv_freq is not None:  # pre-RoPE keys: undo the model's rotation
            pos = ref_rope.token_positions(self.starts, first, n)
            k = ref_rope.unrotate(k, pos, self.inv_freq)
        if self.fp8:
            self._flush_fp8(k, v, valid, n, waiting)
            return
        self._check_range(k, v, valid, n)
        (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero), outliers = \
            self._quantize_layer(k, v, valid)
        if outliers is not None:
            for name, x in zip(_OUTLIER_BUFFERS, outliers):
                setattr(self, name, _write(getattr(self, name), self.body_len, x))
        g0 = self.body_len // G
        at = {"channel": g0, "token": self.body_len}
        self.k_codes = _write(self.k_codes, g0 * self.k_words, k_codes)
        if not self.fixed_key_scales:  # (else one fixed row for every group)
            self.k_scale = _write(self.k_scale, at[self.key_axis], k_scale)
            self.k_zero = _write(self.k_zero, at[self.key_axis], k_zero)
        self.v_codes = _write(self.v_codes, g0 * self.v_words, v_codes)
        self.v_scale = _write(self.v_scale, at[self.value_axis], v_scale)
        self.v_zero = _write(self.v_zero, at[self.value_axis], v_zero)
        self._moved(n)

    def _check_range(self, k: torch.Tensor, v: torch.Tensor, valid, n: int) -> None:
        """Warn where the layer's first ``n`` tokens to be quantized (``valid``: the
        real ones) hold elements that the body cannot store as given: beyond float16's +-65504
        (the integer methods' scales and zeros are float16: bfloat16 / float32 models), beyond
        ``448 x scale`` (fp8), NaN, or float16 keys that the Hadamard rotation saturated
        (:func:`kvbits.reference.hadamard.rotate`); they used to be clipped without a word.

        Cheap by construction: only the layer's first flush (the prompt's first groups) is
        checked, with one host read, outside CUDA-graph capture; later flushes (prompt chunks,
        decode steps) never read the device for it. A model whose K/V pass these limits
        (massive-activation channels) passes them from its first tokens."""
        if self._range_checked or not n:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self._range_checked = True
        B, H = self.batch, self.kv_heads
        rotated16 = self.hadamard is not None and k.dtype == torch.float16  # keys saturated
        rows = []
        for side, x in enumerate((k, v)):
            a = x.abs()
            if valid is not None:
                a = torch.where(valid[:, None, :, None], a, torch.zeros_like(a))
            a = a.amax(dim=(2, 3)).float()  # [B, H]; NaN propagates
            if self.fp8:
                lim = ref_quant.FP8_MAX * (self.k_scale, self.v_scale)[side].reshape(B, H)
            else:
                lim = torch.full_like(a, ref_quant.FP16_MAX)
            over = ~(a <= lim)  # (NaN too)
            if side == 0 and rotated16:
                over |= a >= ref_quant.FP16_MAX  # (by hadamard.rotate)
            worst = torch.where(over, (a / lim).nan_to_num(torch.inf), -1.0).flatten().argmax()
            rows.append(torch.stack([over.any().float(), worst.float(), a.flatten()[worst],
                                     lim.flatten()[worst], a.isnan().any().float()]))
        found = torch.stack(rows).tolist()  # the one host read
        if not any(r[0] for r in found):
            return
        what = []
        for side, (hit, worst, amax, lim, nan) in zip(("keys", "values"), found):
            if not hit:
                continue
            where = f"{side} (sequence {int(worst) // H}, KV head {int(worst) % H})"
            if nan:
                what.append(f"{where} hold NaN: " + ("it stays NaN in float8" if self.fp8 else
                            "its whole quantization group dequantizes to NaN"))
            elif side == "keys" and rotated16 and amax >= ref_quant.FP16_MAX:
                what.append(f"{where} pass float16's +-65504 after the Hadamard rotation (a "
                            "rotated channel sums a block of channels / sqrt(block)): they were "
                            "saturated at +-65504 in the float16 store")
            elif self.fp8:
                what.append(f"{where} reach magnitude {amax:.4g}, beyond 448 x scale = "
                            f"{lim:.4g}: such elements saturate there in float8 e4m3")
            else:
                what.append(f"{where} reach magnitude {amax:.4g}, beyond float16's +-65504 "
                            "(the quantized body's scales and zeros are float16): such elements "
                            "saturate at +-65504 and the rest of their group loses precision")
        name = "a layer" if self.layer_idx is None else f"layer {self.layer_idx}"
        warnings.warn(f"kvbits: {name}: {'; '.join(what)}. Only each layer's "
                      "first quantized tokens are checked.", stacklevel=3)

    def _quantize_layer(self, k: torch.Tensor, v: torch.Tensor, valid):
        """K and V of whole groups with the layer's method: ``(codes, scale, zero)`` of each,
        and KVQuant's outliers in :data:`_OUTLIER_BUFFERS` order (None without outliers)."""
        s, G = self.spec, self.spec.group_size
        if not self.kvquant:
            return (self._quantize(k, s.key_bits, self.key_axis, valid),
                    self._quantize(v, s.value_bits, self.value_axis, valid), None)
        cb = self.codebooks
        kc, ks, kz, koi, kov = kvq.quantize_keys(
            k, s.key_bits, G, cb.k_codebook, cb.k_thresholds, self.n_out, valid,
            (cb.k_scale, cb.k_zero) if self.fixed_key_scales else None)
        vc, vs, vz, voi, vov = kvq.quantize_values(v, s.value_bits, self.value_group, G,
                                                   cb.v_codebook, cb.v_thresholds, self.n_out,
                                                   valid)
        return (kc, ks, kz), (vc, vs, vz), ((koi, kov, voi, vov) if self.n_out else None)

    def _quantize(self, x: torch.Tensor, bits: int, axis: str, valid):
        """Codes + scale + zero of ``x`` along ``axis``: "channel" = KIVI's key quantizer,
        "token" = KIVI's value quantizer (both pack codes along tokens in blocks of G)."""
        G = self.spec.group_size
        if axis == "channel":
            return ops.quantize_keys(x, bits, G, valid)
        return ops.quantize_values(x, bits, self.value_group, G, valid)

    def _flush_fp8(self, k: torch.Tensor, v: torch.Tensor, valid, n: int,
                   held: int | None = None) -> None:
        if not self._fp8_ready:  # dynamic: amax of the tokens held at the first flush
            # Per sequence: the first flush that quantizes a token of its own (in a padded
            # batch a flush of nothing but its padding sets no scale: its first real tokens
            # set it when they are flushed, as in the run of that sequence alone, whatever the
            # padding and the prefill chunks; an amax of padding alone gave scale 1, fixed)
            gran = self.spec.fp8_granularity
            kk, vv, ok = self._with_rest(k, v, valid, n, held)
            ks = ref_quant.fp8_scale_from_amax(ref_quant.fp8_amax(kk, ok, gran))
            vs = ref_quant.fp8_scale_from_amax(ref_quant.fp8_amax(vv, ok, gran))
            first = self.sink_len + self.body_len
            if first + n > self._pad_end and not self.body_len:  # every sequence, at once
                self.k_scale, self.v_scale = ks, vs
            else:  # those whose first own token is flushed now (not the earlier ones)
                start = self._visible_from()[:, 0]  # [B]
                new = ((start < first + n) & (start >= first))[:, None, None, None]
                self.k_scale = torch.where(new, ks, self.k_scale)
                self.v_scale = torch.where(new, vs, self.v_scale)
            self._fp8_ready = self._fp8_all_set(first + n)
        self._check_range(k, v, valid, n)
        self.k_codes = _write(self.k_codes, self.body_len,
                              ref_quant.quantize_fp8(k, self.k_scale, valid))
        self.v_codes = _write(self.v_codes, self.body_len,
                              ref_quant.quantize_fp8(v, self.v_scale, valid))
        self._moved(n)

    def _fp8_all_set(self, body_end: int) -> bool:
        """Dynamic FP8: whether every sequence has a token of its own (past its padding and
        the copies of its sink) before stored index ``body_end`` (the body's end), so that
        its scales are set. One host read only while a padded sequence may have none. After
        an eviction every sequence has them (none goes before that): a body that the window
        emptied keeps them, as the run that no crop touched does."""
        if self.evicted:
            return True
        if not body_end > self.sink_len:
            return False
        if body_end > self._pad_end:  # (the host bound of every sequence's hidden positions)
            return True
        return bool((self._visible_from() < body_end).all())

    def _with_rest(self, k: torch.Tensor, v: torch.Tensor, valid, n: int,
                   held: int | None = None):
        """The ``n`` tokens being flushed (``k, v``, validity ``valid``) and behind them the rest
        of the residual (the prompt's end), with their validity: dynamic FP8 scales come from
        all of them, as a sequence's first flush alone holds them (a sequence whose flushed
        tokens are all padding takes none from this flush: :meth:`_flush_fp8`). ``held``: the
        residual tokens the flush sees (``flush(upto=...)``: a chunk's rows attended as
        generated; the later rows are not there yet when generation flushes); default all."""
        held = self.res_len if held is None else min(held, self.res_len)
        rest = held - n
        if rest <= 0:
            return k, v, valid
        first = self.sink_len + self.body_len + n
        rk, rv = self.res_k[:, :, n:held], self.res_v[:, :, n:held]
        if self.inv_freq is not None:  # pre-RoPE keys, as the flushed ones
            rk = ref_rope.unrotate(rk, ref_rope.token_positions(self.starts, first, rest),
                                   self.inv_freq)
        ok = valid
        if valid is not None or first < self._pad_end:
            pos = first + torch.arange(rest, device=self.device)
            later = pos[None, :] >= self._visible_from()
            ok = torch.cat([valid if valid is not None else torch.ones_like(later[:, :1]).expand(
                -1, n), later], 1)
        return torch.cat([k, rk], 2), torch.cat([v, rv], 2), ok

    def _moved(self, n: int) -> None:
        """``n`` residual tokens went to the body: shift the residual."""
        self.body_len += n
        rest = self.res_len - n
        # A prompt leaves a prompt-sized FP16 buffer: shrink it (in the same copy as the shift)
        # rather than keep FP16 capacity for the whole prompt alive.
        if self.res_k.shape[2] > 2 * self._residual_keep(rest):
            self._set_residual(n, rest)
        else:
            self.res_k[:, :, :rest] = self.res_k[:, :, n:self.res_len].clone()
            self.res_v[:, :, :rest] = self.res_v[:, :, n:self.res_len].clone()
            self.res_len = rest

    def _residual_keep(self, held: int) -> int:
        """Residual capacity worth keeping: what it holds, at least the R + G slots of decode
        (a multiple of 16, see :func:`_capacity`)."""
        return _capacity(max(held, self.spec.residual_length + self.spec.group_size))

    def _set_residual(self, first: int, held: int) -> None:
        """Reallocate the residual to the minimal capacity, keeping tokens ``first .. +held``."""
        keep = self._residual_keep(held)
        self.res_k = self.res_k[:, :, first:first + keep].clone()
        self.res_v = self.res_v[:, :, first:first + keep].clone()
        self.res_len = held

    def compact_residual(self) -> None:
        """Shrink the FP16 residual buffers to ``max(held, R + G)`` tokens of capacity when they
        are larger (e.g. after a caller pre-sized them for a long fill)."""
        self._host_lengths("compact_residual")
        if self.res_k.shape[2] > self._residual_keep(self.res_len):
            self._set_residual(0, self.res_len)

    # ------------------------------------------------------------------ edits
    def reorder(self, index: torch.Tensor) -> None:
        """Select sequences along the batch (beam search): every buffer follows ``index``."""
        self._host_lengths("reorder")
        index = _batch_rows(index, self.batch, "reorder").to(self.device)
        self._undo = None
        for name in _BUFFERS:
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, buf.index_select(0, index))
        if self._dense is not None:  # the dequantized body follows (the same codes per row)
            self._dense = tuple(x.index_select(0, index) for x in self._dense)
        self.starts = self.starts.index_select(0, index)
        self.batch = int(index.numel())
        if self.fp8 and not self._fp8_ready:  # the sequences kept may all have their scales
            self._fp8_ready = self._fp8_all_set(self.sink_len + self.body_len)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens. Quantized tokens can only be dropped in whole groups."""
        length = self.check_crop(length)
        if length is None:
            return
        # groups the cut tokens flushed (track_flushes) go back to the residual, and only
        # what the kept tokens bring due is flushed again (the same codes: the same tokens)
        refill = self._undo is not None and self._put_back_flushed()
        self._undo = None
        self._dense = None
        body_end = self.sink_len + self.body_len
        if length >= body_end:
            self.res_len = length - body_end
        elif length <= self.sink_len:
            self.sink_len, self.body_len, self.res_len = length, 0, 0
        else:
            self.body_len, self.res_len = length - self.sink_len, 0
        if self._pad > length:  # a cut into a sequence's left padding (check_crop refuses one
            # into a sink of its own): the tokens that come next are that sequence's own, as
            # in transformers' attention mask after the cut, not more padding to hide
            self.starts = self.starts.clamp(max=length)
            self._pad = length
            self._pad_now = min(self._pad_now, length)
            self._pad_end = min(self._pad_end, length)
        if self.fp8 and self.spec.fp8_scale == "dynamic":
            # a sequence left with no token of its own in the body: its next first flush sets
            # its scales again (the others keep theirs); until then they are 1, as unset
            self._fp8_ready = self._fp8_all_set(self.sink_len + self.body_len)
            if not self._fp8_ready:
                unset = self._visible_from() >= self.sink_len + self.body_len  # [B, 1]
                self.k_scale, self.v_scale = (torch.where(unset[:, :, None, None], 1.0, x)
                                              for x in (self.k_scale, self.v_scale))
        if refill:  # one group at a time, as generation flushes them (dynamic FP8 scales)
            due = self.spec.residual_length + self.spec.group_size
            while self.res_len >= due:
                self.flush(upto=self.sink_len + self.body_len + due)

    def check_crop(self, length: int) -> int | None:
        """The length :meth:`crop` would keep (None: nothing to drop), or ValueError for a cut
        inside a quantized group; changes nothing (a multi-layer crop checks every layer first)."""
        self._host_lengths("crop")
        n = as_int(length)  # (True kept one token)
        if n is None:
            raise ValueError(f"crop: length must be an integer (tokens to keep, or a negative "
                             f"number to drop), got {length!r}")
        length = n
        if length < 0:
            length = max(0, self.seq_len + length)
        if length >= self.seq_len:
            return None
        if self._row_sinks and self.sink_len and length < self._pad_end:
            raise ValueError(
                f"crop: cannot cut at {length}: in this left-padded batch a sequence's own sink "
                f"tokens reach position {self._pad_end - 1}; crop to >= {self._pad_end}")
        # groups flushed since track_flushes go back to the residual first (crop)
        body_len = self.body_len - self._undone()
        body_end = self.sink_len + body_len
        if self.sink_len < length < body_end and (length - self.sink_len) % self.spec.group_size:
            raise CropInGroupError(
                f"crop: cannot cut at {length}: tokens {self.sink_len}..{body_end} are quantized "
                f"in groups of {self.spec.group_size}; crop to a group boundary or into the "
                f"FP16 residual (>= {body_end})")
        return length

    # ------------------------------------------------------------------ persistence
    def state(self) -> tuple[dict, dict]:
        """What :meth:`load_state` restores: the used rows of every buffer (not their spare
        capacity) with ``starts``, and the lengths and flags (for saving a cache,
        :mod:`kvbits.integrations.persist`)."""
        if self.lens_dev is not None:
            raise ValueError("a store whose lengths live on the device (a captured decode loop) "
                             "cannot be saved; save it before or after that loop")
        groups = self.body_len // self.spec.group_size
        per_group = self._rows_per_group()
        tensors = {"starts": self.starts}
        for name in _BUFFERS:
            buf = getattr(self, name)
            if buf is None:
                continue
            if name in per_group:
                buf = buf.narrow(2, 0, groups * per_group[name])
            elif name in ("res_k", "res_v"):
                buf = buf.narrow(2, 0, self.res_len)
            if buf.numel():  # the sink (S rows) and FP8's per-head scales are kept whole
                tensors[name] = buf
        scalars = {n: int(getattr(self, n)) for n in _STATE_INTS}
        scalars.update({n: bool(getattr(self, n)) for n in _STATE_FLAGS})
        if self._undo is not None:  # saved between a verification step and its crop: the
            # crop must still put back what the drafts flushed (only such files carry these)
            scalars["tracking_flushes"] = True
            tensors.update(undo_k=self._undo[0], undo_v=self._undo[1])
        return tensors, scalars

    def load_state(self, tensors: dict, scalars: dict) -> None:
        """Restore :meth:`state` into this new, empty store (same spec and shapes): growing
        buffers get a capacity of whole 16-row blocks, as :func:`_write` gives them."""
        self._host_lengths("load_state")
        self._undo = None
        unknown = (set(tensors) - {"starts", *_BUFFERS, *_UNDO_BUFFERS}
                   | set(scalars) - {*_STATE_INTS, *_STATE_FLAGS, "tracking_flushes"})
        if unknown:
            raise ValueError(f"unknown store state: {sorted(unknown)}")
        self._check_state_rows(tensors, scalars)
        self._check_state_starts(tensors.get("starts"), scalars)
        tensors, scalars = dict(tensors), dict(scalars)
        undo = tuple(tensors.pop(n, None) for n in _UNDO_BUFFERS)
        tracking = scalars.pop("tracking_flushes", False)
        growing = {*self._rows_per_group(), "res_k", "res_v"}  # the rest is fixed (state())
        for name, t in tensors.items():
            if name == "starts":
                self.starts = t.to(self.device, torch.int32)
                continue
            buf = getattr(self, name)
            if buf is None or t.shape[:2] != buf.shape[:2] or t.shape[3:] != buf.shape[3:]:
                raise ValueError(f"saved {name} has shape {tuple(t.shape)}; this layer's buffer "
                                 f"is {None if buf is None else tuple(buf.shape)}")
            if name not in growing:  # the sink, FP8's scales, offline key scale rows
                buf.copy_(t)
            else:
                rows = t.shape[2]
                buf = buf.new_empty(*buf.shape[:2], _capacity(rows), *buf.shape[3:])
                buf.narrow(2, 0, rows).copy_(t)
                setattr(self, name, buf)
        for name, value in scalars.items():
            setattr(self, name, value)
        self._pad_now = self._pad  # (not saved: the padding as set bounds it)
        self._dense = None
        if tracking:
            self._load_undo(*undo)

    def _load_undo(self, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """The FP16 copies of flushed groups that :meth:`track_flushes` kept, from a file: whole
        groups, at most what the body holds and :meth:`_undo_limit` keeps."""
        G, body_len = self.spec.group_size, self.body_len
        want = (self.batch, self.kv_heads)
        if (k is None or v is None or not self.spec.quantized or k.shape != v.shape
                or k.dim() != 4 or tuple(k.shape[:2]) != want or k.shape[3] != self.head_dim
                or k.shape[2] % G or k.shape[2] > min(body_len, self._undo_limit())):
            raise ValueError(
                "the saved layer tracks its flushes (saved between a verification step and its "
                f"crop) but its undo_k / undo_v are {None if k is None else tuple(k.shape)} / "
                f"{None if v is None else tuple(v.shape)}: whole groups of {G} tokens, at most "
                f"{min(body_len, self._undo_limit())}, of [{want[0]}, {want[1]}, tokens, "
                f"{self.head_dim}] were expected: the file is inconsistent")
        dtype = self.res_k.dtype
        self._undo = (k.to(self.device, dtype), v.to(self.device, dtype))

    def _check_state_starts(self, starts, scalars: dict) -> None:
        """Saved ``starts`` (each sequence's first real token, left padding) are one integer per
        sequence, from ``-evicted`` (eviction shifts them down) to the tokens stored: one of
        another shape loaded and failed at the next step, and a float or out-of-range one loaded
        silently and masked the wrong tokens."""
        if starts is None:
            return
        if starts.dtype not in (torch.int32, torch.int64) or tuple(starts.shape) != (self.batch,):
            raise ValueError(f"saved starts is {starts.dtype} of shape {tuple(starts.shape)}; one "
                             f"integer per sequence ({self.batch}) was expected: the file is "
                             "inconsistent")
        lens = [scalars.get(k, 0) for k in ("evicted", "sink_len", "body_len", "res_len")]
        if not all(type(x) is int for x in lens) or not starts.numel():
            return  # (lengths refused by _check_state_rows)
        evicted, stored = lens[0], sum(lens[1:])
        lo, hi = (int(x) for x in torch.aminmax(starts))
        if lo < -evicted or hi > stored:
            raise ValueError(f"saved starts range from {lo} to {hi}; a layer of {stored} tokens "
                             f"stored ({evicted} evicted) takes {-evicted} to {stored}: the file "
                             "is inconsistent")

    def _check_state_rows(self, tensors: dict, scalars: dict) -> None:
        """The saved lengths must be the ones the saved rows hold (a damaged file otherwise
        decodes uninitialized memory, or fails later with an unrelated error)."""
        n = {name: scalars.get(name, getattr(self, name)) for name in _STATE_INTS}
        G = self.spec.group_size
        bad = [name for name, v in n.items() if type(v) is not int or v < 0]
        if bad or n["body_len"] % G or n["sink_len"] > (
                0 if self.sink_k is None else self.sink_k.shape[2]):
            raise ValueError(f"saved lengths {n} do not fit this layer (sink of "
                             f"{self.spec.sink_tokens} tokens, whole groups of {G} in the body)")
        if "starts" not in tensors:  # (each sequence's first real token: padding)
            raise ValueError("the saved layer has no 'starts': the file is inconsistent")
        want = {name: n["body_len"] // G * rows for name, rows in self._rows_per_group().items()}
        want.update(res_k=n["res_len"], res_v=n["res_len"])
        if n["sink_len"]:  # the sink is saved whole (its S rows) once it holds a token
            want.update(sink_k=self.sink_k.shape[2], sink_v=self.sink_v.shape[2])
        for name, rows in want.items():
            got = tensors[name].shape[2] if name in tensors else 0
            if getattr(self, name) is not None and got != rows:
                raise ValueError(f"saved {name} holds {got} rows, but the saved lengths (body "
                                 f"{n['body_len']}, residual {n['res_len']}, sink "
                                 f"{n['sink_len']} tokens) need {rows}: the file is inconsistent")

    # ------------------------------------------------------------------ checks
    def _check_input(self, k: torch.Tensor, v: torch.Tensor) -> None:
        want = (self.batch, self.kv_heads, self.head_dim)
        for name, x in (("key_states", k), ("value_states", v)):
            if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != want:
                hint = ""
                if x.dim() == 4 and x.shape[0] % want[0] == 0 and x.shape[0] > want[0]:
                    hint = (f" (a batch {x.shape[0] // want[0]}x the cache's: beam search or "
                            "num_return_sequences over a cache that already holds the prompt? "
                            "Expand it first: cache.batch_repeat_interleave"
                            f"({x.shape[0] // want[0]}))")
                elif x.dim() == 4 and x.shape[0] != want[0] and self.total_len:
                    hint = (f" (this layer holds {self.total_len} tokens of {want[0]} sequences, "
                            "e.g. from an earlier generate: cache.reset() or a new cache for "
                            "another batch)")
                raise ValueError(
                    f"{name} must be [batch={want[0]}, kv_heads={want[1]}, tokens, "
                    f"head_dim={want[2]}], got {tuple(x.shape)}{hint}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"key_states has {k.shape[2]} tokens but value_states {v.shape[2]}")
        for name, x in (("key_states", k), ("value_states", v)):
            if not x.is_floating_point():  # (integers and booleans were cast silently; complex
                # lost its imaginary part)
                raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


_OUTLIER_BUFFERS = ("k_out_idx", "k_out_val", "v_out_idx", "v_out_val")
_BUFFERS = ("sink_k", "sink_v", "res_k", "res_v", "k_codes", "k_scale", "k_zero",
            "v_codes", "v_scale", "v_zero", *_OUTLIER_BUFFERS)


# The lengths and flags of LayerStore.state (the buffers' rows follow from them).
_UNDO_BUFFERS = ("undo_k", "undo_v")  # track_flushes' FP16 copies, in a file saved mid-step
_STATE_INTS = ("sink_len", "body_len", "res_len", "evicted", "_pad_end", "_pad")
_STATE_FLAGS = ("_row_sinks", "_sink_closed", "_fp8_ready")


# LayerStore.evict waits until the dead groups are at least 1/4 of the live ones: a sliding
# layer holds at most ~1.25 windows (plus a group and the residual), and the kept groups are
# copied at most 4 times per token over a generation.
EVICT_RATIO = 4


# The last index _batch_rows read back: transformers hands one beam index to every layer of a
# step, so only the first layer pays the host read (a GPU sync) of its range check.
_CHECKED_ROWS: dict = {"ref": None, "version": None, "batch": None}


def _batch_rows(index, batch: int, op: str) -> torch.Tensor:
    """``index`` (a 1-D integer tensor or sequence) as int64 rows of a batch of ``batch``, or a
    ValueError naming ``op``: a float index was truncated silently (0.9 -> row 0), and a row out
    of range failed inside ``index_select`` (a device-side assert on CUDA). One host read per
    index tensor (the same unchanged tensor again is not read)."""
    t = index if isinstance(index, torch.Tensor) else torch.as_tensor(index)
    if t.dim() != 1 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{op}: the index must be a 1-D integer tensor of rows in "
                         f"[0, {batch}), got {t.dtype} of shape {tuple(t.shape)}")
    last = _CHECKED_ROWS["ref"]() if _CHECKED_ROWS["ref"] is not None else None
    seen = (last is t and _CHECKED_ROWS["version"] == t._version
            and _CHECKED_ROWS["batch"] == batch)
    if t.numel() and not seen:
        lo, hi = torch.stack(torch.aminmax(t)).tolist()
        if lo < 0 or hi >= batch:
            raise ValueError(f"{op}: the index must hold rows in [0, {batch}) (the cache's "
                             f"batch), got rows {lo}..{hi}")
        _CHECKED_ROWS.update(ref=weakref.ref(t), version=t._version, batch=batch)
    return t.long()


def _capacity(n: int) -> int:
    """Buffer capacities are multiples of 16 tokens (or rows): the kernels take them as strides,
    and Triton compiles one variant per divisibility class of an integer argument, so a capacity
    that drifted between classes as the cache grows would recompile (~1 s) in the middle of a
    generation."""
    return max(16, -(-n // 16) * 16)


def _realloc(buf: torch.Tensor, first: int, n: int, cap: int) -> torch.Tensor:
    """A new buffer of ``cap`` rows (dim 2) whose first ``n`` are ``buf``'s rows ``first..``."""
    out = buf.new_empty(*buf.shape[:2], cap, *buf.shape[3:])
    out.narrow(2, 0, n).copy_(buf.narrow(2, first, n))
    return out


def _write(buf: torch.Tensor, at: int, x: torch.Tensor) -> torch.Tensor:
    """Write ``x`` into ``buf`` along dim 2 at ``at``, growing capacity geometrically if needed.

    Growth is by 1/8 (amortized O(1) copies per token): doubling would leave up to half of a
    long cache's memory allocated but unused, which is what a memory budget pays for."""
    end = at + x.shape[2]
    if end > buf.shape[2]:
        buf = _realloc(buf, 0, at, _capacity(max(end, buf.shape[2] + buf.shape[2] // 8)))
    buf.narrow(2, at, x.shape[2]).copy_(x)  # narrow + copy_: a fraction of slice-assign's host time
    return buf
