"""Compile kvbits.kernels.decode_gluon_tma's body kernel (TMA ring) for sm_90 on the CPU and
summarise its SASS (registers, shared memory, instruction mix; no GPU needed). Configurations:
2 and 4 bits at G = 32, 2 bits at G = 16 and 64, uniform-int4 (per-token key scales, 64-channel
value groups); SASS and TTGIR go to /tmp/sass_tma_*."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
sys.path.insert(0, str(ROOT / "src"))
from aot import summarize

from kvbits.kernels import decode_gluon_tma as dt

for bits, G, k_tok in [(2, 32, False), (4, 32, False), (2, 16, False), (2, 64, False),
                       (4, 64, True)]:  # the last: uniform-int4 (per-token keys, GV = 64)
    GV = 64 if k_tok else 32
    cx = dict(HG=4, HP=8, D=128, BITS=bits, G=G, GV=GV, HAS_STARTS=True, HAS_LENS=True,
              LENS_DEV=False, NS=dt.STAGES[bits], K_TOK=k_tok)
    c = dt.compile_sm90(cx)
    tag = f"{bits}_{G}" + ("_tok" if k_tok else "")
    sass = summarize(c, f"tma body bits={bits} G={G} GV={GV} K_TOK={k_tok} NS={cx['NS']}")
    Path(f"/tmp/sass_tma_{tag}.txt").write_text(sass)
    Path(f"/tmp/ttgir_tma_{tag}.txt").write_text(c.asm["ttgir"])
    ir = c.asm["ttgir"]
    print("   local_alloc:", ir.count("local_alloc"), "convert_layout:", ir.count("convert_layout"),
          "shfl:", c.asm["ptx"].count("shfl.sync"), flush=True)
