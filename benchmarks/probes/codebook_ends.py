"""Probe (CPU): KVQuant codebooks with their end entries pinned at the group min and max.

Every key group (G tokens of one channel) and value group (Gv channels of one token) normalizes
its min and max to exactly 0 and 2**bits - 1, which uniform min-max returns exactly; free
k-means pulls the two end centroids inwards. This runs ``kvbits ppl`` (or, with ``--command
needle``, ``kvbits needle``: does keeping the extremes keep passkeys?) with the codebook fit
replaced by ``kmeans_1d(..., ends=(0, 2**bits - 1))`` (``--ends pinned``) or the library's own
fit (``--ends fitted``), each rule with its own calibration files (so a cached calibration of
the other rule is never reused). Results: benchmarks/results/codebook_ends.md.

    python benchmarks/probes/codebook_ends.py --ends pinned -- --model smollm2 \
        --text sotu-2010-2016 --tokens 1024 --chunk 256 --calib-tokens 2048 \
        --presets kvquant-3-dense-post,kvquant-3,kvquant-2,kvquant-4 --no-progress
    python benchmarks/probes/codebook_ends.py --ends pinned --command needle -- --model smollm2 \
        --trials 6 --seed 1 --threads 2 --presets fp16,kvquant-3 --out DIR --name NAME
"""
import argparse
import sys

from kvbits.cli import main
from kvbits.methods import kvquant as kvq


def pinned_fit(u, w, bits, qnorm):
    if qnorm:
        raise SystemExit("codebook_ends: Q-Norm moves the table; compare without it")
    cb = kvq.kmeans_1d(u, w, 1 << bits, ends=(0.0, float((1 << bits) - 1)))
    return cb, kvq.thresholds_of(cb)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ends", choices=("pinned", "fitted"), required=True)
    p.add_argument("--command", choices=("ppl", "needle"), default="ppl")
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.ends == "pinned":
        kvq._fit_one = pinned_fit
    path_of = kvq.calibration_path
    kvq.calibration_path = lambda *a, **k: path_of(*a, **k).with_name(
        f"{path_of(*a, **k).stem}-ends-{args.ends}.safetensors")
    sys.exit(main([args.command, *rest]))
