"""How kvbits calls a transformers model and its attention: the two adapters that the
calibrations here and the cache integration above share (so that a calibration never imports
the integration layer)."""

from __future__ import annotations

import inspect
import math

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# Float32 scores per block of query rows in the capped eager attention (a 32k prompt with 16
# heads would otherwise need 64 GiB at once).
EAGER_SCORE_BYTES = 1 << 28


def cache_kwargs(model, cache) -> dict:
    """``{"cache": cache}`` where the model's ``forward`` takes ``cache=`` (transformers >= 5.2x,
    where ``past_key_values=`` is deprecated), else ``{"past_key_values": cache}``."""
    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def full_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                   scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """Attention over full-precision K/V (a prompt step, a calibration pass, tensors of another
    cache), with transformers' attention-function signature: its SDPA path, or with ``softcap``
    (Gemma2) the eager form, which caps the scores before the mask (SDPA cannot), in blocks of
    query rows so that the float32 scores of a long prompt never exceed ``EAGER_SCORE_BYTES``.
    It reads the boolean or absent mask that the registered ``sdpa_mask`` gives (the model's
    own eager attention adds the mask to the scores: a boolean one, or none at all on SDPA's
    causal fast path, would leave every token seeing the ones after it)."""
    softcap = kwargs.get("softcap")
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    B, hq, lq, _ = query.shape
    lk = key.shape[2]
    key = key.repeat_interleave(hq // key.shape[1], dim=1)
    value = value.repeat_interleave(hq // value.shape[1], dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    rows = max(1, EAGER_SCORE_BYTES // (4 * B * hq * lk))
    outs = []
    for r0 in range(0, lq, rows):
        r1 = min(lq, r0 + rows)
        scores = torch.matmul(query[:, :, r0:r1].float(), key.float().transpose(2, 3)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        if attention_mask is not None:
            mask = attention_mask[..., r0:r1, :lk] if attention_mask.shape[-2] > 1 \
                else attention_mask[..., :lk]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, -torch.inf)
            else:
                scores = scores + mask.float()
        else:  # SDPA's causal fast path: no mask tensor, the prompt's rows end at the last key
            row = torch.arange(r0, r1, device=query.device)[:, None] + (lk - lq)
            col = torch.arange(lk, device=query.device)[None, :]
            see = col <= row
            window = kwargs.get("sliding_window")
            if window is not None:
                see &= col > row - window
            scores = scores.masked_fill(~see, -torch.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        if dropout and module.training:
            probs = torch.nn.functional.dropout(probs, p=dropout)
        outs.append(torch.matmul(probs.to(value.dtype), value))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None
