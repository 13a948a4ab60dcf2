"""KVQuant against KIVI at equal effective bits, from perplexity tables already measured.

Reads ``benchmarks/results/NAME.json`` (``kvbits ppl`` output) for each NAME given (default: the
news-text and SOTU tables of all three models, and the
per-head-codebook news tables) and writes ``ppl_frontier.{md,json,png}`` there:
per table, each kvquant row against KIVI's Pareto front interpolated at its bits
(``kvbits.eval.frontier``), and a plot of perplexity against bits per element. ``A+B`` reads
table A with the rows of its companion B (same model, text and tokens) added.

    python benchmarks/ppl_frontier.py [--out STEM] [NAME ...]

``--out``: write ``STEM.{md,json,png}`` instead of ``ppl_frontier.*`` (a table of its own).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvbits.eval.frontier import compare_at_equal_bits, pareto_front, points_of
from kvbits.eval.memory import markdown_table

RESULTS = Path(__file__).resolve().parent / "results"
# The news tables and SmolLM2's SOTU table with their 64-token-group companions
# (benchmarks/ppl_group64.sh): KIVI's front then includes kivi-N:G=64 (with and without a sink).
DEFAULT = ("ppl_lee_news+ppl_group64_lee_news", "ppl_lee_news_qwen+ppl_group64_lee_news_qwen",
           "ppl_lee_news_gemma3+ppl_group64_lee_news_gemma3",
           "ppl_methods+ppl_group64_methods",
           "ppl_methods_qwen", "ppl_methods_gemma3", "ppl_kvquant_dense_post",
           "ppl_kvquant_dense_post_qwen", "ppl_kvquant_dense_post_gemma3",
           "ppl_lee_news_cb_head", "ppl_lee_news_qwen_cb_head", "ppl_methods_cb_head",
           "ppl_methods_qwen_cb_head")


def _pct(x: float | None, base: float) -> str:
    return "-" if x is None else f"{100 * (x / base - 1):+.2f}%"


def _interval(row: dict) -> str:
    ci = row.get("gap_ci")
    if ci is None:
        return "-"
    text = f"[{100 * ci[0]:+.2f}%, {100 * ci[1]:+.2f}%]"
    return text if row["gap"] is not None else f"{text} vs {row['ci_against'][0]}"


def _results(name: str) -> tuple[dict, list]:
    """A table's document and rows; ``A+B``: A's rows, then B's rows of labels A lacks (a
    companion table of the same model, text and tokens, e.g. ``ppl_group64_*``)."""
    parts = name.split("+")
    doc = json.loads((RESULTS / f"{parts[0]}.json").read_text())
    res = list(doc["results"])
    for extra in parts[1:]:
        other = json.loads((RESULTS / f"{extra}.json").read_text())
        for k in ("model", "text", "tokens"):
            if other[k] != doc[k]:
                raise ValueError(f"{extra}: {k} {other[k]!r} differs from {parts[0]}'s {doc[k]!r}")
        seen = {r["label"] for r in res}
        res += [r for r in other["results"] if r["label"] not in seen]
    for r in res[1:]:  # the rows must have scored the same tokens and count bits alike
        for k in ("window", "stride", "chunk_size", "tokens_scored"):
            if r.get(k) != res[0].get(k):
                raise ValueError(f"{name}: row {r['label']!r} has {k} {r.get(k)!r}, "
                                 f"{res[0]['label']!r} {res[0].get(k)!r}")
        if ("cache_elements" in r) != ("cache_elements" in res[0]):
            raise ValueError(f"{name}: rows {r['label']!r} and {res[0]['label']!r} count bits "
                             "per element differently (one records cache_elements): give "
                             "tables written by the same kvbits")
    return doc, res


def analyse(name: str) -> dict:
    doc, res = _results(name)
    fp16 = next(r["ppl"] for r in res if r["label"] == "fp16")
    kivi = points_of(res, "kivi")
    rows = compare_at_equal_bits(points_of(res, "kvquant"), kivi)
    return {"name": name, "model": doc["model"], "text": doc["text"], "tokens": doc["tokens"],
            "command": doc["command"], "fp16_ppl": fp16, "rows": rows,
            "kivi": [{"label": p.label, "bits": p.bits, "ppl": p.ppl} for p in kivi],
            "kivi_front": [p.label for p in pareto_front(kivi)]}


def markdown(tables: list[dict], out: str = "ppl_frontier") -> str:
    flag = "" if out == "ppl_frontier" else f"--out {out} "
    lines = ["# KVQuant against KIVI at equal effective bits", "",
             "```", f"python benchmarks/ppl_frontier.py {flag}"
             + " ".join(t["name"] for t in tables), "```", "",
             ("Perplexities are the measured rows of each table (command beside it); nothing is "
              "re-run. Bits per element count every byte the cache holds (codes, FP16 "
              "scales/zeros, outliers, codebooks, FP16 sink and residual). \"kivi at these "
              "bits\" interpolates KIVI's Pareto front (its presets and sink variants in the same "
              "table) linearly in log perplexity; outside the front's range a row is judged only "
              "where one side dominates (`kvbits.eval.frontier`). \"95% interval\": of the gap "
              "(outside the front's range: of the perplexity over the KIVI point named: the one "
              "that dominates the row or, past the front's end, its best point), by a paired "
              "bootstrap over blocks of 16 scored tokens (tables that record them); a "
              "difference whose interval holds zero is a tie."), ""]
    for t in tables:
        lines += [f"## {t['model']} on {t['text']}, {t['tokens']} tokens ({t['name']})", "",
                  f"FP16 {t['fp16_ppl']:.3f}; KIVI's front: {', '.join(t['kivi_front'])}.", ""]
        body = [[r["label"], f"{r['bits']:.2f}", _pct(r["ppl"], t["fp16_ppl"]),
                 _pct(r["reference_ppl"], t["fp16_ppl"]),
                 "-" if r["gap"] is None else f"{100 * r['gap']:+.2f}%", _interval(r),
                 r["verdict"]]
                for r in t["rows"]]
        lines += [markdown_table(["kvquant preset", "bits/elem", "vs fp16",
                                  "kivi at these bits", "gap", "95% interval", "verdict"], body),
                  ""]
    return "\n".join(lines)


def plot(tables: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cols = min(3, len(tables))
    rows = -(-len(tables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False,
                             constrained_layout=True)
    for ax, t in zip(axes.flat, tables):
        base = t["fp16_ppl"]
        kivi = sorted(t["kivi"], key=lambda p: p["bits"])
        front = [p for p in kivi if p["label"] in t["kivi_front"]]
        ax.plot([p["bits"] for p in front], [100 * (p["ppl"] / base - 1) for p in front],
                "-", color="tab:blue", alpha=0.6, label="kivi front")
        ax.plot([p["bits"] for p in kivi], [100 * (p["ppl"] / base - 1) for p in kivi], "o",
                color="tab:blue", label="kivi")
        for head, marker, label in ((False, "s", "kvquant"),
                                    (True, "^", "kvquant, codebook per head")):
            rows = [r for r in t["rows"] if ("codebook=head" in r["label"]) == head]
            if not rows:  # (an empty series still took a legend entry)
                continue
            ax.plot([r["bits"] for r in rows], [100 * (r["ppl"] / base - 1) for r in rows],
                    marker, color="tab:red" if not head else "tab:orange", label=label)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_title(f"{t['model']}, {t['text']}, {t['tokens']} tok", fontsize=9)
        ax.set_xlabel("bits per element (whole cache)")
        ax.set_ylabel("perplexity vs FP16 (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tables):]:
        ax.axis("off")
    axes.flat[-1 - (len(axes.flat) - len(tables))].legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help="tables benchmarks/results/NAME.json (A+B: A with its companion B's rows); "
                         "default: the news, SOTU and per-head-codebook tables of all three models")
    ap.add_argument("--out", default="ppl_frontier", metavar="STEM",
                    help="write results/STEM.{md,json,png} (default ppl_frontier)")
    args = ap.parse_args()
    if not args.names:  # the defaults that exist here
        names = [n for n in DEFAULT
                 if all((RESULTS / f"{part}.json").exists() for part in n.split("+"))]
    else:
        names = args.names
        missing = [f"{part}.json" for n in names for part in n.split("+")
                   if not (RESULTS / f"{part}.json").exists()]
        if missing:  # (before anything is written: a typo rewrote the committed table)
            ap.error(f"no such table in {RESULTS}: {', '.join(missing)}")
    if not names:
        ap.error(f"none of the default tables is in {RESULTS}")
    tables = [analyse(n) for n in names]
    (RESULTS / f"{args.out}.json").write_text(json.dumps(tables, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(tables, args.out))
    plot(tables, RESULTS / f"{args.out}.png")
    print(markdown(tables, args.out))


if __name__ == "__main__":
    main()
