"""Attention over a packed layer in plain PyTorch: the oracle for the ``decode_attention`` kernel.

It dequantizes the whole history in float32 (exactly what the kernel must never do on the GPU)
and applies the same masking rules the kernel applies:

* the ``Lq`` query rows of sequence ``b`` sit at positions ``lengths[b] - Lq + i``;
* row ``i`` sees tokens ``starts[b] <= t <= lengths[b] - Lq + i`` (left padding, causality and
  ragged ends), and with a sliding ``window`` only ``t > position - window``;
* query head ``h`` reads KV head ``h // (Hq // Hkv)`` (grouped-query attention);
* a row that sees no token outputs zeros.
"""

from __future__ import annotations

import torch

from ..formats.layout import PackedKV
from .quant import dequantize_keys, dequantize_values


def dequantize_layer(kv: PackedKV, dtype: torch.dtype = torch.float32):
    """Full-precision ``(K, V)`` of shape ``[B, H, total_len, D]`` in logical token order."""
    keys = [kv.sink_k[:, :, : kv.sink_len].to(dtype)]
    values = [kv.sink_v[:, :, : kv.sink_len].to(dtype)]
    if kv.body_len and kv.dense_body is not None:
        keys.append(kv.dense_body[0][:, :, : kv.body_len].to(dtype))
        values.append(kv.dense_body[1][:, :, : kv.body_len].to(dtype))
    elif kv.body_len:
        n_groups = kv.body_len // kv.group_size
        keys.append(dequantize_keys(kv.k_codes, kv.k_scale[:, :, :n_groups], kv.k_zero[:, :, :n_groups],
                                    kv.key_bits, kv.group_size, dtype))
        values.append(dequantize_values(
            kv.v_codes, kv.v_scale[:, :, : kv.body_len], kv.v_zero[:, :, : kv.body_len],
            kv.value_bits, kv.value_group, kv.group_size, dtype))
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


def decode_attention(q: torch.Tensor, kv: PackedKV, *, scale: float, starts=None, lengths=None,
                     window: int | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over the packed layer; returns ``[B, Hq, Lq, D]``."""
    B, Hq, Lq, D = q.shape
    keys, values = dequantize_layer(kv)  # [B, Hkv, T, D]
    Hkv = kv.kv_heads
    qg = q.float().reshape(B, Hkv, Hq // Hkv, Lq, D)  # query head h reads KV head h // group
    scores = torch.einsum("bhgqd,bhtd->bhgqt", qg, keys) * scale
    mask = attention_mask(B, Lq, keys.shape[2], q.device, starts, lengths, window)[:, None, None]
    scores = scores.masked_fill(~mask, -torch.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see nothing -> zeros
    out = torch.einsum("bhgqt,bhtd->bhgqd", probs, values)
    return out.reshape(B, Hq, Lq, D).to(q.dtype)


def _per_seq(x, batch: int, default: int, device) -> torch.Tensor:
    if x is None:
        return torch.full((batch,), default, dtype=torch.long, device=device)
    return torch.as_tensor(x, device=device).long().expand(batch)
