"""Renders ``benchmarks/results/outlier_rule.{json,md}`` (session 57) from the JSON written by
``outlier_rule_ppl.py`` (perplexity per rule) and ``needle_outlier_rule.py`` (passkeys per rule).

    python benchmarks/probes/outlier_rule_report.py --ppl A.json B.json ... \
        --needle seed6=X.json,Y.json seed8=Z.json

``--base outlier_rule.json`` starts from the inputs a previous rendering kept (its perplexity
runs and passkey rows), so a later draw is added without the earlier JSON files; ``--note``
appends a sentence to the passkey section (what the added draw is).
"""

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch
import transformers

OUT = Path(__file__).resolve().parents[1] / "results"
RULES = {"mad": "|x - median| / MAD, both sides (before session 57)",
         "abs": "|x - median| for keys, / MAD for values (kvbits since session 57)",
         "abs2": "|x - median| for both",
         "none": "no outliers (kvquant-3:O=0)", "koff": "no key outliers (values MAD)",
         "voff": "no value outliers (keys MAD)"}


def needle_counts(rows: list[dict]) -> dict:
    """Per rule: hits (smallest key-token margin > 0), lost / won against FP16, mean margin and
    log-probability change."""
    out = {}
    rules = [k for k in rows[0] if k not in ("trial", "length", "depth", "key")]
    for v in rules:
        hit = [r[v][1] > 0 for r in rows]
        base = [r["fp16"][1] > 0 for r in rows]
        out[v] = {"trials": len(rows), "hits": sum(hit),
                  "lost": sum(b and not h for h, b in zip(hit, base)),
                  "won": sum(h and not b for h, b in zip(hit, base)),
                  "mean_dmargin": sum(r[v][1] - r["fp16"][1] for r in rows) / len(rows),
                  "mean_abs_dmargin": sum(abs(r[v][1] - r["fp16"][1]) for r in rows) / len(rows),
                  "mean_dlogp": sum(r[v][0] - r["fp16"][0] for r in rows) / len(rows)}
    return out


def merge_needle(paths: list[str]) -> list[dict]:
    """Rows of several runs over the same draw, joined per (trial, length, depth)."""
    merged: dict = {}
    for p in paths:
        for r in json.loads(Path(p).read_text()):
            merged.setdefault((r["trial"], r["length"], r["depth"]), {}).update(r)
    return list(merged.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ppl", nargs="+", default=[])
    ap.add_argument("--needle", nargs="+", default=[])
    ap.add_argument("--base", help="a previous outlier_rule.json: its inputs come first")
    ap.add_argument("--note", default="", help="a sentence appended to the passkey section")
    args = ap.parse_args()
    base = json.loads(Path(args.base).read_text()) if args.base else {"ppl": [], "needle": {}}
    ppl = base["ppl"] + [json.loads(Path(p).read_text()) for p in args.ppl]
    needle = dict(base["needle"])
    for item in args.needle:
        name, _, paths = item.partition("=")
        needle[name] = merge_needle(paths.split(","))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=OUT, check=False).stdout.strip()
    meta = {"device": "cpu", "threads": 2, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "git": git}
    lines = ["# Which elements become KVQuant's outliers: the rule, measured (sessions 57-58)", "",
             ("Each rule with codebooks refitted under it (in memory, SOTU 1900-1999, 2048 tokens "
              "for perplexity and 4096 for the passkeys, as `kvbits ppl` / `kvbits needle` "
              "calibrate), everything else kvquant-N as shipped (G=32, R=128, one sink, pre-RoPE "
              "keys, 1% outliers). Rules:"), ""]
    lines += [f"- `{k}`: {v}" for k, v in RULES.items()]
    lines += ["", (f"CPU, 2 threads, python {meta['python']}, torch {meta['torch']}, transformers "
                   f"{meta['transformers']}; rendered at {git}. Commands: "
                   "`benchmarks/probes/outlier_rule_ppl.py --model M --text T --tokens N "
                   "--presets kvquant-3,kvquant-2,kvquant-4 --rules R` and `benchmarks/probes/"
                   "needle_outlier_rule.py --seed S --rules R`."), "",
              "## Perplexity against FP16", ""]
    table: dict = {}
    for run in ppl:
        a = run["args"]
        for r in run["rows"]:
            if r["preset"] != "fp16":
                table.setdefault((a["model"], a["text"], a["tokens"], r["preset"]), {})[
                    r["rule"]] = r["vs_fp16"]
    ppl_rules = [k for k in RULES if any(k in got for got in table.values())]
    lines += ["| model / text | tokens | preset | " + " | ".join(ppl_rules) + " |",
              "|---|---|---|" + "---|" * len(ppl_rules)]
    for (model, text, tokens, preset), got in table.items():
        cells = [f"{100 * got[k]:+.2f}%" if k in got else "-" for k in ppl_rules]
        lines.append(f"| {model} / {text} | {tokens} | {preset} | " + " | ".join(cells) + " |")
    lines += ["", "Summed over the rows: " + ", ".join(
        f"{k} {100 * sum(got.get(k, 0.0) for got in table.values()):+.2f} points"
        for k in ppl_rules) + "."]
    counts = {name: needle_counts(rows) for name, rows in needle.items()}
    lines += ["", "## Passkeys (kvquant-3), against FP16", "",
              ("Every trial of a `kvbits needle` draw: Gemma3-270M `--trials 4 --seed S` (1k-8k "
               "tokens, depths 0-100%), SmolLM2 `--lengths 1k,2k --trials 6 --seed 2` (the draw "
               "of `needle_key_bits.md`); the document prefilled in FP16 and copied into "
               "each cache. A hit: the key's tokens, teacher-forced after the question, each "
               "win the argmax (smallest margin > 0; on seed 6 this agrees with the harness's "
               "greedy answers in 79 of 80 FP16 trials and 79 of 80 kvquant-3 ones, the misses "
               "answering \"the 53985.\"). Margin: that smallest logit margin minus FP16's."
               + (" " + args.note if args.note else "")), "",
              "| draw | rule | hits | lost | won | mean margin change | mean abs margin change |",
              "|---|---|---|---|---|---|---|"]
    for name, c in counts.items():
        for v, x in c.items():
            if v == "fp16":
                continue
            lines.append(f"| {name} | {v} | {x['hits']} / {x['trials']} (FP16 "
                         f"{c['fp16']['hits']}) | {x['lost']} | {x['won']} | "
                         f"{x['mean_dmargin']:+.3f} | {x['mean_abs_dmargin']:.3f} |")
    total = {}
    for c in counts.values():
        for v, x in c.items():
            t = total.setdefault(v, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + x["lost"], t[1] + x["won"], t[2] + x["trials"]
    lines += ["", "Over the draws, lost / won against FP16: " + ", ".join(
        f"{v} {t[0]} / {t[1]} of {t[2]}" for v, t in total.items() if v != "fp16") + "."]
    OUT.joinpath("outlier_rule.md").write_text("\n".join(lines) + "\n")
    OUT.joinpath("outlier_rule.json").write_text(json.dumps(
        {"meta": meta, "ppl": ppl, "needle": needle, "needle_counts": counts}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
