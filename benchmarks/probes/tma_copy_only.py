"""Probe (GPU): how fast the TMA ring's bytes can arrive at all. The ring's own copies (the
six descriptors and boxes of ``decode_gluon_tma``, eight copies per 64-token step into the same
stages, the same grid and split counts) with no math: each step is waited for and one word of
it read; against the same bytes laid out contiguously per step (one ``[R, 32]`` int32 box per
step, as a step-interleaved layout would store them). CUDA-graph time, best of three medians;
bytes are the layer's body bytes; bandwidth against a device-to-device copy measured here.

    PYTHONPATH=src python3 benchmarks/probes/tma_copy_only.py [B:Hq:Hkv:T:preset,...]
"""
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_graph_us, copy_bandwidth, parse_rows, random_packed_kv

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt
from kvbits.spec import resolve_spec


@gluon.jit
def _ring_copy_kernel(Out, kc_d, ks_d, kz_d, vc_d, vs_d, vz_d, body_len, kc_cap, ng_cap, vc_cap,
                      vs_rows, steps_per_split, D: gl.constexpr, BITS: gl.constexpr,
                      G: gl.constexpr, NS: gl.constexpr):
    """The ring of ``decode_gluon_tma._body_tma_kernel`` without the math (KIVI layers: key
    scale rows per group, 32-channel value groups)."""
    RS: gl.constexpr = 2 * BITS
    SG: gl.constexpr = 64 // G
    bh = gl.program_id(0)
    n_steps = (body_len + 63) // 64
    s_lo = gl.program_id(1) * steps_per_split
    s_hi = gl.minimum(s_lo + steps_per_split, n_steps)
    WT: gl.constexpr = dt.word_tile(BITS, D)
    kc_s = gl.allocate_shared_memory(gl.int32, [2 * NS, WT[0], WT[1], WT[2]], kc_d.layout)
    ks_s = gl.allocate_shared_memory(gl.int32, [NS, SG, D // 2], ks_d.layout)
    kz_s = gl.allocate_shared_memory(gl.int32, [NS, SG, D // 2], kz_d.layout)
    vc_s = gl.allocate_shared_memory(gl.int32, [2 * NS, WT[0], WT[1], WT[2]], vc_d.layout)
    vs_s = gl.allocate_shared_memory(gl.int32, [NS, 32, 4], vs_d.layout)
    vz_s = gl.allocate_shared_memory(gl.int32, [NS, 32, 4], vz_d.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(NS - 1):
        if s_lo + i < s_hi:
            dt._issue_step(s_lo + i, bh, i, bars, kc_s, ks_s, kz_s, vc_s, vs_s, vz_s, kc_d, ks_d,
                           kz_d, vc_d, vs_d, vz_d, kc_cap, ng_cap, vc_cap, vs_rows, RS, SG,
                           D // 2, 32, D)
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    acc = gl.zeros([SG, 32], gl.int32, L)
    for s in range(s_lo, s_hi):
        it = s - s_lo
        st = it % NS
        if s + NS - 1 < s_hi:
            fence_async_shared()
            dt._issue_step(s + NS - 1, bh, (it + NS - 1) % NS, bars, kc_s, ks_s, kz_s, vc_s,
                           vs_s, vz_s, kc_d, ks_d, kz_d, vc_d, vs_d, vz_d, kc_cap, ng_cap, vc_cap,
                           vs_rows, RS, SG, D // 2, 32, D)
        mbarrier.wait(bars.index(st), (it // NS) & 1)
        acc += ks_s.index(st).slice(0, 32, dim=1).load(L)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bars.index(i))
    r = gl.arange(0, SG, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    gl.store(Out + (bh * gl.num_programs(1) + gl.program_id(1)) * SG * 32 + r[:, None] * 32
             + c[None, :], acc)


@gluon.jit
def _block_copy_kernel(Out, blk_a, blk_b, n_steps, steps_per_split, RA: gl.constexpr,
                       RB: gl.constexpr, NS: gl.constexpr):
    """The same bytes per step as one contiguous block of ``RA + RB`` rows of 32 int32 (a
    step-interleaved layout), copied as two boxes (TMA boxes are powers of two), in a ring of
    ``NS`` stages."""
    bh = gl.program_id(0)
    s_lo = gl.program_id(1) * steps_per_split
    s_hi = gl.minimum(s_lo + steps_per_split, n_steps)
    ring_a = gl.allocate_shared_memory(gl.int32, [NS, RA, 32], blk_a.layout)
    ring_b = gl.allocate_shared_memory(gl.int32, [NS, RB, 32], blk_b.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(NS - 1):
        if s_lo + i < s_hi:
            _issue_block(blk_a, blk_b, ring_a, ring_b, bars, i, (bh * n_steps + s_lo + i) * (RA + RB),
                         RA, RB)
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    acc = gl.zeros([2, 32], gl.int32, L)
    for s in range(s_lo, s_hi):
        it = s - s_lo
        st = it % NS
        if s + NS - 1 < s_hi:
            fence_async_shared()
            _issue_block(blk_a, blk_b, ring_a, ring_b, bars, (it + NS - 1) % NS,
                         (bh * n_steps + s + NS - 1) * (RA + RB), RA, RB)
        mbarrier.wait(bars.index(st), (it // NS) & 1)
        acc += ring_b.index(st).slice(0, 2, dim=0).load(L)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bars.index(i))
    r = gl.arange(0, 2, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    gl.store(Out + (bh * gl.num_programs(1) + gl.program_id(1)) * 64 + r[:, None] * 32
             + c[None, :], acc)


@gluon.jit
def _issue_block(blk_a, blk_b, ring_a, ring_b, bars, st, row, RA: gl.constexpr,
                 RB: gl.constexpr):
    bar = bars.index(st)
    mbarrier.expect(bar, (RA + RB) * 128)
    dt._tma_load(blk_a, [row, 0], bar, ring_a.index(st))
    dt._tma_load(blk_b, [row + RA, 0], bar, ring_b.index(st))


def main():
    rows = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
        (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 131072, "kivi-4"),
        (8, 32, 32, 32768, "kivi-2"), (32, 32, 8, 32768, "kivi-2")])
    dt.MODE = "1"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: device copy {copy_bw / 1e12:.2f} TB/s (read + "
          "write); the TMA ring's copies without math, CUDA-graph us (best of 3 medians)")
    for row in rows:
        measure(*row, sms, copy_bw)


def measure(B, hq, hkv, T, preset, sms, copy_bw):
    """One row: the ring's copies, one block per step, and the body kernel itself."""
    spec = resolve_spec(preset)
    kv = random_packed_kv(B, hkv, T, 128, spec)
    q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
    steps = -(-kv.body_len // 64)
    per = -(-steps // splits)
    bits, G = kv.key_bits, kv.group_size
    nbytes = sum(t.numel() * t.element_size() for t in (kv.k_codes, kv.k_scale, kv.k_zero,
                                                        kv.v_codes, kv.v_scale, kv.v_zero))
    out = torch.empty(B * hkv * splits * 64, dtype=torch.int32, device="cuda")
    descs = dt._descriptors(kv)

    def ring():
        _ring_copy_kernel[(B * hkv, splits)](
            out, *descs, kv.body_len, kv.k_codes.shape[2], kv.k_scale.shape[2],
            kv.v_codes.shape[2], kv.v_scale.shape[2] * kv.v_scale.shape[3] // 8, per,
            D=128, BITS=bits, G=G, NS=dt.STAGES[bits], num_warps=1)
    step_bytes = nbytes // (B * hkv * steps)
    R = step_bytes // 128
    RA = 1 << (R.bit_length() - 1)  # 32 + 16 rows at 2 bits, 64 + 16 at 4
    RB = R - RA
    blk = torch.randint(-2**31, 2**31 - 1, (B * hkv * steps * R, 32), dtype=torch.int32,
                        device="cuda")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    bd_a, bd_b = (TensorDescriptor(blk, list(blk.shape), list(blk.stride()), [r, 32], layout)
                  for r in (RA, RB))

    def block():
        _block_copy_kernel[(B * hkv, splits)](out, bd_a, bd_b, steps, per, RA=RA, RB=RB,
                                              NS=dt.STAGES[bits], num_warps=1)

    o = torch.empty(B * hq, splits, 128, dtype=torch.float32, device="cuda")
    lse = torch.empty(B * hq, splits, dtype=torch.float32, device="cuda")

    def body():
        dt.attend_body(q, kv, o, lse, scale_log2=0.127, starts=q, lengths=q,
                       has_starts=False, has_lens=False, n_out=splits, splits=splits)
    fns = {"ring copies": ring, "one block per step": block, "body kernel": body}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    row = []
    for name, us in best_graph_us(fns).items():
        bw = nbytes / (us * 1e-6)
        row.append(f"{name} {us:.1f} us = {bw / 1e12:.2f} TB/s ({bw / copy_bw * 100:.0f}% of copy)")
    print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits} "
          f"({step_bytes} B per step): " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
