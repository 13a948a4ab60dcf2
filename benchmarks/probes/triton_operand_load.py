import re
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import triton
import triton.language as tl
from aot import compile_kernel, summarize


@triton.jit
def probe(Q, KW, Out, n_iter, D: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, TRANSPOSED: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, N)
    q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
    acc = tl.zeros([BLOCK_M, N], tl.float32)
    for i in range(n_iter):
        base = KW + i * N * (D // 16)
        if TRANSPOSED:  # kT [D, N]: element (d, n) from word n * D/16 + d // 16
            w = tl.load(base + offs_n[None, :] * (D // 16) + (offs_d // 16)[:, None])
            c = (w >> ((offs_d % 16) * 2)[:, None]) & 3
            kt = c.to(tl.float16)
            acc += tl.dot(q, kt)
        else:
            w = tl.load(base + offs_n[:, None] * (D // 16) + (offs_d // 16)[None, :])
            c = (w >> ((offs_d % 16) * 2)[None, :]) & 3
            acc += tl.dot(q, tl.trans(c.to(tl.float16)))
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], acc)

sig = {"Q": "*fp16", "KW": "*i32", "Out": "*fp32", "n_iter": "i32"}
for tr in (True, False):
    c = compile_kernel(probe, sig, dict(D=128, N=128, BLOCK_M=16, TRANSPOSED=tr), num_warps=4)
    s = summarize(c, f"transposed={tr}")
    ir = c.asm["ttgir"]
    print("  local_alloc:", ir.count("local_alloc"), " convert_layout:", ir.count("convert_layout"), " local_load:", ir.count("local_load"))
    for line in ir.splitlines():
        if "local_alloc" in line or "convert_layout" in line:
            print("   ", re.sub(r"loc\(.*", "", line.strip())[:200])
