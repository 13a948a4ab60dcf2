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
