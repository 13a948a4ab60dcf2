"""Compile kvbits.kernels.decode_gluon_tma's body kernel (TMA ring) for sm_90 on the CPU and
summarise its SASS (registers, shared memory, instruction mix; no GPU needed). Configurations:
2 and 4 bits at G = 32, 2 bits at G = 16 and 64; SASS and TTGIR go to /tmp/sass_tma_*."""
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
sys.path.insert(0, str(ROOT / "src"))
from aot import summarize

from kvbits.kernels import decode_gluon_tma as dt


def desc(dtype, shape):
    return (f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],NVMMASharedLayout(swizzle_byte_width=0, "
            f"element_bitwidth=32, rank=2)>")


for bits, G in [(2, 32), (4, 32), (2, 16), (2, 64)]:
    D, RS, SG = 128, 2 * bits, 64 // G
    sig = {"Q": "*fp16", "Out": "*fp32", "Lse": "*fp32", "kc_d": desc("i32", [RS, D]),
           "ks_d": desc("i32", [SG, D // 2]), "kz_d": desc("i32", [SG, D // 2]),
           "vc_d": desc("i32", [RS, D]), "vs_d": desc("i32", [32, 4]),
           "vz_d": desc("i32", [32, 4]), "Starts": "*i32", "Lens": "*i32", "LenTab": "*i32",
           "qk_scale": "fp32"}
    sig.update({k: "i32" for k in ("sink_len", "body_len", "res_len", "kc_cap", "ng_cap",
                                   "vc_cap", "vs_rows", "Hkv", "n_out", "steps_per_split")})
    cx = dict(HG=4, HP=8, D=D, BITS=bits, G=G, GV=32, HAS_STARTS=True, HAS_LENS=True,
              LENS_DEV=False, NS=dt.STAGES[bits])
    fn = dt._body_tma_kernel
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*")}
    src = gluon._runtime.GluonASTSource(fn=fn, signature={**sig, **dict.fromkeys(cx, "constexpr")},
                                        constexprs=cx, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    sass = summarize(c, f"tma body bits={bits} G={G} NS={cx['NS']}")
    Path(f"/tmp/sass_tma_{bits}_{G}.txt").write_text(sass)
    Path(f"/tmp/ttgir_tma_{bits}_{G}.txt").write_text(c.asm["ttgir"])
    ir = c.asm["ttgir"]
    print("   local_alloc:", ir.count("local_alloc"), "convert_layout:", ir.count("convert_layout"),
          "shfl:", c.asm["ptx"].count("shfl.sync"), flush=True)
