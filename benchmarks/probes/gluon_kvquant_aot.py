"""Compile the Gluon body's KVQuant variants for sm_90 on the CPU and print registers, spills and
the hot loop's instruction count (no GPU needed; Triton ships ptxas).

    python benchmarks/probes/gluon_kvquant_aot.py [INDEX ...]

Variants (ROPE, KOUT, VOUT, D, HG): the codebooks alone, with outliers, with pre-RoPE keys, both
(GQA 4 and MHA), and both at D = 64 with 16 heads. Session 18's numbers (Triton 3.6): codebooks
alone 2568 instructions per 64-token step; full layer 4570 (GQA 4) and 4559 (MHA) after the trim,
224-248 bytes of spills. SASS of each variant goes to /tmp/sass_kvq_*.txt."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
sys.path.insert(0, str(ROOT / "src"))
from aot import loop_size, summarize  # noqa: E402

from kvbits.kernels import decode_gluon as dg  # noqa: E402

SETS = [(False, 0, 0, 128, 4), (False, 2, 2, 128, 4), (True, 0, 0, 128, 4), (True, 2, 2, 128, 4),
        (True, 2, 2, 128, 1), (True, 2, 2, 64, 16)]

if __name__ == "__main__":
    for rope, kout, vout, D, HG in [SETS[int(i)] for i in sys.argv[1:]] or SETS:
        c = dg.compile_sm90(dict(HG=HG, HP=8 if HG <= 8 else 16, D=D, KBITS=3, VBITS=3, G=32,
                                 GV=32, HAS_STARTS=True, HAS_LENS=True, GK=32, K_TOK=False,
                                 LENS_DEV=False, PF=1, PF_AFTER=True, CB=True, KOUT=kout,
                                 VOUT=vout, ROPE=rope))
        sass = summarize(c, f"rope={rope} kout={kout} vout={vout} D={D} HG={HG}")
        print("   loop:", loop_size(sass))
        Path(f"/tmp/sass_kvq_{int(rope)}{kout}{vout}_{D}_{HG}.txt").write_text(sass)
