"""Prompt-lookup decoding over the quantized cache: speed and agreement with plain decoding.

A real model is asked to repeat a paragraph of real text (a task where drafts copied from the
prompt are often right, as in editing, quoting or summarizing with citations). Each preset
generates the same greedy continuation twice through transformers' ``generate``: plainly, and
with ``prompt_lookup_num_tokens`` (drafts verified in one multi-row step; the rejected ones
cropped from the cache's FP16 residual). Reported: wall time, tokens per forward, and whether
the two texts agree (for FP16 they must; for quantized presets the first round is verified at
full precision together with the prompt, so the texts may part at a near-tie).

    python benchmarks/prompt_lookup.py --threads 2 --presets fp16,kivi-4,kivi-2,kvquant-3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import write_model_results  # noqa: E402
from kvbits.cli import make_cache_factory, parse_presets  # noqa: E402
from kvbits.data import load_model, load_text  # noqa: E402
from kvbits.integrations.hf import cache_kwargs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def paragraphs(text: str, tok, n: int, tokens: int = 100) -> list[str]:
    """``n`` passages of whole sentences, each just past ``tokens`` tokens, starting at evenly
    spaced sentences of the text."""
    sentences = [x.strip() + "." for x in text.replace("\n", " ").split(". ") if x.strip()]
    out = []
    for i in range(n):
        j, passage = i * len(sentences) // n, []
        while j < len(sentences) and len(tok(" ".join(passage)).input_ids) < tokens:
            passage.append(sentences[j])
            j += 1
        out.append(" ".join(passage))
    return out


def run(model, ids, cache, new: int, lookup: int) -> tuple[list[int], float, int]:
    """Greedy continuation (tokens), seconds, and the number of model forwards."""
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 temperature=None, top_p=None, top_k=None,
                                 **kw, **cache_kwargs(model, cache))
        seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    return out[0, ids.shape[1]:].tolist(), seconds, calls[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="sotu-2010-2016")
    ap.add_argument("--presets", default="fp16,kivi-4,kivi-2,kvquant-3")
    ap.add_argument("--prompts", type=int, default=3, help="paragraphs (default 3)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per generation")
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--name", default="prompt_lookup")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    prompts = []
    for para in paragraphs(load_text(args.text), tok, args.prompts):
        msgs = [{"role": "user", "content": "Repeat the following text word for word.\n\n" + para}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, return_tensors="pt").input_ids)
    rows = []
    for v in parse_presets(args.presets):
        make = make_cache_factory(model, v)
        run(model, prompts[0][:, :64], make(), 4, args.lookup)  # warm-up (and calibration)
        for i, ids in enumerate(prompts):
            plain, t_plain, _ = run(model, ids, make(), args.new, 0)
            drafted, t_look, f_look = run(model, ids, make(), args.new, args.lookup)
            agree = next((j for j, (a, b) in enumerate(zip(plain, drafted)) if a != b), args.new)
            rows.append({"preset": v.label, "prompt": i, "prompt_tokens": ids.shape[1],
                         "new_tokens": args.new, "plain_s": round(t_plain, 2),
                         "lookup_s": round(t_look, 2), "speedup": round(t_plain / t_look, 2),
                         "tokens_per_forward": round(args.new / max(1, f_look - 1), 2),
                         "same_text": plain == drafted, "agree_tokens": agree})
            print(rows[-1], file=sys.stderr, flush=True)
    write_model_results(
        Path(args.out), args.name, f"Prompt-lookup decoding through the cache: {args.model} on "
        f"{args.text}", "prompt_lookup.py",
        {"model": args.model, "text": args.text, "new_tokens": args.new, "lookup": args.lookup,
         "threads": torch.get_num_threads()}, rows, list(rows[0]),
        f"Each prompt asks the model (chat template) to repeat one paragraph of the text; "
        f"{args.new} greedy tokens through `generate`, plainly (`plain_s`) and with "
        f"`prompt_lookup_num_tokens={args.lookup}` (`lookup_s`). `tokens_per_forward`: new "
        "tokens per decode forward with lookup (the prefill forward not counted). "
        "`agree_tokens`: how many leading tokens the two texts share (FP16 must agree on all; "
        "a quantized cache verifies the first drafts at full precision with the prompt, so its "
        "texts may part at a near-tie).", setting=f"CPU, {torch.get_num_threads()} threads; ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
