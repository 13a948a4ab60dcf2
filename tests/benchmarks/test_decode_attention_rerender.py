"""``benchmarks/decode_attention.py --rerender``: the FP16 flash rows' bandwidth figures of a
committed table re-derived from its recorded medians (no GPU, nothing measured)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
decode_attention = pytest.importorskip("decode_attention")
common = pytest.importorskip("common")

BASE = {"model": "llama-2-7b", "batch": 1, "context": 4096, "q_heads": 32, "kv_heads": 32,
        "head_dim": 128}
FP_BYTES = 2 * 1 * 32 * 4096 * 128 * 2


def _old_flash(us: float, us_graph: float, bw: float, **base) -> dict:
    """A flash row as the benchmark wrote it before 5385329: bandwidth from the eager median."""
    return dict(BASE, **base, preset="fp16", provider="sdpa_fp16 (flash_attention)", us=us,
                speedup=1.0, us_graph=us_graph, speedup_graph=1.0, host_us=76.6, bytes=FP_BYTES,
                tbps=FP_BYTES / us * 1e-6, frac_bw=FP_BYTES / us * 1e6 / bw, speedup_best=0.685)


def _rows() -> list[dict]:
    bw = 4.25e12
    return [_old_flash(47.1, 34.7, bw),  # decode_attention.md's Llama-2-7B B1 4k: 0.335
            dict(BASE, preset="fp16", provider="sdpa_fp16 (default backend)", us=32.3,
                 speedup=1.46, speedup_best=1.0, bytes=FP_BYTES, tbps=FP_BYTES / 32.3 * 1e-6,
                 frac_bw=FP_BYTES / 32.3 * 1e6 / bw),
            dict(BASE, preset="kivi-2", provider="kvbits", us=98.6, speedup=0.478,
                 speedup_best=0.327, us_graph=24.5, speedup_graph=1.41, host_us=107.0,
                 bytes=14286848, tbps=14286848 / 24.5 * 1e-6,
                 frac_bw=14286848 / 24.5 * 1e6 / bw, rel_err=8.6e-05),
            # eager the faster: its figures stand
            _old_flash(151.0, 160.0, bw, context=32768),
            # a row merged from an earlier run, measured against another copy bandwidth
            _old_flash(210.0, 200.0, 4.27e12, batch=8)]


def test_rederive_flash_bandwidth_uses_the_faster_timing_and_each_rows_bandwidth():
    """The committed flash rows divided by the eager median alone (Llama-2-7B B1 4k: 34% of the
    copy bandwidth where the graph median gives 46%); re-derived, they use min(eager, graph) as
    :func:`fp16_rows` does now, against the copy bandwidth of the run that measured the row."""
    rows = _rows()
    untouched = [dict(r) for r in rows[1:4]]
    changed = decode_attention.rederive_flash_bandwidth(rows)
    assert [r["us"] for r in changed] == [47.1, 210.0]
    assert rows[0]["frac_bw"] == pytest.approx(FP_BYTES / 34.7 * 1e6 / 4.25e12)
    assert rows[0]["frac_bw"] == pytest.approx(0.455, abs=5e-4)  # was 0.335
    assert rows[0]["tbps"] == pytest.approx(FP_BYTES / 34.7 * 1e-6)
    assert rows[4]["frac_bw"] == pytest.approx(FP_BYTES / 200.0 * 1e6 / 4.27e12)
    # the same figures fp16_rows gives a row measured now
    now = decode_attention.fp16_rows({}, "flash_attention", 47.1, 34.7, 76.6, 32.3, FP_BYTES,
                                     4.25e12)[0]
    assert (rows[0]["tbps"], rows[0]["frac_bw"]) == pytest.approx((now["tbps"], now["frac_bw"]))
    assert rows[1:4] == untouched  # default backend, kvbits, eager-faster flash
    assert decode_attention.rederive_flash_bandwidth(rows) == []  # once only


def _write_table(out: Path, notes: list[str]) -> Path:
    env = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0",
           "python": "3.12", "date": "2026-12-03T14:07:48+00:00",
           "command": "benchmarks/decode_attention.py --name tiny"}
    common.write_results("tiny", _rows(), decode_attention.table_columns(), env, notes, out)
    return out / "tiny.json"


def test_rerender_rewrites_the_json_and_its_markdown_with_the_benchmarks_writer(tmp_path):
    path = _write_table(tmp_path, ["copy bandwidth measured in this run: 4.25 TB/s", "a note"])
    md_before = (tmp_path / "tiny.md").read_text().split("\n")
    command = "python benchmarks/decode_attention.py --rerender tiny.json"
    changed = decode_attention.rerender(path, command, "2026-12-04")
    assert len(changed) == 2
    data = json.loads(path.read_text())
    assert data["env"]["command"] == "benchmarks/decode_attention.py --name tiny"  # kept
    assert data["rows"][0]["frac_bw"] == pytest.approx(0.455, abs=5e-4)
    md = (tmp_path / "tiny.md").read_text().split("\n")
    # one note more, after the run's own; the table differs only in the flash rows' TB/s and
    # of copy bw cells
    assert md[:6] == md_before[:6] and md[6].startswith("- 2026-12-04: the FP16 flash rows'")
    assert md[6].endswith(f"by `{command}`")
    assert len(md) == len(md_before) + 1 and md[7:9] == md_before[6:8]
    diff = [(a, b) for a, b in zip(md_before[6:], md[7:]) if a != b]
    assert len(diff) == 2
    headers = [h for _, h in decode_attention.table_columns()]
    tbps = headers.index("TB/s")
    assert headers[tbps + 1] == "of copy bw"
    for a, b in diff:
        a, b = a.split(" | "), b.split(" | ")
        assert a[headers.index("provider")] == "sdpa_fp16 (flash_attention)"
        assert [i for i in range(len(a)) if a[i] != b[i]] == [tbps, tbps + 1]
    assert md_before[9].split(" | ")[tbps:tbps + 2] == ["1.42", "0.335"]
    assert md[10].split(" | ")[tbps:tbps + 2] == ["1.93", "0.455"]
    # a second run finds nothing to do and writes nothing
    text = (tmp_path / "tiny.md").read_text()
    assert decode_attention.rerender(path, command, "2026-12-05") == []
    assert (tmp_path / "tiny.md").read_text() == text


def test_rerender_leaves_a_table_the_writer_does_not_reproduce(tmp_path):
    """A Markdown edited by hand outside the notes (decode_attention_other_models.md) or missing
    is refused, and neither file is touched."""
    path = _write_table(tmp_path, ["a note"])
    md = tmp_path / "tiny.md"
    edited = md.read_text().replace("\n\n| model", "\n\n- note (added by hand)\n| model")
    md.write_text(edited)
    before = path.read_text()
    with pytest.raises(ValueError, match="not reproduced"):
        decode_attention.rerender(path, "cmd", "2026-12-04")
    assert path.read_text() == before and md.read_text() == edited
    md.unlink()
    with pytest.raises(ValueError, match="no Markdown"):
        decode_attention.rerender(path, "cmd", "2026-12-04")


def test_rerender_option_needs_no_gpu(tmp_path, capsys):
    path = _write_table(tmp_path, ["a note"])
    decode_attention.main(["--rerender", str(path)])
    assert "2 FP16 flash rows re-derived" in capsys.readouterr().out
    md = (tmp_path / "tiny.md").read_text()
    assert "by `python benchmarks/decode_attention.py --rerender " in md


# tables left as they were: Markdown edited by hand outside the notes / no Markdown committed
NOT_RERENDERED = {"decode_attention_other_models.json", "decode_attention_rows5_s43.json"}


def test_committed_flash_rows_use_the_faster_timing():
    """Every committed decode_attention*.json (but the two the writer cannot reproduce) has its
    flash rows' TB/s from bytes over min(eager, graph), as the kvbits rows."""
    low = []
    for path in sorted((ROOT / "benchmarks/results").glob("decode_attention*.json")):
        if path.name in NOT_RERENDERED:
            continue
        for r in json.loads(path.read_text())["rows"]:
            if r.get("provider") == "sdpa_fp16 (flash_attention)" and r.get("us_graph"):
                want = r["bytes"] / min(r["us"], r["us_graph"]) * 1e-6
                if r["tbps"] != pytest.approx(want, rel=1e-9):
                    low.append(f"{path.name} {r['model']} B{r['batch']} {r['context']}")
    assert not low
