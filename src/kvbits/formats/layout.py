"""The memory-layout contract of one layer's quantized K/V: what the cache writes and kernels read.

Logical token order of a sequence: ``sink | body | residual``.

* ``sink_k``, ``sink_v``: ``[B, H, S_cap, D]`` model dtype; the first ``sink_len`` are used.
* Body keys, per-channel groups of G tokens, packed along tokens *within each group*
  (see :mod:`kvbits.formats.packing`):
  ``k_codes [B, H, n_groups_cap * Wk, D] int32`` with ``Wk = packed_length(G, key_bits)``, so
  the words of group ``g`` are rows ``[g * Wk, (g + 1) * Wk)``: one group x all channels is one
  contiguous block; ``k_scale``, ``k_zero``: ``[B, H, n_groups_cap, D] float16``.
* Body values, per-token groups of Gv channels, but packed along *tokens* within each block of G
  tokens, exactly like the keys: ``v_codes [B, H, n_groups_cap * Wv, D] int32`` with
  ``Wv = packed_length(G, value_bits)``; ``v_scale``, ``v_zero``: ``[B, H, T_cap, ceil(D / Gv)]
  float16`` (channel ``d`` in group ``d // Gv``; when Gv does not divide D, as at head_dim 100
  with G = 32, the last group is shorter, see ``QuantSpec.value_group``). Packing both along tokens lets the decode kernel unpack one K slot and the matching
  V slot (the same tokens) with plain shifts, and apply the per-token value scales to the
  attention probabilities instead of to every element.
* ``res_k``, ``res_v``: ``[B, H, R_cap, D]`` model dtype; the first ``res_len`` are used.

KVQuant additions (all optional, ``None`` for plain KIVI; see :mod:`kvbits.methods.kvquant`):

* ``k_codebook [H, 2**key_bits]``, ``v_codebook [H, 2**value_bits]`` float32, sorted, in code
  units: a body element dequantizes to ``codebook[h, code] * scale + zero`` instead of
  ``code * scale + zero`` (one table lookup; the codes, scales and zeros keep the layout above).
* ``k_out_idx``, ``v_out_idx [B, H, T_cap, n_out]`` uint8 (int16 when ``D > 256``) and
  ``k_out_val``, ``v_out_val [B, H, T_cap, n_out]`` float16, indexed by *body* token (like
  ``v_scale``): token ``t`` of head ``h`` adds ``out_val[b, h, t, j]`` to channel
  ``out_idx[b, h, t, j]`` of its dequantized K (resp. V) vector, for ``j < n_out``. A padding
  token has index 0 and value 0.
* ``rope_inv_freq [D / 2]`` float32: the body keys are stored *pre-RoPE*. After dequantizing
  (outliers included), body token ``j`` is rotated at position ``p = sink_len + j - starts[b]``:
  ``k * cos + rotate_half(k) * sin`` with ``angle = p * inv_freq`` repeated over both halves of D
  (transformers' Llama convention). Sink and residual keys stay post-RoPE.

Method breadth (``QuantSpec.method`` "uniform" / "fp8", ``hadamard``; plain KIVI has
``key_axis="channel"``, ``value_axis="token"``, ``fp8=False``):

* ``key_axis`` / ``value_axis`` (str): which axis the scale/zero of keys / values run along.
  ``"channel"``: scale/zero per (G-token group, channel), ``[B, H, NG_cap, D] float16`` indexed by
  body group ``g = t // G`` (the KIVI key layout above). ``"token"``: scale/zero per (token,
  channel group of ``Gq = value_group`` channels), ``[B, H, T_cap, ceil(D / Gq)] float16`` indexed by
  body token (the KIVI value layout above). Whatever the axis, the *codes* keep the layout above:
  ``[B, H, NG_cap * W, D] int32`` packed along tokens within blocks of G (``W =
  packed_length(G, bits)``), so element ``(t, d)`` is unpacked exactly as today; only where its
  scale/zero is read changes: per-token keys use ``k_scale[b, h, t, d // Gq]``, per-channel
  values ``v_scale[b, h, t // G, d]`` (same for zeros).
* ``fp8`` (bool, with ``key_bits == value_bits == 8``): the body is float8 e4m3 (torch
  ``float8_e4m3fn``), not packed: ``k_codes``, ``v_codes [B, H, T_cap, D] float8_e4m3fn`` indexed
  by body token; ``k_scale``, ``v_scale [B, H, 1, 1] float32`` dequant multipliers (per sequence
  and KV head; a per-tensor scale is the same value in every head); ``k_zero``, ``v_zero`` are
  ``None``. A body element is ``float(code) * scale``. ``group_size`` only sets how many tokens
  move from the residual at a time.
* ``key_scales_fixed`` (bool, KVQuant with ``key_scales="calibrated"``): ``k_scale``,
  ``k_zero [B, H, 1, D] float16`` are one row, the layer's offline per-channel key scale and
  zero, that every key group shares (read at group index 0); nothing per group. The Triton
  kernel reads it (``_scale_tile``'s ``FIXED``), the Gluon bodies do not.
* Hadamard keys (``QuantSpec.hadamard``) need no field: the store keeps *every* key (sink, body,
  residual) rotated by a fixed orthonormal matrix and rotates the queries the same way before
  calling attention, so ``q . k`` is unchanged and a kernel reads the layer as a plain one.

Lengths are shared by the batch (as in transformers' caches); per-sequence validity is given to
the ops separately (``starts``: left padding, ``lengths``: ragged ends). Sequence ``b``'s sink
holds *its own* first ``sink_len`` tokens, at positions ``starts[b] + j``; its body and residual
are visible from index ``starts[b] + sink_len`` (before that: padding, and copies of its sink
tokens, which the cache keeps out of every group's min/max). Without padding this is the plain
``sink | body | residual`` order. A dequantized value is
``code * scale + zero``: the reference computes it in float32, the decode kernel in float16
(one half-precision FMA; the kernel tests bound the difference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import as_int, is_count
from .packing import PACK_BITS, packed_length


@dataclass
class PackedKV:
    """Views of one layer's K/V storage in the layout above (no copies)."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_len: int
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    body_len: int
    res_k: torch.Tensor
    res_v: torch.Tensor
    res_len: int
    key_bits: int
    value_bits: int
    group_size: int
    value_group: int
    # Optional float32 (K, V) of the first ``body_len`` body tokens, already dequantized: the
    # CPU reference path keeps one so it does not dequantize the whole history at every step.
    # Kernels never read it; the packed tensors stay the source of truth.
    dense_body: tuple | None = None
    # KVQuant (see the module docstring); None for plain KIVI.
    k_codebook: torch.Tensor | None = None
    v_codebook: torch.Tensor | None = None
    k_out_idx: torch.Tensor | None = None
    k_out_val: torch.Tensor | None = None
    v_out_idx: torch.Tensor | None = None
    v_out_val: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None
    # Method breadth (see the module docstring): axes of the key / value scales, FP8 body.
    key_axis: str = "channel"
    value_axis: str = "token"
    fp8: bool = False
    # KVQuant with key_scales="calibrated": k_scale / k_zero are one [B, H, 1, D] row that every
    # key group shares (the offline per-channel scales), not one row per group.
    key_scales_fixed: bool = False
    # The object that owns the buffers (the layer's store), for caches of what a kernel derives
    # from the buffers alone (the TMA ring's descriptors), kept as long as the owner lives.
    owner: object | None = field(default=None, compare=False, repr=False)

    @property
    def is_plain(self) -> bool:
        """Plain KIVI body (uniform codes, keys per-channel, values per-token, no outliers,
        post-RoPE keys, integer codes). Which layers the fused decode kernel reads is decided by
        :func:`kvbits.kernels.decode_attention.reads` (all of these and more)."""
        return (all(x is None for x in (self.k_codebook, self.v_codebook, self.k_out_idx,
                                        self.v_out_idx, self.rope_inv_freq))
                and self.key_axis == "channel" and self.value_axis == "token" and not self.fp8)

    @property
    def total_len(self) -> int:
        return self.sink_len + self.body_len + self.res_len

    @property
    def head_dim(self) -> int:
        return self.res_k.shape[-1]

    @property
    def batch(self) -> int:
        return self.res_k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.res_k.shape[1]


def check_value_group(op: str, group, head_dim: int) -> None:
    """``value_group``: an int in ``[1, head_dim]``; the last group is shorter when it does not
    divide head_dim (the reference and the kernels check alike; ``op`` names the caller)."""
    if not isinstance(group, int) or isinstance(group, bool) or not 1 <= group <= head_dim:
        raise ValueError(f"{op}: value_group must be an int in [1, head_dim={head_dim}], got "
                         f"{group!r}")


# A sliding window at least this wide hides nothing (positions are int32, so no two are 2**32
# apart): the entry points run it as no window. The kernels took one of 2**63 and more as an
# unsigned integer (a wrong answer) or failed to specialize it.
WINDOW_NONE = 2**32


def check_query(q: torch.Tensor, kv: PackedKV) -> None:
    """Refuse a query that does not fit the layer: ``q`` must be ``[batch, a multiple of the KV
    heads, >= 1 rows, head_dim]`` (metadata only). Shared by :func:`kvbits.ops.decode_attention`
    and the kernel's own entry point, which read past the buffers for a larger batch."""
    if q.dim() == 4:
        B, Hq, Lq, D = q.shape
        if (B == kv.batch and D == kv.head_dim and Lq >= 1 and Hq >= kv.kv_heads >= 1
                and Hq % kv.kv_heads == 0):  # (no heads divided by zero in the kernel)
            return
    raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit the layer (batch "
                     f"{kv.batch}, {kv.kv_heads} KV heads, head_dim {kv.head_dim}): it must "
                     "be [batch, a multiple of the KV heads (>= 1), >= 1 rows, head_dim]")


def check_buffers(kv: PackedKV, op: str = "decode_attention", rows: bool = True) -> None:
    """Refuse a layer whose buffers do not hold what its lengths and the layout above say
    (metadata only): every buffer ``[batch, kv_heads, >= the rows its length needs, its width]``
    (``D``; scales per token ``ceil(D / value_group)``; FP8 scales ``[.., 1, 1]``); values and
    zeros shaped like their keys and scales (one capacity addresses both); codes of their
    dtype; codebooks ``[kv_heads, 2**bits]``; outlier values shaped like their indices; ``D / 2``
    RoPE frequencies. A body longer than its code or scale buffers, a buffer of another head_dim,
    capacity or value grouping was read past its end or at the wrong offsets by the fused kernel,
    silently (NaN or a wrong answer), where the reference failed in a reshape or a
    concatenation, or answered; a ``value_group`` of 0 failed inside Triton's compiler. Call
    after the lengths are known to be whole groups. ``rows=False``: ``kv``'s lengths are bounds
    (:meth:`kvbits.cache.store.LayerStore.view_dev`, the true ones on the device), which the
    buffers need not hold: their rows are not checked."""
    B, H, D, G = kv.batch, kv.kv_heads, kv.head_dim, kv.group_size
    n_body, n_groups = (kv.body_len, kv.body_len // G) if rows else (0, 0)

    def need(name: str, t, rows: int, width: int, dtype=None, exact: bool = False) -> None:
        if t is None:
            raise ValueError(f"{op}: kv.{name} is None; this layer needs one")
        if (t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != width
                or (t.shape[2] != rows if exact else t.shape[2] < rows)):
            raise ValueError(f"{op}: kv.{name} is {tuple(t.shape)}; this layer needs [{B}, {H}, "
                             f"{rows if exact else f'>= {rows}'}, {width}] (sink_len "
                             f"{kv.sink_len}, body_len {n_body}, res_len {kv.res_len}, head_dim "
                             f"{D}, group_size {G}, value_group {kv.value_group})")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{op}: kv.{name} must be {dtype}, got {t.dtype}")

    def twins(a: str, b: str) -> None:  # (the kernels address both with a's capacity)
        x, y = getattr(kv, a), getattr(kv, b)
        if x.shape != y.shape:
            raise ValueError(f"{op}: kv.{a} {tuple(x.shape)} and kv.{b} {tuple(y.shape)} must "
                             "have the same shape (the kernels address both with one capacity)")

    for name, n in (("sink_k", kv.sink_len), ("sink_v", kv.sink_len), ("res_k", kv.res_len),
                    ("res_v", kv.res_len)):
        need(name, getattr(kv, name), n if rows else 0, D)
    twins("sink_k", "sink_v")
    twins("res_k", "res_v")
    if kv.fp8:  # e4m3 codes per token; one float32 multiplier per (sequence, KV head)
        for name in ("k_codes", "v_codes"):
            need(name, getattr(kv, name), n_body, D, torch.float8_e4m3fn)
        for name in ("k_scale", "v_scale"):
            need(name, getattr(kv, name), 1, 1, exact=True)
        return
    need("k_codes", kv.k_codes, n_groups * packed_length(G, kv.key_bits), D, torch.int32)
    need("v_codes", kv.v_codes, n_groups * packed_length(G, kv.value_bits), D, torch.int32)
    if "token" in (kv.key_axis, kv.value_axis):
        check_value_group(op, kv.value_group, D)
    per_token = (n_body, -(-D // kv.value_group) if "token" in (kv.key_axis, kv.value_axis)
                 else None)
    axes = {"channel": (n_groups, D), "token": per_token}
    k_rows, k_width = (min(n_body, 1), D) if kv.key_scales_fixed else axes[kv.key_axis]
    for name in ("k_scale", "k_zero"):
        need(name, getattr(kv, name), k_rows, k_width)
    for name in ("v_scale", "v_zero"):
        need(name, getattr(kv, name), *axes[kv.value_axis])
    twins("k_scale", "k_zero")
    twins("v_scale", "v_zero")
    for name, bits in (("k_codebook", kv.key_bits), ("v_codebook", kv.value_bits)):
        t = getattr(kv, name)
        if t is not None and tuple(t.shape) != (H, 1 << bits):
            raise ValueError(f"{op}: kv.{name} must be [kv_heads, 2**bits] = [{H}, {1 << bits}], "
                             f"got {list(t.shape)}")
    for idx, val in (("k_out_idx", "k_out_val"), ("v_out_idx", "v_out_val")):
        i, v = getattr(kv, idx), getattr(kv, val)
        if i is None and v is None:
            continue
        need(idx, i, n_body, i.shape[-1] if i is not None else 0)
        need(val, v, i.shape[2], i.shape[3], exact=True)
    f = kv.rope_inv_freq
    if f is not None and tuple(f.shape) != (D // 2,):
        raise ValueError(f"{op}: kv.rope_inv_freq must be [head_dim / 2] = [{D // 2}], got "
                         f"{list(f.shape)}")


def pre_rope_kernel_ok(head_dim: int, key_axis: str = "channel") -> bool:
    """Whether the fused decode kernel reads pre-RoPE keys of this head_dim: it rotates a key
    tile as two halves and multiplies each with ``tl.dot``, whose inner dimension must be >= 16
    (so head_dim >= 32). Halves that are not a power of two (head_dim 80, 96) are padded lanes,
    which per-channel key scales follow (KVQuant's) but per-token scale groups would cross
    (those keys need a power-of-two head_dim). Other layers attend through the reference."""
    if head_dim < 32 or head_dim % 2:
        return False
    return key_axis == "channel" or head_dim & (head_dim - 1) == 0


def body_bytes_per_token(head_dim: int, key_bits: int, value_bits: int, group_size: int,
                         value_group: int, outliers: int = 0, key_axis: str = "channel",
                         value_axis: str = "token", fp8: bool = False,
                         key_scales_fixed: bool = False) -> float:
    """Bytes one token of one KV head occupies in the packed body (K and V, codes + scale + zero).

    Keys: ``Wk * 4 * D / G`` bytes of codes (= bits * D / 8) plus an FP16 scale and zero per
    channel per G tokens; values: the same code bytes plus an FP16 scale and zero per Gv channels
    (``ceil(D / Gv)`` pairs: the last group may be shorter).
    ``outliers`` per vector (KVQuant) add an index (1 byte, 2 when D > 256) and an FP16 value
    each, for K and for V. Per-layer codebooks are a constant, not counted here.
    ``key_axis`` / ``value_axis`` "token" / "channel" swap the scale/zero cost of that tensor;
    ``fp8``: one byte per element (the per-head scales are a constant).
    ``key_scales_fixed``: keys carry no per-group scale/zero (one row per sequence and KV head,
    a constant, as the per-layer codebooks are).
    """
    for name, axis in (("key_axis", key_axis), ("value_axis", value_axis)):
        if axis not in ("channel", "token"):  # (a KeyError before; a zero group: ZeroDivision)
            raise ValueError(f"body_bytes_per_token: {name} must be 'channel' or 'token', got "
                             f"{axis!r}")
    if not is_count(head_dim, 1):
        raise ValueError(f"body_bytes_per_token: head_dim must be a positive int, got "
                         f"{head_dim!r}")
    for name, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
        if as_int(bits) is None or bits not in PACK_BITS:  # (failed in packed_length, unnamed)
            raise ValueError(f"body_bytes_per_token: {name} must be one of "
                             f"{', '.join(map(str, PACK_BITS))}, got {bits!r}")
    if not is_count(group_size, 1):
        raise ValueError(f"body_bytes_per_token: group_size must be a positive int, got "
                         f"{group_size!r}")
    if not is_count(outliers, 0):
        raise ValueError(f"body_bytes_per_token: outliers must be an int >= 0 (per vector), "
                         f"got {outliers!r}")
    if fp8:
        if (key_bits, value_bits) != (8, 8):  # (counted as 8-bit elements, silently)
            raise ValueError(f"body_bytes_per_token: fp8 needs key_bits == value_bits == 8, got "
                             f"{key_bits} / {value_bits}")
        return 2.0 * head_dim
    check_value_group("body_bytes_per_token", value_group, head_dim)
    meta = {"channel": 2 * 2 * head_dim / group_size,
            "token": 2 * 2 * -(-head_dim // value_group)}  # a shorter last group costs a pair
    index_bytes = 1 if head_dim <= 256 else 2
    sparse = 2 * outliers * (index_bytes + 2)
    key_codes = packed_length(group_size, key_bits) * 4 * head_dim / group_size
    key_meta = 0.0 if key_scales_fixed else meta[key_axis]
    value_codes = packed_length(group_size, value_bits) * 4 * head_dim / group_size
    value_meta = meta[value_axis]
    return key_codes + key_meta + value_codes + value_meta + sparse


def fp_bytes_per_token(head_dim: int, itemsize: int = 2) -> int:
    """Bytes one token of one KV head occupies in FP16 (K and V)."""
    return 2 * head_dim * itemsize
