"""The README's decode-attention summary, computed from ``decode_attention.json``.

Reads a table written by ``benchmarks/decode_attention.py`` (no GPU needed) and prints Markdown:

* the headline table: a few shapes x the main presets, CUDA-graph µs of the library's call and
  its speedup over FP16 flash SDPA's own CUDA-graph time in the same run (and, in the FP16
  column, torch's default SDPA backend, eager);
* per preset, the range of graph speedups over the long rows (batch x context >= 256k tokens),
  per model: the chooser's "attention speed" column;
* the issues' speed targets checked against those rows (met / missed, with the numbers).

    python benchmarks/decode_headline.py [benchmarks/results/decode_attention.json] [--plot PNG]

``--plot`` also draws the headline shapes' graph speedups per preset (a PNG for the README).
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LONG = 256 * 1024  # batch x context of the "long rows" the targets speak of
HEADLINE_SHAPES = [("llama-2-7b", 32, 131072), ("llama-3-8b", 32, 32768),
                   ("llama-2-7b", 8, 32768), ("llama-3-8b", 8, 32768),
                   ("llama-3-8b", 8, 131072), ("llama-2-7b", 1, 32768),
                   ("llama-3-8b", 1, 131072)]
HEADLINE_PRESETS = ["kivi-2", "kivi-3", "kivi-4", "uniform-int4", "fp8-dynamic", "kvquant-3",
                    "kvquant-3-dense-post"]
# (issue, preset, least graph speedup over flash SDPA on every long row)
TARGETS = [(3, "kivi-2", 4.5), (3, "kivi-4", 3.0), (4, "kvquant-3", 3.0),
           (5, "uniform-int4", 3.0)]
BASELINES = {"hf_quantized (emulated)": "QuantizedCache path (emulated)",
             "seed_unfused": "seed design"}
BW_TARGET, BW_TARGET_PRESETS = 0.8, ("kivi-2", "kivi-4")  # issue 3: bytes over time, long rows
QC_TARGET = ("uniform-int4", 10.0, 32768)  # issue 5: >= 10x the QuantizedCache path at 32k
MODEL_NAMES = {"llama-2-7b": "Llama-2-7B", "llama-3-8b": "Llama-3-8B"}


def _ctx(t: int) -> str:
    return f"{t // 1024}k"


def _graph_speedup(flash: dict, row: dict) -> float:
    """FP16 flash SDPA's CUDA-graph time over the row's, both from the same run."""
    return flash["us_graph"] / row["us_graph"]


def _verdict(total: int, short: list[str]) -> str:
    """"met on all N" or "missed on K of N: ..." for a target checked over ``total`` rows."""
    return (f"met on all {total}" if not short else
            f"missed on {len(short)} of {total}: " + ", ".join(short))


def _graph_frac(row: dict) -> float | None:
    """The row's bytes over its CUDA-graph time as a fraction of the copy bandwidth. The table's
    ``frac_bw`` divides by the faster of the eager and graph timings; the graph speedups need the
    graph time's fraction (it differs where the eager median was the faster)."""
    f, us, ug = row.get("frac_bw"), row.get("us"), row.get("us_graph")
    if f is None or not ug:
        return None
    return f * min(us, ug) / ug if us else f


def _needs(need: float, speedup: float, frac_bw: float | None) -> str:
    """What a speedup target asks of a row's bytes: the fraction of the copy bandwidth at which
    the row would reach ``need`` (its time scaled to ``need``, its bytes unchanged), and the
    speedup its bytes allow at the whole copy bandwidth; empty without a bandwidth figure.
    ``speedup`` is a graph speedup, so ``frac_bw`` must be the graph time's (:func:`_graph_frac`)."""
    if not frac_bw:
        return ""
    return (f" (needs {frac_bw * need / speedup * 100:.0f}% of the copy bandwidth; "
            f"{speedup / frac_bw:.2f}x at 100%)")


def _ceiling_note(need: float, speedup: float, ceiling: float | None) -> str:
    """A missed row's ceiling (flash SDPA over a plain read of its bytes, timed the table's way):
    whether the target is beyond what the table can show, or the share of the ceiling reached."""
    if not ceiling:
        return ""
    if ceiling < need:
        return f"; ceiling {ceiling:.2f}x: beyond what this timing can show"
    return f"; ceiling {ceiling:.2f}x, {speedup / ceiling * 100:.0f}% of it reached"


def library_rows(rows: list[dict]) -> dict:
    """(model, batch, context, preset) -> the library's own row (the Gluon body where it serves,
    not the Triton-only comparison row)."""
    return {(r["model"], r["batch"], r["context"], r["preset"]): r for r in rows
            if r["provider"].startswith("kvbits") and "triton v4" not in r["provider"]}


def fp16_rows(rows: list[dict]) -> dict:
    """(model, batch, context) -> (flash row, default-backend row)."""
    out: dict = {}
    for r in rows:
        if r["preset"] == "fp16":
            key = (r["model"], r["batch"], r["context"])
            flash, default = out.get(key, (None, None))
            if "default" in r["provider"]:
                default = r
            else:
                flash = r
            out[key] = (flash, default)
    return out


def baseline_rows(rows: list[dict]) -> dict:
    """(model, batch, context, provider) -> the seed design's or the emulated QuantizedCache
    path's row (eager; measured on kivi-2's cache)."""
    return {(r["model"], r["batch"], r["context"], r["provider"]): r for r in rows
            if r["provider"] in BASELINES}


def headline(rows: list[dict]) -> str:
    lib, fp, base = library_rows(rows), fp16_rows(rows), baseline_rows(rows)
    head = (["shape (B, context)", "FP16 flash / default SDPA"] + HEADLINE_PRESETS
            + [f"{label}, eager (kivi-2 faster by)" for label in BASELINES.values()])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, b, t in HEADLINE_SHAPES:
        flash, default = fp.get((m, b, t), (None, None))
        if flash is None:
            continue
        cells = [f"{MODEL_NAMES.get(m, m)}, {b}, {_ctx(t)}",
                 f"{flash['us_graph']:.0f} / {default['us']:.0f}" if default else
                 f"{flash['us_graph']:.0f}"]
        for p in HEADLINE_PRESETS:
            r = lib.get((m, b, t, p))
            cells.append("-" if r is None or r.get("us_graph") is None else
                         f"{r['us_graph']:.0f} ({_graph_speedup(flash, r):.2f}x)")
        mine = lib.get((m, b, t, "kivi-2"))
        for provider in BASELINES:
            r = base.get((m, b, t, provider))
            cells.append("-" if r is None or mine is None else
                         f"{r['us']:.0f} ({r['us'] / mine['us']:.0f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_row_speedups(rows: list[dict]) -> dict:
    """preset -> model -> [(batch, context, graph speedup, fraction of copy bandwidth (the
    table's: the faster timing), the graph time's fraction of copy bandwidth, the row's ceiling
    (None in tables before session 64))]."""
    lib, fp = library_rows(rows), fp16_rows(rows)
    out: dict = {}
    for (m, b, t, p), r in sorted(lib.items()):
        flash = fp.get((m, b, t), (None, None))[0]
        if b * t < LONG or flash is None or r.get("us_graph") is None:
            continue
        out.setdefault(p, {}).setdefault(m, []).append(
            (b, t, _graph_speedup(flash, r), r.get("frac_bw"), _graph_frac(r), r.get("ceiling")))
    return out


def ranges(rows: list[dict]) -> str:
    sp = long_row_speedups(rows)
    models = sorted({m for per in sp.values() for m in per})
    lines = ["| preset | " + " | ".join(f"{MODEL_NAMES.get(m, m)}: graph speedup (of copy bw)"
                                        for m in models) + " |",
             "|---|" + "---|" * len(models)]
    for p, per in sp.items():
        cells = []
        for m in models:
            xs = per.get(m, [])
            if not xs:
                cells.append("-")
                continue
            s = [x[2] for x in xs]
            f = [x[3] for x in xs if x[3] is not None]
            bw = f" ({min(f) * 100:.0f}-{max(f) * 100:.0f}%)" if f else ""
            cells.append(f"{min(s):.2f}-{max(s):.2f}x{bw}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    sp = long_row_speedups(rows)
    lines = []
    for issue, p, need in TARGETS:
        xs = [(m, b, t, s, g, c) for m, per in sp.get(p, {}).items() for b, t, s, _, g, c in per]
        if not xs:
            lines.append(f"- issue {issue}, {p} >= {need}x on the long rows: not measured")
            continue
        short = [f"{MODEL_NAMES.get(m, m)} B{b} {_ctx(t)} {s:.2f}x{_needs(need, s, f)}"
                 f"{_ceiling_note(need, s, c)}" for m, b, t, s, f, c in xs if s < need]
        lines.append(f"- issue {issue}, {p} >= {need}x on the long rows: "
                     + _verdict(len(xs), short))
    for p in BW_TARGET_PRESETS:
        fr = [(m, b, t, f) for m, per in sp.get(p, {}).items() for b, t, _, f, _, _ in per
              if f is not None]
        if fr:
            low = [f"{MODEL_NAMES.get(m, m)} B{b} {_ctx(t)} {f * 100:.0f}%" for m, b, t, f in fr
                   if f < BW_TARGET]
            lines.append(f"- issue 3, {p} >= {BW_TARGET * 100:.0f}% of the copy bandwidth on the "
                         "long rows: " + _verdict(len(fr), low))
    lib, fp, base = library_rows(rows), fp16_rows(rows), baseline_rows(rows)
    p, need, ctx = QC_TARGET
    qc = [(m, b, r["us"] / lib[(m, b, t, p)]["us"])
          for (m, b, t, prov), r in sorted(base.items())
          if prov.startswith("hf_quantized") and t == ctx and (m, b, t, p) in lib]
    lines.append(f"- issue 5, {p} >= {need:.0f}x the QuantizedCache path (emulated) at "
                 f"{_ctx(ctx)}, eager: " + (", ".join(f"{MODEL_NAMES.get(m, m)} B{b} {x:.0f}x"
                                                      for m, b, x in qc) or "not measured")
                 + ("" if not qc else " (met)" if min(x for *_, x in qc) >= need else
                    " (missed)"))
    speedups = [(p, m, b, t, _graph_speedup(fp[(m, b, t)][0], r))
                for (m, b, t, p), r in sorted(lib.items())
                if t >= 4096 and (m, b, t) in fp and r.get("us_graph")]
    slower = [(p, f"{p} {MODEL_NAMES.get(m, m)} B{b} {_ctx(t)} {x:.2f}x")
              for p, m, b, t, x in speedups if x < 1.0]
    for issue, label, mine in ((3, "KIVI, uniform and FP8 presets", lambda p: "kvquant" not in p),
                               (4, "KVQuant presets", lambda p: "kvquant" in p)):
        own = [text for p, text in slower if mine(p)]
        lines.append(f"- issue {issue}, no row at context >= 4k slower than FP16 flash SDPA "
                     f"(graph time), {label}: "
                     + ("met" if not own else f"{len(own)} rows slower: " + ", ".join(own)))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars: for each headline shape, each headline preset's graph speedup over flash
    SDPA (log scale, a line at 1x: below it the preset is slower than FP16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lib, fp = library_rows(rows), fp16_rows(rows)
    shapes = [s for s in HEADLINE_SHAPES if fp.get(s, (None,))[0] is not None]
    width = 0.8 / len(HEADLINE_PRESETS)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for i, p in enumerate(HEADLINE_PRESETS):
        xs, ys = [], []
        for j, (m, b, t) in enumerate(shapes):
            r = lib.get((m, b, t, p))
            if r is not None and r.get("us_graph"):
                xs.append(j + (i - (len(HEADLINE_PRESETS) - 1) / 2) * width)
                ys.append(_graph_speedup(fp[(m, b, t)][0], r))
        ax.bar(xs, ys, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks([0.5, 1, 2, 3, 4, 5, 6], ["0.5", "1", "2", "3", "4", "5", "6"])
    ax.set_xticks(range(len(shapes)),
                  [f"{MODEL_NAMES.get(m, m)}\nB={b}, {_ctx(t)}" for m, b, t in shapes], fontsize=8)
    ax.set_ylabel("speedup over FP16 flash SDPA (CUDA graphs)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", type=Path, default=RESULTS / "decode_attention.json",
                    help="a table written by benchmarks/decode_attention.py")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG",
                    help="also draw the headline shapes' graph speedups into PNG")
    args = ap.parse_args(argv)
    if not args.json.is_file():
        ap.error(f"json: {args.json} is not a file (run benchmarks/decode_attention.py first)")
    path, png = args.json, args.plot
    data = json.loads(path.read_text())
    env = data["env"]
    print(f"From `{path.name}` ({env.get('gpu')}, {env.get('date')}; "
          f"`{env.get('command')}`). CUDA-graph µs (speedup over FP16 flash SDPA's graph "
          "time):\n")
    print(headline(data["rows"]))
    print(f"\nLong rows (batch x context >= {LONG // 1024}k tokens), graph speedup over flash "
          "SDPA, min-max (fraction of the copy bandwidth):\n")
    print(ranges(data["rows"]))
    print("\nTargets:\n")
    print(targets(data["rows"]))
    if png is not None:
        plot(data["rows"], png, f"one decode step of attention, {env.get('gpu')} "
                                f"({env.get('date', '')[:10]})")


if __name__ == "__main__":
    main()
