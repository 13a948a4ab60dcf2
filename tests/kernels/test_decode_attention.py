"""Tests for kvbits.kernels.decode_attention: the fused Triton kernel against the PyTorch oracle
``kvbits.reference.attention.decode_attention`` on the *same* packed codes (the tight error budget;
quantized-vs-FP16 error belongs to integration tests on a real model).

On a machine without CUDA the kernel runs under ``TRITON_INTERPRET=1``, whose cost is per program,
so the shapes are small but hostile: odd head dims (80, 96), GQA groups of 3 and 7, 17 query rows,
lengths that end inside a key group, left padding that starts inside one, buffers with spare
capacity filled with NaN (and garbage codes) that the kernel must never read.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import zlib
from typing import NamedTuple

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbits import ops
from kvbits.formats.layout import PackedKV
from kvbits.formats.packing import packed_length
from kvbits.kernels.decode_attention import _lookup
from kvbits.kernels.decode_attention import decode_attention as kernel
from kvbits.reference.attention import decode_attention as reference
from kvbits.reference.quant import quantize_keys, quantize_values

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# Relative error budget ||o - r|| / ||r|| of kernel vs reference on the same codes, per dtype:
# (global over the whole output, worst single query row).
# * float16 / bfloat16: the kernel dequantizes the body in float16 arithmetic (code * scale +
#   zero, one rounding of 2**-11) and feeds tl.dot with operands in the model dtype (dequantized
#   K and V, Q * scale and the probabilities P are cast to it), accumulating in float32; the
#   reference does everything in float32. Rounding errors of 2**-11 (fp16) or 2**-8 (bf16),
#   random across D channels and many tokens; measured <= 8e-4 globally and 1.5e-3 on the worst
#   row for fp16. bf16 queries cannot run under the interpreter (ops.decode_attention turns
#   them to float32 there); expect ~8x the fp16 error.
# * float32: the kernel dequantizes the body in float32 (``_body_tile``'s F32), reads a float32
#   pre-RoPE table and multiplies in full float32 (``_dot``: no TF32), and float32 queries do not
#   take the Gluon body (float16 operands). Measured under the interpreter over this file:
#   <= 1.25e-6 globally, 2.2e-6 on the worst row (the fp16 dequantization it replaced reached
#   4.1e-3 on a hypothesis case, K3V2 G=64 D=96, where an output's norm is small against its
#   values'). Budget ~15-20x that.
TOLERANCES = {
    torch.float16: (1e-2, 2e-2),
    torch.bfloat16: (1e-2, 3e-2),
    torch.float32: (2e-5, 5e-5),
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
    Gv: int | None = None  # value group (channels); None: gcd(G, D); the last may be shorter
    softcap: float | None = None  # Gemma2's attention-logit softcapping

    def __str__(self) -> str:
        s = (f"K{self.kb}V{self.vb} G={self.G} D={self.D} B={self.B} Hkv={self.Hkv} "
             f"HG={self.HG} Lq={self.Lq} sink={self.S} body={self.body} res={self.res} "
             f"{str(self.dtype).replace('torch.', '')}")
        for f in ("lengths", "starts", "window", "splits", "Gv", "softcap"):
            if getattr(self, f) is not None:
                s += f" {f}={getattr(self, f)}"
        return s


def make_kv(c: Case, device=DEVICE, spare: int = 5) -> PackedKV:
    """A PackedKV with ``spare`` unused slots past every used region, poisoned with NaN (float
    buffers) and random bits (codes): a kernel reading past the used lengths returns NaN."""
    g = torch.Generator(device=device).manual_seed(c.seed)
    B, H, D, G = c.B, c.Hkv, c.D, c.G
    kmag = 10 ** (torch.rand(D, generator=g, device=device) - 0.5)  # per-channel 0.3 .. 3
    kmag[1] = 8.0  # an outlier channel, as real keys have

    def keys(t):
        return (torch.randn(B, H, t, D, generator=g, device=device) * kmag + 0.5).to(c.dtype)

    def values(t):
        return torch.randn(B, H, t, D, generator=g, device=device).to(c.dtype)

    def fp_buffer(x, n):
        buf = torch.full((B, H, n + spare, *x.shape[3:]), float("nan"), dtype=x.dtype,
                         device=device)
        buf[:, :, :n] = x
        return buf

    def code_buffer(x, n, extra):
        buf = torch.randint(-2**31, 2**31 - 1, (B, H, n + extra, D), generator=g,
                            dtype=torch.int32, device=device)
        buf[:, :, :n] = x
        return buf

    Gv = c.Gv or math.gcd(G, D)
    NG = c.body // G
    assert NG * G == c.body, "body must hold whole key groups"
    Wk, Wv = packed_length(G, c.kb), packed_length(G, c.vb)
    if c.body:
        kc, ks, kz = quantize_keys(keys(c.body), c.kb, G)
        vc, vs, vz = quantize_values(values(c.body), c.vb, Gv, G)
    else:
        kc = vc = torch.zeros(B, H, 0, D, dtype=torch.int32, device=device)
        ks = kz = torch.zeros(B, H, 0, D, dtype=torch.float16, device=device)
        vs = vz = torch.zeros(B, H, 0, -(-D // Gv), dtype=torch.float16, device=device)
    return PackedKV(
        sink_k=fp_buffer(keys(c.S), c.S), sink_v=fp_buffer(values(c.S), c.S), sink_len=c.S,
        k_codes=code_buffer(kc, NG * Wk, spare * Wk),
        k_scale=fp_buffer(ks, NG), k_zero=fp_buffer(kz, NG),
        v_codes=code_buffer(vc, NG * Wv, spare * Wv),
        v_scale=fp_buffer(vs, c.body), v_zero=fp_buffer(vz, c.body), body_len=c.body,
        res_k=fp_buffer(keys(c.res), c.res), res_v=fp_buffer(values(c.res), c.res),
        res_len=c.res, key_bits=c.kb, value_bits=c.vb, group_size=G, value_group=Gv,
    )



def body_case(bits: int, G: int, D: int, HG: int, seed: int, **kw) -> Case:
    """A hostile case for the Gluon body kernels: 3 sequences x 2 KV heads, ~2.1k body tokens
    (an odd group count: a half-empty last 64-token step), a sink of 0-2 tokens, ragged ends
    (one inside a group, one 33 tokens in), left padding inside a group."""
    S, ng = (G + HG) % 3, max(3, 2113 // G)
    return Case(kb=bits, vb=bits, G=G, D=D, B=3, Hkv=2, HG=HG, S=S, body=G * ng, res=40,
                lengths=(S + G * ng + 40, S + G * ng - 7, S + 33), starts=(0, 5, 0),
                seed=seed, **kw)

def count_calls(monkeypatch, module, name="attend_body") -> list:
    """Wrap ``module.name`` so each call appends to the returned list (which kernel ran)."""
    used = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: used.append(1) or real(*a, **k))
    return used


def serve_small(monkeypatch, decode_gluon):
    """Let the Gluon body serve the tests' small batches: lift :func:`decode_gluon.serves`'s
    size limits (body tokens x pairs, per kind of layer), which route small steps to the Triton
    kernel as the faster one, and its limit on blocks of columns for plain KIVI layers."""
    for name in ("MIN_BODY_TOKENS", "MIN_BODY_TOKENS_PLANES", "MIN_BODY_TOKENS_WIDE"):
        monkeypatch.setattr(decode_gluon, name, 1)
    monkeypatch.setattr(decode_gluon, "MAX_PLAIN_BLOCKS", 1 << 10)


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


def _query_and_args(c: Case, device=DEVICE):
    """The case's query (seeded from ``c.seed + 1``) and the attention arguments besides the
    cap: scale, starts, lengths, window."""
    g = torch.Generator().manual_seed(c.seed + 1)
    q = torch.randn(c.B, c.Hkv * c.HG, c.Lq, c.D, generator=g).to(c.dtype).to(device)
    return q, {"scale": c.D ** -0.5, "starts": _seq(c.starts, device),
               "lengths": _seq(c.lengths, device), "window": c.window}


def run_case(c: Case, *, device=DEVICE, check=True, kv=None):
    """Build the case, run kernel and reference; returns (global, worst row) relative error."""
    kv = make_kv(c, device) if kv is None else kv
    q, args = _query_and_args(c, device)
    q_before = q.clone()
    if c.softcap is not None:
        args["softcap"] = c.softcap
    o = kernel(q, kv, splits=c.splits, **args)
    r = reference(q, kv, **args)
    assert torch.equal(q, q_before), "the kernel modified q"
    if not check:
        of, rf = o.float(), r.float()
        return (((of - rf).norm() / rf.norm()).item(),
                ((of - rf).norm(dim=-1) / rf.norm(dim=-1).clamp_min(1e-30)).max().item())
    return compare(o, r, c.dtype, str(c))


def _skip_bf16_in_interpreter(dtype):
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the Triton interpreter multiplies bf16 bit patterns in tl.dot "
                    "(triton-lang/triton#11584); bf16 runs on the GPU")


# ----------------------------------------------------------------------------- the grid
# Each case varies one axis from a small default and is hostile on the others where that is
# cheap (odd lengths, a group cut by `lengths`, left padding inside a group).
GRID = {
    # bits and presets x group size (keys 3 with values 4; values 3 too)
    "K2V2-G32": Case(kb=2, vb=2, G=32, body=96, HG=2),
    "K4V4-G64": Case(kb=4, vb=4, G=64, body=128, HG=2),
    "K8V8-G128": Case(kb=8, vb=8, G=128, body=256, HG=2),
    "K3V4-G32": Case(kb=3, vb=4, G=32, body=96, HG=3),
    "K3V4-G128": Case(kb=3, vb=4, G=128, body=256, HG=2, lengths=(250,)),
    "k4v2-G64": Case(kb=4, vb=2, G=64, body=192, HG=2),
    "k8v4-G32": Case(kb=8, vb=4, G=32, body=96, HG=2),
    "K2V8-G64": Case(kb=2, vb=8, G=64, body=128),
    "K3V3-G32": Case(kb=3, vb=3, G=32, body=64, HG=2),
    "K4V3-G64": Case(kb=4, vb=3, G=64, body=128),
    # head dims (values use gcd(G, D) channels: 16 for D=80, 32 for D=96)
    "D80": Case(kb=2, vb=2, D=80, body=96, HG=2),
    "D80-G128": Case(kb=4, vb=2, G=128, D=80, body=128, res=5),
    "D96": Case(kb=4, vb=4, D=96, body=96, HG=3),
    "D96-K8V8-G64": Case(kb=8, vb=8, G=64, D=96, body=128),
    "D128": Case(kb=4, vb=4, G=64, D=128, body=128, HG=2),
    "D256": Case(kb=2, vb=2, G=128, D=256, body=128, res=16, Hkv=1, HG=2),
    # not multiples of 16 (OpenLLaMA-3B's 100): padded lanes, value groups of 4 / 8 channels
    "D100-ragged": Case(kb=3, vb=3, D=100, B=2, body=96, res=9, lengths=(100, 60)),
    "D40": Case(kb=2, vb=4, D=40, body=96, HG=2),
    "D24-G64": Case(kb=4, vb=4, G=64, D=24, body=128, res=3),
    # value groups with a shorter last one (QuantSpec.value_group): 32 x 3 + 4 at head_dim 100,
    # 32 + 32 + 16 at 80; one group of all 80 channels (not a power of two) at G = 128
    "D100-Gv32": Case(kb=2, vb=2, D=100, body=96, HG=2, B=2, lengths=(120, 77), Gv=32),
    "D80-Gv32-K3V3": Case(kb=3, vb=3, D=80, body=64, Gv=32, S=2),
    "D80-G128-Gv80": Case(kb=4, vb=2, G=128, D=80, body=128, Gv=80, Lq=3),
    # GQA group sizes and MQA
    "MHA": Case(B=2, Hkv=3, HG=1, body=64, res=20),
    "GQA3": Case(Hkv=2, HG=3, body=96),
    "GQA7-Lq4": Case(Hkv=2, HG=7, Lq=4, body=96, lengths=(100,)),
    "GQA8-Lq17": Case(Hkv=1, HG=8, Lq=17, body=64, res=40),  # 136 rows: 3 row tiles
    "MQA12": Case(Hkv=1, HG=12, body=96, S=4),
    "MQA8-Lq4": Case(kb=4, vb=4, Hkv=1, HG=8, Lq=4, body=128, res=3),
    # several query rows (chunked prefill, speculative verify)
    "Lq4-ragged": Case(B=2, HG=2, Lq=4, body=96, lengths=(112, 70)),
    "Lq17-window": Case(Lq=17, body=128, res=16, window=40),
    "Lq17-rows-before-start": Case(B=2, Lq=17, body=64, res=16, lengths=(10, 80)),
    # sink
    "sink4": Case(S=4, body=96, res=16, HG=2),
    "sink4-start-in-sink-and-body": Case(B=3, S=4, body=96, res=16, starts=(2, 4, 45)),
    "sink-only-partial": Case(S=3, body=0, res=0, HG=2),
    "length-inside-sink": Case(B=2, S=4, body=64, res=8, lengths=(3, 76)),
    # residual sizes
    "res0": Case(body=96, res=0, HG=2),
    "res128": Case(body=64, res=128, HG=2, S=4),
    "res130-ragged": Case(B=2, body=32, res=130, lengths=(162, 100)),
    # ragged batch: ends inside a group, on a boundary, left padding inside a group
    "ragged3": Case(B=3, HG=2, body=128, res=16, lengths=(144, 104, 47), starts=(0, 37, 5)),
    "ragged-boundary": Case(B=2, body=128, res=0, lengths=(96, 64), starts=(32, 0)),
    # sliding window
    "window50-ragged": Case(B=2, kb=4, vb=4, D=96, HG=3, Lq=4, S=4, body=160, res=16,
                            lengths=(180, 150), starts=(0, 37), window=50),
    "window1": Case(Lq=4, body=96, window=1),
    "window-over-all": Case(body=96, window=10_000),
    "window-inside-residual": Case(S=4, body=128, res=40, window=20),  # body and sink unseen
    # forced splits
    "splits1": Case(kb=4, vb=2, Hkv=1, HG=4, body=32 * 24, res=8, splits=1),
    "splits2": Case(kb=4, vb=2, Hkv=1, HG=4, body=32 * 24, res=8, splits=2),
    "splits24": Case(kb=4, vb=2, Hkv=1, HG=4, body=32 * 24, res=8, splits=24),
    "splits1000": Case(kb=2, vb=2, Hkv=1, HG=4, body=32 * 24, res=8, splits=1000,
                       lengths=(700,)),
    # empty parts
    "empty-body": Case(body=0, res=100, HG=3),
    "empty-residual-no-sink": Case(body=128, res=0, S=0),
    "nothing-stored": Case(body=0, res=0, S=0, HG=2),
    "fp16-preset": Case(body=0, res=150, HG=4, Lq=3),
    # rows that see nothing -> zeros
    "seq-sees-nothing": Case(B=2, HG=2, body=64, res=16, starts=(0, 80), lengths=(80, 80)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(GRID))
def test_grid(name, dtype):
    _skip_bf16_in_interpreter(dtype)
    seed = zlib.crc32(name.encode()) % 1000  # deterministic per case
    run_case(GRID[name]._replace(seed=seed, dtype=dtype))


@pytest.mark.parametrize("name", ["seq-sees-nothing", "Lq17-rows-before-start", "nothing-stored"])
def test_rows_that_see_nothing_are_zero(name):
    c = GRID[name]
    kv = make_kv(c)
    q = torch.randn(c.B, c.Hkv * c.HG, c.Lq, c.D).to(c.dtype).to(DEVICE)
    o = kernel(q, kv, scale=0.125, starts=_seq(c.starts), lengths=_seq(c.lengths))
    sees = _visible_mask(c)  # [B, Lq, total]
    blind = ~sees.any(-1)  # [B, Lq]
    assert blind.any(), "case has no blind row: it tests nothing"
    rows = o.permute(0, 2, 1, 3)[blind]  # [n, Hq, D]
    assert not o.isnan().any(), "NaN in the output"
    assert (rows == 0).all(), f"blind rows are not zero: max |o| = {rows.abs().max().item()}"


def _visible_mask(c: Case) -> torch.Tensor:
    from kvbits.reference.attention import attention_mask
    total = c.S + c.body + c.res
    return attention_mask(c.B, c.Lq, total, "cpu", _seq(c.starts, "cpu"),
                          _seq(c.lengths, "cpu"), c.window)


# ----------------------------------------------------------------------------- random cases
@st.composite
def cases(draw):
    G = draw(st.sampled_from([32, 64, 128]))
    S = draw(st.sampled_from([0, 0, 1, 4]))
    body = G * draw(st.integers(0, 3 if G < 128 else 2))
    res = draw(st.integers(0, 80))
    total = S + body + res
    B = draw(st.integers(1, 3))
    HG = draw(st.sampled_from([1, 2, 3, 4, 7, 8]))
    Lq = draw(st.sampled_from([1, 1, 2, 4, 5]))
    lengths = starts = None
    if draw(st.booleans()) and total:
        lengths = tuple(draw(st.integers(0, total)) for _ in range(B))
        starts = tuple(draw(st.integers(0, max(0, ln - 1))) for ln in lengths)
    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
    D = draw(st.sampled_from([64, 80, 96, 100, 128]))
    return Case(
        kb=draw(st.sampled_from([2, 3, 4, 8])), vb=draw(st.sampled_from([2, 3, 4, 8])), G=G,
        D=D, B=B, Hkv=draw(st.integers(1, 2)), HG=HG,
        Gv=draw(st.sampled_from([None, min(G, D)])),  # a divisor, or G with a shorter last group
        Lq=Lq, S=S, body=body, res=res, dtype=draw(st.sampled_from(dtypes)),
        lengths=lengths, starts=starts,
        window=draw(st.one_of(st.none(), st.integers(1, total + 5))),
        splits=draw(st.one_of(st.none(), st.integers(1, 5))),
        seed=draw(st.integers(0, 10_000)),
    )


@settings(max_examples=40, deadline=None)
@given(c=cases())
def test_random_cases(c):
    run_case(c)


@settings(max_examples=20, deadline=None)
@given(c=cases(), tile=st.sampled_from([1, 512, 8192]))
def test_random_cases_fp16_in_the_finish_kernel(c, tile):
    """The same random cases with the FP16 part attended by the finish kernel where it holds
    up to 64 sink + residual tokens (longer ones as splits: both routes occur), and merge tiles
    of one to many rows."""
    from kvbits.kernels import decode_attention as da
    old = da.FINISH_FP_TOKENS, da.FINISH_TILE, da.MERGE_IN_SPLITS
    # cases() holds up to 84 FP16 tokens; the finish kernel merges (MERGE_IN_SPLITS off)
    da.FINISH_FP_TOKENS, da.FINISH_TILE, da.MERGE_IN_SPLITS = 64, tile, "0"
    try:
        run_case(c)
    finally:
        da.FINISH_FP_TOKENS, da.FINISH_TILE, da.MERGE_IN_SPLITS = old


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("preset,S,R", [("kivi-2", 0, 16), ("k4v2", 4, 0), ("kivi-4", 2, 40)])
def test_store_built_layer(preset, S, R, monkeypatch):
    # The layout the LayerStore really writes (geometric capacity, flushes token by token).
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    from kvbits.cache.store import LayerStore
    from kvbits.spec import resolve_spec

    spec = resolve_spec(preset, residual_length=R, sink_tokens=S)
    store = LayerStore(spec, 2, 2, 64, torch.float16, DEVICE)
    g = torch.Generator().manual_seed(3)
    kv_in = [torch.randn(2, 2, 150, 64, generator=g).half().to(DEVICE) for _ in range(2)]
    store.append(kv_in[0][:, :, :90], kv_in[1][:, :, :90])
    for t in range(90, 150):
        store.append(kv_in[0][:, :, t:t + 1], kv_in[1][:, :, t:t + 1])
    q = torch.randn(2, 6, 2, 64, generator=g).half().to(DEVICE)
    for kw in ({}, {"starts": _seq((0, 9)), "lengths": _seq((150, 131)), "window": 70}):
        o = kernel(q, store.view(), scale=0.125, **kw)
        compare(o, reference(q, store.view(), scale=0.125, **kw), torch.float16,
                f"store {preset} S={S} R={R} {kw}")


# ----------------------------------------------------------------------------- edge cases
def test_poison_is_really_there():
    # The spare capacity must hold NaN, or the poison checks above prove nothing.
    kv = make_kv(Case(S=2, body=64, res=5))
    assert kv.res_k[:, :, 5:].isnan().all() and kv.sink_v[:, :, 2:].isnan().all()
    assert kv.k_scale[:, :, 2:].isnan().all() and kv.v_scale[:, :, 64:].isnan().all()


# The finish kernel (the last launch: FP16 sink + residual when short, then the merge of every
# split) against the reference, with the FP16 part attended inline or as Triton-kernel splits
# (FINISH_FP_TOKENS 0), and merge tiles of one row or several (FINISH_TILE): ragged rows, sinks,
# left padding, a window, 17 query rows of 7 heads (two m-tiles), a residual past the inline
# limit, FP16 only, body only.
FINISH_CASES = {
    "ragged-sink": Case(B=3, HG=3, S=2, body=128, res=40, lengths=(170, 100, 9),
                        starts=(0, 7, 1)),
    "window-rows": Case(HG=7, Lq=17, body=96, res=33, S=1, window=50, splits=3),
    "long-residual": Case(HG=2, body=64, res=300),
    "fp16-only": Case(HG=4, S=3, body=0, res=70, lengths=(60,)),
    "body-only": Case(HG=2, body=128, res=0, splits=4),
}


@pytest.mark.parametrize("tile", [1, 8192])
@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("name", list(FINISH_CASES))
def test_finish_kernel_matches_reference(name, inline, tile, monkeypatch):
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", 256 if inline else 0)
    monkeypatch.setattr(da, "FINISH_TILE", tile)
    run_case(FINISH_CASES[name])


def _count_triton_launches(monkeypatch, da) -> list:
    """Spy on the Triton kernel's launches (the FP16 splits, with a Gluon body); returns the
    list that each launch appends its grid to."""
    grids = []
    launch = da._DECODE.launch
    monkeypatch.setattr(da._DECODE, "launch", lambda grid, *a: grids.append(grid) or launch(grid, *a))
    return grids


@pytest.mark.parametrize("setting, inline", [(None, True), (0, False), (64, True), (32, False)])
def test_finish_fp_tokens_policy(setting, inline, monkeypatch):
    """``FINISH_FP_TOKENS``: "auto" (None) lets an eager call's finish kernel attend the FP16
    part itself (no Triton launch for a body-less call); an integer is the limit everywhere."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", setting)
    grids = _count_triton_launches(monkeypatch, da)
    run_case(Case(HG=2, S=1, body=0, res=40))  # 41 FP16 tokens, no body
    assert (len(grids) == 0) == inline, grids


@pytest.mark.parametrize("c", [
    Case(HG=2, S=1, body=0, res=40),  # FP16 tokens only
    Case(B=2, HG=4, Lq=3, body=256, res=20, splits=3, lengths=(290, 200)),  # 3 + 1 columns
    Case(HG=16, Lq=5, body=64, res=16, splits=2),  # 80 query rows: two m-tiles, two tickets
], ids=str)
@pytest.mark.parametrize("setting", ["auto", "1"])
def test_stage1_merges_without_a_finish_launch(c, setting, monkeypatch):
    """``MERGE_IN_SPLITS``: a call the Triton kernel serves alone is one launch, whose last
    program per m-tile merges every column; the tickets are back at zero after each call."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", setting)
    finishes = []
    finish = da._FINISH.launch
    monkeypatch.setattr(da._FINISH, "launch",
                        lambda grid, *a: finishes.append(grid) or finish(grid, *a))
    grids = _count_triton_launches(monkeypatch, da)
    for seed in range(2):  # the second call starts from the tickets the first put back
        run_case(c._replace(seed=seed))
        assert not da._merge_counts(1, torch.device(DEVICE)).any(), "tickets left behind"
    assert len(grids) == 2 and not finishes, (grids, finishes)
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    run_case(c)
    assert len(finishes) == 1, "MERGE_IN_SPLITS=0 should merge in the finish kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (realistic sizes)")
def test_stage1_merge_races(monkeypatch):
    """Many programs finishing at once (a long ragged Triton-kernel call, hundreds of tickets
    per launch): every run bit for bit equal, matching the reference, tickets back at zero."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "1")
    c = Case(kb=4, vb=2, G=32, D=128, B=8, Hkv=8, HG=4, S=2, body=32 * 200, res=90,
             lengths=tuple(6000 + 37 * i for i in range(8)), seed=5)
    kv = make_kv(c, "cuda")
    q, args = _query_and_args(c, "cuda")
    first = kernel(q, kv, gluon=False, **args)
    compare(first, reference(q, kv, **args), c.dtype, str(c))
    for _ in range(30):
        assert torch.equal(kernel(q, kv, gluon=False, **args), first)
    assert not da._merge_counts(1, torch.device("cuda")).any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (realistic sizes)")
@pytest.mark.parametrize("tma", ["0", "1"])
def test_stage1_merge_after_the_gluon_body_in_a_graph(tma, monkeypatch):
    """Captured with a Gluon body and ``MERGE_IN_SPLITS`` "1", the FP16 splits run after it in
    the call's stream and merge (no side stream, no finish kernel); replays with new queries and device lengths that grow
    match the reference, as in a captured decode loop."""
    import dataclasses

    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "1")
    monkeypatch.setattr(decode_gluon_tma, "MODE", tma)
    serve_small(monkeypatch, decode_gluon)
    c = Case(kb=2, vb=2, G=32, D=128, B=2, Hkv=2, HG=4, S=1, body=32 * 64, res=100, seed=3)
    kv = make_kv(c, "cuda")
    q, args = _query_and_args(c, "cuda")
    lens_dev = torch.tensor([1, 32 * 60, 60], dtype=torch.int32, device="cuda")
    streams, finishes = [], []
    launch, finish = da._DECODE.launch, da._FINISH.launch
    monkeypatch.setattr(da._DECODE, "launch", lambda grid, *a: streams.append(
        torch.cuda.current_stream()) or launch(grid, *a))
    monkeypatch.setattr(da._FINISH, "launch",
                        lambda grid, *a: finishes.append(grid) or finish(grid, *a))
    kernel(q, kv, gluon=True, lens_dev=lens_dev, **args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        out = kernel(q, kv, gluon=True, lens_dev=lens_dev, **args)
    assert streams[-1] == main and not finishes, (streams, finishes)
    for step in range(6):
        body, res = 32 * (60 + step % 3), 60 + 7 * step
        lens_dev.copy_(torch.tensor([1, body, res]))
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(step)))
        graph.replay()
        ref = reference(q, dataclasses.replace(kv, body_len=body, res_len=res), **args)
        compare(out, ref, c.dtype, f"{c} tma={tma} replay {step}")
    assert not da._merge_counts(1, torch.device("cuda")).any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (graph capture)")
def test_finish_fp16_part_splits_under_graph_capture(monkeypatch):
    """Under "auto", a call captured in a CUDA graph keeps the FP16 splits (measured faster in
    replays), and its eager twin attends the part in the finish kernel; both match the
    reference."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", None)
    c = Case(B=2, HG=4, S=1, body=0, res=100, lengths=(101, 77))
    kv = make_kv(c, "cuda")
    q, args = _query_and_args(c, "cuda")
    grids = _count_triton_launches(monkeypatch, da)
    eager = kernel(q, kv, **args)
    assert not grids, "an eager call launched FP16 splits"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(q, kv, **args)
    assert grids, "the captured call attended the FP16 part in the finish kernel"
    graph.replay()
    ref = reference(q, kv, **args)
    compare(eager, ref, c.dtype, f"{c} eager")
    compare(out, ref, c.dtype, f"{c} graph replay")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (graph capture)")
@pytest.mark.parametrize("side", [True, False])
def test_fp16_splits_beside_the_gluon_body_in_a_graph(side, monkeypatch):
    """Captured with a Gluon body, the FP16 splits go to a side stream (``SIDE_STREAM``), forked
    from and joined to the call's stream; replays match the reference with new queries, as do
    the same splits kept in the call's stream."""
    from kvbits.kernels import decode_attention as da
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", None)
    monkeypatch.setattr(da, "SIDE_STREAM", side)
    monkeypatch.setattr(da, "INLINE_PDL", False)  # (its few splits would take the dependent finish)
    c = Case(kb=2, vb=2, G=32, D=128, B=2, Hkv=2, HG=4, S=1, body=2048, res=100,
             lengths=(2149, 1500))
    kv = make_kv(c, "cuda")
    q, args = _query_and_args(c, "cuda")
    streams = []
    launch = da._DECODE.launch
    monkeypatch.setattr(da._DECODE, "launch", lambda grid, *a: streams.append(
        torch.cuda.current_stream()) or launch(grid, *a))
    kernel(q, kv, gluon=True, **args)  # warm-up: compiles, makes the side stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        out = kernel(q, kv, gluon=True, **args)
    assert streams and (streams[-1] != main) == side, (streams, main)
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        compare(out, reference(q, kv, **args), c.dtype, f"{c} side={side} replay {seed}")


def test_splits_zero_does_not_drop_the_body():
    c = Case(kb=4, vb=4, body=128, res=16, HG=2)
    run_case(c._replace(splits=0))


# Negative starts (a sliding layer's store after eviction: the sequence began before the first
# stored token) with a sink: the sink's tokens sit at positions start + j, before position 0.
# The reference placed sinks in a position-ordered tensor, which has no slot there: with one
# start negative and another positive it raised (index out of bounds in place_sinks), and with
# all starts <= 0 it left the sink at positions 0.. (0.03-0.75 off the kernel where a window or
# a length inside the sink cut it). It now masks the stored order by position.
NEGATIVE_START_CASES = {
    "mixed-signs": Case(B=2, S=4, body=64, res=8, starts=(-3, 2), HG=2),
    "window-cuts-the-sink": Case(S=4, body=64, res=8, starts=(-3,), window=77),
    "length-inside-the-sink": Case(B=2, S=4, body=64, res=8, starts=(-3, -1), lengths=(2, 40),
                                   Lq=2),
    "no-body-rows-over-the-sink": Case(S=4, body=0, res=8, starts=(-3,), lengths=(6,), Lq=4,
                                       window=5),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", list(NEGATIVE_START_CASES))
def test_negative_starts_with_a_sink(name, dtype):
    from kvbits.reference.attention import stored_order_mask

    c = NEGATIVE_START_CASES[name]._replace(dtype=dtype)
    run_case(c)
    # the sink's positions are start + j: a window or a length inside it hides some of it
    total = c.S + c.body + c.res
    mask = stored_order_mask(c.B, c.Lq, total, c.S, "cpu", _seq(c.starts, "cpu"),
                             _seq(c.lengths, "cpu"), c.window)
    b = 0
    pos = (c.lengths[b] if c.lengths else total) - c.Lq + torch.arange(c.Lq)
    sink_pos = c.starts[b] + torch.arange(c.S)
    want = (sink_pos[None, :] <= pos[:, None])
    if c.window is not None:
        want &= sink_pos[None, :] > pos[:, None] - c.window
    assert torch.equal(mask[b, :, : c.S], want)


def test_window_zero_follows_the_reference():
    # The reference treats window=0 as a zero-width window (no token visible, zeros); the kernel
    # must agree rather than read 0 as "no window".
    run_case(Case(body=96, res=16, window=0))


def test_non_contiguous_layer_matches_or_raises():
    # A PackedKV of strided views (here: 2 of 4 heads of a batch of 2) must either give the
    # reference's answer or be refused with a ValueError, never silently read other heads.
    import dataclasses

    c = Case(B=2, Hkv=4, body=64, res=16)
    full = make_kv(c)
    fields = {f.name: getattr(full, f.name) for f in dataclasses.fields(full)}
    for name in ("sink_k", "sink_v", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                 "v_zero", "res_k", "res_v"):
        fields[name] = fields[name][:, 1:3]
    kv = PackedKV(**fields)
    assert not kv.k_codes.is_contiguous()
    q = torch.randn(2, 2, 1, 64).half().to(DEVICE)
    try:
        o = kernel(q, kv, scale=0.125)
    except ValueError:
        return
    compare(o, reference(q, kv, scale=0.125), torch.float16, "strided PackedKV")


def test_bad_head_counts():
    kv = make_kv(Case(Hkv=2))
    with pytest.raises(ValueError, match=r"q \(1, 3, 1, 64\) does not fit the layer .* a multiple "
                                         "of the KV heads"):  # (layout.check_query, as in ops)
        kernel(torch.randn(1, 3, 1, 64).half().to(DEVICE), kv, scale=0.125)


def test_output_dtype_shape_and_q_untouched():
    c = Case(HG=2, Lq=3, body=64, dtype=torch.float32)
    kv = make_kv(c)
    q = torch.randn(1, 4, 3, 64).to(DEVICE)
    q_nc = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided
    o = kernel(q_nc, kv, scale=0.125)
    assert o.shape == q.shape and o.dtype == q.dtype
    compare(o, reference(q, kv, scale=0.125), torch.float32, "strided q")


def test_starts_and_lengths_any_form():
    """``starts``/``lengths`` as ints, int64 tensors or the store's own int32 ``[B]`` tensor (taken
    as is: no conversion ops per decode step) give the same answer."""
    from kvbits.kernels.decode_attention import _as_i32

    own = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    assert _as_i32(own, 2, own.device) is own
    assert torch.equal(_as_i32(3, 2, own.device), torch.tensor([3, 3], dtype=torch.int32,
                                                               device=DEVICE))
    c = Case(B=2, body=64, res=16, lengths=None, starts=None)
    kv = make_kv(c)
    q = torch.randn(2, 2, 1, 64).half().to(DEVICE)
    a = kernel(q, kv, scale=0.125, starts=own, lengths=70)
    b = kernel(q, kv, scale=0.125, starts=own.long(), lengths=torch.tensor([70, 70]).to(DEVICE))
    assert torch.equal(a, b)
    compare(a, reference(q, kv, scale=0.125, starts=own.long(), lengths=70), torch.float16,
            "starts/lengths")


# ----------------------------------------------------------------------------- GPU only
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (realistic sizes)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kb,vb,G", [(2, 2, 32), (4, 4, 128), (4, 2, 64), (3, 4, 32)])
@pytest.mark.parametrize("Lq", [1, 4])
def test_realistic_sizes(kb, vb, G, Lq):
    # Llama-3-8B-like decode step: B=4, 8 KV heads x 4 query heads, D=128, 32k tokens.
    body = 32640  # 1020 groups of 32 = 255 of 128
    c = Case(kb=kb, vb=vb, G=G, D=128, B=4, Hkv=8, HG=4, Lq=Lq, S=4, body=body, res=100,
             lengths=(body + 104, 30001, 17, 20011), starts=(0, 0, 0, 4999), seed=kb * vb + G)
    run_case(c)
    run_case(c._replace(lengths=None, starts=None, window=4096, dtype=torch.bfloat16))


@gpu
@pytest.mark.gpu
def test_million_token_offsets_past_int32():
    """Element offsets past 2**31 in the code tensors (int64 addressing).

    kivi-8, G = 32, D = 128, T = 2**20 body tokens, B = 1, Hkv = 65:
    * k_codes is [1, 65, (T / G) * Wk, D] with Wk = packed_length(32, 8) = 8 words per group
      column, so one head holds 2**15 * 8 * 128 = 2**25 words and head 64 starts at word
      64 * 2**25 = 2**31: every offset into it overflows int32.
    * v_codes has the same shape (values packed along tokens like keys): also past 2**31.
    * Memory: 2 x 65 * 2**25 * 4 B = 16.25 GiB of codes, plus k_scale/k_zero
      (65 * 2**15 * 128 * 2 B = 0.5 GiB each) and v_scale/v_zero (65 * 2**20 * 4 * 2 B = 0.5 GiB
      each): ~18.3 GiB. The reference (which dequantizes to float32) runs on heads 63 and 64 only,
      straddling the 2**31 boundary.
    """
    dev = "cuda"
    H, T, D, G, bits = 65, 2**20, 128, 32, 8
    NG, Wk = T // G, packed_length(G, bits)
    assert (H - 1) * NG * Wk * D == 2**31
    g = torch.Generator(device=dev).manual_seed(0)
    # Random words are valid codes for every slot. Scales spread keys over ~[-1.3, 1.3] and
    # differ per head, so reading another head's words changes the answer.
    head_scale = torch.linspace(0.5, 1.5, H, device=dev).view(1, H, 1, 1)
    k_codes = torch.randint(-2**31, 2**31 - 1, (1, H, NG * Wk, D), generator=g,
                            dtype=torch.int32, device=dev)
    v_codes = torch.randint(-2**31, 2**31 - 1, (1, H, NG * Wk, D), generator=g,
                            dtype=torch.int32, device=dev)
    k_scale = ((torch.rand(1, H, NG, D, generator=g, device=dev) * 0.01 + 0.005)
               * head_scale).half()
    k_zero = (-k_scale.float() * 127).half()
    v_scale = (torch.rand(1, H, T, 4, generator=g, device=dev) * 0.01 + 0.002).half()
    v_zero = (torch.randn(1, H, T, 4, generator=g, device=dev) * 0.3).half()
    res_k = torch.randn(1, H, 24, D, generator=g, device=dev).half()
    res_v = torch.randn(1, H, 24, D, generator=g, device=dev).half()
    empty = torch.zeros(1, H, 0, D, dtype=torch.float16, device=dev)
    kv = PackedKV(empty, empty, 0, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, T,
                  res_k, res_v, 17, bits, bits, G, 32)
    # Sharp scores (q * 6) so that a few tokens dominate and a wrong read shows.
    q = (torch.randn(1, H, 2, D, generator=g, device=dev) * 6).half()
    o = kernel(q, kv, scale=D ** -0.5, lengths=_seq((T + 17,)), window=T - 1000)
    assert torch.isfinite(o).all()
    sl = slice(63, 65)
    part = PackedKV(empty[:, sl], empty[:, sl], 0, k_codes[:, sl], k_scale[:, sl],
                    k_zero[:, sl], v_codes[:, sl], v_scale[:, sl], v_zero[:, sl], T,
                    res_k[:, sl], res_v[:, sl], 17, bits, bits, G, 32)
    r = reference(q[:, sl], part, scale=D ** -0.5, lengths=_seq((T + 17,)), window=T - 1000)
    compare(o[:, sl], r, torch.float16, "million tokens, heads 63-64 (past 2**31 words)")


@pytest.mark.parametrize("part", ["res", "codes"])
def test_slice_past_int32_offsets_is_refused(part):
    """Offsets inside one (sequence, head) slice are int32: a slice of more than 2**31 elements
    (here an FP16 residual, or key codes, of 2**24 + 16 rows of 128) is refused by name before
    any launch. Meta tensors: nothing is allocated."""
    D, G, rows = 128, 32, 2**24 + 16

    def meta(n, dtype=torch.float16):
        return torch.empty(1, 1, n, D, dtype=dtype, device="meta")

    small, scale = meta(64), meta(2)
    res = meta(rows) if part == "res" else small
    codes = meta(rows if part == "codes" else 4, torch.int32)
    kv = PackedKV(small, small, 0, codes, scale, scale, codes, scale, scale, 64, res, res, 10,
                  2, 2, G, G)
    name = "res_k" if part == "res" else "k_codes"
    with pytest.raises(ValueError, match=rf"kv.{name} has {rows} x {D} elements .* int32 .*"
                                         rf"at most 2\*\*31 \({2**31 // D} rows"):
        kernel(meta(1), kv, scale=1.0)


# ----------------------------------------------------------------------------- scale axes, FP8
# The uniform method's layouts (scale/zero of keys per token, of values per channel) and FP8
# bodies: the same codes layout, other places for the scales. Random codes and scales, with NaN
# past every used region as in make_kv.
def _axes_kv(c: Case, key_axis: str, value_axis: str, device=DEVICE, spare: int = 5) -> PackedKV:
    kv = make_kv(c, device, spare)
    g = torch.Generator(device=device).manual_seed(c.seed + 7)
    B, H, D, G = c.B, c.Hkv, c.D, c.G
    NG, Gq = c.body // G, kv.value_group

    def params(rows: int, cols: int):
        s = (torch.rand(B, H, rows, cols, generator=g, device=device) * 0.2 + 0.05).half()
        z = (torch.randn(B, H, rows, cols, generator=g, device=device) * 0.5).half()
        pad = torch.full((B, H, spare, cols), float("nan"), dtype=torch.float16, device=device)
        return torch.cat([s, pad], 2), torch.cat([z, pad], 2)

    n_groups = -(-D // Gq)  # per-token groups (the last may be shorter)
    ks, kz = params(c.body, n_groups) if key_axis == "token" else params(NG, D)
    vs, vz = params(NG, D) if value_axis == "channel" else params(c.body, n_groups)
    kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero = ks, kz, vs, vz
    kv.key_axis, kv.value_axis = key_axis, value_axis
    return kv


def _fp8_kv(c: Case, device=DEVICE, spare: int = 5) -> PackedKV:
    kv = make_kv(c, device, spare)
    g = torch.Generator(device=device).manual_seed(c.seed + 9)
    B, H, D = c.B, c.Hkv, c.D

    def body():
        x = (torch.randn(B, H, c.body + spare, D, generator=g, device=device) * 100).clamp(-448, 448)
        x[:, :, c.body:] = float("nan")  # e4m3fn has a NaN: reading past the body shows
        return x.to(torch.float8_e4m3fn)

    kv.k_codes, kv.v_codes = body(), body()
    kv.k_scale = (torch.rand(B, H, 1, 1, generator=g, device=device) * 0.02 + 0.005)
    kv.v_scale = (torch.rand(B, H, 1, 1, generator=g, device=device) * 0.02 + 0.005)
    kv.k_zero = kv.v_zero = None
    kv.key_bits = kv.value_bits = 8
    kv.fp8 = True
    return kv


AXES_CASES = {
    "K2V2-G32-ragged": Case(kb=2, vb=2, G=32, body=96, HG=2, B=2, lengths=(120, 70),
                            starts=(0, 9)),
    "K4V4-G64-D96": Case(kb=4, vb=4, G=64, D=96, body=128, HG=3),
    "K8V4-G32-sink-window": Case(kb=8, vb=4, G=32, body=96, S=4, Lq=4, window=60),
    "K3V3-G32-D80": Case(kb=3, vb=3, G=32, D=80, body=64, HG=2),
    # per-token groups with a shorter last one (QuantSpec.value_group at head_dim 100 / 80)
    "K4V4-G64-D100-Gv64": Case(kb=4, vb=4, G=64, D=100, body=128, HG=2, Gv=64),
    "K2V2-G32-D80-Gv32-ragged": Case(kb=2, vb=2, G=32, D=80, body=96, B=2, Gv=32,
                                     lengths=(110, 64), starts=(0, 5)),
}


@pytest.mark.parametrize("axes", [("token", "token"), ("channel", "channel"),
                                  ("token", "channel")], ids="-".join)
@pytest.mark.parametrize("name", list(AXES_CASES))
def test_scale_axes_match_reference(name, axes):
    c = AXES_CASES[name]
    run_case(c, kv=_axes_kv(c, *axes))


# ... and with pre-RoPE keys (``uniform:P=1``): the reference turned only KIVI / KVQuant layouts
# back to the model's space, so it answered with unrotated keys (0.86 off exact attention)
@pytest.mark.parametrize("axes", [("token", "token"), ("channel", "channel")], ids="-".join)
@pytest.mark.parametrize("name", ["K2V2-G32-ragged", "K8V4-G32-sink-window"])
def test_scale_axes_with_pre_rope_keys_match_reference(name, axes):
    from kvbits.reference.attention import dequantize_body

    c = AXES_CASES[name]
    kv = _axes_kv(c, *axes)
    kv.rope_inv_freq = 1.0 / (10000 ** (torch.arange(0, c.D, 2, device=DEVICE).float() / c.D))
    plain = _axes_kv(c, *axes)
    turned, unturned = dequantize_body(kv, 0, 32)[0], dequantize_body(plain, 0, 32)[0]
    assert not torch.allclose(turned, unturned)  # the reference turns them
    run_case(c, kv=kv)


# head_dim 256: FP8 keeps 128-token tiles past head_dim 128 (other layers halve them)
FP8_CASES = {name: AXES_CASES[name]
             for name in ("K2V2-G32-ragged", "K4V4-G64-D96", "K8V4-G32-sink-window")}
FP8_CASES["G32-D256-ragged"] = Case(kb=8, vb=8, G=32, D=256, body=288, HG=2, B=2,
                                    lengths=(300, 150), starts=(0, 7))


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_body_matches_reference(name):
    c = FP8_CASES[name]
    run_case(c, kv=_fp8_kv(c))


def test_kernel_reads_every_layout_but_odd_per_token_pre_rope():
    from kvbits.kernels.decode_attention import reads

    c = AXES_CASES["K2V2-G32-ragged"]
    assert reads(make_kv(c)) and reads(_fp8_kv(c)) and reads(_axes_kv(c, "token", "channel"))
    kv = make_kv(c)
    kv.k_codebook = torch.arange(4.0).expand(c.Hkv, 4)
    kv.rope_inv_freq = torch.ones(c.D // 2)
    assert reads(kv)  # codebooks, pre-RoPE at head_dim 64
    odd = make_kv(AXES_CASES["K3V3-G32-D80"])
    odd.rope_inv_freq = torch.ones(40)
    assert reads(odd)  # head_dim 80: the halves padded to 64 lanes
    odd = _axes_kv(AXES_CASES["K3V3-G32-D80"], "token", "token")
    odd.rope_inv_freq = torch.ones(40)
    assert not reads(odd)  # per-token key groups would cross the padded halves: the reference
    from kvbits.formats.layout import pre_rope_kernel_ok

    dims = (16, 30, 32, 48, 64, 80, 96, 128, 256)  # halves of >= 16 lanes (tl.dot's least)
    assert [d for d in dims if pre_rope_kernel_ok(d)] == [32, 48, 64, 80, 96, 128, 256]
    assert [d for d in dims if pre_rope_kernel_ok(d, "token")] == [32, 64, 128, 256]


# ----------------------------------------------------------------------------- KVQuant layers
# Codebook codes (sorted non-uniform levels in code units, per KV head), a fixed count of FP16
# outlier corrections per token, and keys stored before RoPE (the kernel rotates them at
# position ``t - starts[b]``), built with the KVQuant quantizer on random data.
def _kvquant_kv(c: Case, n_out: int, pre_rope: bool, device=DEVICE,
                offline: bool = False) -> PackedKV:
    """A KVQuant layer of ``c``'s shape: random codebooks, ``n_out`` outliers per token;
    ``offline``: key scales as one offline ``[H, D]`` row for every group (key_scales=
    "calibrated"), fitted on other keys of the same distribution, so some codes saturate."""
    from kvbits.methods import kvquant as kvq

    kv = make_kv(c, device)
    g = torch.Generator(device=device).manual_seed(c.seed + 11)
    B, H, D, G, T = c.B, c.Hkv, c.D, c.G, c.body

    def codebook(bits):
        n = 1 << bits
        steps = torch.rand(H, n, generator=g, device=device) + 0.3
        cb = torch.cumsum(steps, 1) - steps[:, :1]
        return cb / cb[:, -1:] * (n - 1)  # sorted, 0 .. n-1, uneven spacing

    kcb, vcb = codebook(c.kb), codebook(c.vb)
    k = torch.randn(B, H, T, D, generator=g, device=device) * (1 + 3 * (torch.arange(D, device=device) == 1))
    v = torch.randn(B, H, T, D, generator=g, device=device)
    valid = None
    if c.starts is not None:
        valid = (torch.arange(T, device=device)[None, :] + c.S
                 >= torch.tensor(c.starts, device=device)[:, None])
    rows = None
    if offline:  # calibration keys: another draw (and a narrower one: codes saturate)
        calib = torch.randn(H, 512, D, generator=g, device=device) * 0.8 * (
            1 + 3 * (torch.arange(D, device=device) == 1))
        rows = kvq.offline_key_rows(calib.cpu(), c.kb)
        kv.key_scales_fixed = True
    kc, ks, kz, koi, kov = kvq.quantize_keys(k, c.kb, G, kcb, kvq.thresholds_of(kcb), n_out, valid,
                                             rows)
    vc, vs, vz, voi, vov = kvq.quantize_values(v, c.vb, kv.value_group, G, vcb,
                                               kvq.thresholds_of(vcb), n_out, valid)
    kv.k_codes, kv.k_scale, kv.k_zero = kc, ks, kz
    kv.v_codes, kv.v_scale, kv.v_zero = vc, vs, vz
    kv.k_codebook, kv.v_codebook = kcb, vcb
    kv.k_out_idx, kv.k_out_val, kv.v_out_idx, kv.v_out_val = koi, kov, voi, vov
    if pre_rope:
        kv.rope_inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))
    return kv


KVQ_CASES = {
    "K2V2-G32-MHA": Case(kb=2, vb=2, G=32, D=64, body=96, B=2, Hkv=2, lengths=(120, 70)),
    "K3V3-G32-GQA-padded": Case(kb=3, vb=3, G=32, D=64, body=128, HG=3, B=2, S=4,
                                starts=(0, 37), lengths=(150, 150)),
    "K4V4-G64-D128-Lq4": Case(kb=4, vb=4, G=64, D=128, body=128, HG=2, Lq=4, window=100),
    # head_dim 256: 32-token steps with pre-RoPE keys (the library's tile there), 64 without
    "K3V3-G32-D256-MQA": Case(kb=3, vb=3, G=32, D=256, body=96, HG=4, B=1, Hkv=1,
                              lengths=(100,)),
    # halves that are not a power of two (Phi-3's 96, 80): padded lanes in the Triton kernel
    "K3V3-G32-D96-padded": Case(kb=3, vb=3, G=32, D=96, body=96, HG=2, B=2, S=1,
                                starts=(0, 21), lengths=(130, 117)),
    "K2V4-G64-D80-Lq2": Case(kb=2, vb=4, G=64, D=80, body=128, HG=3, Lq=2),
    "K3V3-G32-D100": Case(kb=3, vb=3, G=32, D=100, body=96, HG=2, S=1),
    "K3V3-G32-D100-Gv32": Case(kb=3, vb=3, G=32, D=100, body=96, HG=2, Gv=32, B=2,
                               lengths=(110, 97)),
    # 8-bit codes (a spec like "kvquant-3-post:bits=8"): 256-entry tables, gathered (a GPU call
    # with float16 queries stopped at the byte-permute lookup's 16-entry assert)
    "K8V4-G32-GQA": Case(kb=8, vb=4, G=32, D=64, body=64, HG=2, B=2, lengths=(90, 75)),
}


@pytest.mark.parametrize("n_out,pre_rope", [(0, False), (2, False), (1, True), (0, True)])
@pytest.mark.parametrize("name", list(KVQ_CASES))
def test_kvquant_layers_match_reference(name, n_out, pre_rope):
    c = KVQ_CASES[name]
    run_case(c, kv=_kvquant_kv(c, n_out, pre_rope))


# KVQuant keys with offline scales (key_scales="calibrated"): one [B, H, 1, D] scale row for
# every key group, read by the Triton kernel's _scale_tile (FIXED) and the Gluon body (KFIX,
# which serves such a layer exactly where it serves its per-group twin)
@pytest.mark.parametrize("n_out,pre_rope", [(0, False), (1, True)])
@pytest.mark.parametrize("name", ["K2V2-G32-MHA", "K3V3-G32-GQA-padded", "K4V4-G64-D128-Lq4",
                                  "K3V3-G32-D96-padded"])
def test_kvquant_offline_key_scales_match_reference(name, n_out, pre_rope):
    from kvbits.kernels import decode_gluon

    c = KVQ_CASES[name]
    kv = _kvquant_kv(c, n_out, pre_rope, offline=True)
    assert kv.k_scale.shape[2] == 1 and kv.key_scales_fixed
    twin = _kvquant_kv(c, n_out, pre_rope)
    assert decode_gluon.eligible(kv, c.Lq, c.HG) == decode_gluon.eligible(twin, c.Lq, c.HG)
    run_case(c, kv=kv)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("D", [80, 96])
def test_kvquant_pre_rope_padded_halves_on_the_gpu(D):
    """Pre-RoPE keys at head dims whose halves are not a power of two (Phi-3's 96; 80) on the
    GPU's code paths (prmt conversions, MUFU sin/cos, the padded lanes masked): a long ragged,
    left-padded GQA layer with two outliers per token, through the Triton kernel."""
    c = Case(kb=3, vb=3, G=32, D=D, body=32 * 120, B=2, Hkv=4, HG=3, S=1, res=70,
             starts=(0, 40), lengths=(3900, 2600), seed=D)
    run_case(c, device="cuda", kv=_kvquant_kv(c, 2, True, device="cuda"))


# KVQuant codebook layers (no outliers, post-RoPE keys: the kvquant-3-dense-post preset) through
# the 3-bit Gluon body (decode_gluon.PLANES3): codes looked up in the head's codebook by prmt.
GLUON_KVQ_CASES = [body_case(3, G, D, HG, 5 + G + HG)
                   for G, D, HG in ((32, 128, 4), (64, 64, 7), (32, 64, 16), (32, 96, 3),
                                    (64, 256, 2))]
# ... and at 4 bits (decode_gluon.KVQUANT4: the 4-bit body's words, 16-entry tables)
GLUON_KVQ_CASES += [body_case(4, G, D, HG, 41 + G + HG)
                    for G, D, HG in ((32, 128, 4), (64, 64, 7), (32, 128, 16))]
# ... and at 2 bits (decode_gluon.KVQUANT2: the 2-bit body's words, 4-entry tables)
GLUON_KVQ_CASES += [body_case(2, G, D, HG, 23 + G + HG)
                    for G, D, HG in ((32, 128, 4), (64, 64, 7), (32, 128, 16), (128, 128, 2))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c", GLUON_KVQ_CASES, ids=str)
def test_gluon_kvquant_codebooks_match_reference(c, monkeypatch):
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(decode_gluon, "PLANES3", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT4", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT2", True)
    serve_small(monkeypatch, decode_gluon)
    kv = _kvquant_kv(c, 0, False)
    assert decode_gluon.eligible(kv, 1, c.HG), str(c)
    used = count_calls(monkeypatch, decode_gluon)
    run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)
    assert len(used) == 2, "the Gluon kernel was not used"


# KVQuant's full layers through the Gluon body (decode_gluon.KVQUANT_FULL): dense-and-sparse
# outliers as one-hot tiles on the tensor cores, pre-RoPE keys turned per element by R(j) against
# R(p0)^T q; head dims 128, 64 and 256 (KVQUANT_WIDE: four chunks, turned in pairs (0, 2) and
# (1, 3)), GQA 1 to 16, G 32 and 64, 1-3 outliers per token, left padding (pre-RoPE positions
# count from each sequence's start).
GLUON_KVQ_FULL_CASES = [(body_case(3, G, D, HG, 9 + G + HG + n_out), n_out, rope)
                        for G, D, HG, n_out, rope in ((32, 128, 4, 2, True), (32, 128, 1, 2, False),
                                                      (64, 128, 2, 0, True), (64, 64, 7, 1, True),
                                                      (32, 64, 16, 2, True), (32, 128, 8, 3, False),
                                                      (32, 256, 2, 3, True), (64, 256, 1, 3, False),
                                                      (32, 256, 8, 0, True), (64, 256, 4, 2, True))]
# ... and in the halves layout (KVQUANT_HALVES: each rotate-half half of D/2 channels in
# 32-channel chunks of its own, padded): Phi-3's 96, Phi-2's 80, OpenLLaMA-3B's 100, 40; value
# groups as QuantSpec.value_group gives them (32 at 96, 32+32+16 at 80, 64+36 at 100, 32+8)
GLUON_KVQ_FULL_CASES += [(body_case(3, G, D, HG, 9 + G + HG + n_out + D, Gv=Gv), n_out, True)
                         for G, D, HG, n_out, Gv in ((32, 96, 4, 2, None), (64, 96, 1, 3, None),
                                                     (32, 80, 3, 2, 32), (64, 100, 2, 0, 64),
                                                     (32, 40, 8, 1, 32), (32, 72, 16, 2, 32))]
# ... and outliers without pre-RoPE keys there (the kvquant-*-post presets): one-hot tiles over
# the straight chunks, three at 96 and 80 (the last padded), four at 100, two at 40
GLUON_KVQ_FULL_CASES += [(body_case(3, G, D, HG, 7 + G + HG + n_out + D, Gv=Gv), n_out, False)
                         for G, D, HG, n_out, Gv in ((32, 96, 2, 2, None), (64, 80, 4, 3, 64),
                                                     (32, 100, 1, 2, 32), (32, 40, 7, 1, 32))]
# ... and at 4 bits (KVQUANT4, head dims 64 and 128): the full layer, outliers alone, pre-RoPE
# keys alone
GLUON_KVQ_FULL_CASES += [(body_case(4, G, D, HG, 51 + G + HG + n_out + D), n_out, rope)
                         for G, D, HG, n_out, rope in ((32, 128, 4, 2, True), (64, 128, 1, 2, False),
                                                       (32, 64, 8, 1, True), (64, 64, 16, 0, True),
                                                       (32, 128, 2, 3, True))]
# ... and at 2 bits (KVQUANT2)
GLUON_KVQ_FULL_CASES += [(body_case(2, G, D, HG, 33 + G + HG + n_out + D), n_out, rope)
                         for G, D, HG, n_out, rope in ((32, 128, 4, 2, True), (64, 128, 1, 2, False),
                                                       (32, 64, 8, 1, True), (64, 64, 16, 0, True),
                                                       (32, 128, 1, 3, True), (128, 128, 4, 1, True))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c,n_out,rope", GLUON_KVQ_FULL_CASES,
                         ids=[f"{c}-out{n}-rope{int(r)}" for c, n, r in GLUON_KVQ_FULL_CASES])
def test_gluon_kvquant_full_matches_reference(c, n_out, rope, monkeypatch):
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(decode_gluon, "PLANES3", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT_FULL", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT_STRAIGHT_OUTLIERS", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT4", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT2", True)
    serve_small(monkeypatch, decode_gluon)
    kv = _kvquant_kv(c, n_out, rope)
    assert decode_gluon.eligible(kv, 1, c.HG), str(c)
    used = count_calls(monkeypatch, decode_gluon)
    glob, _ = run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)
    assert len(used) == 2, "the Gluon kernel was not used"
    # the outliers and the rotation really are applied: without them the answer is far off
    g = torch.Generator().manual_seed(c.seed + 1)
    q = torch.randn(c.B, c.Hkv * c.HG, c.Lq, c.D, generator=g).to(c.dtype).to(DEVICE)
    args = {"scale": c.D ** -0.5, "starts": _seq(c.starts), "lengths": _seq(c.lengths)}
    r = reference(q, kv, **args).float()
    plain = copy.copy(kv)
    if n_out:
        plain.k_out_val = torch.zeros_like(kv.k_out_val)
        plain.v_out_val = torch.zeros_like(kv.v_out_val)
    if rope:
        plain.rope_inv_freq = None
    off = ((reference(q, plain, **args).float() - r).norm() / r.norm()).item()
    assert off > 20 * glob, (off, glob)


# ... and with offline key scales (KFIX: one fixed key scale row for every group): 3-bit full
# layers at head dims 128, 64, 256 and 96 (halves), codebooks alone, and 4 bits
GLUON_KVQ_OFFLINE_CASES = [(body_case(b, G, D, HG, 61 + G + HG + n_out + D), n_out, rope)
                           for b, G, D, HG, n_out, rope in (
                               (3, 32, 128, 4, 2, True), (3, 64, 64, 7, 1, True),
                               (3, 32, 256, 2, 3, True), (3, 32, 96, 4, 2, True),
                               (3, 32, 128, 8, 0, False), (4, 32, 128, 4, 2, True),
                               (4, 64, 64, 16, 0, False), (2, 32, 128, 4, 2, True),
                               (2, 64, 64, 8, 1, True), (2, 32, 128, 1, 0, False))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c,n_out,rope", GLUON_KVQ_OFFLINE_CASES,
                         ids=[f"{c}-out{n}-rope{int(r)}" for c, n, r in GLUON_KVQ_OFFLINE_CASES])
def test_gluon_kvquant_offline_keys_match_reference(c, n_out, rope, monkeypatch):
    from kvbits.kernels import decode_gluon
    for name in ("PLANES3", "KVQUANT_FULL", "KVQUANT4", "KVQUANT2", "KVQUANT_WIDE",
                 "EXTRA_HEAD_DIMS", "KVQUANT_HALVES"):
        monkeypatch.setattr(decode_gluon, name, True)
    serve_small(monkeypatch, decode_gluon)
    kv = _kvquant_kv(c, n_out, rope, offline=True)
    assert kv.key_scales_fixed and decode_gluon.eligible(kv, 1, c.HG), str(c)
    used = count_calls(monkeypatch, decode_gluon)
    run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)
    assert len(used) == 2, "the Gluon kernel was not used"


def test_gluon_halves_layout():
    """The halves layout's chunks (pre-RoPE keys at head dims other than 64 / 128 / 256): each
    rotate-half half in 32-channel chunks of its own, the lanes past the half masked, and the
    frequencies padded with zeros to the chunks' width, once per frequency tensor."""
    from kvbits.kernels import decode_gluon as dg
    if dg.gluon is None:
        pytest.skip("this Triton has no Gluon")
    base, end = dg.key_base.fn, dg.key_end.fn
    for D, want in ((96, [(0, 48), (32, 48), (48, 96), (80, 96)]),
                    (80, [(0, 40), (32, 40), (40, 80), (72, 80)]),
                    (100, [(0, 50), (32, 50), (50, 100), (82, 100)]),
                    (40, [(0, 20), (20, 40)])):
        n = dg.chunks_of(D, True)
        assert dg.chunk_width_of(D, True) == 32 and n == len(want)
        assert [(base(c, D, 32, True), end(c, D, 32, True)) for c in range(n)] == want
        # every channel of the head in exactly one chunk's unmasked lanes
        got = sorted(ch for c in range(n) for ch in range(base(c, D, 32, True),
                                                          min(base(c, D, 32, True) + 32,
                                                              end(c, D, 32, True))))
        assert got == list(range(D))
        # the straight layout is unchanged by it
        width = dg.chunk_width_of(D)
        assert [base(c, D, width, False) for c in range(dg.chunks_of(D))] == \
            [32 * c for c in range(dg.chunks_of(D))]
        assert dg.halves_layout.fn(D, True) and not dg.halves_layout.fn(D, False)
    assert not any(dg.halves_layout.fn(D, True) for D in (64, 128, 256))
    inv = 1.0 / (10000 ** (torch.arange(0, 96, 2).float() / 96))
    padded = dg.rope_freqs(inv, 96)
    assert padded.shape == (64,) and torch.equal(padded[:48], inv) and not padded[48:].any()
    assert dg.rope_freqs(inv, 96) is padded  # kept on the tensor: a captured call finds it
    inv128 = torch.ones(64)
    assert dg.rope_freqs(inv128, 128) is inv128


@pytest.mark.parametrize("G", [32, 64])
def test_gluon_rope_rows_follow_the_token_order(G):
    """The Gluon body's pre-RoPE table (no GPU needed): row n holds cos / sin of the step offset
    of MMA row n (``token_order(3, G)``) times each frequency, built once per frequency tensor
    and kept apart from the Triton kernel's table of plain offsets."""
    from kvbits.kernels import decode_gluon
    from kvbits.kernels.decode_attention import _rope_table
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 128, 2).float() / 128))
    table = decode_gluon.rope_rows(inv_freq, 3, G)
    j = torch.tensor(decode_gluon.token_order(3, G), dtype=torch.float64)
    ang = j[:, None] * inv_freq.double()[None, :]
    assert table.shape == (2, 64, 64) and table.dtype == torch.float16
    torch.testing.assert_close(table.double(), torch.stack([ang.cos(), ang.sin()]),
                               atol=1e-3, rtol=0)
    assert sorted(j.long().tolist()) == list(range(64)) and j[1] != 1  # a permutation, not 0..63
    assert decode_gluon.rope_rows(inv_freq, 3, G) is table  # cached on the tensor
    plain = _rope_table(inv_freq, 64, torch.float16)  # offsets 0..63 in order (Triton's tile)
    ang = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    torch.testing.assert_close(plain.double(), torch.stack([ang.cos(), ang.sin()]), atol=1e-3,
                               rtol=0)
    wide = _rope_table(inv_freq, 64, torch.float32)  # float32 queries: a float32 table beside it
    assert wide.dtype == torch.float32 and _rope_table(inv_freq, 64, torch.float16) is plain
    torch.testing.assert_close(wide.double(), torch.stack([ang.cos(), ang.sin()]), atol=1e-7,
                               rtol=0)
    assert not torch.equal(plain, table)


def test_gluon_kvquant_dispatch(monkeypatch):
    """Which KVQuant layers the Gluon body takes (no GPU needed): 3-bit codebooks without
    outliers or pre-RoPE keys, with PLANES3 only."""
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    c = Case(kb=3, vb=3, G=32, D=128, B=1, Hkv=2, body=128, res=0)
    kv = _kvquant_kv(c, 0, False, device="cpu")
    monkeypatch.setattr(decode_gluon, "PLANES3", False)
    assert not decode_gluon.eligible(kv, 1, 4)
    monkeypatch.setattr(decode_gluon, "PLANES3", True)
    assert decode_gluon.eligible(kv, 1, 4)
    full = [_kvquant_kv(c, 2, False, device="cpu"), _kvquant_kv(c, 0, True, device="cpu"),
            _kvquant_kv(c, 2, True, device="cpu")]
    monkeypatch.setattr(decode_gluon, "KVQUANT_FULL", False)
    assert not any(decode_gluon.eligible(kv, 1, 4) for kv in full)
    monkeypatch.setattr(decode_gluon, "KVQUANT_FULL", True)  # outliers / pre-RoPE keys
    assert all(decode_gluon.eligible(kv, 1, 4) for kv in full)
    assert not decode_gluon.eligible(_kvquant_kv(c, 5, False, device="cpu"), 1, 4)
    odd = _kvquant_kv(c, 2, False, device="cpu")  # indices one byte off a 16-bit boundary
    buf = torch.empty(odd.k_out_idx.numel() + 1, dtype=torch.uint8)
    odd.k_out_idx = buf[1:].view(odd.k_out_idx.shape).copy_(odd.k_out_idx)
    assert not decode_gluon.eligible(odd, 1, 4)
    # 4- and 2-bit codebooks (KVQUANT4, on by default since session 44; KVQUANT2): head dims 64
    # and 128, any mix of outliers and pre-RoPE keys; never the TMA ring (no codebook lookup)
    from kvbits.kernels import decode_gluon_tma
    for bits in (4, 2):
        for D in (128, 64, 96, 256):
            cb = Case(kb=bits, vb=bits, G=32, D=D, B=1, Hkv=2, body=128, res=0)
            layers = [_kvquant_kv(cb, n, r, device="cpu") for n, r in ((0, False), (2, True),
                                                                         (1, False))]
            monkeypatch.setattr(decode_gluon, f"KVQUANT{bits}", False)
            assert not any(decode_gluon.eligible(kv, 1, 4) for kv in layers), (bits, D)
            monkeypatch.setattr(decode_gluon, f"KVQUANT{bits}", True)
            assert all(decode_gluon.eligible(kv, 1, 4) == (D in (64, 128)) for kv in layers), \
                (bits, D)
            assert not any(decode_gluon_tma.eligible(kv, False) for kv in layers), (bits, D)
            monkeypatch.setattr(decode_gluon, f"KVQUANT{bits}", False)
    # head dims other than 64 / 128 / 256 (KVQUANT_HALVES): pre-RoPE keys with each half in
    # chunks of its own; outliers alone in the straight chunks (three at 96 and 80) only with
    # KVQUANT_STRAIGHT_OUTLIERS (on by default; the switch sends them to Triton)
    for D, Gv in ((96, None), (80, 32), (100, 64), (40, 32)):
        odd_dim = c._replace(D=D, Gv=Gv)
        assert all(decode_gluon.eligible(_kvquant_kv(odd_dim, n, True, device="cpu"), 1, 4)
                   for n in (0, 2)), D
        post = _kvquant_kv(odd_dim, 2, False, device="cpu")
        monkeypatch.setattr(decode_gluon, "KVQUANT_STRAIGHT_OUTLIERS", False)
        assert not decode_gluon.eligible(post, 1, 4), D
        monkeypatch.setattr(decode_gluon, "KVQUANT_STRAIGHT_OUTLIERS", True)
        assert decode_gluon.eligible(post, 1, 4), D
        monkeypatch.setattr(decode_gluon, "KVQUANT_HALVES", False)
        assert not any(decode_gluon.eligible(_kvquant_kv(odd_dim, 2, r, device="cpu"), 1, 4)
                       for r in (True, False)), D
        monkeypatch.setattr(decode_gluon, "KVQUANT_HALVES", True)
    wide = c._replace(D=256)  # four: the halves are chunks (0, 1) and (2, 3), with KVQUANT_WIDE
    assert all(decode_gluon.eligible(_kvquant_kv(wide, n, r, device="cpu"), 1, 4)
               for n, r in ((3, True), (3, False), (0, True)))
    monkeypatch.setattr(decode_gluon, "KVQUANT_WIDE", False)
    assert not decode_gluon.eligible(_kvquant_kv(wide, 3, True, device="cpu"), 1, 4)
    assert decode_gluon.eligible(_kvquant_kv(wide, 0, False, device="cpu"), 1, 4)
    two = c._replace(kb=2, vb=2)
    assert not decode_gluon.eligible(_kvquant_kv(two, 0, False, device="cpu"), 1, 4)
    assert not decode_gluon.eligible(_kvquant_kv(two, 2, True, device="cpu"), 1, 4)

def test_kvquant_pre_rope_changes_the_answer():
    # The rotation must really happen: the same layer read as post-RoPE differs.
    from kvbits.kernels.decode_attention import decode_attention as kern

    c = KVQ_CASES["K2V2-G32-MHA"]
    kv = _kvquant_kv(c, 1, True)
    q = torch.randn(c.B, c.Hkv, 1, c.D, generator=torch.Generator().manual_seed(3)).half()
    q = q.to(DEVICE)
    with_rope = kern(q, kv, scale=0.125)
    kv.rope_inv_freq = None
    assert (with_rope.float() - kern(q, kv, scale=0.125).float()).abs().max() > 1e-2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["uniform-token-token", "uniform-token-channel", "fp8",
                                    "kvquant-3-prerope-out2", "kvquant-2-dense"])
def test_realistic_sizes_other_layouts(layout):
    # Llama-3-8B-like step (8 KV heads x 4 query heads, D=128) at 8k body tokens for each layout
    # the kernel reads besides KIVI; compiled for the GPU, compared with the float32 reference.
    c = Case(kb=3 if "kvquant-3" in layout else 2, vb=3 if "kvquant-3" in layout else 2, G=32,
             D=128, B=2, Hkv=8, HG=4, Lq=2, S=4, body=8192, res=100,
             lengths=(8192 + 104, 5000), starts=(0, 333), seed=len(layout))
    if layout.startswith("uniform"):
        _, k_axis, v_axis = layout.split("-")
        kv = _axes_kv(c, k_axis, v_axis)
    elif layout == "fp8":
        kv = _fp8_kv(c)
    else:
        kv = _kvquant_kv(c, 2 if "out2" in layout else 0, "prerope" in layout)
    run_case(c, kv=kv)


# The codebook lookup alone, exactly: every code of 2, 3 and 4 bits against the float16-rounded
# table, per head. On a GPU this checks the PTX byte-permute tables (USE_PRMT), which the
# interpreter cannot run; under the interpreter it checks the select chain.
@triton.jit
def _lookup_probe(C, CB, Out, NC: tl.constexpr, BLOCK: tl.constexpr, USE_PRMT: tl.constexpr):
    h = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    c = tl.load(C + h * BLOCK + offs).to(tl.int8)
    tile = tl.reshape(c, [BLOCK // 32, 32])
    val = _lookup(tile, CB + h * NC, NC, USE_PRMT)
    tl.store(Out + h * BLOCK + offs, tl.reshape(val, [BLOCK]))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codebook_lookup_is_exact(bits):
    from kvbits.kernels.decode_attention import _use_prmt

    H, n, BLOCK = 3, 1 << bits, 1024
    g = torch.Generator().manual_seed(bits)
    cb = (torch.randn(H, n, generator=g) * 3).to(DEVICE)  # any float32 table, not just sorted
    codes = torch.randint(0, n, (H, BLOCK), generator=g, dtype=torch.int32).to(DEVICE)
    out = torch.empty(H, BLOCK, dtype=torch.float16, device=DEVICE)
    _lookup_probe[(H,)](codes, cb, out, NC=n, BLOCK=BLOCK,
                        USE_PRMT=_use_prmt(torch.device(DEVICE)))
    want = torch.gather(cb.half(), 1, codes.long())
    assert torch.equal(out, want)


# ----------------------------------------------------------------------------- Gluon body (GPU)
# kvbits.kernels.decode_gluon serves the body of plain KIVI layers on the GPU (MMA operands
# built in registers); Gluon has no interpreter, so these run on a GPU only. Hostile as above:
# NaN past every used region, ragged ends inside groups, left padding inside a group, odd group
# counts (a half-empty last 64-token step), GQA groups from 1 to 16 query heads.
GLUON_CASES = [
    body_case(b, G, D, HG, b + G + HG)
    for i, (b, G, D) in enumerate((b, G, D) for b in (2, 4) for G in (32, 64, 128)
                                  for D in (64, 128))
    for HG in [(1, 4, 7, 16, 8, 3)[i % 6]]
]

# 3-bit planes (decode_gluon.PLANES3): G 32 and 64, head dims 64 and 128, GQA 1 to 16
GLUON_CASES += [body_case(3, G, D, HG, 3 + G + HG)
                for G, D, HG in ((32, 128, 4), (32, 64, 1), (64, 128, 16), (64, 64, 7))]

# head dims 96, 192, 256 in 3-4 chunks (decode_gluon.EXTRA_HEAD_DIMS): 2 and 4 bits, G 32 / 64 /
# 128, GQA 1-8
GLUON_CASES += [body_case(b, G, D, HG, b + G + HG + D)
                for b, G, D, HG in ((2, 32, 256, 2), (4, 64, 256, 8), (2, 128, 256, 1),
                                    (4, 32, 256, 4), (2, 32, 96, 3), (4, 64, 96, 1),
                                    (2, 128, 96, 8), (4, 32, 192, 2))]
# ... and 3-bit planes there (G 32 / 64)
GLUON_CASES += [body_case(3, G, D, HG, 3 + G + HG + D)
                for G, D, HG in ((32, 96, 3), (64, 256, 2), (32, 256, 8), (64, 192, 1))]

# head dims 32 does not divide (decode_gluon.PADDED_HEAD_DIMS): 32-channel chunks, the last one
# padded (zero query lanes, masked loads and stores); per-token value groups as
# QuantSpec.value_group gives them there, the last one shorter (80: 32+32+16, 64+16 or the whole
# head; 100: 32 x 3 + 4 or 64+36; 40: 32+8; 72: 64+8); 2, 3 and 4 bits, GQA 1-16
GLUON_PADDED_CASES = [
    body_case(b, G, D, HG, b + G + HG + D, Gv=Gv)
    for b, G, D, HG, Gv in ((2, 32, 80, 4, 32), (4, 64, 80, 1, 64), (2, 128, 80, 8, 80),
                            (3, 32, 80, 3, 32), (2, 32, 100, 2, 32), (4, 64, 100, 7, 64),
                            (3, 64, 100, 4, 64), (4, 32, 40, 16, 32), (2, 64, 72, 5, 64))]
GLUON_CASES += GLUON_PADDED_CASES


# Sliding windows (Gemma2/3, Mistral-style layers) and Gemma2's softcapping in both Gluon bodies:
# a window inside the body (programs whose whole range is hidden), one that hides the sink and
# the body (window 1: the query sees itself only), one past everything; caps of 0.3 (scores of
# ~1 and more: changes the answer) and 50 (Gemma2's value). Register body: 2/3/4 bits, head dims
# 64-256, KVQuant's full layer; TMA ring: 2 and 4 bits at head_dim 128.
GLUON_WINDOW_CASES = [
    body_case(2, 32, 128, 4, 71, window=700, softcap=0.3),
    body_case(4, 64, 256, 2, 72, window=1500, softcap=50.0),
    body_case(3, 32, 64, 8, 73, window=1),  # one token seen: no cap can change it
    body_case(2, 128, 96, 1, 74, window=10_000),
    body_case(4, 32, 128, 16, 75, softcap=0.3),
]
GLUON_CASES += GLUON_WINDOW_CASES


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c", GLUON_CASES, ids=str)
def test_gluon_body_matches_reference(c, monkeypatch):
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(decode_gluon, "PLANES3", True)
    monkeypatch.setattr(decode_gluon, "EXTRA_HEAD_DIMS", True)
    kv = make_kv(c)
    assert decode_gluon.eligible(kv, c.Lq, c.HG), str(c)
    used = count_calls(monkeypatch, decode_gluon)
    serve_small(monkeypatch, decode_gluon)
    run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)  # one program walks the whole body
    assert len(used) == 2, "the Gluon kernel was not used"
    _cap_bites(c, kv)  # window / softcap cases: the cap changes the answer
    run_case(c._replace(lengths=None, starts=None, dtype=torch.bfloat16, seed=c.seed + 1))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tma", ["0", "1"])
def test_gluon_body_offsets_past_int32(tma, monkeypatch):
    """kivi-2 with 2**20 body tokens x 257 heads: head 256 starts at word 2**31 of k_codes
    (register body: int64 pointer math; TMA ring: row coordinates of the 2D descriptors)."""
    from kvbits.kernels import decode_gluon_tma
    monkeypatch.setattr(decode_gluon_tma, "MODE", tma)
    dev = "cuda"
    H, T, D, G, bits = 257, 2**20, 128, 32, 2
    NG, W = T // G, packed_length(G, bits)
    assert (H - 1) * NG * W * D == 2**31
    g = torch.Generator(device=dev).manual_seed(1)
    k_codes = torch.randint(-2**31, 2**31 - 1, (1, H, NG * W, D), generator=g,
                            dtype=torch.int32, device=dev)
    v_codes = torch.randint(-2**31, 2**31 - 1, (1, H, NG * W, D), generator=g,
                            dtype=torch.int32, device=dev)
    head_scale = torch.linspace(0.5, 1.5, H, device=dev).view(1, H, 1, 1)
    k_scale = ((torch.rand(1, H, NG, D, generator=g, device=dev) + 0.5) * head_scale).half()
    k_zero = (-k_scale.float() * 1.5).half()
    v_scale = (torch.rand(1, H, T, 4, generator=g, device=dev) * 0.5 + 0.1).half()
    v_zero = (torch.randn(1, H, T, 4, generator=g, device=dev) * 0.3).half()
    res = torch.randn(1, H, 24, D, generator=g, device=dev).half()
    empty = torch.zeros(1, H, 0, D, dtype=torch.float16, device=dev)
    kv = PackedKV(empty, empty, 0, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, T,
                  res, res, 17, bits, bits, G, 32)
    assert tma == "0" or decode_gluon_tma.eligible(kv, False)
    q = (torch.randn(1, H, 1, D, generator=g, device=dev) * 3).half()
    o = kernel(q, kv, scale=D ** -0.5, gluon=True)
    sl = slice(H - 2, H)
    part = PackedKV(empty[:, sl], empty[:, sl], 0, k_codes[:, sl], k_scale[:, sl],
                    k_zero[:, sl], v_codes[:, sl], v_scale[:, sl], v_zero[:, sl], T,
                    res[:, sl], res[:, sl], 17, bits, bits, G, 32)
    r = reference(q[:, sl], part, scale=D ** -0.5)
    compare(o[:, sl], r, torch.float16, "kivi-2 2**20 tokens, heads 255-256 (past 2**31 words)")


# The same body through a TMA ring (kernels/decode_gluon_tma.py, Hopper): every step's bytes
# copied into shared memory stages ahead of use. Buffers with an even number of spare (NaN)
# tokens, so that the value scales' rows are whole 16-byte TMA rows.
TMA_CASES = [body_case(b, G, 128, HG, b + G + HG, Gv=32)
             for b in (2, 4) for G, HG in ((16, 1), (32, 4), (64, 16), (32, 7))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c", TMA_CASES, ids=str)
def test_gluon_tma_body_matches_reference(c, monkeypatch):
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    kv = make_kv(c, spare=8)
    assert decode_gluon_tma.eligible(kv, False), str(c)
    used = count_calls(monkeypatch, decode_gluon_tma)
    monkeypatch.setattr(decode_gluon_tma, "MODE", "1")
    serve_small(monkeypatch, decode_gluon)
    run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)  # one program walks the whole body through the ring
    run_case(c._replace(splits=3), kv=kv)  # ranges that start mid-body
    n = len(used)
    c16 = c._replace(lengths=None, starts=None, dtype=torch.bfloat16, seed=c.seed + 1)
    run_case(c16, kv=make_kv(c16, spare=8))  # bf16 queries and cache
    assert n == 3 and len(used) == 4, "the TMA kernel was not used for every call"


@gpu
@pytest.mark.gpu
def test_gluon_tma_eager_calls_reuse_descriptors_and_plans(monkeypatch):
    """Eager calls of the ring, one after another (a decode loop without graphs): the second
    call on reuses the layer's descriptors (built once per store and buffers) and launches
    through FastLaunch's plan; every output equals the JIT's launch bit for bit and the
    reference, with fresh queries, a shorter view of the same buffers, and a layer whose
    buffers were replaced (a store that grew), whose descriptors are rebuilt."""
    from kvbits.kernels import decode_gluon, decode_gluon_tma, launch
    class Store:  # stands for the layer's LayerStore, the owner its views name
        pass
    store = Store()
    c = TMA_CASES[1]
    kv = dataclasses.replace(make_kv(c, spare=8), owner=store)
    monkeypatch.setattr(decode_gluon_tma, "MODE", "1")
    serve_small(monkeypatch, decode_gluon)
    built = count_calls(monkeypatch, decode_gluon_tma, "_build_descriptors")
    short = dataclasses.replace(kv, body_len=kv.body_len - c.G)
    grown = dataclasses.replace(kv, k_codes=kv.k_codes.clone(), v_codes=kv.v_codes.clone())
    for i, layer in enumerate((kv, kv, short, kv, grown, grown)):
        q, args = _query_and_args(c._replace(seed=c.seed + i))
        got = kernel(q, layer, **args)
        monkeypatch.setattr(launch, "ENABLED", False)
        jit = kernel(q, layer, **args)
        monkeypatch.setattr(launch, "ENABLED", True)
        assert torch.equal(got, jit), i
        compare(got, reference(q, layer, **args), c.dtype, f"call {i}")
    assert len(built) == 2, "descriptors rebuilt for the same buffers"
    assert decode_gluon_tma._TMA._plans, "the ring's launches never went through a plan"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp_tokens", [0, 256])
@pytest.mark.parametrize("body,tma", [("triton", "0"), ("gluon", "0"), ("gluon", "1")])
def test_finish_kernel_as_programmatic_dependent(body, tma, fp_tokens, monkeypatch):
    """The finish kernel launched as a programmatic dependent of the body kernel (Hopper): its
    FP16 part may run while the body's programs still write their partials, so its merge must
    wait for them. Bit for bit the output without PDL, eagerly and in a CUDA graph whose
    replays see the lengths grow on the device (a captured decode loop)."""
    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    if not da._pdl_ok(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with launch_pdl")
    monkeypatch.setattr(decode_gluon_tma, "MODE", tma)
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", fp_tokens)  # FP16 part: splits, or inline
    serve_small(monkeypatch, decode_gluon)
    c = body_case(2, 32, 128, 4, 7)._replace(B=4, Hkv=8, lengths=None, starts=None, S=1,
                                               body=32 * 300, res=100)
    kv = make_kv(c, spare=8)
    q, args = _query_and_args(c)
    lens_dev = torch.tensor([1, 32 * 290, 60], dtype=torch.int32, device="cuda")

    def call():
        return kernel(q, kv, gluon=body == "gluon", lens_dev=lens_dev, **args)
    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(da, "PDL_ENABLED", pdl)
        lens_dev.copy_(torch.tensor([1, 32 * 290, 60]))
        eager = call()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()  # compile and warm outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        replays = []
        for step in range(12):
            lens_dev.copy_(torch.tensor([1, 32 * 290 + 32 * (step % 3), 60 + step]))
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        outs[pdl] = (eager, replays)
    assert torch.equal(outs[True][0], outs[False][0])
    for a, b in zip(outs[True][1], outs[False][1]):
        assert torch.equal(a, b)
    assert not torch.equal(outs[True][1][0], outs[True][1][1])  # the lengths did change it
    import dataclasses
    view = dataclasses.replace(kv, body_len=32 * 290, res_len=60)
    compare(outs[True][0], reference(q, view, **args), c.dtype, "eager, PDL")


# (case, Gluon body, takes the dependent finish): a one-wave ring body (64 pairs, 16 splits x 4
# rows), a short body the Triton kernel reads (16 splits x 4 rows), and a Gluon body of 132
# splits x 4 rows per finish program (past INLINE_PDL_MAX_MERGE on a 114- or 132-SM GPU), which
# keeps the FP16 splits.
DEP_FINISH_CASES = {
    "one-wave-ring": (Case(kb=2, vb=2, G=32, D=128, B=8, Hkv=8, HG=4, S=1, body=32 * 128,
                           res=100, seed=64), True, True),
    "triton-short": (Case(kb=4, vb=4, G=32, D=128, B=1, Hkv=2, HG=4, S=1, body=32 * 64,
                          res=100, seed=65), False, True),
    "gluon-many-splits": (Case(kb=2, vb=2, G=32, D=128, B=1, Hkv=2, HG=4, S=1, body=32 * 1024,
                               res=100, seed=66), True, False),
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("inline_pdl", [True, False])
@pytest.mark.parametrize("name", list(DEP_FINISH_CASES))
def test_captured_call_takes_the_dependent_finish_where_it_fits(name, inline_pdl, monkeypatch):
    """A captured call whose finish programs merge few partials (``inline_pdl_fits``: a one-wave
    ring body, a short body the Triton kernel reads) attends its FP16 part (sink and residual) in
    the finish kernel, launched as a programmatic dependent of the body, and launches no FP16
    splits (``INLINE_PDL``); with many splits per pair, or with the switch off, the splits as
    before and no PDL. Replays whose lengths change on the device equal the reference."""
    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    dev = torch.device("cuda")
    if not da._pdl_ok(dev):
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with launch_pdl")
    c, gluon, fits = DEP_FINISH_CASES[name]
    for attr, value in (("INLINE_PDL", inline_pdl), ("FINISH_FP_TOKENS", None),
                        ("MERGE_IN_SPLITS", "auto"), ("GLUON_ENABLED", gluon),
                        ("PDL_ENABLED", False), ("SIDE_STREAM", True), ("SIDE_AFTER_BODY", True)):
        monkeypatch.setattr(da, attr, value)  # (the defaults, whatever the environment says)
    monkeypatch.setattr(decode_gluon_tma, "MODE", "auto")
    serve_small(monkeypatch, decode_gluon)
    ring = count_calls(monkeypatch, decode_gluon_tma)
    body_calls = count_calls(monkeypatch, decode_gluon)
    kv = make_kv(c, spare=8)
    q, args = _query_and_args(c)
    lens_dev = torch.tensor([1, c.body, c.res], dtype=torch.int32, device=dev)
    launches = []
    for attr in ("_FINISH", "_DECODE"):
        launcher = getattr(da, attr)
        monkeypatch.setattr(launcher, "launch", lambda grid, a, kw, real=launcher.launch,
                            attr=attr: launches.append((attr, "launch_pdl" in kw.kwargs))
                            or real(grid, a, kw))

    # the eager warm-up takes the other route (FP16 part inline without PDL): the dependent
    # finish is compiled inside the capture, as in a decode loop's
    kernel(q, kv, lens_dev=lens_dev, **args)
    graph = torch.cuda.CUDAGraph()
    launches.clear()
    body_calls.clear()
    with torch.cuda.graph(graph):
        out = kernel(q, kv, lens_dev=lens_dev, **args)
        # (inside the capture: the ring serves captured calls)
        wave = da.one_wave_splits(kv, da._sm_count(dev), dev, c.HG)
    if name == "one-wave-ring":
        assert wave is not None, "not a one-wave grid: the case no longer covers the ring's route"
        assert ring, "the TMA ring did not serve the captured call"
    assert bool(body_calls) == gluon, (name, body_calls)
    if fits and inline_pdl:
        # the Gluon body launches outside _DECODE; the Triton kernel's launch reads the body only
        expected = [("_FINISH", True)] if gluon else [("_DECODE", False), ("_FINISH", True)]
        assert launches == expected, launches
    else:
        assert ("_FINISH", False) in launches and ("_FINISH", True) not in launches, launches
        assert ("_DECODE", False) in launches, "no FP16 splits: " + str(launches)
    for body, res in ((c.body, c.res), (c.body - 32, 77), (c.body, 1)):
        lens_dev.copy_(torch.tensor([1, body, res]))
        graph.replay()
        torch.cuda.synchronize()
        view = dataclasses.replace(kv, body_len=body, res_len=res)
        compare(out, reference(q, view, **args), c.dtype, f"{name}: body {body}, residual {res}")


def test_inline_pdl_fits_plain_head_dim_128_layers_with_few_partials():
    """The dependent finish's rule on the CPU: 2- and 4-bit KIVI / uniform layers at head_dim
    128 whose finish program merges at most ``INLINE_PDL_MAX_MERGE`` partial rows; not other
    head dims, 3 or 8 bits, codebooks, outliers, pre-RoPE keys or FP8 (not timed there)."""
    from kvbits.kernels.decode_attention import INLINE_PDL_MAX_MERGE, inline_pdl_fits
    kv = make_kv(Case(kb=2, vb=4, D=128, body=64, res=3))
    limit = INLINE_PDL_MAX_MERGE
    assert inline_pdl_fits(kv, limit // 4, 4) and inline_pdl_fits(kv, limit, 1)
    assert not inline_pdl_fits(kv, limit // 4 + 1, 4) and not inline_pdl_fits(kv, 0, 4)
    assert inline_pdl_fits(dataclasses.replace(kv, key_axis="token"), 16, 4)
    assert not inline_pdl_fits(make_kv(Case(kb=2, vb=2, D=64, body=64, res=3)), 16, 4)
    assert not inline_pdl_fits(make_kv(Case(kb=3, vb=3, D=128, body=64, res=3)), 16, 4)
    assert not inline_pdl_fits(make_kv(Case(kb=8, vb=8, D=128, body=64, res=3)), 16, 4)
    table = torch.zeros(2, 4)
    for change in ({"k_codebook": table}, {"v_codebook": table}, {"fp8": True},
                   {"k_out_idx": table}, {"v_out_idx": table}, {"rope_inv_freq": table}):
        assert not inline_pdl_fits(dataclasses.replace(kv, **change), 16, 4), change


# The uniform method's layout through the TMA ring (keys and values scaled per token over 64
# channels: one word of two fp16 per token and channel half in each stage), and KIVI with
# 64-channel value groups: 2 and 4 bits, MHA to 16 heads, query rows, a window and caps.
TMA_TOKEN_CASES = [("token", body_case(4, 64, 128, 4, 101)),
                   ("token", body_case(2, 64, 128, 1, 102)),
                   ("token", body_case(2, 64, 128, 16, 103, window=500, softcap=0.3)),
                   ("token", body_case(4, 64, 128, 2, 104, Lq=3, window=6, softcap=50.0)),
                   ("channel", body_case(2, 64, 128, 4, 105)),
                   ("channel", body_case(4, 32, 128, 8, 106, Gv=64, window=37))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("key_axis,c", TMA_TOKEN_CASES, ids=[f"{a}-{c}" for a, c in TMA_TOKEN_CASES])
def test_gluon_tma_token_scales_match_reference(key_axis, c, fold, monkeypatch):
    """``fold``: per-token key scales folded out of the key operands (``KEY_FOLD``) or
    dequantized in them."""
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    if key_axis == "channel" and not fold:
        pytest.skip("the fold concerns per-token key scales only")
    monkeypatch.setattr(decode_gluon, "KEY_FOLD", fold)
    kv = _axes_kv(c, key_axis, "token", spare=8)
    k_tok = key_axis == "token"
    assert kv.value_group == 64 and decode_gluon_tma.eligible(kv, k_tok), str(c)
    assert decode_gluon.eligible(kv, c.Lq, c.HG), str(c)
    monkeypatch.setattr(decode_gluon_tma, "MODE", "1")
    serve_small(monkeypatch, decode_gluon)
    used = count_calls(monkeypatch, decode_gluon_tma)
    run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)  # one program walks the whole body through the ring
    run_case(c._replace(splits=3), kv=kv)  # ranges that start mid-body
    assert len(used) == 3, "the TMA kernel was not used for every call"
    if c.Lq > 1:
        _rows_bite(c, kv)
    _cap_bites(c, kv)


# The same for KVQuant's full layer and for the TMA ring.
GLUON_WINDOW_KVQ_CASES = [(body_case(3, 32, 128, 4, 76, window=900, softcap=0.3), 2, True),
                          (body_case(3, 64, 256, 2, 77, window=333, softcap=50.0), 3, True)]
TMA_WINDOW_CASES = [body_case(2, 32, 128, 4, 78, Gv=32, window=640, softcap=0.3),
                    body_case(4, 16, 128, 8, 79, Gv=32, window=37, softcap=50.0),
                    body_case(2, 64, 128, 1, 80, Gv=32, softcap=0.3)]


def _cap_bites(c, kv):
    """With a cap of 0.3 the answer must differ from the uncapped one (the test would pass with
    a kernel that ignores the cap otherwise)."""
    if c.softcap is not None and c.softcap < 1:
        q, args = _query_and_args(c)
        r = reference(q, kv, softcap=c.softcap, **args).float()
        plain = reference(q, kv, **args).float()
        assert (plain - r).norm() > 0.05 * r.norm(), "the cap did not bite"


# Several query rows per sequence (speculative verification, short chunks) through the Gluon
# bodies: each row is one more column of its KV head's MMA, masked by its own causal end and
# window. The ragged sequences of body_case end inside the body (rows at different ends there);
# a window of a few tokens gives each row a different view. Register body (2/3/4 bits, head dims
# 64-256, up to 16 columns), KVQuant's full layer, the TMA ring.
GLUON_ROWS_CASES = [
    ("register", body_case(2, 32, 128, 1, 81, Lq=5)),
    ("register", body_case(4, 64, 128, 4, 82, Lq=4)),  # 16 columns
    ("register", body_case(3, 32, 64, 2, 83, Lq=3, window=6)),
    ("register", body_case(2, 32, 256, 2, 84, Lq=2, softcap=0.3)),
    ("kvquant", body_case(3, 32, 128, 2, 85, Lq=4, window=9)),
    ("tma", body_case(2, 32, 128, 1, 86, Gv=32, Lq=5)),
    ("tma", body_case(4, 32, 128, 2, 87, Gv=32, Lq=3, window=5, softcap=50.0)),
]
# More than 16 columns per KV head (decode_gluon.column_blocks): blocks of 16, one program each,
# the last one partly empty: multi-query groups (71 heads: five blocks, the last of 7; 20, 48),
# rows of one head split across blocks (6 heads x 3 rows, a window), KVQuant's full layer at 8
# heads x 3 rows, the TMA ring at 48 heads and at 4 heads x 5 rows.
GLUON_ROWS_CASES += [
    ("register", body_case(2, 32, 64, 71, 91)),
    ("register", body_case(3, 32, 128, 20, 92)),
    ("register", body_case(4, 64, 80, 6, 93, Gv=32, Lq=3, window=7)),
    ("kvquant", body_case(3, 32, 128, 8, 94, Lq=3)),
    ("tma", body_case(2, 32, 128, 48, 95, Gv=32)),
    ("tma", body_case(4, 32, 128, 4, 96, Gv=32, Lq=5, window=9)),
]


def _rows_bite(c, kv):
    """The case really tells the rows apart: had every row seen what the last row sees, some
    row's answer would be off by far more than the tolerance."""
    q, args = _query_and_args(c)
    if c.softcap is not None:
        args["softcap"] = c.softcap
    r = reference(q, kv, **args).float()
    as_last = torch.cat([reference(q[:, :, i:i + 1], kv, **args) for i in range(c.Lq)], 2)
    worst = ((as_last.float() - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).max().item()
    assert worst > 3 * TOLERANCES[c.dtype][1], worst


def test_gluon_takes_query_columns_up_to_max_columns():
    """Query heads x query rows per KV head are the MMA's columns (no GPU needed): up to 16 in
    one program, up to MAX_COLUMNS (128) in blocks of 16 (5 rows at GQA 4: two; Falcon-7B's 71
    heads: five), more to Triton."""
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    kv = make_kv(Case(kb=2, vb=2, G=32, D=128, B=1, Hkv=2, body=128), "cpu")
    ok = ((5, 1), (4, 4), (16, 1), (5, 4), (17, 1), (3, 7), (1, 71), (2, 64))
    assert all(decode_gluon.eligible(kv, rows, hg) for rows, hg in ok)
    assert not any(decode_gluon.eligible(kv, rows, hg) for rows, hg in ((129, 1), (9, 16)))
    assert [decode_gluon.column_blocks(n) for n in (1, 8, 16, 17, 32, 33, 71, 128)] == \
        [1, 1, 1, 2, 2, 3, 5, 8]
    # the default dispatch (big steps): plain 2/4-bit KIVI past two blocks goes to Triton
    # (Falcon-7B's 71 heads), verify rows at GQA 4 (two blocks) and 3-bit layers stay here
    many = 1 << 20  # (sequence, KV head) pairs: far past every size limit
    assert decode_gluon.serves(kv, 5, 4, many) and decode_gluon.serves(kv, 1, 32, many)
    assert not decode_gluon.serves(kv, 1, 71, many) and not decode_gluon.serves(kv, 1, 48, many)
    kv3 = make_kv(Case(kb=3, vb=3, G=32, D=128, B=1, Hkv=2, body=128), "cpu")
    assert decode_gluon.serves(kv3, 1, 71, many) and decode_gluon.eligible(kv, 1, 71)
    # splits count each block of columns as a (sequence, KV head) pair: 2 pairs x 5 blocks of
    # Falcon-7B's 71 heads are split as 10 pairs are
    from kvbits.kernels.decode_attention import gluon_splits
    cpu = torch.device("cpu")
    long = make_kv(Case(kb=2, vb=2, G=32, D=128, B=1, Hkv=2, body=32 * 1024), "cpu")
    assert gluon_splits(long, 132, cpu, 71) == decode_gluon.body_splits(10, long.body_len, 132)
    assert gluon_splits(long, 132, cpu, 16) == decode_gluon.body_splits(2, long.body_len, 132)
    assert gluon_splits(long, 132, cpu, 71) < gluon_splits(long, 132, cpu, 16)
    q = torch.arange(2 * 8 * 3 * 4.0).view(2, 8, 3, 4)
    heads, group, rows = decode_gluon.query_rows_as_heads(q, 2)
    assert (group, rows) == (12, 3) and heads.shape == (2, 24, 1, 4)
    assert torch.equal(heads[1, 5 * 3 + 2, 0], q[1, 5, 2])  # column h * Lq + r


# The window / softcap / query-row cases of the other bodies, one test: KVQuant's full layer
# (its outlier count and pre-RoPE keys per case), the TMA ring, and the register body with rows.
GLUON_VARIANT_CASES = ([("kvquant", c, n, r) for c, n, r in GLUON_WINDOW_KVQ_CASES]
                       + [("tma", c, 0, False) for c in TMA_WINDOW_CASES]
                       + [(k, c, 2 if k == "kvquant" else 0, k == "kvquant")
                          for k, c in GLUON_ROWS_CASES])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind,c,n_out,rope", GLUON_VARIANT_CASES,
                         ids=[f"{k}-{c}-out{n}-rope{int(r)}" for k, c, n, r in GLUON_VARIANT_CASES])
def test_gluon_variants_match_reference(kind, c, n_out, rope, monkeypatch):
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    for flag in ("PLANES3", "EXTRA_HEAD_DIMS", "KVQUANT_FULL", "KVQUANT_WIDE"):
        monkeypatch.setattr(decode_gluon, flag, True)
    monkeypatch.setattr(decode_gluon_tma, "MODE", "1" if kind == "tma" else "0")
    serve_small(monkeypatch, decode_gluon)
    kv = _kvquant_kv(c, n_out, rope) if kind == "kvquant" else make_kv(c, spare=8)
    assert decode_gluon.eligible(kv, c.Lq, c.HG), str(c)
    if c.Lq > 1:  # past MAX_COLUMNS: Triton
        assert not decode_gluon.eligible(kv, decode_gluon.MAX_COLUMNS // c.HG + 1, c.HG)
    assert kind != "tma" or decode_gluon_tma.eligible(kv, False)
    used = count_calls(monkeypatch, decode_gluon_tma if kind == "tma" else decode_gluon)
    run_case(c, kv=kv)
    run_case(c._replace(splits=3), kv=kv)  # ranges that start mid-body
    assert len(used) == 2, "the Gluon kernel was not used"
    if c.Lq > 1:
        _rows_bite(c, kv)
    _cap_bites(c, kv)


# Device lengths (CUDA-graph decode): the view's lengths are bounds over real data and lens_dev
# holds the true (sink, body, residual) lengths; anything read past them changes the answer.
LENS_DEV_CASES = [
    Case(kb=2, vb=2, G=32, D=64, B=2, Hkv=2, HG=4, S=3, body=32 * 40, res=48, starts=(0, 7),
         seed=21),
    Case(kb=4, vb=4, G=64, D=128, B=1, Hkv=2, HG=1, body=64 * 20, res=70, seed=22),
    # a sliding window counted from the true end (CUDA-graph decode of a sliding layer), capped
    Case(kb=2, vb=2, G=32, D=64, B=2, Hkv=2, HG=2, S=2, body=32 * 40, res=48, starts=(0, 7),
         window=700, softcap=0.3, seed=24),
]


# the FP16 part as splits, or in the finish kernel (both merged there); or merged by stage 1
@pytest.mark.parametrize("route", ["splits", "finish", "merge"])
@pytest.mark.parametrize("gluon", [False, pytest.param(True, marks=[gpu, pytest.mark.gpu])])
@pytest.mark.parametrize("c", LENS_DEV_CASES, ids=str)
def test_device_lengths_inside_bounds(c, gluon, route, monkeypatch):
    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "1" if route == "merge" else "0")
    monkeypatch.setattr(da, "FINISH_FP_TOKENS", 256 if route == "finish" else 0)
    serve_small(monkeypatch, decode_gluon)
    bound = make_kv(c)
    assert not gluon or decode_gluon.eligible(bound, 1, c.HG)
    q, lens, args = _check_device_lengths(c, bound, gluon, f"{c} lens_dev gluon={gluon}")
    with pytest.raises(ValueError, match="lens_dev"):
        kernel(q, bound, lens_dev=lens.long(), **args)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n_out,rope", [(2, True), (2, False)])
def test_gluon_kvquant_full_device_lengths(n_out, rope, monkeypatch):
    """KVQuant's full layers through the Gluon body with the lengths on the device (how a
    CUDA-graph decode of kvquant-3 runs them): nothing past the true lengths is read."""
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(decode_gluon, "PLANES3", True)
    monkeypatch.setattr(decode_gluon, "KVQUANT_FULL", True)
    serve_small(monkeypatch, decode_gluon)
    c = Case(kb=3, vb=3, G=32, D=128, B=2, Hkv=2, HG=4, S=3, body=32 * 40, res=48,
             starts=(0, 7), seed=24 + rope)
    bound = _kvquant_kv(c, n_out, rope)
    assert decode_gluon.eligible(bound, 1, c.HG)
    used = count_calls(monkeypatch, decode_gluon)
    _check_device_lengths(c, bound, True, f"{c} kvquant out={n_out} rope={rope} lens_dev")
    assert used, "the Gluon kernel was not used"


def _check_device_lengths(c, bound, gluon, what):
    """Run ``bound`` (lengths that are upper bounds over real data) with the true lengths on the
    device (body 3 groups and residual 17 tokens shorter) and compare with the reference over a
    view that holds only the true lengths; returns ``(q, lens, args)``."""
    import dataclasses

    true_body, true_res = c.body - 3 * c.G, c.res - 17
    view = dataclasses.replace(bound, body_len=true_body, res_len=true_res)
    g = torch.Generator().manual_seed(c.seed + 1)
    q = torch.randn(c.B, c.Hkv * c.HG, 1, c.D, generator=g).to(c.dtype).to(DEVICE)
    lens = torch.tensor([c.S, true_body, true_res], dtype=torch.int32, device=DEVICE)
    args = {"scale": c.D ** -0.5, "starts": _seq(c.starts), "window": c.window}
    if c.softcap is not None:
        args["softcap"] = c.softcap
    got = kernel(q, bound, lens_dev=lens, gluon=gluon, **args)
    compare(got, reference(q, view, **args), c.dtype, what)
    return q, lens, args


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits,window", [(2, None), (4, None), (2, 900)])
def test_gluon_tma_device_lengths_inside_bounds(bits, window, monkeypatch):
    """The TMA ring with lengths on the device: steps past the true body are never copied or
    read (the bounds' tail holds real data that would change the answer); with a sliding
    window (and a cap) counted from the true end."""
    from kvbits.kernels import decode_gluon, decode_gluon_tma
    serve_small(monkeypatch, decode_gluon)
    monkeypatch.setattr(decode_gluon_tma, "MODE", "1")
    c = Case(kb=bits, vb=bits, G=32, D=128, B=2, Hkv=2, HG=4, S=3, body=32 * 40, res=48,
             starts=(0, 7), Gv=32, seed=23 + bits, window=window,
             softcap=0.3 if window else None)
    bound = make_kv(c, spare=8)
    assert decode_gluon_tma.eligible(bound, False)
    _check_device_lengths(c, bound, True, f"{c} lens_dev TMA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
def test_gluon_tma_inside_cuda_graph(bits, monkeypatch):
    """Where ``auto`` takes the ring most (CUDA-graph decode): captured once with lengths on the
    device, then replayed with new queries and shorter true lengths written in place; every
    replay equals the reference over the true lengths."""
    import dataclasses

    from kvbits.kernels import decode_gluon
    from kvbits.kernels import decode_gluon_tma as dt
    serve_small(monkeypatch, decode_gluon)
    monkeypatch.setattr(dt, "MODE", "auto")
    used = count_calls(monkeypatch, dt)
    c = Case(kb=bits, vb=bits, G=32, D=128, B=2, Hkv=2, HG=4, S=3, body=32 * 40, res=48,
             starts=(0, 7), Gv=32, seed=31 + bits)
    bound = make_kv(c, spare=8)
    g = torch.Generator().manual_seed(c.seed)
    q = torch.empty(c.B, c.Hkv * c.HG, 1, c.D, dtype=c.dtype, device=DEVICE)
    lens = torch.tensor([c.S, c.body, c.res], dtype=torch.int32, device=DEVICE)
    args = {"scale": c.D ** -0.5, "starts": _seq(c.starts)}
    q.copy_(torch.randn(q.shape, generator=g))
    # the eager warm-up compiles the Triton parts (and, at this size, runs the register body):
    # the ring is compiled and loaded inside the capture, as in GreedyDecoder's first capture
    kernel(q, bound, lens_dev=lens, **args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(q, bound, lens_dev=lens, **args)
    assert used, "the TMA ring was not taken inside the capture"
    for body, res in [(c.body, c.res), (c.body - 3 * c.G, c.res - 17), (c.body - 5 * c.G, 5)]:
        q.copy_(torch.randn(q.shape, generator=g))
        lens.copy_(torch.tensor([c.S, body, res], dtype=torch.int32))
        graph.replay()
        view = dataclasses.replace(bound, body_len=body, res_len=res)
        compare(out, reference(q, view, **args), c.dtype, f"{c} graph replay body={body}")

@pytest.mark.parametrize("var, module, allowed", [
    ("KVBITS_GLUON_TMA", "decode_gluon_tma", "'auto', '0' or '1'"),
    ("KVBITS_GLUON_3BIT", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_EXTRA_DIMS", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_TOKEN_KEYS_WIDE", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_PADDED_DIMS", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_KVQUANT_HALVES", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_KVQUANT_ODD_OUTLIERS", "decode_gluon", "'0' or '1'"),
    ("KVBITS_SIDE_STREAM", "decode_attention", "'0' or '1'"),
    ("KVBITS_SIDE_AFTER", "decode_attention", "'0' or '1'"),
    ("KVBITS_GLUON_KVQUANT", "decode_gluon", "'0' or '1'"),
    ("KVBITS_FINISH_FP_TOKENS", "decode_attention", "'auto' or a non-negative integer"),
    ("KVBITS_GLUON", "decode_attention", "'0' or '1'"),
    ("KVBITS_PDL", "decode_attention", "'0' or '1'"),
    ("KVBITS_FAST_LAUNCH", "launch", "'0' or '1'"),
    # read unchecked until session 53 ('true' ran as off, 'two' failed in int())
    ("KVBITS_GLUON_PREFETCH_L1", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_PREFETCH_AFTER", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_PREFETCH_OUTLIERS", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_EARLY_V", "decode_gluon", "'0' or '1'"),
    ("KVBITS_GLUON_PREFETCH", "decode_gluon", "an integer >= 0"),
    ("KVBITS_GLUON_MAXNREG", "decode_gluon", "an integer >= 0"),
    ("KVBITS_GLUON_Q_RELOAD", "decode_gluon", "'auto', '0' or '1'"),
    ("KVBITS_MERGE", "decode_attention", "'auto', '0' or '1'"),
    ("KVBITS_STEP_GRAPHS", "kvbits.integrations.step_graphs", "'auto', '0' or '1'")])
def test_gluon_env_switches_are_checked(var, module, allowed):
    """A mistyped Gluon switch is refused at import, naming the variable and its values
    (KVBITS_GLUON, KVBITS_PDL and KVBITS_FAST_LAUNCH took 'yes' / 'true' as the default
    silently, 'false' as on)."""
    import subprocess
    import sys

    env = {**os.environ, var: "yes"}
    module = module if "." in module else f"kvbits.kernels.{module}"
    res = subprocess.run([sys.executable, "-c", f"import {module}"],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode != 0
    assert f"{var} must be {allowed}, got 'yes'" in res.stderr


def test_gluon_tma_eligibility():
    """Which layers the TMA ring takes (no GPU needed): KIVI layers at head_dim 128 with 32- or
    64-channel value groups and TMA-addressable buffers, and the uniform method's per-token keys
    over 64 channels; not mixed widths, other value or key groups, or scale rows that are not
    whole 16-byte rows."""
    from kvbits.kernels import decode_gluon_tma
    if decode_gluon_tma.gluon is None:
        pytest.skip("this Triton has no Gluon TMA")
    base = Case(kb=2, vb=2, G=32, D=128, body=32 * 4, Gv=32)
    assert decode_gluon_tma.eligible(make_kv(base, spare=8), False)
    assert not decode_gluon_tma.eligible(make_kv(base, spare=8), True)  # not per-token scales
    assert not decode_gluon_tma.eligible(make_kv(base, spare=5), False)  # odd scale rows
    assert not decode_gluon_tma.eligible(make_kv(base._replace(vb=4), spare=8), False)
    assert decode_gluon_tma.eligible(make_kv(base._replace(Gv=64), spare=8), False)
    assert not decode_gluon_tma.eligible(make_kv(base._replace(Gv=128), spare=8), False)
    assert not decode_gluon_tma.eligible(make_kv(base._replace(D=64), spare=8), False)
    uniform = base._replace(G=64, body=64 * 4, Gv=None)  # keys and values per token, 64 channels
    assert decode_gluon_tma.eligible(_axes_kv(uniform, "token", "token", "cpu", spare=8), True)
    narrow = base._replace(Gv=None)  # 32-channel per-token key groups: two per channel half
    assert not decode_gluon_tma.eligible(_axes_kv(narrow, "token", "token", "cpu", spare=8), True)
    assert not decode_gluon_tma.serves(make_kv(base, spare=8), False, torch.device("cpu"))



def test_gluon_tma_serves_rule(monkeypatch):
    """When the ring serves an eligible layer on a Hopper GPU (no GPU needed): ``auto`` takes
    2- and 4-bit layers inside CUDA-graph capture or for calls of >= EAGER_MIN_WORK body tokens
    x pairs (below, the register body's shorter host path wins eager), at any pair count;
    ``1`` always, ``0`` never."""
    import dataclasses

    from kvbits.kernels import decode_gluon_tma as dt
    if dt.gluon is None:
        pytest.skip("this Triton has no Gluon TMA")
    monkeypatch.setattr(dt, "_hopper", lambda index: True)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    kv2 = make_kv(Case(kb=2, vb=2, G=32, D=128, body=32 * 4, Gv=32), spare=8)  # 2 pairs
    kv4 = make_kv(Case(kb=4, vb=4, G=32, D=128, body=32 * 4, Gv=32), spare=8)
    big2 = dataclasses.replace(kv2, body_len=dt.EAGER_MIN_WORK // 2)  # (2 pairs) x body
    big4 = dataclasses.replace(kv4, body_len=dt.EAGER_MIN_WORK // 2)
    for mode, want in {"auto": [False, True, False, True, True, True, True],
                       "1": [True] * 7, "0": [False] * 7}.items():
        monkeypatch.setattr(dt, "MODE", mode)
        got = [dt.serves(kv2, False, cuda), dt.serves(big2, False, cuda),
               dt.serves(kv4, False, cuda), dt.serves(big4, False, cuda)]
        capturing[0] = True
        got += [dt.serves(kv2, False, cuda), dt.serves(big4, False, cuda),
                dt.serves(kv4, False, cuda)]
        capturing[0] = False
        assert got == want, (mode, got)

@pytest.mark.parametrize("G", [32, 64])
def test_gluon_plane_token_order_matches_packing(G):
    """The 3-bit body's addressing replayed on the CPU: for every MMA row ``n = e + 2a + 8h +
    16k`` of a step, the word rows and bit the kernel reads (``_key_loads3``: row ``g 3 CW + j CW
    + c`` of the step's groups, bit ``p = 16e + 4k + h + 2 a0``, then ``>> 2 a0`` and the merge's
    bit ``4k + h`` of half ``e``) hold the three bits of the code of the token that
    ``token_order(3, G)`` gives it (the token its mask and value scales use), in the cache's
    layout from ``quantize_keys``; and every token of the step is read exactly once."""
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    order = decode_gluon.token_order(3, G)
    assert sorted(order) == list(range(64))
    CW = G // 32
    g = torch.Generator().manual_seed(G)
    x = torch.randn(1, 1, 128, 4, generator=g)  # two steps of 64 tokens, 4 channels
    words, _, _ = quantize_keys(x, 3, G)  # [1, 1, rows, 4], packed per group of G tokens
    from kvbits.formats.packing import unpack_bits
    codes = torch.cat([unpack_bits(words[0, 0, r * 3 * CW:(r + 1) * 3 * CW], 3, G, dim=0)
                       for r in range(128 // G)])  # [128, 4]
    w = (words[0, 0].to(torch.int64) & 0xFFFFFFFF).tolist()
    for s in range(2):
        for n in range(64):
            e, a, h, k = n & 1, (n >> 1) & 3, (n >> 3) & 1, n >> 4
            a0, a1 = a % 2, a // 2
            grp = s * (64 // G) + a1 // CW
            p = 16 * e + 4 * k + h + 2 * a0
            for ch in range(4):
                code = sum(((w[grp * 3 * CW + j * CW + a1 % CW][ch] >> p) & 1) << j
                           for j in range(3))
                assert code == codes[s * 64 + order[n], ch], (G, s, n, ch)

def test_triton_split_rule():
    """About three body programs per SM at head dims 64 / 128, six at the others (96, 256: the
    H200 sweep in tune_head_dims.log), never more splits than work units."""
    from kvbits.kernels.decode_attention import body_programs_per_sm, num_splits
    assert num_splits(32, 255, 132) == 13  # Phi-3-mini batch 1 32k: 32 pairs
    assert num_splits(32, 255, 132, body_programs_per_sm(96)) == 25
    assert num_splits(64, 510, 132, body_programs_per_sm(256)) == 13
    assert num_splits(64, 510, 132, body_programs_per_sm(128)) == 7
    assert num_splits(8, 5, 132, 6) == 5
    assert [body_programs_per_sm(d) for d in (64, 80, 96, 128, 256)] == [3, 6, 6, 3, 6]


def test_gluon_dispatch_rules():
    """Which layers and calls the Gluon body kernel takes (no GPU needed: eligibility only)."""
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    kv = make_kv(Case(kb=2, vb=2, G=32, D=128, B=1, Hkv=1, body=64, res=0), device="cpu")
    assert decode_gluon.eligible(kv, 1, 4)
    assert decode_gluon.eligible(kv, 4, 4)  # several rows: rows x heads columns, up to 16
    assert decode_gluon.eligible(kv, 5, 4)  # 20 columns (a longer chunk): two blocks of 16
    assert not decode_gluon.eligible(kv, 33, 4)  # 132 columns: past MAX_COLUMNS, Triton
    assert decode_gluon.eligible(kv, 1, 17)  # > 16 query heads per KV head: two blocks
    assert not decode_gluon.eligible(kv, 1, 129)  # > MAX_COLUMNS query heads per KV head
    assert not decode_gluon.serves(kv, 1, 4, 64)  # 64 x 64 tokens: too small a step
    kv.body_len = 32768
    assert decode_gluon.serves(kv, 1, 4, 8)  # Llama-3 batch 1 at 32k: 8 x 32k tokens
    assert not decode_gluon.serves(kv, 1, 4, 4)
    # other head dims take it from 2^16 tokens x pairs (the Triton kernel is weaker there)
    wide = make_kv(Case(kb=2, vb=2, G=32, D=96, B=1, Hkv=1, body=64, res=0), device="cpu")
    wide.body_len = 32768
    if decode_gluon.EXTRA_HEAD_DIMS:
        assert decode_gluon.serves(wide, 1, 4, 2)
        assert not decode_gluon.serves(wide, 1, 4, 1)
    # one wave for small grids, 32 programs per SM for large ones; never more than the steps
    assert decode_gluon.body_splits(8, 32768, 132) == 132
    assert decode_gluon.body_splits(4, 32768, 132) == 132  # never more splits per pair than SMs
    assert decode_gluon.body_splits(8, 32768, 132, 256) == 64  # >= 8 steps per program at 256
    assert decode_gluon.body_splits(8, 32768, 132, 96) == 132
    assert decode_gluon.body_splits(64, 32768, 132, 256) == 66  # large grids: as at 128
    assert decode_gluon.body_splits(1024, 32768, 132) == 7  # 48 per SM from 256 pairs
    assert decode_gluon.body_splits(256, 32768, 132) == 25
    assert decode_gluon.body_splits(128, 32768, 132) == 33  # 32 per SM below 256
    assert decode_gluon.body_splits(64, 32768, 132) == 66
    assert decode_gluon.body_splits(20, 32768, 132) == 52  # 1040 programs: within one wave
    assert decode_gluon.body_splits(8, 640, 132) == 10
    # the TMA ring's mid-sized grids: one wave of 8 per SM while a program runs <= 64 steps
    from kvbits.kernels import decode_gluon_tma
    assert decode_gluon_tma.one_wave_splits(64, 32768, 132) == 16  # 1024 programs of 32 steps
    assert decode_gluon_tma.one_wave_splits(128, 32768, 132) == 8
    assert decode_gluon_tma.one_wave_splits(64, 131072, 132) is None  # 128 steps: the rule's
    assert decode_gluon_tma.one_wave_splits(64, 640, 132) == 10  # never more than the steps
    assert decode_gluon_tma.one_wave_splits(32, 32768, 132) is None  # small grids: the rule's
    assert decode_gluon_tma.one_wave_splits(256, 32768, 132) is None  # many pairs: 48 per SM
    for kb, vb, G, D in [(4, 2, 128, 128), (8, 8, 32, 128), (2, 2, 32, 80)]:
        other = make_kv(Case(kb=kb, vb=vb, G=G, D=D, B=1, Hkv=1, body=128, res=0), device="cpu")
        assert not decode_gluon.eligible(other, 1, 4), (kb, vb, G, D)
    # 3-bit planes (PLANES3, on by default): equal widths, G 32 / 64; off sends them to Triton
    three = make_kv(Case(kb=3, vb=3, G=32, D=128, B=1, Hkv=1, body=128, res=0), device="cpu")
    assert decode_gluon.eligible(three, 1, 4) == decode_gluon.PLANES3
    was = decode_gluon.PLANES3
    try:
        decode_gluon.PLANES3 = False
        assert not decode_gluon.eligible(three, 1, 4)
        decode_gluon.PLANES3 = True
        assert decode_gluon.eligible(three, 1, 4)
        # planes from a smaller step (Triton's 3-bit path is the slow one), while a 2-bit step
        # of the same size stays with Triton; the tiniest 3-bit steps stay there too
        two = make_kv(Case(kb=2, vb=2, G=32, D=128, B=1, Hkv=1, body=128, res=0), device="cpu")
        pairs = decode_gluon.MIN_BODY_TOKENS_PLANES // 128  # 128 body tokens per pair
        assert decode_gluon.MIN_BODY_TOKENS_PLANES < decode_gluon.MIN_BODY_TOKENS
        assert decode_gluon.serves(three, 1, 4, pairs)
        assert not decode_gluon.serves(three, 1, 4, pairs - 1)
        assert not decode_gluon.serves(two, 1, 4, pairs)
        # a single pair with a long enough body too (splits capped at one per SM)
        long3 = make_kv(Case(kb=3, vb=3, G=32, D=128, B=1, Hkv=1, body=1 << 16, res=0),
                        device="cpu")
        assert decode_gluon.serves(long3, 1, 4, 1)
        for kb, vb, G in [(3, 3, 128), (3, 2, 32), (2, 3, 32), (3, 4, 64)]:
            other = make_kv(Case(kb=kb, vb=vb, G=G, D=128, B=1, Hkv=1, body=128, res=0),
                            device="cpu")
            assert not decode_gluon.eligible(other, 1, 4), (kb, vb, G)
    finally:
        decode_gluon.PLANES3 = was
    # head dims 96 / 192 / 256 only with EXTRA_HEAD_DIMS (on since its session-16 GPU run):
    # per-channel keys (3-bit planes too); never head dims that are not 2-4 chunks of 32 / 64
    assert [decode_gluon.head_chunks(d) for d in (64, 96, 128, 192, 256)] == [2, 3, 2, 3, 4]
    wide = [make_kv(Case(kb=b, vb=b, G=32, D=d, B=1, Hkv=1, body=128, res=0), device="cpu")
            for b, d in ((2, 256), (4, 96), (2, 192))]
    wide3 = make_kv(Case(kb=3, vb=3, G=32, D=256, B=1, Hkv=1, body=128, res=0), device="cpu")
    d80 = make_kv(Case(kb=2, vb=2, G=32, D=80, B=1, Hkv=1, body=128, res=0), device="cpu")
    assert all(decode_gluon.eligible(w, 1, 2) == decode_gluon.EXTRA_HEAD_DIMS
               for w in wide)
    was = decode_gluon.EXTRA_HEAD_DIMS, decode_gluon.PLANES3
    try:
        decode_gluon.EXTRA_HEAD_DIMS = decode_gluon.PLANES3 = True
        assert all(decode_gluon.eligible(w, 1, 2) for w in wide)
        assert decode_gluon.eligible(wide3, 1, 2)
        assert not decode_gluon.eligible(d80, 1, 2)
    finally:
        decode_gluon.EXTRA_HEAD_DIMS, decode_gluon.PLANES3 = was
    mixed = make_kv(Case(kb=4, vb=2, G=32, D=128, B=1, Hkv=1, body=64, res=0), device="cpu")
    assert decode_gluon.eligible(mixed, 1, 4) == decode_gluon.MIXED_BITS  # on by default


def _store_layer(preset: str, device, tokens: int = 700, D: int = 128):
    """A layer written by the real LayerStore (geometric capacity, token-by-token flushes)."""
    from kvbits.cache.store import LayerStore
    from kvbits.spec import resolve_spec
    store = LayerStore(resolve_spec(preset), 2, 4, D, torch.float16, device)
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 4, tokens, D, generator=g).half().to(device) for _ in range(2))
    store.append(k[:, :, :500], v[:, :, :500])
    for t in range(500, tokens):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return store.view()


@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "uniform-int4", "uniform-int2"])
def test_store_built_kivi_layers_are_gluon_eligible(preset, monkeypatch):
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    kv = _store_layer(preset, "cpu")
    assert kv.body_len > 0 and decode_gluon.eligible(kv, 1, 4)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "uniform-int4"])
def test_gluon_store_built_layer(preset):
    kv = _store_layer(preset, "cuda")
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 16, 1, 128, generator=g).half().cuda()
    for kw in ({}, {"starts": _seq((0, 9)), "lengths": _seq((700, 611))}):
        o = kernel(q, kv, scale=128 ** -0.5, gluon=True, **kw)
        compare(o, reference(q, kv, scale=128 ** -0.5, **kw), torch.float16,
                f"store-built {preset} through the Gluon body {kw}")


GLUON_TOKEN_KEY_CASES = [
    Case(kb=b, vb=b, G=G, D=D, B=2, Hkv=2, HG=HG, S=1, body=G * 19, res=24,
         lengths=(1 + G * 19 + 24, 1 + G * 19 - 5), starts=(0, 3), seed=b * G + HG, Gv=Gv)
    for b, G, D, HG, Gv in [(4, 64, 128, 4, None), (2, 64, 128, 1, None), (2, 32, 64, 8, None),
                            (4, 128, 128, 16, None),
                            # head dims 256 / 96: one key group per 64- / 32-channel chunk
                            # (decode_gluon.TOKEN_KEYS_WIDE)
                            (4, 64, 256, 2, None), (2, 32, 96, 3, None),
                            # padded chunks (PADDED_HEAD_DIMS): uniform-int4's groups of
                            # 64 + 16 channels at head_dim 80, 64 + 36 at 100
                            (4, 64, 80, 4, 64), (2, 64, 100, 2, 64)]
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c", GLUON_TOKEN_KEY_CASES, ids=str)
@pytest.mark.parametrize("fold", [True, False])
def test_gluon_body_token_keys(c, fold, monkeypatch):
    """The uniform method's layout (keys and values scaled per token) through the Gluon body,
    the key scales folded out of the key operands (``KEY_FOLD``, head dims 64 and 128) or
    not."""
    from kvbits.kernels import decode_gluon
    if not fold and c.D not in (64, 128):
        pytest.skip("the fold serves two-chunk heads only")
    monkeypatch.setattr(decode_gluon, "KEY_FOLD", fold)
    monkeypatch.setattr(decode_gluon, "TOKEN_KEYS", True)
    monkeypatch.setattr(decode_gluon, "TOKEN_KEYS_WIDE", True)
    monkeypatch.setattr(decode_gluon, "EXTRA_HEAD_DIMS", True)
    serve_small(monkeypatch, decode_gluon)
    kv = _axes_kv(c, "token", "token")
    assert decode_gluon.eligible(kv, 1, c.HG)
    run_case(c, kv=kv)


def test_key_fold_selection(monkeypatch):
    """Which layers fold their per-token key scales out of the key operands (no GPU needed):
    keys per token at 2 or 4 bits, head_dim 128, in programs of at most 8 score columns, with
    the switch on; never keys per channel (KIVI), 3 or 8 bits, 16 columns, head_dim 64,
    codebooks, pre-RoPE keys, or with ``KEY_FOLD`` off."""
    from types import SimpleNamespace

    from kvbits.kernels import decode_gluon

    def layer(axis, bits):
        return SimpleNamespace(key_axis=axis, key_bits=bits)
    monkeypatch.setattr(decode_gluon, "KEY_FOLD", True)
    assert decode_gluon.fold_token_keys(layer("token", 4), 4, 128)
    assert decode_gluon.fold_token_keys(layer("token", 2), 8, 128)
    assert decode_gluon.fold_token_keys(layer("token", 4), 1, 128)
    assert not decode_gluon.fold_token_keys(layer("token", 4), 16, 128)
    assert not decode_gluon.fold_token_keys(layer("channel", 2), 4, 128)
    assert not decode_gluon.fold_token_keys(SimpleNamespace(key_bits=2), 4, 128)  # KIVI's default
    assert not decode_gluon.fold_token_keys(layer("token", 3), 4, 128)
    assert not decode_gluon.fold_token_keys(layer("token", 8), 4, 128)
    assert not decode_gluon.fold_token_keys(layer("token", 4), 4, 64)
    assert not decode_gluon.fold_token_keys(
        SimpleNamespace(key_axis="token", key_bits=4, k_codebook=object()), 4, 128)
    assert not decode_gluon.fold_token_keys(
        SimpleNamespace(key_axis="token", key_bits=4, rope_inv_freq=object()), 4, 128)
    monkeypatch.setattr(decode_gluon, "KEY_FOLD", False)
    assert not decode_gluon.fold_token_keys(layer("token", 4), 4, 128)


def test_gluon_padded_head_dims_eligibility(monkeypatch):
    """Which layers at head dims 32 does not divide the Gluon body takes (no GPU needed): the
    presets' KIVI, KVQuant (codebooks; post-RoPE outliers with their switch) and uniform layers
    at 80 / 100 / 40 / 72, as the store builds them; not groups that cross a 32-channel chunk, pre-RoPE keys
    without the halves layout, 8 bits, or anything with the switch off."""
    import warnings

    from kvbits.cache.store import LayerStore
    from kvbits.kernels import decode_gluon
    from kvbits.spec import PRESETS
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(decode_gluon, "PADDED_HEAD_DIMS", True)
    assert [d for d in range(4, 260, 4) if decode_gluon.padded_head(d)] == \
        [d for d in range(36, 128, 4) if d not in (64, 96)]
    for D in (80, 100, 40, 72):
        for name in ("kivi-2", "kivi-3", "kivi-4", "k4v2", "kvquant-3-dense-post",
                     "uniform-int4", "kivi-8", "kvquant-3-post"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (group size does not divide head_dim)
                store = LayerStore(PRESETS[name], 1, 2, D, torch.float16, "cpu")
            kv = torch.randn(1, 2, 200, D, dtype=torch.float16)
            store.append(kv, kv)
            # 8 bits: Triton; the rest (outliers alone too: KVQUANT_STRAIGHT_OUTLIERS) Gluon
            want = name != "kivi-8"
            assert decode_gluon.eligible(store.view(), 1, 4) == want, (D, name)
            assert decode_gluon.chunks_of(D) * 32 >= D > (decode_gluon.chunks_of(D) - 1) * 32
    c = GLUON_PADDED_CASES[0]  # head_dim 80, 32-channel value groups
    kv = make_kv(c._replace(body=c.G * 3), device="cpu")
    assert decode_gluon.eligible(kv, 1, c.HG)
    for Gv in (16, 48):  # groups of 16 (two per chunk, unpaired), 48 (crosses a chunk)
        assert not decode_gluon.eligible(make_kv(c._replace(body=c.G * 3, Gv=Gv), "cpu"), 1,
                                         c.HG), Gv
    rope = make_kv(c._replace(body=c.G * 3), device="cpu")
    rope.rope_inv_freq = torch.ones(c.D // 2)
    assert not decode_gluon.eligible(rope, 1, c.HG)  # halves of 40, no codebooks: Triton
    monkeypatch.setattr(decode_gluon, "PADDED_HEAD_DIMS", False)
    assert not decode_gluon.eligible(kv, 1, c.HG)


def test_gluon_token_keys_need_the_flag(monkeypatch):
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    c = GLUON_TOKEN_KEY_CASES[0]
    kv = _axes_kv(c._replace(body=c.G * 3), "token", "token", device="cpu")
    monkeypatch.setattr(decode_gluon, "TOKEN_KEYS", False)
    assert not decode_gluon.eligible(kv, 1, c.HG)
    monkeypatch.setattr(decode_gluon, "TOKEN_KEYS", True)
    assert decode_gluon.eligible(kv, 1, c.HG)
    narrow = _axes_kv(c._replace(body=c.G * 3, G=32, D=128), "token", "token", device="cpu")
    assert not decode_gluon.eligible(narrow, 1, c.HG)  # 32-channel key groups: Triton
    # head_dim 256 (four 64-channel chunks, one 64-channel key group each) only with the flag
    wide = _axes_kv(c._replace(body=c.G * 3, D=256), "token", "token", device="cpu")
    monkeypatch.setattr(decode_gluon, "EXTRA_HEAD_DIMS", True)
    monkeypatch.setattr(decode_gluon, "TOKEN_KEYS_WIDE", False)
    assert not decode_gluon.eligible(wide, 1, c.HG)
    monkeypatch.setattr(decode_gluon, "TOKEN_KEYS_WIDE", True)
    assert decode_gluon.eligible(wide, 1, c.HG)


GLUON_MIXED_CASES = [
    Case(kb=kb, vb=vb, G=G, D=D, B=2, Hkv=2, HG=HG, S=S, body=G * ng, res=24,
         lengths=(S + G * ng + 24, S + G * ng - 9), starts=(0, 4), seed=kb * 10 + G + HG)
    for kb, vb, G, D, HG, S, ng in [(4, 2, 32, 128, 4, 0, 41), (2, 4, 32, 128, 8, 1, 37),
                                    (4, 2, 64, 64, 16, 2, 19), (2, 4, 32, 128, 1, 0, 75),
                                    (4, 2, 32, 64, 3, 1, 70)]
]
# ... at head dims 32 does not divide (PADDED_HEAD_DIMS; k4v2 at Phi-2's 80, k2v4 at 100), with
# the value groups QuantSpec.value_group gives there (32 + 32 + 16; 32 x 3 + 4)
GLUON_MIXED_CASES += [
    Case(kb=kb, vb=vb, G=32, D=D, B=2, Hkv=2, HG=HG, S=1, body=32 * ng, res=24, Gv=32,
         lengths=(1 + 32 * ng + 24, 1 + 32 * ng - 9), starts=(0, 4), seed=kb * 10 + D + HG)
    for kb, vb, D, HG, ng in [(4, 2, 80, 4, 43), (2, 4, 100, 2, 39)]
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("c", GLUON_MIXED_CASES, ids=str)
def test_gluon_body_mixed_bits(c, monkeypatch):
    """Different key and value widths through the Gluon body (P permuted between the keys' and
    the values' token orders)."""
    from kvbits.kernels import decode_gluon
    monkeypatch.setattr(decode_gluon, "MIXED_BITS", True)
    serve_small(monkeypatch, decode_gluon)
    kv = make_kv(c)
    assert decode_gluon.eligible(kv, 1, c.HG)
    run_case(c, kv=kv)
    run_case(c._replace(splits=1), kv=kv)


def test_gluon_token_orders_permute_by_bits(monkeypatch):
    """The P reordering of mixed widths, on the CPU with torch's reshape/permute (the same
    row-major semantics as Gluon's): row n of the result holds the token that the value operand
    expects at row n; and the eligibility switch."""
    from kvbits.kernels import decode_gluon
    if decode_gluon.gluon is None:
        pytest.skip("this Triton has no Gluon")
    for G in (16, 32, 64):
        for kb, vb in ((4, 2), (2, 4)):
            key_tok = torch.tensor(decode_gluon.token_order(kb, G))
            val_tok = torch.tensor(decode_gluon.token_order(vb, G))
            assert sorted(key_tok.tolist()) == list(range(64))  # each a permutation of the step
            axes = [decode_gluon._p_axis(kb, vb, G, d) for d in range(6)] + [6]
            p = key_tok.view(64, 1)  # P's rows in the keys' order, labelled by token
            moved = p.reshape(2, 2, 2, 2, 2, 2, 1).permute(*axes).reshape(64)
            assert torch.equal(moved, val_tok), (kb, vb, G)
    c = GLUON_MIXED_CASES[0]
    kv = make_kv(c._replace(body=c.G * 3, lengths=None, starts=None), device="cpu")
    monkeypatch.setattr(decode_gluon, "MIXED_BITS", False)
    assert not decode_gluon.eligible(kv, 1, c.HG)
    monkeypatch.setattr(decode_gluon, "MIXED_BITS", True)
    assert decode_gluon.eligible(kv, 1, c.HG)
    wide = make_kv(c._replace(G=128, body=384, lengths=None, starts=None), device="cpu")
    assert not decode_gluon.eligible(wide, 1, c.HG)  # G > 64: steps differ by width


def test_store_capacities_are_multiples_of_16(monkeypatch):
    """Capacities are kernel strides: they stay in one divisibility class as the cache grows (see
    ``store._capacity``), so decoding never recompiles a kernel for a new class."""
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    from kvbits.cache.store import LayerStore
    from kvbits.spec import resolve_spec
    store = LayerStore(resolve_spec("kivi-2"), 1, 2, 64, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    store.append(*(torch.randn(1, 2, 37, 64, generator=g) for _ in range(2)))
    for _ in range(300):
        store.append(*(torch.randn(1, 2, 1, 64, generator=g) for _ in range(2)))
        kv = store.view()
        for name in ("res_k", "k_codes", "k_scale", "v_codes", "v_scale"):
            assert getattr(kv, name).shape[2] % 16 == 0, (name, getattr(kv, name).shape)


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", {})
    return sum(len(c[0]) for c in caches.values())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gluon", [False, True])
def test_decode_steps_do_not_recompile(gluon):
    """A generation's later steps reuse the kernels compiled for its first ones: lengths and
    split counts that change every step are not specialized on (``_STEP_VARYING``)."""
    from kvbits.cache.store import LayerStore
    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import decode_gluon
    from kvbits.spec import resolve_spec
    store = LayerStore(resolve_spec("kivi-2"), 2, 8, 128, torch.float16, "cuda")
    g = torch.Generator().manual_seed(8)
    store.append(*(torch.randn(2, 8, 2100, 128, generator=g).half().cuda() for _ in range(2)))
    q = torch.randn(2, 32, 1, 128, generator=g).half().cuda()
    fns = (da._decode_kernel, da._finish_kernel, decode_gluon._body_kernel)

    def steps(n):
        for _ in range(n):
            store.append(*(torch.randn(2, 8, 1, 128, generator=g).half().cuda()
                           for _ in range(2)))
            kernel(q, store.view(), scale=128 ** -0.5, gluon=gluon)
    steps(70)  # every residual length class and a flush
    before = [_compiled_variants(f) for f in fns]
    steps(300)  # more flushes, buffer growth, split counts that change with the length
    torch.cuda.synchronize()
    assert [_compiled_variants(f) for f in fns] == before


# Flags among the decode and finish kernels' constexprs: each must be a bool (an int that
# varies from step to step, as ``x and n_fp`` gives, would be a new compile per value).
_FLAG_CONSTEXPRS = {"HAS_WINDOW", "EVEN_D", "USE_PRMT", "FP8", "HAS_STARTS", "HAS_LENS", "K_CB",
                    "V_CB", "PRE_ROPE", "LENS_DEV", "SOFTCAP", "PDL", "MERGE", "K_FIXED",
                    "HAS_FP",  # the finish kernel's; then the Gluon body's
                    "K_TOK", "CB", "ROPE", "PF_L1", "PF_AFTER", "EARLY_V", "PF_OUT", "ROPE_M",
                    "KFIX"}


@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("preset", ["kivi-2", "kvquant-3-dense-post", "fp16"])
def test_decode_step_constexprs_do_not_vary(preset, gluon, monkeypatch):
    """The constexprs of a generation's decode steps take one value per step kind, whatever the
    residual length: MERGE was the FP16 token count (``... and n_fp``), so eager decoding (beam
    search, assisted decoding, ``step_graphs=False``) compiled a variant of the decode kernel
    per residual length, 32 at G = 32: 62 s more on a cold H200's first call (session 50,
    benchmarks/results/recompile_probe_s50b.log). The launches are recorded, not run."""
    from kvbits.cache.store import LayerStore
    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import decode_gluon
    from kvbits.spec import resolve_spec

    if gluon and decode_gluon._BODY is None:
        pytest.skip("this Triton has no Gluon")
    seen = {"decode": set(), "finish": set(), "gluon body": set()}
    for name, launcher in (("decode", da._DECODE), ("finish", da._FINISH),
                           ("gluon body", decode_gluon._BODY)):
        if launcher is not None:
            monkeypatch.setattr(launcher, "launch",
                                lambda grid, args, kw, name=name: seen[name].add(kw))
    spec = resolve_spec(preset, residual_length=16)
    store = LayerStore(spec, 1, 2, 64, torch.float16, "cpu")
    g = torch.Generator().manual_seed(0)
    store.append(*(torch.randn(1, 2, 100, 64, generator=g).half() for _ in range(2)))
    q = torch.randn(1, 4, 1, 64, generator=g).half()
    for _ in range(2 * spec.group_size):  # every residual length, and two flushes
        store.append(*(torch.randn(1, 2, 1, 64, generator=g).half() for _ in range(2)))
        kernel(q, store.view(), scale=0.125, gluon=gluon)
    assert seen["decode"] or seen["gluon body"]
    for kind, keywords in seen.items():
        for kw in keywords:
            flags = {k: v for k, v in kw.kwargs.items() if k in _FLAG_CONSTEXPRS}
            assert all(type(v) is bool for v in flags.values()), (kind, flags)
        assert len(keywords) <= 2, (kind, [kw.kwargs for kw in keywords])


# ----------------------------------------------------------------------------- softcapping
# Gemma2's attention-logit softcapping (``softcap * tanh(s / softcap)`` before the softmax) in
# the kernel's online softmax: body, sink and residual scores alike, masks kept, ragged and
# windowed rows, FP8 and KVQuant-free layouts; softcap 0.3 against scores of ~1 changes the
# answer (checked), 50 (Gemma2's value) barely does.
SOFTCAP_CASES = {
    "K2V2-G32-sink-ragged": Case(kb=2, vb=2, G=32, body=96, S=3, HG=2, B=2, lengths=(140, 90),
                                 starts=(0, 9)),
    "K4V4-G64-window-chunk": Case(kb=4, vb=4, G=64, body=128, HG=3, Lq=3, window=70),
}


@pytest.mark.parametrize("softcap", [0.3, 50.0])
@pytest.mark.parametrize("name", list(SOFTCAP_CASES))
def test_softcap_matches_reference(name, softcap):
    c = SOFTCAP_CASES[name]
    kv = make_kv(c)
    g = torch.Generator().manual_seed(c.seed + 7)
    q = (3 * torch.randn(c.B, c.Hkv * c.HG, c.Lq, c.D, generator=g)).to(c.dtype).to(DEVICE)
    args = {"scale": c.D ** -0.5, "starts": _seq(c.starts), "lengths": _seq(c.lengths),
            "window": c.window}
    o = kernel(q, kv, softcap=softcap, **args)
    r = reference(q, kv, softcap=softcap, **args)
    compare(o, r, c.dtype, f"{name} softcap={softcap}")
    if softcap < 1:
        plain = reference(q, kv, **args).float()
        assert (plain - r.float()).norm() > 0.05 * r.float().norm(), "the cap did not bite"


def test_softcap_checked():
    c = SOFTCAP_CASES["K2V2-G32-sink-ragged"]
    kv = make_kv(c, device="cpu")
    q = torch.zeros(c.B, c.Hkv * c.HG, 1, c.D)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            ops.decode_attention(q, kv, scale=1.0, softcap=bad)


# ----------------------------------------------------------------------- the op's own checks
def _op_case():
    c = Case(kb=2, vb=2, G=32, body=64, res=16, HG=2)
    return c, make_kv(c), _query_and_args(c)[0]


@pytest.mark.parametrize("what,change,match", [
    ("head_dim", lambda q, kv: (q[..., :32], kv), r"q \(1, 4, 1, 32\) does not fit the layer"),
    ("batch", lambda q, kv: (q.repeat(2, 1, 1, 1), kv), "does not fit the layer .batch 1"),
    ("heads", lambda q, kv: (q[:, :3], kv), "a multiple of the KV heads"),
    ("rows", lambda q, kv: (q[:, :, :0], kv), ">= 1 rows"),
    ("dtype", lambda q, kv: (q.to(torch.int32), kv), "float16, bfloat16 or float32"),
    ("res_len", lambda q, kv: (q, dataclasses.replace(kv, res_len=kv.res_k.shape[2] + 1)),
     r"kv.res_len = \d+ does not fit its buffer"),
    ("body_len", lambda q, kv: (q, dataclasses.replace(kv, body_len=40)),
     "whole number of groups of 32"),
    ("bits", lambda q, kv: (q, dataclasses.replace(kv, key_bits=5)), "key_bits must be 2, 3, 4"),
    ("codes", lambda q, kv: (q, dataclasses.replace(kv, k_codes=kv.k_codes.to(torch.uint8))),
     "k_codes must be int32"),
    ("rows of a buffer", lambda q, kv: (q, dataclasses.replace(kv, sink_k=kv.sink_k[:, :1])),
     r"kv.sink_k is \(1, 1, .* not \[1, 2, ...\]"),
])
def test_bad_calls_name_what_is_wrong(what, change, match):
    """Before any kernel or reference work: these read past a buffer, gave NaN or a finite
    wrong answer, or failed deep inside (found by a QA pass)."""
    _, kv, q = _op_case()
    q, kv = change(q, kv)
    with pytest.raises(ValueError, match=match):
        ops.decode_attention(q, kv, scale=0.125)


@pytest.mark.parametrize("kw,match", [({"scale": float("nan")}, "scale must be a positive"),
                                      ({"scale": 0.125, "window": 2.5}, "window must be a positive"),
                                      ({"scale": 0.125, "window": True}, "window must be"),
                                      ({"scale": True}, "scale must be a positive")])
def test_bad_scale_and_window(kw, match):
    """(``scale=True`` ran as scale 1, where ``window`` and ``softcap`` refuse a bool.)"""
    _, kv, q = _op_case()
    with pytest.raises(ValueError, match=match):
        ops.decode_attention(q, kv, **kw)


@pytest.mark.parametrize("mode", ["Triton", "kernels", "reference "])
def test_a_mistyped_kernels_switch_is_refused(mode, monkeypatch):
    """KVBITS_KERNELS other than auto / triton / reference ran as "auto", silently (a test
    meant to run the kernels measured the reference on the CPU)."""
    monkeypatch.setenv("KVBITS_KERNELS", mode)
    with pytest.raises(ValueError, match="KVBITS_KERNELS must be 'auto', 'triton' or "
                                         f"'reference', got {mode!r}"):
        ops.use_kernels(torch.zeros(1))


def test_groups_the_kernel_cannot_read_go_to_the_reference():
    """G = 48 (not a power of two) or 2-bit groups of 8 tokens (a quarter of a word): layouts
    only a hand-built layer has; the kernel would crash, the reference serves them."""
    _, kv, _ = _op_case()
    assert ops.kernel_reads(kv)
    for G, bits in ((48, 2), (8, 2), (16, 3)):
        assert not ops.kernel_reads(dataclasses.replace(kv, group_size=G, key_bits=bits))


# Per-token scale groups that are neither a power of two nor all of head_dim (24 or 48 of 64
# channels, 96 of 128: only a hand-built layer has them): the kernel's entry point returned
# answers 0.2-0.35 off the reference (24, 48, 96) or failed inside Triton (12 of 64, 40 of 80)
# where ops sends the layer to the reference; it now refuses them.
@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "channel")], ids="-".join)
@pytest.mark.parametrize("Gv,D", [(24, 64), (48, 64), (12, 64), (40, 80), (96, 128)])
def test_odd_per_token_groups_are_refused_by_the_kernel(Gv, D, axes):
    from kvbits.kernels.decode_attention import reads

    c = Case(D=D, Gv=Gv, body=64, res=8)
    kv = _axes_kv(c, *axes)
    q, args = _query_and_args(c)
    assert not reads(kv) and not ops.kernel_reads(kv)
    with pytest.raises(ValueError, match=rf"per-token scale groups of {Gv} channels"):
        kernel(q, kv, **args)
    compare(ops.decode_attention(q, kv, **args), reference(q, kv, **args), c.dtype, str(c))
    both = _axes_kv(c, "channel", "channel")  # no per-token groups: the kernel reads it
    run_case(c, kv=both)


def test_float16_queries_at_a_large_scale(monkeypatch):
    """At scale * log2(e) > 1 the kernels would round the scaled float16 query to inf (|q| near
    65504 at scale 1): such calls run with float32 queries and return float16."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    _, kv, q = _op_case()
    q = (q.float() * 6e4 / q.float().abs().amax()).half()  # 6e4 * log2(e) > 65504
    o = ops.decode_attention(q, kv, scale=1.0)
    r = reference(q.float(), kv, scale=1.0).half()
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    compare(o, r, torch.float16, "fp16 q at scale 1")


@pytest.mark.parametrize("layer_dtype", [torch.bfloat16, torch.float16])
def test_bfloat16_queries_through_the_op(monkeypatch, layer_dtype):
    """bfloat16 queries through ``ops.decode_attention`` with the kernels forced: Triton's
    interpreter computed them wrong (outputs ~8e8; session 53 QA), so there they run as float32
    queries; on the GPU they run as they are. Either way the result is the reference's."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    c = Case(kb=2, vb=2, G=32, body=64, res=16, HG=2, dtype=layer_dtype)
    kv = make_kv(c)
    q = _query_and_args(c)[0].to(torch.bfloat16)
    o = ops.decode_attention(q, kv, scale=0.125)
    assert o.dtype == torch.bfloat16
    compare(o, reference(q, kv, scale=0.125), torch.bfloat16, f"bf16 q, {c}")


@pytest.mark.parametrize("kb,vb", [(2, 2), (4, 4), (3, 2)])
def test_groups_wider_than_float16s_range(kb, vb):
    """A group whose range passes 65504 although every value fits float16 (values from -40000
    to 40000): ``code * scale`` alone overflows, so the body's dequantization is one fused
    multiply-add, on the GPU (where the compiler fused it anyway) and under the interpreter
    (which rounded the product to inf first: found by a QA pass)."""
    c = Case(kb=kb, vb=vb, G=32, body=64, res=16, HG=2)
    kv = make_kv(c)
    top_k, top_v = (1 << kb) - 1, (1 << vb) - 1
    # every used group of keys and of values spans +-40000
    kv.k_scale[:, :, : c.body // c.G] = 80000.0 / top_k
    kv.k_zero[:, :, : c.body // c.G] = -40000.0
    kv.v_scale[:, :, : c.body] = 80000.0 / top_v
    kv.v_zero[:, :, : c.body] = -40000.0
    q, args = _query_and_args(c)
    q = q * 1e-4  # scores of order one over keys of order 4e4
    o = kernel(q, kv, **args)
    r = reference(q, kv, **args)
    compare(o, r, torch.float16, f"K{kb}V{vb} groups spanning 80000")


@pytest.mark.parametrize("change,match", [
    (lambda q, kv, a: (q, object(), a), "kv must be a PackedKV"),
    (lambda q, kv, a: (q.to("meta"), kv, a), "they must share a device"),
    (lambda q, kv, a: (q, kv, {**a, "starts": torch.tensor([0.5])}), "starts must be None"),
    (lambda q, kv, a: (q, kv, {**a, "lengths": torch.tensor([70, 70, 70])}),
     "lengths must be None, an int or 1 integers"),
    (lambda q, kv, a: (q, kv, {**a, "lengths": [[70]]}), "lengths must be None"),
    (lambda q, kv, a: (q, kv, {**a, "softcap": "50"}), "softcap must be a positive"),
    # session 41 QA: the kernels take int32 positions, so these wrapped (2**32 + 50 read as 50)
    (lambda q, kv, a: (q, kv, {**a, "lengths": 2**32 + 50}), "lengths must fit an int32"),
    (lambda q, kv, a: (q, kv, {**a, "starts": torch.tensor([2**40])}),
     "starts must fit an int32 .* got values from 1099511627776"),
    (lambda q, kv, a: (q, kv, {**a, "starts": -2**31 - 1}), "starts must fit an int32"),
])
def test_bad_arguments_name_what_is_wrong(change, match):
    """Found by a QA pass: these failed deep inside torch or a kernel, or a float start was
    truncated silently."""
    _, kv, q = _op_case()
    q, kv, args = change(q, kv, {"scale": 0.125})
    with pytest.raises(TypeError if "PackedKV" in match else ValueError, match=match):
        ops.decode_attention(q, kv, **args)


@pytest.mark.parametrize("change", [lambda q: q.repeat(3, 1, 1, 1), lambda q: q[..., :32],
                                    lambda q: q[:, :, :0], lambda q: q[0]],
                         ids=["batch", "head_dim", "no-rows", "rank-3"])
def test_the_kernel_entry_point_refuses_a_query_that_does_not_fit(change):
    """Session 41 QA: called directly (not through kvbits.ops), a larger query batch read past
    the layer's buffers (NaN), a narrower head_dim gave garbage, no rows divided by zero."""
    _, kv, q = _op_case()
    with pytest.raises(ValueError, match=r"decode_attention: q "):
        kernel(change(q), kv, scale=0.125)


def test_good_position_arguments_pass_the_checks():
    _, kv, q = _op_case()
    r = ops.decode_attention(q, kv, scale=0.125)
    for starts, lengths in ((0, 80), ([0], [80]), (torch.tensor([0]), torch.tensor(80))):
        torch.testing.assert_close(
            ops.decode_attention(q, kv, scale=0.125, starts=starts, lengths=lengths), r)


# ------------------------------------------------- layers whose buffers do not fit (QA pass)
def _trim(name, rows):
    return lambda kv: dataclasses.replace(kv, **{name: getattr(kv, name)[:, :, :rows].contiguous()})


@pytest.mark.parametrize("change,match", [
    # a body past its code / scale buffers: NaN from the spare slots
    (lambda kv: dataclasses.replace(kv, body_len=kv.body_len + 6 * kv.group_size),
     r"kv.k_codes is \(1, 2, 14, 64\); this layer needs \[1, 2, >= 16, 64\]"),
    (_trim("v_scale", 40), r"kv.v_scale is \(1, 2, 40, 2\); this layer needs \[1, 2, >= 64, 2\]"),
    # a value grouping the scales were not made with: scales of other channels
    (lambda kv: dataclasses.replace(kv, value_group=16), r"kv.v_scale is .* >= 64, 4\]"),
    # a value group of 0: ZeroDivisionError inside Triton's compiler
    (lambda kv: dataclasses.replace(kv, value_group=0), r"value_group must be an int in \[1, "),
    # buffers of another head_dim: read at the layer's
    (lambda kv: dataclasses.replace(kv, sink_k=kv.sink_k[..., :32].contiguous()),
     r"kv.sink_k is \(1, 2, 8, 32\)"),
    (lambda kv: dataclasses.replace(kv, k_codes=kv.k_codes[..., :32].contiguous()),
     r"kv.k_codes is \(1, 2, 14, 32\)"),
    (lambda kv: dataclasses.replace(kv, v_codes=kv.v_codes.long()), "v_codes must be torch.int32"),
    # values / zeros of another capacity than their keys / scales: addressed with theirs
    (_trim("res_v", 16), r"kv.res_k \(1, 2, 21, 64\) and kv.res_v \(1, 2, 16, 64\) must have"),
    (_trim("sink_v", 3), r"kv.sink_k .* and kv.sink_v .* must have the same shape"),
    (_trim("k_zero", 2), r"kv.k_scale \(1, 2, 7, 64\) and kv.k_zero \(1, 2, 2, 64\)"),
    (_trim("v_zero", 64), r"kv.v_scale .* and kv.v_zero .* must have the same shape"),
    (lambda kv: dataclasses.replace(kv, group_size=0), "group_size must be a positive int"),
], ids=["body-past-codes", "short-v_scale", "value_group", "value_group-0", "sink_k-head_dim",
        "k_codes-head_dim", "v_codes-int64", "res_v-capacity", "sink_v-capacity",
        "k_zero-capacity", "v_zero-capacity", "group_size-0"])
def test_layer_buffers_that_do_not_fit_are_refused(change, match, monkeypatch):
    """A PackedKV whose buffers do not hold what its lengths and layout say: the kernel read past
    them (NaN from the spare slots), at another head's offsets (a value or zero buffer of another
    capacity than its key or scale twin), or with other channels' scales, silently; a value
    group of 0 failed in Triton's compiler (QA pass). The op now names the buffer."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    c = Case(kb=2, vb=2, G=32, body=64, res=16, S=3, HG=2)
    kv = make_kv(c)
    q, args = _query_and_args(c)
    with pytest.raises(ValueError, match=match):
        ops.decode_attention(q, change(kv), **args)


def test_valid_layers_pass_the_buffer_checks():
    from kvbits.formats.layout import check_buffers

    c = Case(kb=3, vb=3, G=32, D=80, body=64, S=2, HG=2, Gv=32)
    for kv in (make_kv(c), _axes_kv(c, "token", "channel"), _fp8_kv(c._replace(kb=8, vb=8)),
               _kvquant_kv(c, 2, True), _kvquant_kv(c, 1, False, offline=True),
               make_kv(c._replace(body=0, S=0, res=0))):
        check_buffers(kv)


def test_zero_query_heads_are_refused():
    """``q [B, 0, Lq, D]``: 0 is a multiple of the KV heads, and the kernel divided by zero."""
    _, kv, q = _op_case()
    for f in (ops.decode_attention, kernel):
        with pytest.raises(ValueError, match=r"a multiple of the KV heads \(>= 1\)"):
            f(q[:, :0], kv, scale=0.125)


@pytest.mark.parametrize("window", [2**32, 2**63, 2**64])
def test_windows_wider_than_any_distance_hide_nothing(window, monkeypatch):
    """A window of 2**63 reached the kernels as an unsigned integer (2.8 off the reference,
    which it matched); 2**64 failed to specialize (kernel) or to convert (reference). No two
    int32 positions are 2**32 apart: such a window runs as none."""
    c = Case(B=2, S=4, body=64, res=8, starts=(-3, 2), lengths=(70, 76), Lq=2, HG=2)
    kv = make_kv(c)
    q, args = _query_and_args(c)
    r = reference(q, kv, **args)
    compare(kernel(q, kv, **{**args, "window": window}), r, c.dtype, f"window {window}")
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    compare(ops.decode_attention(q, kv, **{**args, "window": window}), r, c.dtype, "ops")
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    torch.testing.assert_close(ops.decode_attention(q, kv, **{**args, "window": window}), r)


@pytest.mark.parametrize("kw", [{"lengths": 2**31 - 1}, {"lengths": torch.tensor([2**31 - 1])},
                                {"starts": -2**31}, {"lengths": 2**30 + 1}])
def test_positions_near_int32_limits_are_refused(kw, monkeypatch):
    """lengths of 2**31 - 1 passed the int32 check and then wrapped inside the kernel (``length
    + G - 1``): the body was skipped, 3.1 off the reference (QA pass). Positions now stay within
    +-2**30, where the kernels' int32 arithmetic has room."""
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    _, kv, q = _op_case()
    with pytest.raises(ValueError, match="must fit an int32 with headroom, within"):
        ops.decode_attention(q, kv, scale=0.125, **kw)
    lim = {name: 2**30 if name == "lengths" else -2**30 for name in kw}  # the limit passes
    compare(ops.decode_attention(q, kv, scale=0.125, **lim), reference(q, kv, scale=0.125, **lim),
            q.dtype, str(lim))


@pytest.mark.parametrize("kw", [{"scale": 1e39}, {"scale": 2.4e38},
                                {"scale": 0.125, "softcap": 1e39}])
def test_scale_and_softcap_past_float32_are_refused(kw):
    """Finite Python floats that are infinite in the kernels' float32 (times log2(e)): NaN
    outputs (QA pass)."""
    _, kv, q = _op_case()
    with pytest.raises(ValueError, match=r"must be a positive finite number .*at most 2.36e\+38"):
        ops.decode_attention(q, kv, **kw)
