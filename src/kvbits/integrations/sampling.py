"""Next-token choice that a CUDA graph can replay: greedy, or temperature / top-k / top-p sampling.

Why not transformers' logits processors: they run on the host between steps. Here every
operation is a fixed-shape device op with no host synchronisation (sort, cumsum, masks, and the
Gumbel-max draw ``argmax(logits / T + Gumbel noise)``, which equals sampling from
``softmax(logits / T)``), so the draw is part of the captured step. Random numbers come from
torch's default generator (``torch.manual_seed`` seeds it); a captured graph advances that
generator's offset at every replay, so replays draw fresh numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import is_count

__all__ = ["Sampling", "next_token"]


@dataclass(frozen=True)
class Sampling:
    """``temperature`` > 0; ``top_k`` = 0 keeps every token; ``top_p`` in (0, 1] keeps the
    smallest set of most likely tokens whose probability reaches it (always at least one)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"Sampling: temperature must be > 0, got {self.temperature}")
        if not is_count(self.top_k, 0):  # (not a float or bool: topk)
            raise ValueError(f"Sampling: top_k must be an int >= 0 (0: no limit), got "
                             f"{self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling: top_p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling | None) -> torch.Tensor:
    """``[B, 1]`` token ids from ``[B, V]`` logits: the argmax when ``sampling`` is None, else a
    draw from the tempered, top-k / top-p filtered distribution."""
    if sampling is None:
        return logits.argmax(-1, keepdim=True)
    x = logits.float()
    x = (x - x.amax(-1, keepdim=True)) / sampling.temperature  # <= 0: no overflow at a tiny T
    if 0 < sampling.top_k < x.shape[-1]:
        kth = x.topk(sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1:
        srt, idx = x.sort(dim=-1, descending=True)
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p) >= sampling.top_p  # mass before it already reaches top_p
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    u = torch.rand_like(x).clamp_(min=torch.finfo(x.dtype).tiny)
    return (x - (-u.log()).log()).argmax(-1, keepdim=True)
