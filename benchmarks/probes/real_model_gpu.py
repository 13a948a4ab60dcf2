"""The GPU kernels on a real model (session 54): SmolLM2-135M (real weights, float16 and
bfloat16 on the GPU), every preset's perplexity through the cache on held-out SOTU text with

- ``kernels``: the library's own dispatch (the Triton kernel at these sizes, the Gluon body
  where its size threshold is met),
- ``gluon``: the same with the Gluon bodies' size thresholds set to 0, so that every layer the
  Gluon body can serve takes it,
- ``reference``: ``KVBITS_KERNELS=reference``, the PyTorch reference on the same GPU and model,

in one process, plus token-by-token scoring (``chunk=1``: each token one decode step, through
the step graphs) and greedy ``generate()`` with kernels against the reference. Until now every
accuracy table came from the CPU reference and the kernels were checked against it on random
tensors only; this compares them on the model's own queries, keys and values.

    KVBITS_CACHE=DIR python benchmarks/probes/real_model_gpu.py --out DIR

(``DIR`` of the cache holding the SmolLM2 GGUF and the SOTU texts: the GPU machine has no
network.) Writes ``real_model_gpu.json`` / ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

PRESETS = ("fp16,kivi-4,kivi-3,kivi-2,k4v2,kivi-2:S=1,kvquant-4,kvquant-3,kvquant-2,"
           "kvquant-3-dense-post,kvquant-3-offline,uniform,uniform-int2,uniform-int4,fp8,"
           "fp8-dynamic,kivi-2-had,kivi-2-hadc")
STEP_PRESETS = "fp16,kivi-2,kivi-4,kvquant-3,uniform-int4,fp8-dynamic,kivi-2-hadc"
GEN_PRESETS = "kivi-2,kivi-4,kvquant-3,uniform-int4,fp8-dynamic"
BF16_PRESETS = "kivi-2,kivi-4,kvquant-3,uniform-int4"


def log(msg: str) -> None:
    print(f"[real_model_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def force_gluon(on: bool, saved: dict = {}) -> None:  # noqa: B006 (the saved thresholds)
    """Set the Gluon bodies' size thresholds to 0 (``on``) or back."""
    from kvbits.kernels import decode_gluon as g

    names = ("MIN_BODY_TOKENS", "MIN_BODY_TOKENS_PLANES", "MIN_BODY_TOKENS_WIDE")
    if not saved:
        saved.update({n: getattr(g, n) for n in names})
    for n in names:
        setattr(g, n, 0 if on else saved[n])


def set_mode(mode: str) -> None:
    os.environ["KVBITS_KERNELS"] = "reference" if mode == "reference" else "auto"
    force_gluon(mode == "gluon")


def ppl_rows(model, ids, variants, factories, modes, chunk: int) -> list[dict]:
    from kvbits.eval.perplexity import perplexity

    rows = []
    for v in variants:
        row = {"preset": v.label, "chunk": chunk}
        for mode in modes:
            set_mode(mode)
            try:
                r = perplexity(model, ids, factories[v.label], chunk_size=chunk, progress=False)
                row[mode] = r["ppl"]
                row[mode + "_s"] = round(r["seconds"], 2)
            except Exception as exc:  # noqa: BLE001 (a failure is a finding: report it, go on)
                traceback.print_exc()
                row[mode] = None
                row[mode + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        ref = row.get("reference")
        for mode in modes:
            if mode != "reference" and ref and row.get(mode):
                row[mode + "_vs_ref"] = row[mode] / ref - 1
        log(json.dumps(row))
        rows.append(row)
    set_mode("kernels")
    return rows


def gen_rows(model, tok, ids, variants, factories, new_tokens: int) -> list[dict]:
    rows = []
    prompt = ids[:, :1000].to(model.device)
    for v in variants:
        outs = {}
        for mode in ("kernels", "reference"):
            set_mode(mode)
            try:
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                     past_key_values=factories[v.label](), do_sample=False,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     pad_token_id=tok.eos_token_id)
                outs[mode] = out[0, prompt.shape[1]:].tolist()
            except Exception as exc:  # noqa: BLE001 (as above)
                traceback.print_exc()
                outs[mode] = f"{type(exc).__name__}: {exc}"[:300]
        a, b = outs["kernels"], outs["reference"]
        row = {"preset": v.label}
        if isinstance(a, list) and isinstance(b, list):
            lead = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            row.update(tokens=len(a), leading_equal=lead,
                       equal=sum(x == y for x, y in zip(a, b)),
                       text_kernels=tok.decode(a[:40]), text_reference=tok.decode(b[:40]))
        else:
            row.update(error=str(a if not isinstance(a, list) else b))
        log(json.dumps(row))
        rows.append(row)
    set_mode("kernels")
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--step-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--presets", default=PRESETS)
    p.add_argument("--parts", default="ppl,step,gen,bf16")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from kvbits.cli import make_cache_factory, parse_presets
    from kvbits.data import load_model, load_text, tokenize_text

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a smoke test of this script)
    parts = args.parts.split(",")
    result = {"command": " ".join([sys.executable, *sys.argv]), "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "versions": {"torch": torch.__version__,
                           "triton": __import__("triton").__version__,
                           "transformers": __import__("transformers").__version__,
                           "python": platform.python_version()},
              "model": "smollm2", "text": "sotu-2010-2016", "calib_text": "sotu-pre-2000",
              "tokens": args.tokens, "calib_tokens": args.calib_tokens}

    def write() -> None:
        (out / "real_model_gpu.json").write_text(json.dumps(result, indent=1) + "\n")

    for dtype_name in ("float16", "bfloat16"):
        if dtype_name == "bfloat16" and "bf16" not in parts:
            continue
        dtype = getattr(torch, dtype_name)
        t0 = time.perf_counter()
        model, tok = load_model("smollm2", dtype=dtype, device=dev, log=log)
        log(f"model {dtype_name} ready in {time.perf_counter() - t0:.1f} s")
        text = load_text("sotu-2010-2016", log=log)
        ids = tokenize_text(tok, text, args.tokens)
        names = args.presets if dtype_name == "float16" else BF16_PRESETS
        variants = parse_presets(names)
        set_mode("kernels")
        factories = {}
        for v in variants:
            t0 = time.perf_counter()
            try:
                factories[v.label] = make_cache_factory(model, v, "sotu-pre-2000",
                                                        args.calib_tokens)
            except Exception:  # noqa: BLE001 (as above)
                traceback.print_exc()
                continue
            log(f"{v.label}: cache factory ready in {time.perf_counter() - t0:.1f} s")
        variants = [v for v in variants if v.label in factories]
        key = dtype_name
        if "ppl" in parts or dtype_name == "bfloat16":
            result[f"ppl_{key}"] = ppl_rows(model, ids, variants, factories,
                                            ("kernels", "gluon", "reference"), 256)
            write()
        if dtype_name == "float16" and "step" in parts:
            step = [v for v in variants if v.label in STEP_PRESETS.split(",")]
            result["step_float16"] = ppl_rows(model, ids[:, :args.step_tokens], step, factories,
                                              ("kernels", "reference"), 1)
            write()
        if dtype_name == "float16" and "gen" in parts:
            gen = [v for v in variants if v.label in GEN_PRESETS.split(",")]
            result["generate_float16"] = gen_rows(model, tok, ids, gen, factories,
                                                  args.new_tokens)
            write()
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    write()
    (out / "real_model_gpu.md").write_text(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = ["# The GPU kernels on a real model: SmolLM2-135M on held-out SOTU", "",
             "```", result["command"], "```", "",
             (f"{result['gpu']}, torch {result['versions']['torch']}, Triton "
              f"{result['versions']['triton']}, transformers {result['versions']['transformers']}; "
              f"{result['tokens']} tokens of {result['text']}, calibrated presets on "
              f"{result['calib_tokens']} tokens of {result['calib_text']}."), ""]

    def fmt(x, pct=False):
        if x is None:
            return "failed"
        return f"{100 * x:+.3f}%" if pct else f"{x:.3f}"

    for key, title in (("ppl_float16", "float16 model, chunks of 256"),
                       ("ppl_bfloat16", "bfloat16 model, chunks of 256"),
                       ("step_float16", "float16 model, token by token (decode steps)")):
        rows = result.get(key)
        if not rows:
            continue
        modes = [m for m in ("kernels", "gluon", "reference") if m in rows[0]]
        lines += [f"## Perplexity, {title}", "",
                  "| preset | " + " | ".join(modes) + " | " +
                  " | ".join(f"{m} vs reference" for m in modes if m != "reference") + " |",
                  "|---" * (2 * len(modes)) + "|"]
        for r in rows:
            lines.append(f"| {r['preset']} | " + " | ".join(fmt(r.get(m)) for m in modes) + " | "
                         + " | ".join(fmt(r.get(m + "_vs_ref"), True) for m in modes
                                      if m != "reference") + " |")
        lines.append("")
    rows = result.get("generate_float16")
    if rows:
        lines += ["## Greedy generate(), float16: kernels against the reference", "",
                  "| preset | new tokens | leading tokens equal | tokens equal |",
                  "|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['preset']} | failed: {r['error']} | | |")
            else:
                lines.append(f"| {r['preset']} | {r['tokens']} | {r['leading_equal']} | "
                             f"{r['equal']} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
