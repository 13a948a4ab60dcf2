"""Add effective bits per element to benchmarks/results/ppl_methods.{json,md}.

* ``bits/elem (cache)``: every byte the cache held at the end of the window (codes, FP16
  scales/zeros, outliers, codebooks, FP16 sink and residual, as an FP16 model would hold them)
  per K/V element: ``16 * cache_bytes_fp16 / fp16_cache_bytes``.
* ``bits/elem (body)``: the marginal cost of a token once quantized (codes + scales/zeros +
  outliers), ``8 * body_bytes_per_token / (2 * head_dim)``; for transformers' QuantizedCache the
  codes + quanto's per-group (G=64) FP16 scale and zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvbits.eval.memory import markdown_table  # noqa: E402
from kvbits.formats.layout import body_bytes_per_token  # noqa: E402
from kvbits.spec import QuantSpec  # noqa: E402

HEAD_DIM = 64  # SmolLM2
ROOT = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def body_bits(r: dict) -> str:
    f = r.get("spec_fields", {})
    if r["kind"] != "kvbits":
        bits = f.get("nbits")
        if bits is None:
            return "-"
        return f"{bits + 2 * 16 / int(f.get('q_group_size') or 64):.2f}"
    spec = QuantSpec(**f)
    if not spec.quantized:
        return "16.00"
    b = body_bytes_per_token(HEAD_DIM, spec.key_bits, spec.value_bits, spec.group_size,
                             spec.value_group(HEAD_DIM), spec.n_outliers(HEAD_DIM))
    return f"{8 * b / (2 * HEAD_DIM):.2f}"


def main() -> None:
    data = json.loads((ROOT / "ppl_methods.json").read_text())
    res = data["results"]
    base = next(r for r in res if r["label"] == "fp16")
    rows = []
    for r in res:
        r["bits_per_element_cache"] = 16 * r["cache_bytes_fp16"] / r["fp16_cache_bytes"]
        r["bits_per_element_body"] = body_bits(r)
        rows.append([r["label"], r["spec"], f"{r['ppl']:.3f}",
                     f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%",
                     f"{r['bits_per_element_cache']:.2f}", r["bits_per_element_body"],
                     f"{r['seconds']:.0f}"])
    (ROOT / "ppl_methods.json").write_text(json.dumps(data, indent=1) + "\n")
    head = ["variant", "spec", "PPL", "vs fp16", "bits/elem (cache)", "bits/elem (body)", "s"]
    md = (ROOT / "ppl_methods.md").read_text()
    table = markdown_table(head, rows)
    marker = "\n## With effective bits per element\n"
    md = md.split(marker)[0].rstrip() + "\n" + marker + "\n" + table + "\n\n" + __doc__.split(
        "\n\n", 1)[1]
    (ROOT / "ppl_methods.md").write_text(md)
    print(table)


if __name__ == "__main__":
    main()
