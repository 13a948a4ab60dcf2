"""What a user waits for before the first token: ``generate()`` with each preset in a fresh
process, Triton's kernel cache empty (cold) and then filled by that run (warm disk cache), against
the same call repeated in the process (everything compiled and captured).

    PYTHONPATH=src python3 benchmarks/cold_start.py --out DIR                # H200, ~2 min
    PYTHONPATH=src python3 benchmarks/cold_start.py --model tiny --device cpu --out DIR

Each preset runs in two child processes that share a new ``TRITON_CACHE_DIR``: the first finds
it empty (every Triton / Gluon kernel the call needs compiles; per-layer step graphs are
captured), the second finds it filled (kernels load from disk; graphs are captured again). In
each, the call is timed twice: ``first`` (what the user waits for) and ``again`` (the steady
state). The model is the named configuration with **random weights** (compile and capture
times do not depend on weight values); its construction is not timed. Writes ``NAME.json`` and
``NAME.md``: GPU, versions and command, per preset the three times and the kernels compiled
(files in the cache directory that the cold run wrote).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def child(args) -> dict:
    """One process: build the model, time ``generate`` twice, print the times as JSON."""
    import torch

    from kvbits.eval.speed import build_model, make_cache, model_config, parse_variant
    from kvbits.integrations.hf import cache_kwargs

    t0 = time.perf_counter()
    device = torch.device(args.device)
    model = build_model(model_config(args.model), device=device)
    built = time.perf_counter() - t0
    variant = parse_variant(args.preset)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt), generator=gen)
    ids = ids.to(device)

    def call(new: int = args.new) -> float:
        cache = make_cache(model, variant)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, temperature=None, top_p=None,
                       top_k=None, **cache_kwargs(model, cache))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = call()
    again = min(call() for _ in range(2))
    # per call, a new cache each: the best of three at each length
    calls = {n: min(call(n) for _ in range(3)) for n in args.calls} if args.sweep else {}
    return {"first_s": first, "again_s": again, "build_s": built, "calls": calls}


def _fit(calls: dict) -> tuple[float, float]:
    """Least squares ``seconds = fixed + per_token * new``: (fixed s, per-token s)."""
    n = [float(k) for k in calls]
    t = list(calls.values())
    mn, mt = sum(n) / len(n), sum(t) / len(t)
    slope = sum((a - mn) * (b - mt) for a, b in zip(n, t)) / sum((a - mn) ** 2 for a in n)
    return mt - slope * mn, slope


def _kernel_files(cache_dir: str) -> int:
    """Compiled kernels in a Triton cache directory (one ``.json`` metadata file each)."""
    return sum(1 for p in Path(cache_dir).rglob("*.json") if not p.name.startswith("__grp__"))


def run_preset(args, preset: str) -> dict:
    row = {"preset": preset}
    with tempfile.TemporaryDirectory(prefix="kvbits-triton-") as cache_dir:
        env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
        for label in ("cold", "warm"):
            cmd = [sys.executable, __file__, "--child", "--preset", preset, "--model", args.model,
                   "--device", args.device, "--prompt", str(args.prompt), "--new", str(args.new),
                   "--batch", str(args.batch), "--calls", ",".join(map(str, args.calls))]
            if label == "warm" and len(args.calls) > 1:
                cmd.append("--sweep")
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
            if done.returncode:
                raise RuntimeError(f"{preset} ({label}) failed:\n{done.stderr[-3000:]}")
            times = json.loads(done.stdout.strip().splitlines()[-1])
            row[f"{label}_first_s"], row[f"{label}_again_s"] = times["first_s"], times["again_s"]
            row[f"{label}_process_s"] = wall
            if label == "cold":
                row["kernels_compiled"] = _kernel_files(cache_dir)
            if times["calls"]:
                row["calls_s"] = times["calls"]
                fixed, per_token = _fit(times["calls"])
                row["fixed_s"], row["per_token_ms"] = fixed, 1e3 * per_token
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="a kvbits.eval.speed config name")
    p.add_argument("--presets", default="fp16,kivi-2,kivi-4,uniform-int4,fp8-dynamic,k8v4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="generated tokens")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", default="",
                   help="new-token counts (e.g. 16,64,256): the warm process also times one "
                        "call per count, a new cache each, and fits fixed + per-token time")
    p.add_argument("--out", type=Path, default=None, help="result folder (default: print only)")
    p.add_argument("--name", default="cold_start")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.calls = [int(x) for x in args.calls.split(",") if x.strip()]
    except ValueError:
        p.error(f"--calls must be comma-separated positive integers, got {args.calls!r}")
    if any(n < 1 for n in args.calls) or len(set(args.calls)) == 1 < len(args.calls):
        p.error(f"--calls must be distinct positive integers, got {args.calls}")
    for name in ("prompt", "new", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.child:
        print(json.dumps(child(args)))
        return
    from common import environment, write_results

    rows = [run_preset(args, preset) for preset in args.presets.split(",")]
    if args.out is None:
        return
    notes = [(f"model: {args.model} configuration, random weights, batch {args.batch}, a "
              f"{args.prompt}-token prompt and {args.new} new tokens, greedy `generate()`"),
             ("first: the first call in a fresh process; again: the best of two more calls in "
              "the cold process, each with a new cache (kvbits captures its per-layer step "
              "graphs per cache), so one short call, not decode throughput; cold: Triton's "
              "cache directory empty, warm: filled by the cold process; process: the child's "
              "wall time (imports, model construction, three calls)"),
             "kernels: files of compiled kernels the cold process wrote to the cache"]
    if len(args.calls) > 1:
        notes.append(f"fixed s, ms/token: the warm process times one call at each of "
                     f"{args.calls} new tokens (best of 3, a new cache each) and fits "
                     "seconds = fixed + new x per-token (the prompt's prefill is in fixed)")
    columns = [("preset", "preset"), ("cold_first_s", "cold first s"),
               ("warm_first_s", "warm first s"), ("cold_again_s", "again s"),
               ("kernels_compiled", "kernels"), ("cold_process_s", "cold process s"),
               ("warm_process_s", "warm process s")]
    if len(args.calls) > 1:
        columns += [("fixed_s", "fixed s"), ("per_token_ms", "ms/token")]
    write_results(args.name, rows, columns, environment(), notes, out_dir=args.out)


if __name__ == "__main__":
    main()
