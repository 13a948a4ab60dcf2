"""Perplexity of each row of a left-padded batch against the same row run alone.

A batch of prompts of different lengths is left-padded and prefilled in one forward (as
``generate()`` does); then a common continuation of every row is fed in chunks, so the scored
tokens attend to the quantized prompt and continuation (as ``kvbits ppl`` scores). Each row is
also run alone with the same prompt and chunks. With a per-sequence sink (kvbits since session
22), a padded row keeps its own first tokens in FP16 and scores like its solo run; before, its
sink slot held padding. Rows come from different slices of the text.

    python benchmarks/padded_batch_ppl.py --presets fp16,kvquant-3,kivi-2:S=1 --name padded_batch
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import write_model_results  # noqa: E402
from kvbits.cli import make_cache_factory, parse_presets  # noqa: E402
from kvbits.data import load_model, load_text, tokenize_text  # noqa: E402
from kvbits.integrations.hf import cache_kwargs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def continuation_nll(model, prompts: list[list[int]], conts: torch.Tensor, cache, chunk: int,
                     pad_id: int) -> torch.Tensor:
    """Summed NLL ``[B]`` of ``conts [B, C]`` after the left-padded ``prompts``, fed in chunks."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = cache_kwargs(model, cache)
    nll = torch.zeros(len(prompts), dtype=torch.float64)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, **kw)
        last = out.logits[:, -1:]
        for c0 in range(0, conts.shape[1], chunk):
            x = conts[:, c0:c0 + chunk]
            mask = torch.cat([mask, torch.ones_like(x)], 1)
            pos = mask.sum(-1, keepdim=True) - x.shape[1] + torch.arange(x.shape[1])
            out = model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
            logits = torch.cat([last, out.logits[:, :-1]], 1)  # predicts x
            nll += torch.nn.functional.cross_entropy(
                logits.float().transpose(1, 2), x, reduction="none").sum(-1).double()
            last = out.logits[:, -1:]
    return nll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="sotu-2010-2016")
    ap.add_argument("--prompts", default="1024,600,257,65",
                    help="prompt tokens of each row (default 1024,600,257,65)")
    ap.add_argument("--cont", type=int, default=512, help="scored continuation tokens per row")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--presets", default="fp16,kvquant-3,kivi-2:S=1")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--name", default="padded_batch")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lens = [int(x) for x in args.prompts.split(",")]
    model, tok = load_model(args.model)
    ids = tokenize_text(tok, load_text(args.text))[0]
    span = max(lens) + args.cont
    if ids.numel() < span * len(lens):
        raise SystemExit(f"text has {ids.numel()} tokens, need {span * len(lens)}")
    rows = [ids[i * span: i * span + span].tolist() for i in range(len(lens))]
    prompts = [r[:n] for r, n in zip(rows, lens)]
    conts = torch.tensor([r[n:n + args.cont] for r, n in zip(rows, lens)])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    results = []
    for v in parse_presets(args.presets):
        make = make_cache_factory(model, v)
        t0 = time.time()
        batch = continuation_nll(model, prompts, conts, make(), args.chunk, pad_id)
        alone = torch.cat([continuation_nll(model, [p], conts[i:i + 1], make(), args.chunk,
                                            pad_id) for i, p in enumerate(prompts)])
        for i, n in enumerate(lens):
            ppl_b = math.exp(batch[i] / args.cont)
            ppl_a = math.exp(alone[i] / args.cont)
            results.append({"preset": v.label, "row": i, "prompt": n, "padding": max(lens) - n,
                            "ppl_alone": round(ppl_a, 4), "ppl_in_batch": round(ppl_b, 4),
                            "batch_vs_alone": f"{100 * (ppl_b / ppl_a - 1):+.2f}%"})
        print(f"{v.label}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    write_model_results(
        Path(args.out), args.name, f"Left-padded batch vs each row alone: {args.model} on "
        f"{args.text}", "padded_batch_ppl.py",
        {"model": args.model, "text": args.text, "continuation": args.cont, "chunk": args.chunk},
        results, ["preset", "row", "prompt", "padding", "ppl_alone", "ppl_in_batch",
                  "batch_vs_alone"],
        f"Rows take prompts of {args.prompts} tokens from different slices of the text, left-"
        f"padded to the longest and prefilled in one forward; then {args.cont} continuation "
        f"tokens per row are scored in chunks of {args.chunk} (they attend to the quantized "
        "history). `ppl_alone`: the same row as a batch of one.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
