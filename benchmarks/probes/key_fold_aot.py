"""Compile both Gluon decode bodies for sm_90 on the CPU with the uniform method's per-token key
scales folded out of the key operands (``KFOLD``, ``decode_gluon.KEY_FOLD``) and without, and
print registers, spills and the instructions of the body loop (session 55, docs/KERNEL_LOG.md,
"Per-token key scales folded out of the operands"; no GPU needed).

    PYTHONPATH=src python3 benchmarks/probes/key_fold_aot.py
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
sys.path.insert(0, str(ROOT / "src"))
from aot import loop_size, summarize

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt

REGISTER = {"HG": 4, "HP": 8, "D": 128, "KBITS": 2, "VBITS": 2, "G": 64, "GV": 64,
            "HAS_STARTS": True, "HAS_LENS": True, "GK": 64, "K_TOK": True, "LENS_DEV": False,
            "PF": 1, "PF_L1": False, "PF_AFTER": True, "EARLY_V": False}
CASES = [  # (label, compile, constexprs)
    *[(f"ring bits={b} HP={hp}", dt.compile_sm90,
       {"HG": 4 if hp == 8 else 16, "HP": hp, "D": 128, "BITS": b, "G": 64, "GV": 64, "HAS_STARTS": True,
        "HAS_LENS": True, "LENS_DEV": False, "NS": dt.STAGES[b], "K_TOK": True})
      for b in (4, 2) for hp in (8, 16)],
    *[(f"register body bits={b} D={d} HP={hp}", dg.compile_sm90,
       {**REGISTER, "KBITS": b, "VBITS": b, "D": d, "HG": 4 if hp == 8 else 16, "HP": hp})
      for b in (4, 2) for d, hp in ((128, 8), (128, 16), (64, 8), (64, 16))],
]

for label, compile_sm90, cx in CASES:
    for fold in (False, True):
        c = compile_sm90({**cx, "KFOLD": fold})
        sass = summarize(c, f"{label} KFOLD={fold}")
        print(f"    loop={loop_size(sass)}", flush=True)
