"""Compile kvbits.kernels.decode_gluon_tma's body kernel (TMA ring) for sm_90 on the CPU and
summarise its SASS (registers, shared memory, instruction mix; no GPU needed). Configurations:
2 and 4 bits at G = 32, 2 bits at G = 16 and 64; SASS and TTGIR go to /tmp/sass_tma_*."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
sys.path.insert(0, str(ROOT / "src"))
from aot import summarize

from kvbits.kernels import decode_gluon_tma as dt

for bits, G in [(2, 32), (4, 32), (2, 16), (2, 64)]:
    cx = dict(HG=4, HP=8, D=128, BITS=bits, G=G, GV=32, HAS_STARTS=True, HAS_LENS=True,
              LENS_DEV=False, NS=dt.STAGES[bits])
    c = dt.compile_sm90(cx)
    sass = summarize(c, f"tma body bits={bits} G={G} NS={cx['NS']}")
    Path(f"/tmp/sass_tma_{bits}_{G}.txt").write_text(sass)
    Path(f"/tmp/ttgir_tma_{bits}_{G}.txt").write_text(c.asm["ttgir"])
    ir = c.asm["ttgir"]
    print("   local_alloc:", ir.count("local_alloc"), "convert_layout:", ir.count("convert_layout"),
          "shfl:", c.asm["ptx"].count("shfl.sync"), flush=True)
