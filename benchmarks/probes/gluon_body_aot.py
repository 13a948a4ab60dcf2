"""Compile kvbits.kernels.decode_gluon's body kernel for sm_90 on the CPU and summarise its SASS
(registers, spills, instruction mix; no GPU needed). MAXNREG, KTOK=1 (per-token keys), VBITS
(value bits, default = key bits) and CB=1 (KVQuant codebooks on the 3-bit row) environment
variables select variants; SASS and TTGIR
are written to /tmp/sass_* and /tmp/ttgir_*."""
import importlib.util, sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
spec = importlib.util.spec_from_file_location("dg", ROOT / "src/kvbits/kernels/decode_gluon.py")
dg = importlib.util.module_from_spec(spec); spec.loader.exec_module(dg)
from aot import summarize
import os
# 3-bit planes (PLANES3) at the end, with CB=1 their KVQuant codebook variant
for bits, D, GV, G, HP in [(2, 128, 32, 32, 8), (4, 128, 32, 32, 8), (2, 64, 64, 64, 8), (2, 128, 128, 128, 16), (3, 128, 32, 32, 8)]:
    KT = os.environ.get("KTOK") == "1"
    cx = dict(HG=4, HP=HP, D=D, KBITS=bits, VBITS=int(os.environ.get("VBITS", bits)), G=G, GV=GV, HAS_STARTS=True, HAS_LENS=True, GK=GV if KT else G, K_TOK=KT, LENS_DEV=False, PF=int(os.environ.get('PF', 0)), PF_L1=os.environ.get('PF_L1') == '1', PF_AFTER=os.environ.get('PF_AFTER') == '1', EARLY_V=os.environ.get('EARLY_V') == '1', CB=bits == 3 and os.environ.get('CB') == '1')
    c = dg.compile_sm90(cx, **({"maxnreg": int(os.environ["MAXNREG"])} if os.environ.get("MAXNREG") else {}))
    sass = summarize(c, f"gluon body bits={bits} D={D} GV={GV} G={G} HP={HP}")
    open(f"/tmp/sass_{bits}_{D}_{G}.txt","w").write(sass); open(f"/tmp/ttgir_{bits}_{D}_{G}.txt","w").write(c.asm["ttgir"]); ir = c.asm["ttgir"]
    print("   local_alloc:", ir.count("local_alloc"), "convert_layout:", ir.count("convert_layout"))
