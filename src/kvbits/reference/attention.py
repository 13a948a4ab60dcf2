"""Attention over a packed layer in plain PyTorch: the oracle for the ``decode_attention`` kernel.

It dequantizes the whole history in float32 (exactly what the kernel must never do on the GPU)
and applies the same masking rules the kernel applies:

* the ``Lq`` query rows of sequence ``b`` sit at positions ``lengths[b] - Lq + i``;
* row ``i`` sees tokens ``starts[b] <= t <= lengths[b] - Lq + i`` (left padding, causality and
  ragged ends), and with a sliding ``window`` only ``t > position - window``;
* a left-padded sequence's sink holds its own first tokens, at positions ``starts[b] + j``
  (:func:`dequantize_layer` puts them there; :func:`decode_attention` keeps the stored order and
  masks by position, which also holds for negative starts);
* query head ``h`` reads KV head ``h // (Hq // Hkv)`` (grouped-query attention);
* a row that sees no token outputs zeros.
"""

from __future__ import annotations

import torch

from ..formats.layout import PackedKV
from ..formats.packing import packed_length
from . import quant as ref_quant
from . import rope as ref_rope


def dequantize_body(kv: PackedKV, t0: int, t1: int, starts: torch.Tensor | None = None):
    """float32 ``(K, V) [B, H, t1 - t0, D]`` of body tokens ``t0 .. t1 - 1`` (whole groups), in
    the model's (post-RoPE) key space: codebook lookup, outliers and re-rotation included."""
    G = kv.group_size
    # (a range past the body, or out of step with its groups, came back cut short)
    if not 0 <= t0 <= t1 <= kv.body_len or (not kv.fp8 and (t0 % G or t1 % G)):
        raise ValueError(f"dequantize_body: tokens [{t0}, {t1}) must lie within the body's "
                         f"{kv.body_len}" + ("" if kv.fp8 else f", in whole groups of {G}"))
    g0, g1 = t0 // G, t1 // G
    if kv.fp8:  # (keys post-RoPE: QuantSpec refuses pre_rope for fp8)
        k = ref_quant.dequantize_fp8(kv.k_codes[:, :, t0:t1], kv.k_scale)
        v = ref_quant.dequantize_fp8(kv.v_codes[:, :, t0:t1], kv.v_scale)
        return k, v
    if kv.key_axis != "channel" or kv.value_axis != "token":
        k, v = _dequantize_axes(kv, t0, t1)
        return _rotate_body_keys(kv, k, t0, starts), v
    wk = packed_length(G, kv.key_bits)
    wv = packed_length(G, kv.value_bits)
    kc = kv.k_codes[:, :, g0 * wk: g1 * wk].contiguous()
    vc = kv.v_codes[:, :, g0 * wv: g1 * wv].contiguous()
    if kv.k_codebook is None:
        k = ref_quant.dequantize_keys(kc, kv.k_scale[:, :, g0:g1], kv.k_zero[:, :, g0:g1],
                                      kv.key_bits, G)
        v = ref_quant.dequantize_values(vc, kv.v_scale[:, :, t0:t1], kv.v_zero[:, :, t0:t1],
                                        kv.value_bits, kv.value_group, G)
    else:
        def sl(x):
            return None if x is None else x[:, :, t0:t1]
        if kv.key_scales_fixed:  # one offline row for every group
            ks, kz, groups = kv.k_scale, kv.k_zero, g1 - g0
        else:
            ks, kz, groups = kv.k_scale[:, :, g0:g1], kv.k_zero[:, :, g0:g1], None
        k = _kvq().dequantize_keys(kc, ks, kz, kv.key_bits, G, kv.k_codebook, sl(kv.k_out_idx),
                                   sl(kv.k_out_val), groups=groups)
        v = _kvq().dequantize_values(vc, kv.v_scale[:, :, t0:t1], kv.v_zero[:, :, t0:t1],
                                  kv.value_bits, kv.value_group, G, kv.v_codebook,
                                  sl(kv.v_out_idx), sl(kv.v_out_val))
    return _rotate_body_keys(kv, k, t0, starts), v


def _rotate_body_keys(kv: PackedKV, k: torch.Tensor, t0: int, starts):
    """Pre-RoPE keys (``kv.rope_inv_freq``) turned back to the model's space at their positions
    (body token ``t0`` onwards, after the sink); other keys unchanged."""
    if kv.rope_inv_freq is None:
        return k
    if starts is None:
        starts = torch.zeros(kv.batch, dtype=torch.int32, device=k.device)
    pos = ref_rope.token_positions(starts.to(k.device), kv.sink_len + t0, k.shape[2])
    return ref_rope.rotate(k, pos, kv.rope_inv_freq)


def _dequantize_axes(kv: PackedKV, t0: int, t1: int):
    """Uniform method: keys and values each per-channel (KIVI key layout) or per-token (KIVI
    value layout); codes packed along tokens in blocks of G either way."""
    G = kv.group_size
    g0, g1 = t0 // G, t1 // G
    out = []
    for codes, scale, zero, bits, axis in (
            (kv.k_codes, kv.k_scale, kv.k_zero, kv.key_bits, kv.key_axis),
            (kv.v_codes, kv.v_scale, kv.v_zero, kv.value_bits, kv.value_axis)):
        w = packed_length(G, bits)
        c = codes[:, :, g0 * w: g1 * w].contiguous()
        if axis == "channel":
            out.append(ref_quant.dequantize_keys(c, scale[:, :, g0:g1], zero[:, :, g0:g1], bits, G))
        else:
            out.append(ref_quant.dequantize_values(c, scale[:, :, t0:t1], zero[:, :, t0:t1], bits,
                                                   kv.value_group, G))
    return out[0], out[1]


def _kvq():
    from ..methods import kvquant

    return kvquant


def dequantize_layer(kv: PackedKV, dtype: torch.dtype = torch.float32, starts=None):
    """Full-precision ``(K, V)`` of shape ``[B, H, total_len, D]`` in logical token order.

    ``starts`` (left padding): sequence ``b``'s sink tokens are its first real ones, so they go
    to positions ``starts[b] + j`` (over the body/residual copies there, or into the sink's
    slots); pre-RoPE keys are re-rotated at their positions. A negative start with a sink is
    refused: its sink tokens sit before position 0, where this tensor has no slot (the store
    drops its sink when a sliding window evicts, so it never holds both; the reference
    attention reads the stored order, :func:`stored_order_mask`)."""
    at, lo, hi = None, 0, 0
    if starts is not None:  # (an int or a list reached the body's re-rotation raw: it failed)
        starts = _per_seq(starts, kv.batch, 0, kv.sink_k.device)
    if starts is not None and kv.sink_len:
        at = starts
        lo, hi = torch.stack(at.aminmax()).tolist()  # (one host read)
    if lo < 0:
        raise ValueError(f"dequantize_layer: starts {at.tolist()} holds a negative start and "
                         f"the layer a sink (sink_len={kv.sink_len}): its tokens sit at "
                         "positions start + j before 0, which a position-ordered tensor has no "
                         "slot for; read the stored order (decode_attention)")
    keys, values = _stored_order(kv, dtype, starts)
    if hi > 0:
        keys, values = (place_sinks(x, at, kv.sink_len) for x in (keys, values))
    return keys, values


def place_sinks(x: torch.Tensor, starts: torch.Tensor, sink_len: int) -> torch.Tensor:
    """``x [B, H, n, D]`` in stored order (the ``sink_len`` sink tokens first) -> position
    order: sequence ``b``'s sink tokens go to positions ``starts[b] + j``, over what the stored
    order has there (padding, or the hidden copies of those tokens). A sink token past ``n`` (a
    sequence shorter than its sink) is dropped: no query sees it, as in the kernel."""
    n, S = x.shape[2], sink_len
    at = (starts.long()[:, None] + torch.arange(S, device=x.device)).clamp(max=n + S - 1)
    at = at[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return torch.cat([x, x[:, :, :S]], 2).scatter(2, at, x[:, :, :S])[:, :, :n]


def _stored_order(kv: PackedKV, dtype: torch.dtype, starts):
    """``sink | body | residual`` as stored, concatenated."""
    keys = [kv.sink_k[:, :, : kv.sink_len].to(dtype)]
    values = [kv.sink_v[:, :, : kv.sink_len].to(dtype)]
    if kv.body_len and kv.dense_body is not None:
        keys.append(kv.dense_body[0][:, :, : kv.body_len].to(dtype))
        values.append(kv.dense_body[1][:, :, : kv.body_len].to(dtype))
    elif kv.body_len:
        k, v = dequantize_body(kv, 0, kv.body_len, starts)
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    keys.append(kv.res_k[:, :, : kv.res_len].to(dtype))
    values.append(kv.res_v[:, :, : kv.res_len].to(dtype))
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


def attention_mask(batch: int, q_len: int, total: int, device, starts=None, lengths=None,
                   window: int | None = None) -> torch.Tensor:
    """Bool ``[B, Lq, total]``: True where query row ``i`` of sequence ``b`` sees token ``t``."""
    t = torch.arange(total, device=device)
    lengths = _per_seq(lengths, batch, total, device)
    starts = _per_seq(starts, batch, 0, device)
    pos = lengths[:, None] - q_len + torch.arange(q_len, device=device)[None, :]  # [B, Lq]
    mask = (t[None, None, :] <= pos[:, :, None]) & (t[None, None, :] >= starts[:, None, None])
    if window is not None:
        mask &= t[None, None, :] > pos[:, :, None] - window
    return mask


def stored_order_mask(batch: int, q_len: int, total: int, sink_len: int, device, starts=None,
                      lengths=None, window: int | None = None) -> torch.Tensor:
    """Bool ``[B, Lq, total]`` over tokens in *stored* order (``sink | body | residual``): True
    where query row ``i`` of sequence ``b`` sees stored token ``t``. Sink token ``j`` sits at
    position ``starts[b] + j``, a later one at its index ``t``, hidden below ``starts[b] +
    sink_len`` (left padding, and the body's copies of the sink's tokens). For ``starts >= 0``
    this is :func:`attention_mask` of :func:`dequantize_layer`'s position order; it also holds
    for negative starts, whose sink tokens sit before position 0."""
    t = torch.arange(total, device=device)
    lengths = _per_seq(lengths, batch, total, device)
    starts = _per_seq(starts, batch, 0, device)
    is_sink = t[None, :] < sink_len
    tpos = torch.where(is_sink, starts[:, None] + t[None, :], t[None, :])  # [B, T]
    shown = is_sink | (t[None, :] >= starts[:, None] + sink_len)
    pos = lengths[:, None] - q_len + torch.arange(q_len, device=device)[None, :]  # [B, Lq]
    mask = (tpos[:, None, :] <= pos[:, :, None]) & (tpos[:, None, :] >= starts[:, None, None])
    mask &= shown[:, None, :]
    if window is not None:
        mask &= tpos[:, None, :] > pos[:, :, None] - window
    return mask


def decode_attention(q: torch.Tensor, kv: PackedKV, *, scale: float, starts=None, lengths=None,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over the packed layer; returns ``[B, Hq, Lq, D]``.

    ``softcap`` (Gemma2's attention-logit softcapping): scores become ``softcap * tanh(scores /
    softcap)`` before the mask and the softmax."""
    B, Hq, Lq, D = q.shape
    # Stored order (sink | body | residual) with each token's position: a sink token's is
    # start + j, which may be negative (a start below 0 after a sliding layer evicted), where
    # dequantize_layer's position-ordered tensor has no slot for it.
    keys, values = _stored_order(kv, torch.float32, None if starts is None else
                                 _per_seq(starts, B, 0, q.device))  # [B, Hkv, T, D]
    Hkv = kv.kv_heads
    qg = q.float().reshape(B, Hkv, Hq // Hkv, Lq, D)  # query head h reads KV head h // group
    scores = torch.einsum("bhgqd,bhtd->bhgqt", qg, keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    mask = stored_order_mask(B, Lq, keys.shape[2], kv.sink_len, q.device, starts, lengths,
                             window)[:, None, None]
    scores = scores.masked_fill(~mask, -torch.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing -> zeros
    out = torch.einsum("bhgqt,bhtd->bhgqd", probs, values)
    return out.reshape(B, Hq, Lq, D).to(q.dtype)


def _per_seq(x, batch: int, default: int, device) -> torch.Tensor:
    if x is None:
        return torch.full((batch,), default, dtype=torch.long, device=device)
    return torch.as_tensor(x, device=device).long().expand(batch)
