"""The Triton decode and finish kernels compiled for sm_90 on the CPU (no GPU needed; Triton ships ptxas).

CI runs this kernel under Triton's interpreter, which accepts things the GPU compiler refuses (a
Python global read inside the kernel, an op the NVIDIA backend lacks). Compiling the variants
that no GPU has run yet catches those; numerics are the interpreter's tests. The compile runs in
a child process, outside the interpreter mode this one may be in.
"""

from __future__ import annotations

CHILD = r'''
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from kvbits.kernels import decode_attention as da
PTRS = {"Out": "*fp32", "Lse": "*fp32", "KC": "*i32", "VC": "*i32", "Starts": "*i32",
        "Lens": "*i32", "LenTab": "*i32", "KCB": "*fp32", "VCB": "*fp32", "KOI": "*u8",
        "VOI": "*u8", "InvFreq": "*fp32", "RopeTable": "*fp16"}
FP16_PTRS = ("Q", "O", "SinkK", "SinkV", "ResK", "ResV", "KS", "KZ", "VS", "VZ", "KOV", "VOV")
out = []
for cx in json.loads(sys.argv[1]):
    cx = dict(cx)
    fn = getattr(da, cx.pop("kernel", "_decode_kernel"))
    options = {"num_warps": 4, **cx.pop("options", {})}
    params = inspect.signature(fn.fn).parameters
    sig = {name: (PTRS.get(name) or ("*fp16" if name in FP16_PTRS else None)
                  or ("fp32" if name in ("qk_scale", "softcap") else "i32"))
           for name, p in params.items() if "constexpr" not in str(p.annotation)}
    cx = {k: p.default for k, p in params.items()
          if "constexpr" in str(p.annotation) and p.default is not p.empty} | cx
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*") or k.endswith(("_cap", "_slice"))}
    src = triton.compiler.ASTSource(fn=fn, signature={**sig, **dict.fromkeys(cx, "constexpr")},
                                    constexprs=cx, attrs=attrs)
    if "num_stages" not in options and "BLOCK_FP" in cx:
        options["num_stages"] = 2 if cx["D"] <= 128 else 1
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    out.append({"cubin": len(c.asm["cubin"]), "shared": c.metadata.shared,
                "pdl": c.metadata.launch_pdl, "ptx": [i for i in ("griddepcontrol.wait",
                "griddepcontrol.launch_dependents") if i in c.asm["ptx"]]})
print(json.dumps(out))
'''

BASE = {"HG": 4, "D": 128, "BLOCK_D": 128, "BLOCK_M": 16, "KBITS": 2, "VBITS": 2, "G": 32,
        "GPT": 4, "GK": 32, "GV": 32, "K_PER_TOKEN": False, "V_PER_TOKEN": True, "BLOCK_FP": 64,
        "HAS_WINDOW": False, "EVEN_D": True, "USE_PRMT": True, "FP8": False, "HAS_STARTS": True,
        "HAS_LENS": True, "K_CB": False, "V_CB": False, "K_OUT": 0, "V_OUT": 0,
        "PRE_ROPE": False, "LENS_DEV": False}
FINISH = {"kernel": "_finish_kernel", "HG": 4, "D": 128, "BLOCK_D": 128, "BLOCK_M": 16,
          "BLOCK_FP": 64, "BLOCK_S": 32, "ROWS": 2, "HAS_FP": True, "HAS_WINDOW": False,
          "HAS_STARTS": True, "HAS_LENS": True, "LENS_DEV": True, "SOFTCAP": False, "PDL": False}
CONFIGS = [
    {**BASE, "SOFTCAP": True, "HAS_WINDOW": True},  # Gemma2: capped scores, sliding layers
    # FP8 at head_dim 256 with 128-token tiles (its default there)
    {**BASE, "D": 256, "BLOCK_D": 256, "KBITS": 8, "VBITS": 8, "FP8": True, "BLOCK_FP": 32},
    {**BASE, "PDL": True},  # lets the finish kernel start early
    # the finish kernel as a programmatic dependent (waits before merging), and plain
    {**FINISH, "PDL": True, "options": {"launch_pdl": True}},
    {**FINISH, "HAS_FP": False, "ROWS": 1, "BLOCK_S": 64, "D": 64, "BLOCK_D": 64},
    # KVQuant codebooks of 8-bit keys (256 entries: gathered) beside 3-bit values (byte permutes)
    {**BASE, "KBITS": 8, "VBITS": 3, "K_CB": True, "V_CB": True, "K_OUT": 1, "V_OUT": 1},
]


def test_decode_kernel_variants_compile_for_sm90(compile_sm90):
    results = compile_sm90(CHILD, CONFIGS)
    for cx, r in zip(CONFIGS, results):
        assert r["cubin"] > 0 and r["shared"] <= 228 * 1024, (cx, r)
        # the grid-dependency instructions only where asked for
        want = ["griddepcontrol.wait" if cx.get("kernel") else "griddepcontrol.launch_dependents"]
        assert r["ptx"] == (want if cx.get("PDL") else []), (cx, r)
    assert [r["pdl"] for r in results] == [False, False, False, True, False, False]
