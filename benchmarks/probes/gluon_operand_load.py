"""Probe: can Gluon load packed words straight into an MMA operand layout and unpack there?"""
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import triton
from aot import summarize
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def probe(Q, KW, Out, n_iter, D: gl.constexpr, N: gl.constexpr, M: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    qm = gl.arange(0, M, layout=gl.SliceLayout(1, a_l))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, a_l))
    q = gl.load(Q + qm[:, None] * D + qd[None, :])
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(1, b_l))
    offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, b_l))
    acc = gl.zeros([M, N], gl.float32, layout=mma)
    for i in range(n_iter):
        base = KW + i * N * (D // 16)
        # K^T [D, N] in kvbits' current contract: slot-major 2-bit, G=32 (W=2 words per group):
        # token n -> group n // 32, word (n % 32) % 2, slot (n % 32) // 2; words are [rows, D]
        e = offs_n % 32
        row = (offs_n // 32) * 2 + e % 2
        w = gl.load(base + row[None, :] * D + offs_d[:, None])
        c = (w >> ((e // 2) * 2)[None, :]) & 3
        kt = c.to(gl.float16)
        acc = mma_v2(q, kt, acc)
    om = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
    on = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(Out + om[:, None] * N + on[None, :], acc)


sig = {"Q": "*fp16", "KW": "*i32", "Out": "*fp32", "n_iter": "i32", "D": "constexpr", "N": "constexpr", "M": "constexpr"}
names = probe.arg_names
attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("Q", "KW", "Out")}
src = gluon._runtime.GluonASTSource(fn=probe, signature=sig, constexprs={"D": 128, "N": 128, "M": 16}, attrs=attrs) if hasattr(gluon, "_runtime") else None
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
s = summarize(c, "gluon probe")
ir = c.asm["ttgir"]
print("local_alloc:", ir.count("local_alloc"), "convert_layout:", ir.count("convert_layout"))
