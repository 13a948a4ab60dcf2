"""Add effective bits per element to benchmarks/results/ppl_methods.{json,md} (or to the
benchmarks/results/NAME.{json,md} named on the command line, e.g. ppl_methods_qwen).

* ``bits/elem (cache)``: every byte the cache held at the end of the window (codes, FP16
  scales/zeros, outliers, codebooks, FP16 sink and residual, as an FP16 model would hold them)
  per K/V element the cache held (``kvbits.eval.frontier.effective_bits``: ``8 *
  cache_bytes_fp16 / cache_elements``; rows from before session 59 divide by an FP16
  ``DynamicCache``'s elements, ``16 * cache_bytes_fp16 / fp16_cache_bytes``, which on Gemma3's
  sliding layers counts the tokens a kvbits cache keeps longer as bits).
* ``bits/elem (body)``: the marginal cost of a token once quantized (codes + scales/zeros +
  outliers), ``8 * body_bytes_per_token / (2 * head_dim)``; for transformers' QuantizedCache the
  codes + quanto's per-group (G=64) FP16 scale and zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvbits.eval.frontier import effective_bits  # noqa: E402
from kvbits.eval.memory import markdown_table  # noqa: E402
from kvbits.formats.layout import body_bytes_per_token  # noqa: E402
from kvbits.spec import QuantSpec  # noqa: E402

HEAD_DIMS = {"smollm2": 64, "qwen2.5-0.5b": 64, "gemma3-270m": 256}
ROOT = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def body_bits(r: dict, head_dim: int) -> str:
    f = r.get("spec_fields", {})
    if r["kind"] != "kvbits":
        bits = f.get("nbits")
        if bits is None:
            return "-"
        return f"{bits + 2 * 16 / int(f.get('q_group_size') or 64):.2f}"
    f = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list)
         else v for k, v in f.items()}  # JSON lists back to the spec's tuples
    spec = QuantSpec(**f)
    if not spec.quantized:
        return "16.00"
    b = body_bytes_per_token(head_dim, spec.key_bits, spec.value_bits, spec.group_size,
                             spec.value_group(head_dim), spec.n_outliers(head_dim),
                             key_axis=spec.key_axis, value_axis=spec.value_axis,
                             fp8=spec.method == "fp8")
    return f"{8 * b / (2 * head_dim):.2f}"


def main() -> None:
    for name in sys.argv[1:] or ["ppl_methods"]:
        add_bits(name)


def add_bits(name: str) -> None:
    data = json.loads((ROOT / f"{name}.json").read_text())
    head_dim = HEAD_DIMS[data["model"]]
    res = data["results"]
    base = next(r for r in res if r["label"] == "fp16")
    rows = []
    for r in res:
        r["bits_per_element_cache"] = effective_bits(r)
        r["bits_per_element_body"] = body_bits(r, head_dim)
        rows.append([r["label"], r["spec"], f"{r['ppl']:.3f}",
                     f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%",
                     f"{r['bits_per_element_cache']:.2f}", r["bits_per_element_body"],
                     f"{r['seconds']:.0f}"])
    (ROOT / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    head = ["variant", "spec", "PPL", "vs fp16", "bits/elem (cache)", "bits/elem (body)", "s"]
    md = (ROOT / f"{name}.md").read_text()
    table = markdown_table(head, rows)
    marker = "\n## With effective bits per element\n"
    md = md.split(marker)[0].rstrip() + "\n" + marker + "\n" + table + "\n\n" + __doc__.split(
        "\n\n", 1)[1]
    (ROOT / f"{name}.md").write_text(md)
    print(table)


if __name__ == "__main__":
    main()
