"""Merge benchmarks/results/ppl_breadth_*.json (and the fp16 / kivi baselines of ppl_methods.json,
same model, text, tokens and chunks) into ppl_breadth.{md,json}."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PARTS = ("hadamard", "uniform", "fp8", "tune", "qwen", "gemma3")
BASELINES = ("fp16", "kivi-4", "kivi-3", "kivi-2")


def main() -> None:
    rows, meta = [], {}
    methods = RESULTS / "ppl_methods.json"
    if methods.exists():
        doc = json.loads(methods.read_text())
        rows += [dict(r, part="baseline (ppl_methods)") for r in doc["results"]
                 if r["label"] in BASELINES]
    for part in PARTS:
        path = RESULTS / f"ppl_breadth_{part}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            meta = meta or {k: doc[k] for k in ("model", "text", "tokens", "chunk", "versions")}
            rows += [dict(r, part=part, model=doc["model"], command=doc["command"])
                     for r in doc["results"]]
    for r in rows:
        r.setdefault("model", meta.get("model"))
    bases = {r["model"]: r for r in rows if r["label"] == "fp16"}
    head = "| model | part | variant | spec | PPL | vs fp16 | KV MiB | KV vs FP16 |"
    lines = [f"# Method breadth, perplexity through the cache on {meta.get('text')}", "",
             f"{meta.get('tokens')} tokens, chunks of {meta.get('chunk')}, torch "
             f"{meta.get('versions', {}).get('torch')}, transformers "
             f"{meta.get('versions', {}).get('transformers')}. Commands: "
             "`benchmarks/ppl_breadth.sh` (one `kvbits ppl` per part, files "
             "`ppl_breadth_PART.{md,json}`), baselines from `ppl_methods.json`.", "",
             head, "|" + "---|" * 8]
    for r in rows:
        base = bases.get(r["model"])
        delta = f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if base else ""
        lines.append(f"| {r['model']} | {r['part']} | {r['label']} | {r['spec']} | {r['ppl']:.3f} | {delta} | "
                     f"{r['cache_bytes_fp16'] / 2**20:.2f} | "
                     f"{r['fp16_cache_bytes'] / r['cache_bytes_fp16']:.2f}x |")
    lines += ["", "KV MiB: cache at the end of the first window as an FP16 model would hold it; "
              "HF rows are transformers' QuantizedCache (it re-quantizes the dequantized history "
              "whenever its residual fills, and attends a chunk's own keys in full precision).",
              ""]
    (RESULTS / "ppl_breadth.md").write_text("\n".join(lines))
    (RESULTS / "ppl_breadth.json").write_text(json.dumps({**meta, "results": rows}, indent=1)
                                              + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
