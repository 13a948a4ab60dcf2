"""``benchmarks/decode_attention.py``'s row arithmetic (no GPU: the module imports on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
decode_attention = pytest.importorskip("decode_attention")


def test_fp16_rows_bandwidth_uses_the_faster_timing_like_the_kvbits_rows():
    """The notes say "TB/s and the fraction of copy bandwidth use the faster of the two timings"
    and the kvbits rows do (bytes / min(eager, graph)); the flash row divided by its eager median
    alone, so at Llama-2-7B B1 4k (eager 47.1 µs, graph 34.7 µs in decode_attention.json) FP16
    showed 34% of the copy bandwidth where its graph time gives 46%."""
    base = {"model": "m", "batch": 1, "context": 4096}
    fp_bytes, bw = 2 * 1 * 32 * 4096 * 128 * 2, 4.0e12
    flash, default = decode_attention.fp16_rows(base, "flash_attention", 47.1, 34.7, 9.0, 40.0,
                                                fp_bytes, bw)
    assert flash["provider"] == "sdpa_fp16 (flash_attention)" and flash["us_graph"] == 34.7
    assert flash["frac_bw"] == pytest.approx(fp_bytes / 34.7 * 1e6 / bw)
    assert flash["tbps"] == pytest.approx(fp_bytes / 34.7 * 1e-6)
    assert flash["speedup_best"] == pytest.approx(40.0 / 47.1)
    # the default backend has only an eager median
    assert default["us"] == 40.0 and default["frac_bw"] == pytest.approx(fp_bytes / 40.0 * 1e6 / bw)
    # eager faster than graph: the eager time
    flash, _ = decode_attention.fp16_rows(base, "flash_attention", 30.0, 34.7, 9.0, 30.0,
                                          fp_bytes, bw)
    assert flash["frac_bw"] == pytest.approx(fp_bytes / 30.0 * 1e6 / bw)


def test_ceiling_fields_bound_the_graph_speedup_by_a_read_of_the_same_bytes():
    """The ceiling columns (session 64): flash SDPA's graph time over a plain read of the row's
    bytes, and the row's share of that read's time. A row as fast as the read shows its graph
    speedup equal to the ceiling and 100% of it; Llama-3-8B batch 8 32k uniform-int4 on the
    H200 (flash 261.5 us, the row 98.7 us) against a read of ~82 us: 3.19x, 83%."""
    fields = decode_attention.ceiling_fields(261.5, 82.0, 98.7)
    assert fields["ceiling"] == pytest.approx(261.5 / 82.0)
    assert fields["of_ceiling"] == pytest.approx(82.0 / 98.7)
    assert fields["ceiling"] * fields["of_ceiling"] == pytest.approx(261.5 / 98.7)  # the speedup
    same = decode_attention.ceiling_fields(261.5, 82.0, 82.0)
    assert same["of_ceiling"] == 1.0 and same["ceiling"] == pytest.approx(261.5 / 82.0)
    headers = [h for _, h in decode_attention.table_columns()]
    assert headers.index("ceiling vs FP16") == headers.index("graph speedup") + 1
    assert headers.index("of ceiling") == headers.index("ceiling vs FP16") + 1
