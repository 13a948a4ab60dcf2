"""Equal-bits comparison of two methods' perplexity points (kvbits.eval.frontier)."""

from __future__ import annotations

import math
import random

import pytest

from kvbits.eval.frontier import (
    Point,
    compare_at_equal_bits,
    envelope_at,
    pareto_front,
    points_of,
)

KIVI = [Point("kivi-2", 4.0, 30.0), Point("kivi-3", 5.0, 28.0), Point("kivi-4", 6.0, 27.0),
        Point("kivi-3:S=1", 5.5, 29.0)]  # the last is dominated by kivi-3


def test_pareto_front_keeps_only_undominated_points_by_bits():
    assert [p.label for p in pareto_front(KIVI)] == ["kivi-2", "kivi-3", "kivi-4"]


@pytest.mark.parametrize("seed", range(5))
def test_pareto_front_on_random_points(seed):
    g = random.Random(seed)
    pts = [Point(str(i), g.uniform(2, 8), g.uniform(20, 40)) for i in range(30)]
    front = pareto_front(pts)
    for p in pts:  # every point is on the front or dominated by a point of it
        assert p in front or any(q.bits <= p.bits and q.ppl <= p.ppl for q in front)
    for p in front:  # and no front point is dominated by another point
        assert not any(q is not p and q.bits <= p.bits and q.ppl < p.ppl for q in pts)


def test_envelope_interpolates_log_perplexity_and_stops_at_its_ends():
    front = pareto_front(KIVI)
    assert envelope_at(front, 4.5) == pytest.approx(math.sqrt(30.0 * 28.0))
    assert envelope_at(front, 6.0) == pytest.approx(27.0)
    assert envelope_at(front, 6.03) == pytest.approx(27.0)  # within 1%: the same bits
    assert envelope_at(front, 6.5) is None and envelope_at(front, 3.5) is None
    assert envelope_at([], 5.0) is None


def test_verdicts():
    rows = {r["label"]: r for r in compare_at_equal_bits([
        Point("below", 4.5, 28.5),        # front there: sqrt(30 * 28) ~ 28.98
        Point("above", 4.5, 29.5),
        Point("dominated", 5.2, 28.0),    # kivi-3 has fewer bits and the same perplexity
        Point("cheaper", 3.5, 29.0),      # fewer bits than kivi-2 and better
        Point("cheap-worse", 3.5, 31.0),  # fewer bits, worse: not comparable
        Point("richer", 7.0, 26.0),       # more bits, better than all of KIVI: not comparable
        Point("richer-worse", 7.0, 27.5),
    ], KIVI)}
    assert rows["below"]["verdict"] == "better"
    assert rows["below"]["gap"] == pytest.approx(28.5 / math.sqrt(30 * 28) - 1)
    assert rows["above"]["verdict"] == "worse" and rows["above"]["gap"] > 0
    assert rows["dominated"]["verdict"] == "worse"
    assert rows["cheaper"]["verdict"] == "better" and rows["cheaper"]["gap"] is None
    assert rows["cheap-worse"]["verdict"] == "fewer bits"
    assert rows["richer"]["verdict"] == "more bits"
    assert rows["richer-worse"]["verdict"] == "worse"


def test_points_of_reads_ppl_rows_and_skips_other_methods_and_rotations():
    def row(label, method, cache, **fields):
        return {"label": label, "kind": "kvbits", "ppl": 20.0, "cache_bytes_fp16": cache,
                "fp16_cache_bytes": 1600, "spec_fields": {"method": method, **fields}}

    res = [row("fp16", "fp16", 1600), row("kivi-2", "kivi", 400),
           row("kivi-2-hadc", "kivi", 400, hadamard_calibrated=True),
           row("kvquant-2", "kvquant", 450),
           {"label": "HF quanto:int2", "kind": "hf", "ppl": 30.0, "cache_bytes_fp16": 300,
            "fp16_cache_bytes": 1600, "spec_fields": {"nbits": 2}}]
    assert points_of(res, "kivi") == [Point("kivi-2", 4.0, 20.0)]
    assert points_of(res, "kvquant") == [Point("kvquant-2", 4.5, 20.0)]


def test_an_empty_reference_is_refused():
    """Against no reference points every point was labelled "more bits", without a word."""
    with pytest.raises(ValueError, match="reference has no points"):
        compare_at_equal_bits([Point("kvquant-3", 3.2, 21.0)], [])
