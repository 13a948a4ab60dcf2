"""Quality at equal memory: one method's perplexity against another's at the same effective bits.

A preset that keeps more bytes (outliers, an FP16 sink, codebooks) tends to score better, so a
row-by-row reading of a perplexity table mixes two effects. Whether KVQuant beats KIVI *at equal
bits* needs KIVI's curve at KVQuant's bits: here the lower envelope of the reference method's
points (its Pareto front: no other configuration of it has fewer or equal bits and a lower or
equal perplexity), joined linearly in (bits, log perplexity). A point outside the front's range
is judged only where one side dominates: the other method's point uses no more bits and scores
no worse. Where the rows carry per-block NLL sums (``kvbits ppl`` since session 60), a paired
bootstrap over blocks of tokens gives the gap a 95% interval (outside the front's range: the
difference from the point that dominates the row or, past the front's end, from its best), and
a difference whose interval holds zero is a tie: at three and four bits both methods sit within
a few tenths of a percent of FP16, as close as a thousand-token text can tell.

Effective bits per element count every byte the cache holds (codes, FP16 scales and zeros,
outliers, codebooks, FP16 sink and residual) per K/V element it holds:
``8 * cache_bytes_fp16 / cache_elements``. Rows written before ``kvbits ppl`` recorded
``cache_elements`` (session 59) divide by what an FP16 ``DynamicCache`` holds instead,
``16 * cache_bytes_fp16 / fp16_cache_bytes``: the same on models without sliding-window layers;
on Gemma3, whose sliding layers a kvbits cache keeps longer than ``DynamicCache`` does, that
counts the extra tokens as bits (its FP16 row at ~20 bits instead of 16).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

__all__ = ["Point", "bits_per_element", "compare_at_equal_bits", "effective_bits", "envelope_at",
           "front_mix", "gap_interval", "pareto_front", "point_of", "points_of"]


@dataclass(frozen=True)
class Point:
    """One configuration's (bits, perplexity); ``nll_blocks``: its NLL summed over blocks of
    ``nll_block`` scored tokens (``kvbits ppl`` rows since session 60; empty before), what a
    paired bootstrap against another configuration of the same table resamples."""

    label: str
    bits: float
    ppl: float
    nll_blocks: tuple = ()
    nll_block: int = 0
    tokens_scored: int = 0


def bits_per_element(fp16_bytes: int, elements: int | None) -> float:
    """Bits per K/V element held: a cache's bytes (floating-point parts at 2 bytes) over the
    elements it holds; NaN where they are unknown (none, or a cache kept packed elsewhere)."""
    return 8 * fp16_bytes / elements if elements else math.nan


def effective_bits(result: dict) -> float:
    """Bits per K/V element of a ``kvbits ppl`` result row, every byte of the cache counted
    (per element held; older rows: per element of an FP16 ``DynamicCache``, module docstring)."""
    if result.get("cache_elements"):
        return bits_per_element(result["cache_bytes_fp16"], result["cache_elements"])
    return 16 * result["cache_bytes_fp16"] / result["fp16_cache_bytes"]


def points_of(results: list[dict], method: str) -> list[Point]:
    """The ``kvbits ppl`` result rows of ``method`` (plain: no Hadamard rotation) as points."""
    out = []
    for r in results:
        f = r.get("spec_fields") or {}
        if r.get("kind") != "kvbits" or f.get("method") != method:
            continue
        if f.get("hadamard") or f.get("hadamard_calibrated"):
            continue
        out.append(point_of(r))
    return out


def point_of(result: dict) -> Point:
    """A ``kvbits ppl`` result row as a point: its effective bits, perplexity and NLL blocks."""
    return Point(result["label"], effective_bits(result), result["ppl"],
                 tuple(result.get("nll_blocks", ())), result.get("nll_block", 0),
                 result.get("tokens_scored", 0))


def pareto_front(points: list[Point]) -> list[Point]:
    """The points no other point beats on both bits and perplexity, by increasing bits."""
    front: list[Point] = []
    for p in sorted(points, key=lambda p: (p.bits, p.ppl)):
        if not front or p.ppl < front[-1].ppl:
            front.append(p)
    return front


def front_mix(front: list[Point], bits: float,
              rel_tol: float = 0.01) -> list[tuple[Point, float]] | None:
    """The front at ``bits`` as weights of its two neighbouring points (linear in bits), or
    ``None`` outside the front's range of bits. Within ``rel_tol`` of an end the end counts as
    equal bits (a KVQuant preset's codebooks add a few hundred bytes to the same layout)."""
    if not front or not front[0].bits * (1 - rel_tol) <= bits <= front[-1].bits * (1 + rel_tol):
        return None
    bits = min(max(bits, front[0].bits), front[-1].bits)
    for a, b in itertools.pairwise(front):
        if a.bits <= bits <= b.bits:
            w = (bits - a.bits) / (b.bits - a.bits)
            # a point of weight 0 (at or clamped to an end) is left out: it adds nothing to
            # the envelope and must not need NLL blocks of its own for the interval
            return [(q, x) for q, x in ((a, 1 - w), (b, w)) if x > 0]
    return [(front[0], 1.0)]  # a single-point front, at exactly its bits


def envelope_at(front: list[Point], bits: float, rel_tol: float = 0.01) -> float | None:
    """The front's perplexity at ``bits``, linear in log perplexity between its neighbours
    (:func:`front_mix`); ``None`` outside the front's range of bits."""
    mix = front_mix(front, bits, rel_tol)
    if mix is None:
        return None
    return math.exp(sum(w * math.log(q.ppl) for q, w in mix))


def gap_interval(p: Point, mix: list[tuple[Point, float]], level: float = 0.95,
                 draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """A ``level`` confidence interval of ``p``'s perplexity over the mixed front's, minus one,
    by a paired bootstrap over blocks of scored tokens: each draw resamples the blocks with
    replacement and recomputes the mean NLL difference (``p`` minus the weighted front points,
    every point scored on the same tokens). ``None`` where a point lacks blocks or the points'
    blocks differ (another text or length) or do not cover its scored tokens (the last block
    holds 1 to ``nll_block`` of them), or for a single block (every draw the same: no
    width, so never a tie), or where an NLL is not finite (sorted among NaNs, the draws that
    missed it gave arbitrary finite bounds)."""
    import random

    points = [p] + [q for q, _ in mix]
    n = len(p.nll_blocks)
    if n < 2 or any(len(q.nll_blocks) != n or q.nll_block != p.nll_block
                    or q.tokens_scored != p.tokens_scored for q in points) \
            or not p.nll_block * (n - 1) < p.tokens_scored <= p.nll_block * n:
        return None
    diff = [b - sum(w * q.nll_blocks[i] for q, w in mix) for i, b in enumerate(p.nll_blocks)]
    if not all(map(math.isfinite, diff)):
        return None
    size = [p.nll_block] * (n - 1) + [p.tokens_scored - p.nll_block * (n - 1)]
    rng = random.Random(seed)
    means = []
    for _ in range(draws):
        pick = rng.choices(range(n), k=n)
        means.append(sum(diff[i] for i in pick) / sum(size[i] for i in pick))
    means.sort()
    k = round((1 - level) / 2 * draws)  # draws left out at each end (the same number: symmetric)
    return math.expm1(means[k]), math.expm1(means[draws - 1 - k])


def compare_at_equal_bits(points: list[Point], reference: list[Point]) -> list[dict]:
    """Each of ``points`` against the reference method's front at the same bits.

    ``verdict``: ``"better"`` (below the front at its bits; or no worse than its cheapest point
    with fewer bits; or past its last point, below it, where a reference point has at least
    these bits: the reference reached no lower perplexity with up to these bits), ``"worse"``
    (above the front, or outside its range and dominated by a reference point: no more bits, no
    higher perplexity), ``"tie"`` (the comparison's 95% interval, ``gap_ci``, holds zero: the
    difference is within the text's sampling noise), ``"more bits"`` / ``"fewer bits"``
    (outside the reference's measured range of bits and not dominating or dominated: not
    comparable). ``gap``: perplexity over the front's at these bits, minus one,
    where defined; ``gap_ci``: the interval (:func:`gap_interval`) of the gap, or outside the
    front's range of the perplexity over the dominating or best point's (``ci_against``), where
    the rows carry NLL blocks.
    """
    front = pareto_front(reference)
    if not front:  # (every point was labelled "more bits" against nothing)
        raise ValueError("compare_at_equal_bits: reference has no points; give the reference "
                         "method's (bits, perplexity) points")
    rows = []
    for p in points:
        mix = front_mix(front, p.bits)
        ref = None if mix is None else envelope_at(front, p.bits)
        dominating = [q for q in front if q.bits <= p.bits and q.ppl <= p.ppl]
        if mix is None and dominating:
            mix = [(min(dominating, key=lambda q: q.ppl), 1.0)]
        elif mix is None and p.bits > front[-1].bits and any(q.bits >= p.bits for q in reference):
            # past the front's end, within the reference's measured bits: its best point is
            # the best it reached with up to these bits (the configurations with more were
            # no better)
            mix = [(front[-1], 1.0)]
        ci = None if mix is None else gap_interval(p, mix)
        if ci is not None and ci[0] <= 0 <= ci[1]:
            verdict = "tie"
        elif ref is not None:
            verdict = "better" if p.ppl < ref else "worse"
        elif dominating:
            verdict = "worse"
        elif mix is not None:
            verdict = "better"
        elif p.bits < front[0].bits:
            verdict = "better" if p.ppl <= front[0].ppl else "fewer bits"
        else:
            verdict = "more bits"
        rows.append({"label": p.label, "bits": p.bits, "ppl": p.ppl, "reference_ppl": ref,
                     "gap": None if ref is None else p.ppl / ref - 1, "gap_ci": ci,
                     "ci_against": None if ci is None else [q.label for q, _ in mix],
                     "verdict": verdict})
    return rows
