"""Passkey retrieval (needle in a haystack) through a quantized KV cache.

A five-digit pass key is hidden in real text (State of the Union addresses by default)::

    <chat template: user>
    There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize
    it. I will quiz you about the pass key.

    ...haystack... The pass key is 71432. Remember it. 71432 is the pass key. ...haystack...

    What is the pass key?
    <chat template: assistant>The pass key is

and the model continues greedily for at most ``max_new_tokens`` tokens, stopping at its end of
turn (an EOS id of the model's generation config or of the tokenizer: SmolLM2's ``<|im_end|>``),
as ``generate`` would; what it would emit after that (a made-up next turn) is no part of the
answer. A trial is correct when the first run of digits in the answer is exactly the key. The
needle goes at the sentence boundary of the haystack nearest the requested depth (0 = first
thing after the instruction, 1 = right before the question; mid-sentence at the depth itself
when no sentence ends within max(64, 5%) of the haystack's tokens of it), and the whole prompt
is ``length`` tokens, starting with the BOS where the tokenizer puts one first (Gemma), as the
text of ``kvbits ppl`` does.

How the caches are compared
---------------------------
The prompt is split into the *document* (instruction + haystack + needle) and the *question*
(the last tokens: question and answer prefix, from the chat template). The document is prefilled
once per trial with a ``DynamicCache`` of full layers (full-precision attention; the model still
masks its sliding windows, and a sliding layer must hand over every token, not the window a
config-built ``DynamicCache`` keeps: :func:`kvbits.eval.cachefill.copy_dense_cache`). Each kvbits
preset then gets
a :class:`~kvbits.integrations.hf.KVBitsCache` holding those K/V, filled through the same calls a
prefill through the ``"kvbits"`` attention makes (:func:`kvbits.eval.cachefill.copy_dense_cache`:
same K/V, quantized in one call), so the prefill is shared by all presets. The question is then
fed as one chunk and the answer decoded token by token, both through the cache: every token of
the question and the answer attends to the document *as the cache stores it* (quantized body,
FP16 residual). This is the situation of a document cached once and queried later; a plain
``generate`` over the whole prompt would compute the first answer token from the full-precision
prefill instead, which hides most of the quantization error. FP16 (``DynamicCache``) goes through
the same procedure.

Presets may carry field overrides (``kivi-2:S=1``, as in ``kvbits ppl``). Calibrated presets
(``kvquant-*`` codebooks, ``kivi-N-hadc`` channel subsets, calibrated ``fp8`` scales) are
calibrated once on ``NeedleConfig.calib_text`` (SOTU 1900-1999 by default, disjoint from the
2010-2016 haystack), through the same cached calibration as ``kvbits ppl``. Every row records
``kv_bits``: bits per stored K/V element of the document in that cache, floating-point parts
counted at 2 bytes (16.0 for FP16; the FP16 residual and sink tokens included, so it is higher at
short lengths).
"""

from __future__ import annotations

import math
import random
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..checks import is_count, repeated, require_count
from ..data import bos_prefix

__all__ = ["NeedleConfig", "PasskeyPrompt", "build_passkey_prompt", "check_needle_config",
           "eos_ids", "haystack_ids", "needle_caches", "needle_markdown", "needle_meta",
           "passkey_correct", "plot_needle", "run_needle", "summarize", "write_needle"]

INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. Find it "
               "and memorize it. I will quiz you about the pass key.\n\n")
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"


@dataclass
class NeedleConfig:
    model: str = "smollm2"
    text: str = "sotu-2010-2016"
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    presets: tuple[str, ...] = ("fp16", "kivi-4", "kivi-2")
    trials: int = 2
    max_new_tokens: int = 8
    seed: int = 0
    chat: bool = True
    calib_text: str = "sotu-pre-2000"  # calibrated presets (kvquant, -hadc, fp8) only
    calib_tokens: int = 4096
    calibration: str | None = None  # kvquant presets: a kvbits calibrate file instead


@dataclass
class PasskeyPrompt:
    ids: list[int]  # the whole prompt
    question_tokens: int  # how many of the last tokens are the question (fed through the cache)
    needle_at: int  # token index where the needle starts
    key: str


def passkey_correct(answer: str, key: str | int) -> bool:
    """Whether the first run of digits in ``answer`` is exactly ``key``.

    >>> passkey_correct(" 71432.", 71432), passkey_correct(" 7143", 71432), passkey_correct("714321", 71432)
    (True, False, False)
    """
    digits = re.findall(r"\d+", answer)
    return bool(digits) and digits[0] == str(key)


def haystack_ids(tokenizer, text: str, max_tokens: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` (no special tokens) and the indices ``i`` where a sentence ends
    right before token ``i`` (allowed insertion points)."""
    if max_tokens is not None:
        text = text[: 8 * max_tokens + 1024]
    ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    if max_tokens is not None:
        ids = ids[:max_tokens]
    ends = [0]
    for i, t in enumerate(ids):
        s = tokenizer.decode([t])
        if s.rstrip().endswith((".", "?", "!")) and s.strip():
            ends.append(i + 1)
    return ids, ends


def _template_parts(tokenizer, chat: bool) -> tuple[str, str]:
    """Text before the haystack and after it (question + answer prefix)."""
    if chat and getattr(tokenizer, "chat_template", None):
        mark = "\x00HAYSTACK\x00"
        msgs = [{"role": "user", "content": INSTRUCTION + mark + QUESTION}]
        full = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        head, tail = full.split(mark)
        return head, tail + ANSWER_PREFIX
    return INSTRUCTION, QUESTION + " " + ANSWER_PREFIX


def build_passkey_prompt(tokenizer, hay: list[int], ends: list[int], length: int, depth: float,
                         key: str | int, offset: int = 0, chat: bool = True) -> PasskeyPrompt:
    """A ``length``-token prompt with the needle at ``depth`` (0..1) of the haystack.

    ``hay``/``ends`` come from :func:`haystack_ids`; the haystack starts at the sentence
    boundary at or after token ``offset`` (different trials use different text).
    """
    if not 0 <= depth <= 1:  # (a percentage went right before the question; NaN near 0)
        raise ValueError(f"depth must be a fraction in [0, 1] (0: right after the instruction, "
                         f"1: right before the question), got {depth}")
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])
    head_s, tail_s = _template_parts(tokenizer, chat)
    head, tail = enc(head_s), enc(tail_s)
    # the BOS the tokenizer puts first (Gemma; not SmolLM2 or Qwen), as ppl's text has it
    # (kvbits.data.tokenize_text); a chat template that writes it already keeps its own
    bos = bos_prefix(tokenizer)
    if bos and head[:1] != bos:
        head = bos + head
    needle = enc(NEEDLE.format(key=key))
    n_hay = length - len(head) - len(tail) - len(needle)
    if n_hay <= 0:
        raise ValueError(f"length {length} is too short for the instruction, needle and question "
                         f"({length - n_hay} tokens): give lengths (--lengths) longer than that")
    start = next((e for e in ends if e >= offset), 0)
    if start + n_hay > len(hay):
        start = 0
    if n_hay > len(hay):
        raise ValueError(f"the haystack text has {len(hay)} tokens; a {length}-token prompt "
                         f"needs {n_hay} of it: give a longer text or shorter lengths")
    body = hay[start:start + n_hay]
    local_ends = [e - start for e in ends if start <= e <= start + n_hay]
    want = round(depth * n_hay)
    pos = min(local_ends, key=lambda e: (abs(e - want), e)) if local_ends else want
    if abs(pos - want) > max(64, n_hay // 20):  # no sentence end near the depth (a text
        pos = want  # without . ? ! put every needle at depth 0): mid-sentence, at the depth
    if depth >= 1.0:
        pos = n_hay
    elif depth <= 0.0:
        pos = 0
    ids = head + body[:pos] + needle + body[pos:] + tail
    return PasskeyPrompt(ids, len(tail), len(head) + pos, str(key))


def eos_ids(model, tokenizer=None) -> set[int]:
    """The token ids that end the answer: the model's ``generation_config.eos_token_id`` (an id
    or a list) and the tokenizer's ``eos_token_id``."""
    out: set[int] = set()
    for src in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        out.update(int(i) for i in (src if isinstance(src, (list, tuple, set)) else [src]))
    return out


@torch.no_grad()
def _answer(model, cache, question: torch.Tensor, max_new_tokens: int,
            eos: set[int] | None = None) -> list[int]:
    """Feed ``question [1, T]`` through ``cache`` as one chunk, then decode greedily until an
    ``eos`` id (default :func:`eos_ids` of the model), which is not returned, or
    ``max_new_tokens`` tokens."""
    from ..integrations.hf import cache_kwargs

    eos = eos_ids(model) if eos is None else eos
    kw = cache_kwargs(model, cache)
    out = model(question, use_cache=True, logits_to_keep=1, **kw)
    new = []
    for i in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        if int(nxt) in eos:
            break
        new.append(int(nxt))
        if i + 1 < max_new_tokens:
            out = model(nxt, use_cache=True, logits_to_keep=1, **kw)
    return new


def needle_caches(model, cfg: NeedleConfig) -> dict:
    """``{preset: (spec, make_cache)}`` for ``cfg.presets`` (``kivi-2:S=1`` overrides allowed);
    calibrated presets are calibrated once on ``cfg.calib_text`` (cached, as in ``kvbits ppl``).
    ``make_cache`` is None for FP16 (the prefill's ``DynamicCache`` is used)."""
    from ..cli import make_cache_factory, parse_presets

    return {v.label: (v.spec, make_cache_factory(model, v, calib_text=cfg.calib_text,
                                                 calib_tokens=cfg.calib_tokens,
                                                 calibration=cfg.calibration)
                      if v.spec.quantized else None)
            for v in parse_presets(",".join(cfg.presets))}


def _kv_bits(cache) -> float:
    """Bits per stored K/V element, floating-point parts counted at 2 bytes (per element held:
    a sliding-window layer holds fewer than the tokens seen)."""
    from .frontier import bits_per_element
    from .perplexity import cache_elements, cache_nbytes

    return bits_per_element(cache_nbytes(cache, fp16=True), cache_elements(cache))


def check_needle_config(cfg: NeedleConfig) -> None:
    """Refuse, naming the field, a grid :func:`run_needle` cannot serve as asked: depths outside
    [0, 1] (percentages), a length or depth given twice (its trials counted twice), no lengths
    or depths, no trials or no answer tokens (every preset 0%)."""
    for name, minimum in (("trials", 1), ("max_new_tokens", 1)):
        require_count(f"NeedleConfig.{name}", getattr(cfg, name), minimum)

    def fraction(d) -> bool:  # (NaN compares false)
        return isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1

    depths = ("fractions in [0, 1] (0: right after the instruction, 1: right before the "
              "question; kvbits needle --depths takes percentages)")
    for name, ok, what in (("lengths", is_count, "token counts >= 1"),
                           ("depths", fraction, depths)):
        values = tuple(getattr(cfg, name))
        if not values:
            raise ValueError(f"NeedleConfig.{name}: give at least one")
        bad = [v for v in values if not ok(v)]
        if bad:
            raise ValueError(f"NeedleConfig.{name}: {what}, got {bad[0]!r}")
        twice = repeated(values)
        if twice:
            raise ValueError(f"NeedleConfig.{name}: {', '.join(map(str, twice))} given twice "
                             "(its trials would count twice); give each once")


def run_needle(model, tokenizer, text: str, cfg: NeedleConfig,
               log: Callable[[str], None] = print,
               on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every (length, depth, trial) for every preset; one row per run (see module docstring)."""
    from transformers import DynamicCache

    from ..integrations.hf import KVBitsCache, cache_kwargs
    from .cachefill import copy_dense_cache
    from .perplexity import trained_positions

    check_needle_config(cfg)  # before any work
    max_len = max(cfg.lengths)
    trained = trained_positions(model)
    if trained and max_len > trained:  # measured anyway: retrieval past it tests the model
        warnings.warn(f"needle: length {max_len} is past the {trained} positions the model was "
                      "trained for; FP16 itself may miss the key there", stacklevel=2)
    hay, ends = haystack_ids(tokenizer, text, 3 * max_len)
    # the longest prompt first: a text too short for it failed after every shorter trial had run
    build_passkey_prompt(tokenizer, hay, ends, max_len, 0.5, 10000, 0, cfg.chat)
    stop = eos_ids(model, tokenizer)
    rng = random.Random(cfg.seed)
    # Trial-major order: every (length, depth) cell gets trial 0 before any gets trial 1, so a
    # run stopped early (results are written after every trial) still covers the whole grid.
    draws = {(t, n, d): (rng.randint(10000, 99999), rng.randint(0, max(0, len(hay) - n)))
             for n in cfg.lengths for d in cfg.depths for t in range(cfg.trials)}
    # every prompt once before any work: a length too short for the instruction, needle and
    # question failed only at its first trial, after the other lengths' trials had run
    for (_, length, depth), (key, offset) in draws.items():
        build_passkey_prompt(tokenizer, hay, ends, length, depth, key, offset, cfg.chat)
    caches = needle_caches(model, cfg)
    specs = {p: spec for p, (spec, _) in caches.items()}
    for preset, spec in specs.items():
        kept = spec.sink_tokens + spec.residual_length + spec.group_size
        if spec.quantized and min(cfg.lengths) < kept:
            warnings.warn(f"needle: {preset} keeps up to {kept} tokens in FP16 (sink, residual "
                          f"and a group filling), so at length {min(cfg.lengths)} it quantizes "
                          "little or nothing and answers as FP16 does", stacklevel=2)
    # Switch the model to the "kvbits" attention once (untagged tensors, as from DynamicCache,
    # take plain SDPA there).
    KVBitsCache(model, "kivi-2")
    rows: list[dict] = []
    device = next(model.parameters()).device
    for trial in range(cfg.trials):
        for length in cfg.lengths:
            for depth in cfg.depths:
                key, offset = draws[(trial, length, depth)]
                p = build_passkey_prompt(tokenizer, hay, ends, length, depth, key, offset, cfg.chat)
                ids = torch.tensor([p.ids], device=device)
                doc, question = ids[:, :-p.question_tokens], ids[:, -p.question_tokens:]
                t0 = time.perf_counter()
                dense = DynamicCache()  # full layers: sliding ones must copy every token
                with torch.no_grad():
                    model(doc, use_cache=True, logits_to_keep=1, **cache_kwargs(model, dense))
                prefill_s = time.perf_counter() - t0
                # FP16 reads the DynamicCache itself, so it goes last; rows keep cfg's order.
                order = [q for q in cfg.presets if specs[q].quantized] + \
                        [q for q in cfg.presets if not specs[q].quantized]
                trial_rows = {}
                for preset in order:
                    t1 = time.perf_counter()
                    if specs[preset].quantized:
                        cache = caches[preset][1]()
                        copy_dense_cache(dense, cache)
                    elif preset != order[-1]:  # another FP16 preset reads it after this one
                        cache = DynamicCache()
                        copy_dense_cache(dense, cache)
                    else:
                        cache = dense  # FP16: the DynamicCache itself (used last)
                    kv_bits = _kv_bits(cache)
                    new = _answer(model, cache, question, cfg.max_new_tokens, stop)
                    answer = tokenizer.decode(new, skip_special_tokens=True)
                    ok = passkey_correct(answer, p.key)
                    trial_rows[preset] = ({"length": length, "depth": depth, "trial": trial,
                                 "preset": preset, "spec": specs[preset].describe(),
                                 "key": p.key, "answer": answer, "correct": ok,
                                 "needle_at": p.needle_at, "prompt_tokens": len(p.ids),
                                 "kv_bits": round(kv_bits, 3),
                                 "prefill_s": round(prefill_s, 2),
                                 "answer_s": round(time.perf_counter() - t1, 2)})
                    log(f"len {length} depth {depth:.2f} trial {trial} {preset:>11}: "
                        f"{'OK ' if ok else 'MISS'} key {p.key} -> {answer!r}")
                    del cache
                del dense
                rows += [trial_rows[q] for q in cfg.presets]
                if on_row is not None:
                    on_row(rows)
    return rows


def summarize(rows: list[dict]) -> dict:
    """``{preset: {"acc": overall, (length, depth): accuracy}}``."""
    out: dict = {}
    for r in rows:
        d = out.setdefault(r["preset"], {"_n": 0, "_ok": 0})
        d["_n"] += 1
        d["_ok"] += r["correct"]
        cell = d.setdefault((r["length"], r["depth"]), [0, 0])
        cell[0] += r["correct"]
        cell[1] += 1
    for d in out.values():
        d["acc"] = d.pop("_ok") / d.pop("_n")
        for k in [k for k in d if isinstance(k, tuple)]:
            ok, n = d[k]
            d[k] = ok / n
    return out


def paired_against(rows: list[dict], base: str = "fp16") -> dict:
    """``{preset: (pairs, lost, won, p)}`` against ``base`` over the trials both ran.

    Every preset sees the same key and haystack in a given (length, depth, trial), so the trials
    pair up: ``lost`` counts those ``base`` got and the preset missed, ``won`` the reverse, and
    ``p`` is the exact two-sided McNemar test (a binomial test on the discordant pairs), which
    says whether a gap in accuracy is more than the trials' luck.
    """
    ref = {(r["length"], r["depth"], r["trial"]): r["correct"]
           for r in rows if r["preset"] == base}
    out: dict = {}
    for r in rows:
        key = (r["length"], r["depth"], r["trial"])
        if r["preset"] == base or key not in ref:
            continue
        n, lost, won = out.get(r["preset"], (0, 0, 0))
        out[r["preset"]] = (n + 1, lost + (ref[key] and not r["correct"]),
                            won + (r["correct"] and not ref[key]))
    for preset, (n, lost, won) in out.items():
        d = lost + won
        tail = sum(math.comb(d, i) for i in range(min(lost, won) + 1)) / 2 ** d
        out[preset] = (n, lost, won, min(1.0, 2 * tail))
    return out


def _pct(depth: float) -> str:
    """A depth as a percentage, as given (12.5%, not a rounded 12%; 25% stays 25%)."""
    return f"{round(100 * depth, 6):g}%"


def needle_markdown(rows: list[dict], meta: dict) -> str:
    """Accuracy per preset, per length x depth, plus the command and versions."""
    from .memory import markdown_table
    from .report import incomplete_note

    s = summarize(rows)
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    counts = {}
    for r in rows:
        counts[(r["preset"], r["length"], r["depth"])] = counts.get(
            (r["preset"], r["length"], r["depth"]), 0) + 1
    lo, hi = (min(counts.values()), max(counts.values())) if counts else (0, 0)
    trials = str(lo) if lo == hi else f"{lo} to {hi}"
    lines = [f"# Passkey retrieval through the cache: {meta.get('model')} on {meta.get('text')}",
             "", "```", meta.get("command", ""), "```", "",
             # (files written after every trial: a run stopped early looked whole)
             *([incomplete_note(len(rows), meta.get("expected_rows"), "trials"), ""]
               if meta.get("complete") is False else []),
             f"{meta.get('date', '')}; {meta.get('device', 'cpu')}; "
             + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()) + ".", "",
             ("Exact match of the 5-digit key (first run of digits in the greedy answer of "
             f"{meta.get('max_new_tokens', 8)} tokens), {trials} trial(s) per cell, each with its "
             "own key and haystack offset. The document is prefilled once per trial at full "
             "precision and stored in each cache; the question and the answer attend to it "
             "through the cache (module docstring of `kvbits.eval.needle`)."), "",
             "## Overall", ""]
    head = ["preset", "spec", "accuracy", *[f"{n // 1024}k" if n % 1024 == 0 else str(n)
                                            for n in lengths]]
    body = []
    for p in presets:
        spec = next(r["spec"] for r in rows if r["preset"] == p)
        per_len = []
        for n in lengths:
            cells = [r["correct"] for r in rows if r["preset"] == p and r["length"] == n]
            per_len.append(f"{100 * sum(cells) / len(cells):.0f}%" if cells else "-")
        body.append([p, spec, f"{100 * s[p]['acc']:.1f}%", *per_len])
    lines += [markdown_table(head, body), ""]
    paired = paired_against(rows)
    if paired:
        lines += ["## Paired against fp16", "",
                  ("Trials that FP16 answered and the preset missed (lost) or the reverse (won), "
                   "over the same keys and haystacks; p is the exact two-sided McNemar test "
                   "(small p: the gap is more than the trials' luck)."), ""]
        lines += [markdown_table(["preset", "pairs", "lost", "won", "p"],
                                 [[p, str(n), str(lost), str(won), f"{pv:.3g}"]
                                  for p, (n, lost, won, pv) in paired.items()]), ""]
    if any("kv_bits" in r for r in rows):
        lines += ["## Effective KV bits", "",
                  ("Bits per stored K/V element of the document in the cache (mean over its "
                   "trials), floating-point parts counted at 2 bytes; the FP16 residual and sink "
                   "tokens are included, hence more bits at short lengths."), ""]
        tab = []
        for p in presets:
            cells = []
            for n in lengths:
                b = [r["kv_bits"] for r in rows if r["preset"] == p and r["length"] == n
                     and "kv_bits" in r]
                cells.append(f"{sum(b) / len(b):.2f}" if b else "-")
            tab.append([p, *cells])
        lines += [markdown_table(["preset", *[str(n) for n in lengths]], tab), ""]
    for p in presets:
        lines += [f"## {p}: accuracy by depth (rows) and length (columns)", ""]
        tab = []
        for d in depths:
            tab.append([_pct(d), *[f"{100 * s[p][(n, d)]:.0f}%" if (n, d) in s[p]
                                              else "-" for n in lengths]])
        lines += [markdown_table(["depth", *[str(n) for n in lengths]], tab), ""]
    misses = [r for r in rows if not r["correct"]]
    if misses:
        lines += ["## Misses", ""]
        lines += [markdown_table(["preset", "length", "depth", "trial", "key", "answer"],
                                 [[r["preset"], str(r["length"]), _pct(r["depth"]),
                                   str(r["trial"]), r["key"], repr(r["answer"])]
                                  for r in misses]), ""]
    return "\n".join(lines)


def plot_needle(rows: list[dict], path, title: str = "") -> None:
    """Heatmap per preset: accuracy over (length, depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(rows)
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(3.2 * len(presets) + 1, 3.4),
                             squeeze=False, constrained_layout=True)
    im = None
    for ax, p in zip(axes[0], presets):
        grid = [[s[p].get((n, d), float("nan")) for n in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [_pct(d) for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{p} ({100 * s[p]['acc']:.0f}%)")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
    axes[0][0].set_ylabel("needle depth")
    if im is not None:
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_needle(out_dir, rows: list[dict], meta: dict, name: str = "needle") -> list:
    """``name.json`` (meta + rows), ``name.md`` and ``name.png`` in ``out_dir``; returns the paths.
    ``meta["complete"] is False`` (with ``meta["expected_rows"]``) marks the files of a run not
    finished (kvbits needle writes them after every trial)."""
    import json
    from pathlib import Path

    from ..files import write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md", out / f"{name}.png"]
    write_text_atomic(paths[0], json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    write_text_atomic(paths[1], needle_markdown(rows, meta))
    if rows:
        plot_needle(rows, paths[2], title=f"passkey retrieval, {meta.get('model')}, "
                    f"{meta.get('text')} haystack")
    return paths


def needle_meta(cfg: NeedleConfig, command: str, versions: dict, device: str = "cpu") -> dict:
    import datetime

    return {"command": command, "model": cfg.model, "text": cfg.text,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": device, "threads": torch.get_num_threads(), "versions": versions,
            "max_new_tokens": cfg.max_new_tokens, "config": asdict(cfg)}
