"""Tests for kvbits.kernels.decode_attention: the fused Triton kernel against the PyTorch oracle
``kvbits.reference.attention.decode_attention`` on the *same* packed codes (the tight error budget;
quantized-vs-FP16 error belongs to integration tests on a real model).

On a machine without CUDA the kernel runs under ``TRITON_INTERPRET=1``, whose cost is per program,
so the shapes are small but hostile: odd head dims (80, 96), GQA groups of 3 and 7, 17 query rows,
lengths that end inside a key group, left padding that starts inside one, buffers with spare
capacity filled with NaN (and garbage codes) that the kernel must never read.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvbits.formats.layout import PackedKV  # noqa: E402
from kvbits.formats.packing import packed_length  # noqa: E402
from kvbits.kernels.decode_attention import decode_attention as kernel  # noqa: E402
from kvbits.reference.attention import decode_attention as reference  # noqa: E402
from kvbits.reference.quant import quantize_keys, quantize_values  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# Relative error budget ||o - r|| / ||r|| of kernel vs reference on the same codes, per dtype:
# (global over the whole output, worst single query row).
# * float16 / bfloat16: the kernel feeds tl.dot with operands in the model dtype (dequantized K
#   and V are cast to it, and so are Q * scale and the probabilities P), accumulating in float32;
#   the reference does everything in float32. One rounding of every operand: 2**-11 (fp16) or
#   2**-8 (bf16) relative, averaged over D channels and many tokens; measured ~5e-4 (fp16) and
#   ~4e-3 (bf16) globally, ~2x that on the worst row.
# * float32: on the GPU tl.dot rounds float32 operands to TF32 (10-bit mantissa, like fp16), so
#   the fp16 budget applies; the interpreter multiplies in true float32 (measured ~1e-6).
TOLERANCES = {
    torch.float16: (1e-2, 2e-2),
    torch.bfloat16: (1e-2, 3e-2),
    torch.float32: (1e-2, 2e-2) if CUDA else (1e-5, 5e-5),
}


class Case(NamedTuple):
    kb: int = 2            # key bits
    vb: int = 2            # value bits
    G: int = 32            # key group (tokens); values use gcd(G, D) channels
    D: int = 64            # head dim
    B: int = 1
    Hkv: int = 2
    HG: int = 1            # query heads per KV head (GQA group)
    Lq: int = 1            # query rows (1: decode; > 1: chunked prefill / speculative verify)
    S: int = 0             # sink tokens held
    body: int = 64         # packed body tokens (a multiple of G)
    res: int = 16          # FP16 residual tokens held
    dtype: torch.dtype = torch.float16
    lengths: tuple | None = None  # per-sequence end (ragged batch)
    starts: tuple | None = None   # per-sequence first visible token (left padding)
    window: int | None = None
    splits: int | None = None
    seed: int = 0

    def __str__(self) -> str:
        s = (f"K{self.kb}V{self.vb} G={self.G} D={self.D} B={self.B} Hkv={self.Hkv} "
             f"HG={self.HG} Lq={self.Lq} sink={self.S} body={self.body} res={self.res} "
             f"{str(self.dtype).replace('torch.', '')}")
        for f in ("lengths", "starts", "window", "splits"):
            if getattr(self, f) is not None:
                s += f" {f}={getattr(self, f)}"
        return s


def make_kv(c: Case, device=DEVICE, spare: int = 5) -> PackedKV:
    """A PackedKV with ``spare`` unused slots past every used region, poisoned with NaN (float
    buffers) and random bits (codes): a kernel reading past the used lengths returns NaN."""
    g = torch.Generator().manual_seed(c.seed)
    B, H, D, G = c.B, c.Hkv, c.D, c.G
    kmag = 10 ** (torch.rand(D, generator=g) - 0.5)  # per-channel key scale 0.3 .. 3
    kmag[1] = 8.0  # an outlier channel, as real keys have

    def keys(t):
        return (torch.randn(B, H, t, D, generator=g) * kmag + 0.5).to(c.dtype)

    def values(t):
        return torch.randn(B, H, t, D, generator=g).to(c.dtype)

    def fp_buffer(x, n):
        buf = torch.full((B, H, n + spare, *x.shape[3:]), float("nan"), dtype=x.dtype)
        buf[:, :, :n] = x
        return buf.to(device)

    def code_buffer(x, n, extra):
        buf = torch.randint(-2**31, 2**31 - 1, (B, H, n + extra, x.shape[3]), generator=g,
                            dtype=torch.int32)
        buf[:, :, :n] = x
        return buf.to(device)

    Gv = math.gcd(G, D)
    NG = c.body // G
    assert NG * G == c.body, "body must hold whole key groups"
    Wk = packed_length(G, c.kb)
    if c.body:
        kc, ks, kz = quantize_keys(keys(c.body), c.kb, G)
        vc, vs, vz = quantize_values(values(c.body), c.vb, Gv)
    else:
        kc = torch.zeros(B, H, 0, D, dtype=torch.int32)
        ks = kz = torch.zeros(B, H, 0, D, dtype=torch.float16)
        vc = torch.zeros(B, H, 0, packed_length(D, c.vb), dtype=torch.int32)
        vs = vz = torch.zeros(B, H, 0, D // Gv, dtype=torch.float16)
    return PackedKV(
        sink_k=fp_buffer(keys(c.S), c.S), sink_v=fp_buffer(values(c.S), c.S), sink_len=c.S,
        k_codes=code_buffer(kc, NG * Wk, spare * Wk),
        k_scale=fp_buffer(ks, NG), k_zero=fp_buffer(kz, NG),
        v_codes=code_buffer(vc, c.body, spare),
        v_scale=fp_buffer(vs, c.body), v_zero=fp_buffer(vz, c.body), body_len=c.body,
        res_k=fp_buffer(keys(c.res), c.res), res_v=fp_buffer(values(c.res), c.res),
        res_len=c.res, key_bits=c.kb, value_bits=c.vb, group_size=G, value_group=Gv,
    )


def _seq(x, device=DEVICE):
    return None if x is None else torch.tensor(x, dtype=torch.int32, device=device)


def compare(o: torch.Tensor, r: torch.Tensor, dtype, what: str, tol=None):
    """Kernel output ``o`` vs reference ``r`` [B, Hq, Lq, D]; returns (global, worst row) error."""
    glob_tol, row_tol = tol or TOLERANCES[dtype]
    assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, o.dtype, r.shape, r.dtype)
    bad = ~torch.isfinite(o)
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite outputs, first at "
                             f"[b, h, i, d] = {idx} (value {o[idx].item()})")
    assert torch.isfinite(r).all(), f"{what}: reference not finite (bad test input)"
    of, rf = o.float(), r.float()
    r_rows = rf.norm(dim=-1)  # [B, Hq, Lq]
    e_rows = (of - rf).norm(dim=-1)
    empty = r_rows == 0  # rows that see no token: the reference outputs exact zeros
    if empty.any():
        leak = of[empty].abs().max().item()
        assert leak == 0, f"{what}: a row that sees nothing output {leak} (must be exactly 0)"
    glob = ((of - rf).norm() / rf.norm().clamp_min(1e-30)).item()
    rows = torch.where(empty, torch.zeros_like(e_rows), e_rows / r_rows.clamp_min(1e-30))
    worst = rows.max().item() if rows.numel() else 0.0
    if glob > glob_tol or worst > row_tol:
        w = tuple((rows == rows.max()).nonzero()[0].tolist())
        d = (of[w] - rf[w]).abs().argmax().item()
        raise AssertionError(
            f"{what}: relative error {glob:.3e} (budget {glob_tol:g}), worst row [b, h, i] = {w} "
            f"{worst:.3e} (budget {row_tol:g}); there channel {d}: kernel {of[w][d].item():.6g} "
            f"vs reference {rf[w][d].item():.6g}; {int(empty.sum())} of {empty.numel()} rows "
            f"see nothing")
    return glob, worst


def run_case(c: Case, *, device=DEVICE, check=True, kv=None):
    """Build the case, run kernel and reference; returns (global, worst row) relative error."""
    kv = make_kv(c, device) if kv is None else kv
    g = torch.Generator().manual_seed(c.seed + 1)
    q = torch.randn(c.B, c.Hkv * c.HG, c.Lq, c.D, generator=g).to(c.dtype).to(device)
    q_before = q.clone()
    args = dict(scale=c.D ** -0.5, starts=_seq(c.starts, device), lengths=_seq(c.lengths, device),
                window=c.window)
    o = kernel(q, kv, splits=c.splits, **args)
    r = reference(q, kv, **args)
    assert torch.equal(q, q_before), "the kernel modified q"
    if not check:
        of, rf = o.float(), r.float()
        return (((of - rf).norm() / rf.norm()).item(),
                ((of - rf).norm(dim=-1) / rf.norm(dim=-1).clamp_min(1e-30)).max().item())
    return compare(o, r, c.dtype, str(c))
