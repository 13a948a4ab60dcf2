"""Merge the end-to-end parts (``benchmarks/results/e2e_<part>.json``, written by
``benchmarks/e2e_gpu.sh``) into ``benchmarks/results/e2e.json`` and ``e2e.md``.

The Markdown keeps each part's generated tables as they are and adds what the parts cannot say
alone: which runs they came from and the caveats measured across them.

    python benchmarks/e2e_merge.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ["e2e_llama3_8b", "e2e_llama2_7b", "e2e_budget_llama2_7b", "e2e_budget32k_llama2_7b",
         "e2e_smollm2"]
CAVEATS = [
    "Batch-1 rows are host-bound: HF eager `generate` spends ~30 ms per step on the host for a "
    "30-32-layer model (~60 ms with the FP16 path, next item), and step times vary by +-30% "
    "between runs on the shared GPU host.",
    "The FP16 rows use transformers' SDPA attention with torch's default backend, which is cuDNN "
    "on the H200 (torch 2.11): its forward costs ~1 ms of host time per call, i.e. ~30 ms per "
    "step at batch 1, against ~6 us of GPU time (`e2e_host_profile.log`). That host cost, not "
    "attention bandwidth, is most of kvbits' batch-1 lead over FP16 (~2x). `hf-int2` runs "
    "the same transformers SDPA path at ~31-39 ms per step at 1-4k, kvbits at 27-33 ms: at "
    "batch 1 both are host-bound, and kvbits' attention is not what sets its step time. Every part runs one short untimed generate per variant first (one-time costs).",
    "FP16 `DynamicCache` concatenates the whole history every step (transformers' behaviour), "
    "which is part of why FP16 slows down at large batch x context.",
    "`hf-int2`: transformers' `QuantizedLayer.update` over an emulated quanto storage (optimum-"
    "quanto is not installed on the GPU machine).",
]


def main() -> None:
    merged, md = {}, ["# End-to-end decode (all parts)", "", "Caveats measured across the parts:", ""]
    md += [f"- {c}" for c in CAVEATS] + [""]
    for name in PARTS:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        merged[name] = json.loads(path.read_text())
        part_md = RESULTS / f"{name}.md"
        if part_md.exists():
            text = part_md.read_text().replace("\n# ", "\n## ").replace("\n## ", "\n### ")
            md += ["---", "", text.replace("# End-to-end", "## End-to-end", 1), ""]
        else:
            md += ["---", "", f"## {name}", "", f"(only `{name}.json`: the run timed out before "
                   "writing its table; rows below are what it measured)", ""]
            for r in merged[name].get("speed", []):
                md.append(f"- {r.get('variant')} batch {r.get('batch')} context "
                          f"{r.get('context')}: {r.get('tok_s', float('nan')):.1f} tok/s, TPOT {r.get('tpot_ms', float('nan')):.1f} ms")
            md.append("")
    (RESULTS / "e2e.json").write_text(json.dumps({"caveats": CAVEATS, "parts": merged}, indent=1))
    (RESULTS / "e2e.md").write_text("\n".join(md) + "\n")
    print(f"wrote {RESULTS / 'e2e.json'} and e2e.md ({len(merged)} parts)")


if __name__ == "__main__":
    main()
