"""The seed document's unfused design, as a baseline: a Triton GEMV over packed K for Q.K^T,
softmax in PyTorch, a second Triton GEMV over packed V for P.V (plus the FP16 residual with torch).

It keeps the seed's own layout (codes packed contiguously along the output axis N, scales per
(k, group of N)), its loop over the reduction axis with ``tl.sum``, and its lack of GQA: every
query head reads its KV head's codes again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _seed_gemv(a_ptr, b_ptr, s_ptr, z_ptr, out_ptr, K, N, a_heads_per_b,
               BITS: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """out[r, n] = sum_k a[r, k] * (code(b[k, n]) * scale[k, n // G] + zero[k, n // G])."""
    r = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rb = r // a_heads_per_b  # the packed matrix this row reads (no GQA sharing)
    PER_INT: tl.constexpr = 32 // BITS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    packed_n = offs_n // PER_INT
    shifter = (offs_n % PER_INT) * BITS
    group_n = offs_n // G
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    n_words = N // PER_INT
    n_groups = N // G
    for k0 in range(0, K, BLOCK_K):
        k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        valid = (k[:, None] < K) & (offs_n[None, :] < N)
        a = tl.load(a_ptr + r * K + k, mask=k < K, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + (rb * K + k[:, None]) * n_words + packed_n[None, :], mask=valid, other=0)
        sc = tl.load(s_ptr + (rb * K + k[:, None]) * n_groups + group_n[None, :], mask=valid,
                     other=0.0).to(tl.float32)
        mn = tl.load(z_ptr + (rb * K + k[:, None]) * n_groups + group_n[None, :], mask=valid,
                     other=0.0).to(tl.float32)
        b_int = (b >> shifter[None, :]) & ((1 << BITS) - 1)
        acc += tl.sum(a[:, None] * (b_int.to(tl.float32) * sc + mn), axis=0)
    tl.store(out_ptr + r * N + offs_n, acc, mask=offs_n < N)


def seed_gemv(a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              bits: int, group: int, rows_per_matrix: int) -> torch.Tensor:
    """a [R, K] times dequantized B [R // rows_per_matrix, K, N] -> [R, N] float32."""
    R, K = a.shape
    N = codes.shape[-1] * (32 // bits)
    out = torch.empty(R, N, dtype=torch.float32, device=a.device)
    BLOCK_N = 64
    _seed_gemv[(R, triton.cdiv(N, BLOCK_N))](a, codes, scale, zero, out, K, N, rows_per_matrix,
                                             BITS=bits, G=group, BLOCK_K=32, BLOCK_N=BLOCK_N)
    return out


class SeedCache:
    """Random packed K (along tokens) and V (along channels) in the seed layout, + FP16 residual."""

    def __init__(self, batch, kv_heads, context, head_dim, bits, group, residual, device="cuda"):
        body = (context - residual) // group * group
        per = 32 // bits
        B, H, D = batch, kv_heads, head_dim

        def words(*shape):
            return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device)

        def par(*shape, lo):
            return (torch.rand(*shape, device=device) * 0.05 + lo).to(torch.float16)

        self.bits, self.group, self.body = bits, group, body
        self.kT = words(B * H, D, body // per)
        self.k_s, self.k_z = par(B * H, D, body // group, lo=0.01), par(B * H, D, body // group, lo=-1)
        self.v = words(B * H, body, D // per)
        self.v_s, self.v_z = par(B * H, body, D // group, lo=0.01), par(B * H, body, D // group, lo=-1)
        self.res_k = torch.randn(B, H, context - body, D, dtype=torch.float16, device=device)
        self.res_v = torch.randn_like(self.res_k)

    def attend(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, 1, D] -> [B, Hq, 1, D]: GEMV, torch softmax, GEMV."""
        B, Hq, _, D = q.shape
        hg = Hq // self.res_k.shape[1]
        s_body = seed_gemv(q.reshape(B * Hq, D), self.kT, self.k_s, self.k_z, self.bits,
                           self.group, hg).view(B, Hq, -1)
        res_k = self.res_k.repeat_interleave(hg, 1)
        res_v = self.res_v.repeat_interleave(hg, 1)
        s_res = (q.float() @ res_k.float().transpose(-1, -2)).view(B, Hq, -1)
        p = torch.softmax(torch.cat([s_body, s_res], -1) * scale, dim=-1)
        out = seed_gemv(p[..., : self.body].reshape(B * Hq, -1).contiguous(), self.v, self.v_s,
                        self.v_z, self.bits, D if self.group > D else self.group, hg)
        out = out.view(B, Hq, 1, D) + p[..., self.body:].unsqueeze(2) @ res_v.float()
        return out.to(q.dtype)
