"""Draft of the v5 decode body in Gluon (compile-only probe; not used by the library yet).

One program attends one (sequence, KV head) over whole groups of the packed body, KIVI layout
(keys per channel over G tokens, values per token over GV channels, slot-major int32 packing):
every operand is loaded straight into its MMA layout (`DotOperandLayout` of `mma_v2`) and
unpacked there, so no tile crosses shared memory; only the probabilities P change layout
(accumulator -> A operand). No masking beyond the body end: the point is the instruction count
and the shared-memory use, printed by `python benchmarks/probes/gluon_decode_body.py`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton
from aot import summarize
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _codes_f16(w, shift, BITS: gl.constexpr):
    c = (w >> shift) & ((1 << BITS) - 1)
    return (c | 0x6400).to(gl.int16).to(gl.float16, bitcast=True) - 1024.0


@gluon.jit
def body(Q, Out, KC, KS, KZ, VC, VS, VZ, n_groups, qk_scale,
         D: gl.constexpr, M: gl.constexpr, BITS: gl.constexpr, G: gl.constexpr,
         GV: gl.constexpr, N: gl.constexpr, WARPS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    W: gl.constexpr = G * BITS // 32
    NGV: gl.constexpr = D // GV
    bh = gl.program_id(0).to(gl.int64)
    qm = gl.arange(0, M, layout=gl.SliceLayout(1, a_l))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, a_l))
    q = gl.load(Q + bh * M * D + qm[:, None] * D + qd[None, :])
    q = (q.to(gl.float32) * qk_scale).to(gl.float16)
    # K^T [D, N] operand: element (d, n) of token n of the step
    kd = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    kn = gl.arange(0, N, layout=gl.SliceLayout(0, b_l))
    k_row = (kn // G) * W + (kn % G) % W
    k_shift = ((kn % G) // W) * BITS
    # V [N, D] operand: element (n, d)
    vn = gl.arange(0, N, layout=gl.SliceLayout(1, b_l))
    vd = gl.arange(0, D, layout=gl.SliceLayout(0, b_l))
    v_row = (vn // G) * W + (vn % G) % W
    v_shift = ((vn % G) // W) * BITS
    m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([M, D], gl.float32, layout=mma)
    GPT: gl.constexpr = N // G
    for g0 in range(0, n_groups, GPT):
        kw = gl.load(KC + (bh * n_groups + g0) * W * D + k_row[None, :] * D + kd[:, None])
        grp = g0 + kn // G
        ks = gl.load(KS + (bh * n_groups + grp)[None, :] * D + kd[:, None])
        kz = gl.load(KZ + (bh * n_groups + grp)[None, :] * D + kd[:, None])
        kt = _codes_f16(kw, k_shift[None, :], BITS) * ks + kz
        s = mma_v2(q, kt, gl.zeros([M, N], gl.float32, layout=mma))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        vw = gl.load(VC + (bh * n_groups + g0) * W * D + v_row[:, None] * D + vd[None, :])
        tok = (bh * n_groups + g0) * G + vn
        vs = gl.load(VS + tok[:, None] * NGV + (vd // GV)[None, :])
        vz = gl.load(VZ + tok[:, None] * NGV + (vd // GV)[None, :])
        v = _codes_f16(vw, v_shift[:, None], BITS) * vs + vz
        pa = gl.convert_layout(p.to(gl.float16), a_l)
        acc = mma_v2(pa, v, acc * alpha[:, None])
    om = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
    od = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
    gl.store(Out + bh * M * D + om[:, None] * D + od[None, :], acc / l_i[:, None])


def compile_body(bits=2, N=128, D=128, warps=4):
    sig = {"Q": "*fp16", "Out": "*fp32", "KC": "*i32", "KS": "*fp16", "KZ": "*fp16", "VC": "*i32",
           "VS": "*fp16", "VZ": "*fp16", "n_groups": "i32", "qk_scale": "fp32"}
    cx = dict(D=D, M=16, BITS=bits, G=32, GV=32, N=N, WARPS=warps)
    names = body.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*")}
    src = gluon._runtime.GluonASTSource(fn=body, signature={**sig, **{k: "constexpr" for k in cx}},
                                        constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


if __name__ == "__main__":
    for bits, N, warps in ((2, 128, 4), (4, 128, 4), (2, 64, 4)):
        c = compile_body(bits, N, warps=warps)
        summarize(c, f"gluon body bits={bits} tokens/step={N} warps={warps}")
        print("   local_alloc:", c.asm["ttgir"].count("local_alloc"))
