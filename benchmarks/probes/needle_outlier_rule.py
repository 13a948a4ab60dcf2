"""Probe (CPU, session 57): does the rule that picks a token's key outliers decide Gemma3-270M's
passkeys under kvquant-3?

Until session 57 kvquant-3 ranked a token's channels by ``|x - median_c| / MAD_c`` over its key
group (each channel's own spread) and kept the top ``n`` exact; this probe is what changed it. Session 56 found kvquant-3:O=0 (no
outliers) losing fewer passkeys than kvquant-3 on Gemma3 while its key errors were larger. This
probe swaps the key rule, refits the codebooks under it (in memory), and scores every trial of a
``kvbits needle`` draw with a continuous measure as well as the hit:

* ``abs``: ``|x - median_c|`` for the keys (the absolute distance, so the budget goes where the
  step, and so the error of the other tokens, shrinks most in absolute terms), the values as
  before: the rule kvbits ships since (``OUTLIER_RULE = "keys-abs-median"``); ``abs2``: the
  absolute distance for the values too (``|x - median|`` over the token's channel group);
* ``mad``: the earlier rule on both sides; ``none``: kvquant-3:O=0;
* ``koff`` / ``voff``: no outliers on the keys / the values only (the cache stores zero
  corrections there, so its layout is kvquant-3's).

Per trial and variant: the teacher-forced log-probability of the key's tokens after the question
(as FP16 answers it: a space, then the digits) and the smallest logit margin of its tokens (> 0:
greedy decoding writes the key). The document is prefilled once in FP16 and copied into each
cache as ``kvbits needle`` does.

    KVBITS_CACHE=... python benchmarks/probes/needle_outlier_rule.py --seed 6 --out F.json
"""

import argparse
import json
import random
import time

import torch
from transformers import DynamicCache

from kvbits.cli import parse_presets
from kvbits.data import load_model, load_text, tokenize_text
from kvbits.eval import needle as nd
from kvbits.eval.cachefill import copy_dense_cache
from kvbits.integrations.hf import KVBitsCache, cache_kwargs
from kvbits.methods import kvquant as kvq

RULE = {"rule": "abs"}
_abs_score = kvq._outlier_score  # its default: the absolute distance (the keys' rule since session 57)


def _mad_score(x, dim, ok):
    """The rule before session 57, on both sides: the distance divided by the group's MAD (the
    values' score kvbits keeps)."""
    return _abs_score(x, dim, ok, spread=True)


def _score(x, dim, ok, spread=False):
    """The rule RULE names: ``abs2`` both sides absolute, ``abs`` the keys (scored along dim 3)
    only; MAD-normalized otherwise (``mad``, and ``koff`` / ``voff`` on the side that keeps its
    outliers; ``none`` has none)."""
    if RULE["rule"] == "abs2" or (dim == 3 and RULE["rule"] == "abs"):
        return _abs_score(x, dim, ok)
    return _mad_score(x, dim, ok)


kvq._outlier_score = _score
_split_keys, _split_values = kvq._split_keys, kvq._split_values
_quantize_keys, _quantize_values = kvq.quantize_keys, kvq.quantize_values


def _without(split, side):
    """``split`` with no outliers on ``side`` when RULE says so (the codebook fit's normalization)."""
    def fn(x, bits, group, n_out, valid):
        return split(x, bits, group, 0 if RULE["rule"] == side else n_out, valid)
    return fn


def _zero_corrections(quantize, side, at):
    """``quantize`` with no outliers on ``side`` when RULE says so: the cache still stores its
    ``n`` corrections per token, all zero (channel 0 plus 0), so the layout is unchanged.
    ``at``: the position of ``n_out`` in the store's positional call."""
    def fn(x, *args):
        if RULE["rule"] != side:
            return quantize(x, *args)
        args = list(args)
        n_out, args[at - 1] = args[at - 1], 0
        out = quantize(x, *args)
        B, H, T, D = x.shape
        idx = torch.zeros(B, H, T, n_out, dtype=kvq.outlier_index_dtype(D), device=x.device)
        return (*out[:3], idx, torch.zeros(B, H, T, n_out, dtype=torch.float16, device=x.device))
    return fn


kvq._split_keys = _without(_split_keys, "koff")
kvq._split_values = _without(_split_values, "voff")
kvq.quantize_keys = _zero_corrections(_quantize_keys, "koff", 5)  # (k, bits, G, cb, th, n_out, ...)
kvq.quantize_values = _zero_corrections(_quantize_values, "voff", 6)  # (v, bits, Gv, G, cb, th, n_out


def teacher_forced(model, cache, question, target):
    """Sum of log p(target) and the smallest logit margin over its tokens, through ``cache``."""
    ids = torch.cat([question, target], dim=1)
    with torch.no_grad():
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
    logits = out.logits[0, question.shape[1] - 1: -1].float()
    want = target[0]
    logp = logits.log_softmax(-1).gather(-1, want[:, None])[:, 0]
    right = logits.gather(-1, want[:, None])[:, 0]
    other = logits.scatter(-1, want[:, None], -torch.inf).amax(-1)
    return float(logp.sum()), float((right - other).min())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--preset", default="kvquant-3", help="the KVQuant preset under each rule")
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--rules", default="mad,abs,none")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model(args.model)
    text = load_text("sotu-2010-2016")
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    hay, ends = nd.haystack_ids(tok, text, 3 * max(lengths))
    rng = random.Random(args.seed)  # the draws of kvbits needle --seed over the same grid
    draws = {(t, n, d): (rng.randint(10000, 99999), rng.randint(0, max(0, len(hay) - n)))
             for n in lengths for d in depths for t in range(args.trials)}
    calib_ids = tokenize_text(tok, load_text("sotu-pre-2000"), 4096)
    caches = {}
    for rule in args.rules.split(","):
        spec = parse_presets(f"{args.preset}:O=0" if rule == "none" else args.preset)[0].spec
        RULE["rule"] = rule
        t0 = time.perf_counter()
        cal = kvq.calibrate(model, calib_ids, spec)
        print(f"{rule}: calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
        caches[rule] = (spec, cal)
    rows = []
    KVBitsCache(model, "kivi-2")  # the "kvbits" attention, as kvbits needle sets it
    for trial in range(args.trials):
        for n in lengths:
            for d in depths:
                key, off = draws[(trial, n, d)]
                p = nd.build_passkey_prompt(tok, hay, ends, n, d, key, off, True)
                ids = torch.tensor([p.ids])
                doc, question = ids[:, :-p.question_tokens], ids[:, -p.question_tokens:]
                target = torch.tensor([tok(f" {p.key}", add_special_tokens=False)["input_ids"]])
                dense = DynamicCache()
                with torch.no_grad():
                    model(doc, use_cache=True, logits_to_keep=1, **cache_kwargs(model, dense))
                row = {"trial": trial, "length": n, "depth": d, "key": p.key}
                for rule, (spec, cal) in caches.items():
                    RULE["rule"] = rule
                    cache = KVBitsCache(model, spec, calibration=cal)
                    copy_dense_cache(dense, cache)
                    row[rule] = teacher_forced(model, cache, question, target)
                row["fp16"] = teacher_forced(model, dense, question, target)
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    json.dump(rows, f)


if __name__ == "__main__":
    main()
