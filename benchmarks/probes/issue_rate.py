"""How far instruction issue lets each Gluon body go: the hot loop's warp-instructions per
64-token step (sm_90 SASS, compiled on the CPU) against the decode table's measured times.

    python benchmarks/probes/issue_rate.py [--table benchmarks/results/decode_attention.json]
        [--out benchmarks/results/issue_rate]

For each preset's body and each long row of the table it prints:

- ``loop``: SASS instructions of the body's loop, one iteration = one 64-token step of one
  (sequence, KV head) pair with its whole GQA group (``benchmarks/probes/aot.loop_size``);
- ``IPC``: warp-instructions issued per scheduler cycle that the measured CUDA-graph time
  implies, ``steps * loop / (time * SMs * 4 * clock)``, with every step of the body counted and
  the whole call's time (so it is a lower bound on the body's own rate);
- ``at IPC 1``: the speedup over FP16 flash SDPA (same run) if every scheduler issued one
  instruction every cycle through the whole call, the most that body can give at that row.

The kernels are compiled with the same constexprs the dispatch uses at head_dim 128 (GQA 4:
``HG=4``; MHA: ``HG=1``). Run it with the Triton that timed the table (3.6 on the H200:
``pip install --no-deps --target DIR triton==3.6.0`` and put DIR first on ``PYTHONPATH``);
another version's SASS differs by a few percent. H200: 132 SMs, 4 schedulers each, 1.98 GHz
(the boost clock the decode table's kernels run at)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/probes"))
sys.path.insert(0, str(ROOT / "src"))
from aot import loop_size, summarize

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels import decode_gluon_tma as dt

SMS, SCHEDULERS, CLOCK_HZ = 132, 4, 1.98e9
RESIDUAL = 128  # the presets' FP16 residual window: tokens outside the body

# The register body's constexprs as attend_body sets them at head_dim 128 (defaults of its
# switches: PF=1, PF_AFTER, ROPE_M with pre-RoPE keys; Q_RELOAD only at head_dim 256).
_REGISTER = {"D": 128, "HAS_STARTS": True, "HAS_LENS": True, "K_TOK": False, "LENS_DEV": False,
             "PF": 1, "PF_L1": False, "PF_AFTER": True, "EARLY_V": False, "LQ": 1, "NQB": 1}
_PLANES3 = {"KBITS": 3, "VBITS": 3, "G": 32, "GV": 32, "GK": 32}
_KVQUANT = {**_PLANES3, "CB": True, "KOUT": 2, "VOUT": 2, "ROPE": True, "ROPE_M": True}
BODIES = {  # preset -> (body, constexprs besides HG / HP)
    "kivi-2": ("ring", {"BITS": 2, "G": 32, "GV": 32, "K_TOK": False, "KFOLD": False}),
    "kivi-4": ("ring", {"BITS": 4, "G": 32, "GV": 32, "K_TOK": False, "KFOLD": False}),
    "uniform-int2": ("ring", {"BITS": 2, "G": 64, "GV": 64, "K_TOK": True, "KFOLD": True}),
    "uniform-int4": ("ring", {"BITS": 4, "G": 64, "GV": 64, "K_TOK": True, "KFOLD": True}),
    "kivi-3": ("register", _PLANES3),
    "kvquant-3-dense-post": ("register", {**_PLANES3, "CB": True}),
    "kvquant-3": ("register", _KVQUANT),
    "kvquant-3-offline": ("register", {**_KVQUANT, "KFIX": True}),
}
ROWS = [("llama-3-8b", 8, 32768), ("llama-3-8b", 8, 131072), ("llama-3-8b", 1, 131072),
        ("llama-2-7b", 8, 32768), ("llama-2-7b", 32, 131072)]


def compile_body(preset: str, HG: int):
    body, cx = BODIES[preset]
    if body == "ring":
        c = dt.compile_sm90(dict(HG=HG, HP=8, D=128, HAS_STARTS=True, HAS_LENS=True,
                                 LENS_DEV=False, NS=dt.STAGES[cx["BITS"]], **cx))
    else:
        c = dg.compile_sm90(dict(HG=HG, HP=8, **_REGISTER, **cx))
    sass = summarize(c, f"{preset} HG={HG}")
    return loop_size(sass)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default=str(ROOT / "benchmarks/results/decode_attention.json"))
    ap.add_argument("--out", default=None, help="stem for .json and .md (default: print only)")
    args = ap.parse_args(argv)
    import triton

    table = json.loads(Path(args.table).read_text())
    rows = table["rows"]
    loops = {}
    out = []
    for model, batch, ctx in ROWS:
        found = [r for r in rows if (r["model"], r["batch"], r["context"]) == (model, batch, ctx)]
        if not found:
            continue
        fp16 = min(r["us_graph"] for r in found if r["preset"] == "fp16" and r.get("us_graph"))
        hkv, hq = found[0]["kv_heads"], found[0]["q_heads"]
        steps = batch * hkv * -(-(ctx - RESIDUAL) // 64)
        for preset in BODIES:
            hit = [r for r in found if r["preset"] == preset and "gluon" in r["provider"]]
            if not hit:
                continue
            key = (preset, hq // hkv)
            if key not in loops:
                loops[key] = compile_body(preset, hq // hkv)
            loop = loops[key]
            us = hit[0]["us_graph"] or hit[0]["us"]
            slots = us * 1e-6 * SMS * SCHEDULERS * CLOCK_HZ
            issue_us = steps * loop / (SMS * SCHEDULERS * CLOCK_HZ) * 1e6
            out.append({"model": model, "batch": batch, "context": ctx, "preset": preset,
                        "loop": loop, "steps": steps, "us": us, "fp16_us": fp16,
                        "speedup": fp16 / us, "ipc": steps * loop / slots,
                        "issue_us": issue_us, "speedup_at_ipc1": fp16 / issue_us})
    lines = [
        "# Instruction issue against the decode table",
        "",
        (f"`python benchmarks/probes/issue_rate.py --table {Path(args.table).name}` "
         f"(SASS from Triton {triton.__version__}, compiled on the CPU; times from the table: "
         f"{table['env'].get('gpu')}, Triton {table['env'].get('triton')}, "
         f"{table['env'].get('date')})."),
        "",
        ("loop: warp-instructions per 64-token step of one (sequence, KV head) pair; IPC: "
         "instructions per scheduler cycle the measured graph time implies (132 SMs x 4 "
         "schedulers x 1.98 GHz); issue us: the loop's instructions alone at one per scheduler "
         "cycle; at IPC 1: FP16 flash SDPA's time over that."),
        "",
        "| model | batch | context | preset | loop | us | vs FP16 | IPC | issue us | at IPC 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in out:
        lines.append(f"| {o['model']} | {o['batch']} | {o['context']} | {o['preset']} | "
                     f"{o['loop']} | {o['us']:.1f} | {o['speedup']:.2f}x | {o['ipc']:.2f} | "
                     f"{o['issue_us']:.1f} | {o['speedup_at_ipc1']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text)
        Path(args.out + ".json").write_text(json.dumps(
            {"triton": triton.__version__, "table": Path(args.table).name, "env": table["env"],
                 "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
