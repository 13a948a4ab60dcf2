"""Compile the Gluon body's KVQuant variants for sm_90 on the CPU and print registers, spills and
the hot loop's instruction count (no GPU needed; Triton ships ptxas).

    python benchmarks/probes/gluon_kvquant_aot.py [INDEX ...]

Variants (ROPE, KOUT, VOUT, D, HG): the codebooks alone, with outliers, with pre-RoPE keys, both
(GQA 4 and MHA), and both at D = 64 with 16 heads. Session 18's numbers (Triton 3.6): codebooks
alone 2568 instructions per 64-token step; full layer 4570 (GQA 4) and 4559 (MHA) after the trim,
224-248 bytes of spills. SASS of each variant goes to /tmp/sass_kvq_*.txt."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402

from aot import loop_size, summarize  # noqa: E402

spec = importlib.util.spec_from_file_location("dg", ROOT / "src/kvbits/kernels/decode_gluon.py")
dg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dg)

SETS = [(False, 0, 0, 128, 4), (False, 2, 2, 128, 4), (True, 0, 0, 128, 4), (True, 2, 2, 128, 4),
        (True, 2, 2, 128, 1), (True, 2, 2, 64, 16)]
SIG = {"Q": "*fp16", "Out": "*fp32", "Lse": "*fp32", "KC": "*i32", "KS": "*fp16", "KZ": "*fp16",
       "VC": "*i32", "VS": "*fp16", "VZ": "*fp16", "Starts": "*i32", "Lens": "*i32",
       "LenTab": "*i32", "KCB": "*fp32", "VCB": "*fp32", "KOI": "*u8", "KOV": "*fp16",
       "VOI": "*u8", "VOV": "*fp16", "InvFreq": "*fp32", "RopeCS": "*fp16", "qk_scale": "fp32"}
SIG.update({k: "i32" for k in ("sink_len", "body_len", "res_len", "kc_cap", "ks_slice", "vc_cap",
                               "vs_slice", "kout_cap", "vout_cap", "Hkv", "n_out",
                               "steps_per_split")})

if __name__ == "__main__":
    chosen = [SETS[int(i)] for i in sys.argv[1:]] or SETS
    fn = dg._body_kernel
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in SIG.items()
             if v.startswith("*") or k.endswith(("_cap", "_slice"))}
    for rope, kout, vout, D, HG in chosen:
        cx = dict(HG=HG, HP=8 if HG <= 8 else 16, D=D, KBITS=3, VBITS=3, G=32, GV=32,
                  HAS_STARTS=True, HAS_LENS=True, GK=32, K_TOK=False, LENS_DEV=False, PF=1,
                  PF_L1=False, PF_AFTER=True, EARLY_V=False, CB=True, KOUT=kout, VOUT=vout,
                  ROPE=rope)
        src = gluon._runtime.GluonASTSource(fn=fn, signature={**SIG, **dict.fromkeys(cx, "constexpr")},
                                            constexprs=cx, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        sass = summarize(c, f"rope={rope} kout={kout} vout={vout} D={D} HG={HG}")
        print("   loop:", loop_size(sass))
        Path(f"/tmp/sass_kvq_{int(rope)}{kout}{vout}_{D}_{HG}.txt").write_text(sass)
