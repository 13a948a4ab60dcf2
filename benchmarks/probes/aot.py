"""Compile a Triton/Gluon kernel for sm_90 on the CPU and summarise its SASS (no GPU needed).

``compile_kernel(fn, signature, constexprs)`` returns the compiled kernel (pointer arguments and
``*_cap`` / ``*_slice`` integers get the 16-divisibility the JIT specializes at run time);
``summarize`` prints registers, shared memory, spills and the instruction mix, from the
``cuobjdump`` that ships in Triton's wheel. ``python benchmarks/probes/aot.py`` summarises the
decode kernel at a few configurations; ``AOT_SET=kvquant`` (env) instead compares KVQuant layers
(codebooks, outliers, pre-RoPE keys; 3 bits, D=128, tile 128) with plain KIVI, adding the size of
the largest loop (the body loop: warp-instructions per tile step). ``SOFTCAP=1`` compiles the
default set with Gemma2's logit softcapping."""
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

da = importlib.import_module(os.environ.get('DA', 'kvbits.kernels.decode_attention'))

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

def compile_kernel(fn, signature, constexprs, num_warps=4, num_stages=2):
    import inspect
    # constexpr parameters with defaults (e.g. SOFTCAP) that the caller does not set
    constexprs = {**{k: p.default for k, p in inspect.signature(fn.fn).parameters.items()
                     if "constexpr" in str(p.annotation) and p.default is not p.empty},
                  **constexprs}
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    names = fn.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
             if v.startswith("*") or k.endswith("_cap") or k.endswith("_slice")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))

def summarize(c, label):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"]); path = f.name
    res = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{BIN}/cuobjdump", "--dump-sass", path], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m: ops[m.group(1).split(".")[0]] += 1
    regs = re.search(r"REG:(\d+)", res); shared = re.search(r"SHARED:(\d+)", res); stack = re.search(r"STACK:(\d+)", res)
    print(f"== {label}: regs={regs and regs.group(1)} shared={shared and shared.group(1)} stack={stack and stack.group(1)} total_sass={sum(ops.values())}")
    print("   ", ", ".join(f"{k}:{v}" for k, v in ops.most_common(28)))
    return sass

SIG = {"LenTab": "*i32", "KCB": "*fp32", "VCB": "*fp32", "KOI": "*u8", "KOV": "*fp16", "VOI": "*u8", "VOV": "*fp16", "InvFreq": "*fp32", "RopeTable": "*fp16", "kout_cap": "i32", "vout_cap": "i32"} | {n: "*fp16" for n in ["Q"]} | {"Out": "*fp32", "Lse": "*fp32"} | {n: "*fp16" for n in ["SinkK","SinkV","ResK","ResV"]} \
    | {"KC": "*i32", "KS": "*fp16", "KZ": "*fp16", "VC": "*i32", "VS": "*fp16", "VZ": "*fp16", "Starts": "*i32", "Lens": "*i32",
       "qk_scale": "fp32", "window": "i32", "softcap": "fp32"} | {n: "i32" for n in ["sink_len","body_len","res_len","sink_cap","res_cap","kc_cap","ks_slice","vc_cap","vs_slice",
       "Hkv","Lq","m_tiles","n_body_splits","groups_per_split","fp_per_split","split0","n_out"]}

def loop_size(sass):
    """Instructions in the largest backward-branch span of a SASS dump (the hot loop)."""
    best = 0
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", sass):
        here, target = int(m.group(1), 16), int(m.group(2), 16)
        if target < here:
            best = max(best, (here - target) // 16 + 1)
    return best

# name: (KBITS, VBITS, K_CB/V_CB, K_OUT/V_OUT, PRE_ROPE)
KVQ_SET = {"kivi-2": (2, 2, False, 0, False), "kivi-3": (3, 3, False, 0, False),
           "kvquant-3 cb": (3, 3, True, 0, False), "kvquant-3 cb+out2": (3, 3, True, 2, False),
           "kvquant-3 cb+rope": (3, 3, True, 0, True),
           "kvquant-3 cb+out2+rope": (3, 3, True, 2, True),
           "kvquant-2 cb+out2+rope": (2, 2, True, 2, True),
           "kvquant-4 cb+out2+rope": (4, 4, True, 2, True)}

if __name__ == "__main__":
    import inspect
    params = inspect.signature(da._decode_kernel.fn).parameters
    # Run-time arguments SIG does not name (a kernel newer than this probe) are taken as i32.
    sig = {k: SIG.get(k, "i32") for k, p in params.items()
           if "constexpr" not in str(p.annotation)}
    if os.environ.get("AOT_SET") == "kvquant":
        for name, (kb, vb, cb, nout, rope) in KVQ_SET.items():
            cx = {"HG": 4, "D": 128, "BLOCK_D": 128, "BLOCK_M": 16, "KBITS": kb, "VBITS": vb,
                  "G": 32, "GPT": 4, "GK": 32, "GV": 32, "K_PER_TOKEN": False,
                  "V_PER_TOKEN": True, "BLOCK_FP": 64, "HAS_WINDOW": False, "EVEN_D": True,
                  "USE_PRMT": True, "FP8": False, "HAS_STARTS": True, "HAS_LENS": True,
                  "K_CB": cb, "V_CB": cb, "K_OUT": nout, "V_OUT": nout, "PRE_ROPE": rope,
                  "LENS_DEV": False}
            sass = summarize(compile_kernel(da._decode_kernel, sig, cx), name)
            print(f"    loop={loop_size(sass)}")
        raise SystemExit
    for bits, tile, warps, D in [(2, 128, 4, 128), (4, 128, 4, 128), (2, 64, 4, 256)]:
        cx = dict(HG=4, D=D, BLOCK_D=D, BLOCK_M=16, KBITS=bits, VBITS=bits, G=32, GPT=tile // 32,
                  GK=32, GV=32, K_PER_TOKEN=False, V_PER_TOKEN=True,
                  BLOCK_FP=64 if D <= 128 else 32, HAS_WINDOW=False, EVEN_D=True, USE_PRMT=True,
                  FP8=False, HAS_STARTS=True, HAS_LENS=True, K_CB=False, V_CB=False, K_OUT=0,
                  V_OUT=0, PRE_ROPE=False, LENS_DEV=False,
                  SOFTCAP=os.environ.get("SOFTCAP") == "1")  # Gemma2's capped scores
        c = compile_kernel(da._decode_kernel, sig, cx, num_warps=warps,
                           num_stages=2 if D <= 128 else 1)
        summarize(c, f"bits={bits} tile={tile} warps={warps} D={D} softcap={cx['SOFTCAP']}")
