"""Probe (CPU, session 57): perplexity of the KVQuant presets under each key-outlier rule of
``needle_outlier_rule.py`` (the rules, and the patch that applies them, live there), each rule
with codebooks refitted under it, in memory, on the calibration text ``kvbits ppl`` uses.

    KVBITS_CACHE=... python benchmarks/probes/outlier_rule_ppl.py --model gemma3-270m \
        --text lee-news --tokens 2048 --presets kvquant-3,kvquant-2 --rules mad,abs
"""

import argparse
import json
import time

import torch
from needle_outlier_rule import RULE  # (patches kvquant's outlier selection on import)

from kvbits.cli import parse_presets
from kvbits.data import load_model, load_text, tokenize_text
from kvbits.eval.perplexity import perplexity
from kvbits.integrations.hf import KVBitsCache
from kvbits.methods import kvquant as kvq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="lee-news")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--presets", default="kvquant-3")
    ap.add_argument("--rules", default="mad,abs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model(args.model)
    ids = tokenize_text(tok, load_text(args.text), args.tokens)
    calib = tokenize_text(tok, load_text("sotu-pre-2000"), args.calib_tokens)
    from transformers import DynamicCache
    rows = [{"preset": "fp16", "ppl": perplexity(model, ids, DynamicCache, progress=False)["ppl"]}]
    print(json.dumps(rows[-1]), flush=True)
    for preset in args.presets.split(","):
        spec = parse_presets(preset)[0].spec
        for rule in args.rules.split(","):
            RULE["rule"] = rule
            t0 = time.perf_counter()
            cal = kvq.calibrate(model, calib, spec)
            r = perplexity(model, ids, lambda s=spec, c=cal: KVBitsCache(model, s, calibration=c),
                           progress=False)
            rows.append({"preset": preset, "rule": rule, "ppl": r["ppl"],
                         "vs_fp16": r["ppl"] / rows[0]["ppl"] - 1,
                         "s": round(time.perf_counter() - t0)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
