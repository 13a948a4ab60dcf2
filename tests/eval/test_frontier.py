"""Equal-bits comparison of two methods' perplexity points (kvbits.eval.frontier)."""

from __future__ import annotations

import math
import random

import pytest

from kvbits.eval.frontier import (
    Point,
    compare_at_equal_bits,
    envelope_at,
    front_mix,
    gap_interval,
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


def _blocks(seed: int, n: int, shift: float = 0.0, noise: float = 1.0) -> tuple:
    g = random.Random(seed)
    return tuple(16 * 3.0 + shift + g.gauss(0, noise) for _ in range(n))


def _jittered(base: tuple, shift: float, noise: float) -> tuple:
    """``base`` shifted by ``shift`` nats per block, with noise of its own per block."""
    return tuple(b + shift + random.Random(i).gauss(0, noise) for i, b in enumerate(base))


def _kivi_pair(base: tuple, top: str) -> list:
    """KIVI at 4 bits per element (0.2 nats per block above ``base``) and at 6 (``base``)."""
    return [Point("kivi-2", 4.0, 30.0, tuple(b + 3.2 for b in base), 16, 3200),
            Point(top, 6.0, 28.0, base, 16, 3200)]


def test_gap_interval_is_paired_and_centred_on_the_gap():
    """A preset whose every block is 0.16 nats (0.01 per token) worse than the front's: the
    interval sits around exp(0.01) - 1 and excludes zero, however noisy the text itself is
    (pairing removes the text's own variance)."""
    base = _blocks(0, 200, noise=5.0)
    front = [Point("a", 4.0, 30.0, base, 16, 3200)]
    worse = Point("q", 4.0, 30.3, _jittered(base, 0.16, 0.05), 16, 3200)
    lo, hi = gap_interval(worse, [(front[0], 1.0)])
    assert 0 < lo < math.expm1(0.01) < hi < 0.02
    same = Point("s", 4.0, 30.0, _jittered(base, 0.0, 0.5), 16, 3200)
    lo, hi = gap_interval(same, [(front[0], 1.0)])
    assert lo < 0 < hi


def test_gap_interval_of_the_swapped_rows_is_its_mirror():
    """As many bootstrap draws fall below the interval as above it: the interval of q over p is
    that of p over q mirrored (log scale), not one draw wider at its upper end."""
    base = _blocks(5, 200, noise=5.0)
    p = Point("p", 4.0, 30.1, _jittered(base, 0.05, 1.0), 16, 3200)
    q = Point("q", 4.0, 30.0, base, 16, 3200)
    lo, hi = gap_interval(p, [(q, 1.0)])
    lo2, hi2 = gap_interval(q, [(p, 1.0)])
    assert math.log1p(lo) == pytest.approx(-math.log1p(hi2), abs=1e-12)
    assert math.log1p(hi) == pytest.approx(-math.log1p(lo2), abs=1e-12)


def test_gap_interval_mixes_the_front_with_the_envelope_weights():
    a = Point("a", 4.0, 30.0, _blocks(1, 100), 16, 1600)
    b = Point("b", 6.0, 27.0, tuple(x - 1.6 for x in a.nll_blocks), 16, 1600)  # 0.1 nats/token
    mix = front_mix([a, b], 5.0)
    assert [(q.label, w) for q, w in mix] == [("a", 0.5), ("b", 0.5)]
    p = Point("p", 5.0, 28.0, tuple(x - 0.8 for x in a.nll_blocks), 16, 1600)  # the midpoint
    lo, hi = gap_interval(p, mix)
    assert lo == pytest.approx(0.0, abs=1e-9) and hi == pytest.approx(0.0, abs=1e-9)


def test_a_front_end_point_of_weight_zero_is_left_out_of_the_mix():
    """Within 1% of the front's end the end point alone counts: its neighbour, of weight 0,
    is not in the mix, so a neighbour without blocks (an older companion table) does not take
    the interval away."""
    a = Point("a", 4.0, 30.0)  # no blocks
    b = Point("b", 6.0, 27.0, _blocks(1, 100), 16, 1600)
    for bits in (6.0, 6.05):
        mix = front_mix([a, b], bits)
        assert [(q.label, w) for q, w in mix] == [("b", 1.0)]
        p = Point("p", bits, 27.5, _jittered(b.nll_blocks, 0.3, 0.05), 16, 1600)
        lo, hi = gap_interval(p, mix)
        assert 0 < lo < hi
    assert [q.label for q, _ in front_mix([a, b], 3.98)] == ["a"]


def test_gap_interval_needs_the_same_blocks():
    a = Point("a", 4.0, 30.0, _blocks(1, 100), 16, 1600)
    assert gap_interval(Point("p", 4.0, 30.0), [(a, 1.0)]) is None  # an old row: no blocks
    assert gap_interval(Point("p", 4.0, 30.0, _blocks(2, 99), 16, 1584), [(a, 1.0)]) is None
    assert gap_interval(Point("p", 4.0, 30.0, _blocks(2, 100), 16, 1590), [(a, 1.0)]) is None


def test_gap_interval_needs_blocks_that_cover_the_scored_tokens():
    """Blocks without their size (Point's defaults: a division by zero) or not the tokens
    scored (the last block's weight came out negative or past a block): no interval."""
    blocks = _blocks(7, 100)
    bare = Point("q", 4.0, 30.0, blocks)
    assert gap_interval(Point("p", 4.0, 30.0, _jittered(blocks, 0.1, 1.0)), [(bare, 1.0)]) is None
    for scored in (1584, 1700):  # 100 blocks of 16 cover 1585 to 1600 tokens
        a = Point("a", 4.0, 30.0, blocks, 16, scored)
        p = Point("p", 4.0, 30.0, _jittered(blocks, 0.1, 1.0), 16, scored)
        assert gap_interval(p, [(a, 1.0)]) is None


def test_one_block_gives_no_interval():
    """A text of up to 16 scored tokens is one block: every draw resamples that block, so the
    interval had no width and could never call a difference a tie."""
    q = Point("q", 4.0, 30.0, (49.0,), 16, 10)
    p = Point("p", 4.0, 30.2, (49.1,), 16, 10)
    assert gap_interval(p, [(q, 1.0)]) is None
    row, = compare_at_equal_bits([p], [q])
    assert row["gap_ci"] is None and row["verdict"] == "worse"


def test_a_row_with_a_nan_block_gives_no_interval():
    """A preset whose NLL went NaN in one block (its perplexity NaN): the draws that miss that
    block are finite, and sorting them among NaNs had left finite bounds, an interval (even a
    tie) for a row with no perplexity."""
    base = _blocks(6, 200, noise=5.0)
    blocks = list(_jittered(base, 0.16, 1.0))
    blocks[63] = math.nan
    p = Point("p", 4.0, math.nan, tuple(blocks), 16, 3200)
    assert gap_interval(p, [(Point("q", 4.0, 30.0, base, 16, 3200), 1.0)]) is None


def test_a_gap_within_the_noise_is_a_tie():
    base = _blocks(3, 200, noise=5.0)
    kivi = _kivi_pair(base, "kivi-3")
    noisy, clear = _jittered(base, 1.6, 3.0), _jittered(base, 0.8, 0.05)
    rows = compare_at_equal_bits([Point("tie", 5.0, 29.0, noisy, 16, 3200),
                                  Point("win", 5.0, 28.5, clear, 16, 3200)], kivi)
    assert [r["verdict"] for r in rows] == ["tie", "better"]
    assert rows[0]["gap_ci"][0] < 0 < rows[0]["gap_ci"][1]
    assert rows[1]["gap_ci"][1] < 0


def test_outside_the_front_a_dominated_row_is_compared_with_the_point_that_dominates_it():
    """Past the front's last bits a row no better than a cheaper KIVI point is worse, unless
    the two differ by less than the noise (then a tie, the interval against that point)."""
    base = _blocks(4, 200, noise=5.0)
    kivi = _kivi_pair(base, "kivi-4")
    near, far = _jittered(base, 0.01, 2.0), _jittered(base, 0.8, 0.05)
    rows = compare_at_equal_bits([Point("near", 7.0, 28.01, near, 16, 3200),
                                  Point("far", 7.0, 29.4, far, 16, 3200),
                                  Point("old", 7.0, 29.4)], kivi)
    assert [r["verdict"] for r in rows] == ["tie", "worse", "worse"]
    assert rows[0]["ci_against"] == rows[1]["ci_against"] == ["kivi-4"]
    assert rows[1]["gap_ci"][0] > 0 and rows[0]["gap"] is None
    assert rows[2]["gap_ci"] is None  # a row without blocks: the plain rule


def test_past_the_fronts_end_a_row_below_it_is_better_only_within_the_measured_bits():
    """kivi-4 (G=32) has more bits than kivi-4:G=64 and a higher perplexity, so the front ends at
    the latter; a row between their bits below the front's best beats every KIVI configuration
    of up to its bits. Past every KIVI row's bits it stays "more bits" (kivi-8 was not run)."""
    kivi = [Point("kivi-4:G=64", 5.0, 28.0), Point("kivi-4", 5.6, 28.1),
            Point("kivi-2", 3.0, 33.0)]
    rows = compare_at_equal_bits([Point("mid", 5.3, 27.9), Point("past", 6.0, 27.9)], kivi)
    assert [r["verdict"] for r in rows] == ["better", "more bits"]
