"""Tables of benchmarks/results/kvquant_offline_range.md from the probe's JSON files
(``kvquant_offline_range_<name>.json``); writes the .md tables section and the combined .json.

    python benchmarks/probes/kvquant_offline_range_report.py
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

R = Path("benchmarks/results")
GROUPS = [  # (title, run names in order)
    ("gemma3-270m on lee-news, 2048 tokens", ["gemma3_lee_news_repro", "gemma3_lee_news_rules",
                                              "gemma3_lee_news_rules2",
                                              "gemma3_lee_news_layers",
                                              "gemma3_lee_news_layers2"]),
    ("gemma3-270m on lee-news, 2048 tokens, 4 bits", ["gemma3_lee_news_repro",
                                                     "gemma3_lee_news_4bit"]),
    ("gemma3-270m on sotu-2010-2016, 2048 tokens", ["gemma3_sotu"]),
    ("qwen2.5-0.5b on lee-news, 2048 tokens", ["qwen_lee_news", "qwen_lee_news_rules2"]),
    ("smollm2 on sotu-2010-2016, 1024 tokens", ["smollm2_sotu"]),
    ("smollm2 on lee-news, 4096 tokens", ["smollm2_lee_news"]),
    ("smollm2 on lee-news, 4096 tokens, 4 bits", ["smollm2_lee_news", "smollm2_lee_news_4bit"]),
]


def _quoted(cmd: str) -> str:
    """Commands recorded before the probe used shlex.join: re-quote --rules and --once."""
    if "'" in cmd:
        return cmd
    cmd = re.sub(r"--rules (.*?) --", lambda m: f"--rules {shlex.quote(m.group(1))} --", cmd)
    return cmd.replace("--once  --", "--once '' --")


def main():
    out, md = {"tables": []}, []
    for title, names in GROUPS:
        runs = [json.loads((R / f"kvquant_offline_range_{n}.json").read_text())
                for n in names if (R / f"kvquant_offline_range_{n}.json").exists()]
        if not runs:
            continue
        rows = [r for run in runs for r in run["rows"]]
        fp16 = next(r["ppl"] for r in rows if r["preset"] == "fp16")
        ref = {r["preset"]: r["ppl"] for r in rows if r["rule"] is None}
        rules = list(dict.fromkeys(r["rule"] for r in rows if r["rule"] is not None))
        by = {(r["rule"], r["preset"]): r["ppl"] for r in rows if r["rule"] is not None}
        presets = [p for p in ("kvquant-4-offline", "kvquant-3-offline", "kvquant-2-offline")
                   if any(k[1] == p for k in by)]
        if "4 bits" in title:
            presets = ["kvquant-4-offline"]
        elif "kvquant-4-offline" in presets:
            presets.remove("kvquant-4-offline")
        cur = {p: by.get(("q0.002", p)) for p in presets}
        md += [f"### {title}", "", "```"] + [_quoted(run["command"]) for run in runs] + ["```", ""]
        md += [f"FP16 {fp16:.3f}" + "".join(f"; {p} {v:.3f} ({100 * (v / fp16 - 1):+.2f}%)"
                                            for p, v in ref.items() if p != "fp16") + ".", ""]
        md += ["| rule | " + " | ".join(f"{p[8]}-bit PPL | vs fp16 | Δ vs q0.002" for p in presets)
               + " |", "|---|" + "---|---|---|" * len(presets)]
        table = []
        for rule in rules:
            cells = [rule]
            row = {"rule": rule}
            if not any((rule, p) in by for p in presets):
                continue
            for p in presets:
                v = by.get((rule, p))
                if v is None:
                    cells += ["-", "-", "-"]
                    continue
                c = cur[p]
                cells += [f"{v:.3f}", f"{100 * (v / fp16 - 1):+.2f}%",
                          "-" if c is None or rule == "q0.002" else f"{100 * (v - c) / fp16:+.2f} pp"]
                row[p] = v
            md.append("| " + " | ".join(cells) + " |")
            table.append(row)
        md.append("")
        out["tables"].append({"title": title, "runs": names, "commands": [_quoted(r["command"]) for r in runs],
                              "fp16": fp16, "reference": ref, "rules": table})
    (R / "kvquant_offline_range_tables.md").write_text("\n".join(md) + "\n")
    diag = {}
    for f in sorted(R.glob("kvquant_offline_range_*diag_*.json")):
        diag[f.stem] = json.loads(f.read_text())
    out["diagnostics"] = diag
    (R / "kvquant_offline_range.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
