"""Localise a hang or a wrong answer of the TMA ring (kernels/decode_gluon_tma.py) on a GPU: one
tiny layer per subprocess, each under a hard timeout, from one step (no ring refill) up to
several rounds of the ring. Prints, per case, "ok <rel err>", the error, or "TIMEOUT".

    PYTHONPATH=src python3 benchmarks/probes/tma_diag.py [seconds per case]
    DIAG_TESTS=0,1,... (same): the test file's TMA_CASES by index, one sub-run per line
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [(2, 32, 1), (2, 32, 2), (2, 32, 3), (2, 32, 8), (4, 32, 1), (4, 32, 4), (2, 16, 4),
         (2, 64, 4)]


def one(bits: int, G: int, steps: int) -> None:
    sys.path.insert(0, str(ROOT / "tests/kernels"))
    import test_decode_attention as T
    from kvbits.kernels import decode_gluon, decode_gluon_tma

    decode_gluon_tma.MODE = "1"
    decode_gluon.MIN_BODY_TOKENS = 1
    used = []
    real = decode_gluon_tma.attend_body
    decode_gluon_tma.attend_body = lambda *a, **k: used.append(1) or real(*a, **k)
    c = T.Case(kb=bits, vb=bits, G=G, D=128, B=1, Hkv=1, HG=1, body=64 * steps, res=16, Gv=32,
               splits=1, seed=steps)
    kv = T.make_kv(c, spare=8)
    print("eligible", decode_gluon_tma.eligible(kv, False), flush=True)
    import torch
    err = T.run_case(c, kv=kv, check=False)
    torch.cuda.synchronize()
    print("ok", err, "tma used", len(used), flush=True)


def test_case(i: int) -> None:
    """``tests/kernels/test_decode_attention.py``'s TMA case ``i``, one sub-run at a time."""
    sys.path.insert(0, str(ROOT / "tests/kernels"))
    import test_decode_attention as T
    import torch
    from kvbits.kernels import decode_gluon, decode_gluon_tma

    decode_gluon_tma.MODE = "1"
    decode_gluon.MIN_BODY_TOKENS = 1
    c = T.TMA_CASES[i]
    print(c, flush=True)
    kv = T.make_kv(c, spare=8)
    for sub in (c, c._replace(splits=1), c._replace(splits=3)):
        print("splits", sub.splits, T.run_case(sub, kv=kv, check=False), flush=True)
        torch.cuda.synchronize()
    c16 = c._replace(lengths=None, starts=None, dtype=torch.bfloat16, seed=c.seed + 1)
    print("bf16", T.run_case(c16, kv=T.make_kv(c16, spare=8), check=False), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        one(*map(int, sys.argv[1:]))
        sys.exit(0)
    if len(sys.argv) == 3:
        test_case(int(sys.argv[2]))
        sys.exit(0)
    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 30
    runs = [(str(b), str(G), str(n)) for b, G, n in CASES]
    if os.environ.get("DIAG_TESTS"):  # the test file's TMA cases instead, by index
        runs = [("case", i) for i in os.environ["DIAG_TESTS"].split(",")]
    for args in runs:
        try:
            r = subprocess.run([sys.executable, __file__, *args],
                               capture_output=True, text=True, timeout=limit, env=os.environ)
            tail = (r.stdout + r.stderr).strip().splitlines()[-6:]
            print(f"{args}: rc={r.returncode}", *tail, sep="\n  ", flush=True)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-4:]
            print(f"{args}: TIMEOUT after {limit:.0f} s", *out, sep="\n  ", flush=True)
