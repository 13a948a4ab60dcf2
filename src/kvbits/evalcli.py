"""The evidence subcommands of ``kvbits``: ``bench`` (end-to-end decode speed and memory, GPU)
and ``needle`` (passkey retrieval). Registered by :func:`kvbits.cli.build_parser`; kept here so
that ``cli.py`` only gains the registration call. Nothing heavy is imported until a command runs.

    kvbits needle --lengths 1024,2048,4096,8192 --presets fp16,kivi-4,kivi-2 --out benchmarks/results
    kvbits bench --model llama-2-7b --contexts 4096,32768 --presets fp16,hf-quantized,kivi-2 --out DIR
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from .checks import repeated


def _log(msg: str) -> None:
    print(f"[kvbits] {msg}", file=sys.stderr, flush=True)


MAX_COUNT = 2**31 - 1  # token counts, batches, contexts: int32 in the kernels
BATCH_CAP = 512  # bench --batch-cap's default
HF_MAX_TOKENS = 1 << 22  # bench --hf-max-tokens' default


def _int_k(item: str) -> int:
    """``"4k"`` -> 4096, ``"300"`` -> 300; one trailing ``k`` only (``"k8"``, ``"1kk"`` fail)."""
    item = item.strip().lower()
    return int(item[:-1]) * 1024 if item.endswith("k") else int(item)


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(_int_k(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (4k = 4096), got {text!r}") from None
    if not vals or min(vals) < 1 or max(vals) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected integers in 1..{MAX_COUNT}, got {text!r}")
    return _once(vals)


def _once(vals: tuple, show=str) -> tuple:
    """``vals``, each given once: a repeated one ran its cells twice (needle counted their
    trials twice)."""
    twice = repeated(vals)
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(map(show, twice))} given twice; give each "
                                         "once")
    return vals


def _depths(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentages, got {text!r}") from None
    if not vals or not all(0 <= v <= 100 for v in vals):  # (NaN compares false: refused)
        raise argparse.ArgumentTypeError(f"depths are percentages in 0..100, got {text!r}")
    return tuple(v / 100 for v in _once(vals, lambda v: f"{v:g}"))


def _preset_items(text: str) -> tuple[str, ...]:
    """Presets with overrides, as ``kvbits ppl --presets`` splits them (``kivi-2:S=1,R=64``)."""
    from .cli import _split_items

    try:
        items = tuple(_split_items(text))
    except ValueError as exc:  # (a preset given twice)
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--presets: ")) from None
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated presets, got {text!r}")
    return items


def _positive(text: str) -> int:
    from .cli import _positive as parse

    return parse(text)


def _non_negative(text: str) -> int:
    from .cli import _non_negative as parse

    return parse(text)


def _file_stem(text: str) -> str:
    """``--name``: the stem of the files written into ``--out``, a plain name (no folder, not
    empty, not ``.`` or ``..``), so that nothing is written elsewhere or fails after a run."""
    if not text or text in (".", "..") or "/" in text or "\\" in text:
        raise argparse.ArgumentTypeError(
            f"expected a plain file name without folders (the files go into --out), got {text!r}")
    return text


# ------------------------------------------------------------------------------------- needle
def _cmd_needle(args) -> int:
    import torch

    from .cli import (
        _check_calib_text,
        _check_calib_tokens,
        _check_calibration,
        _check_spec_layers,
        _check_text,
        _versions,
        check_device,
        load_model_option,
        parse_presets,
        resolve_dtype,
        run_info,
    )
    from .data import load_text
    from .eval.needle import NeedleConfig, needle_meta, run_needle, write_needle

    dtype = resolve_dtype(args.dtype, check_device(args.device), "needle")  # before the model
    variants = parse_presets(",".join(args.presets))
    _check_calibration(args.calibration, variants)  # fail early
    haystack = _check_text(args.text, "--text")  # (a file: read once, here)
    calib_text = _check_calib_text(args.calib_text, args.calibration, variants)
    calib_tokens = _check_calib_tokens(args.calib_tokens, args.calibration, variants)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = NeedleConfig(model=args.model, text=args.text, lengths=args.lengths, depths=args.depths,
                       presets=args.presets, trials=args.trials,
                       max_new_tokens=args.max_new_tokens, seed=args.seed, chat=not args.no_chat,
                       calib_text=calib_text, calib_tokens=calib_tokens,
                       calibration=args.calibration)
    _log(f"loading model {cfg.model!r} and text {cfg.text!r}")
    model, tok = load_model_option(cfg.model, dtype=dtype, device=args.device)
    _check_spec_layers(variants, model, "--presets")
    text = load_text(cfg.text, log=_log) if haystack is None else haystack
    if cfg.chat and not getattr(tok, "chat_template", None):
        _log(f"{cfg.model}'s tokenizer has no chat template (a base model): the passkey prompt "
             "goes in as plain text")
    meta = needle_meta(cfg, shlex.join(["kvbits", *args.argv]), _versions(),
                       device=str(args.device))
    meta.update(run_info(model), git=_git_commit())

    # every (preset, length, depth, trial): the files say whether they hold them all yet
    expected = len(cfg.presets) * len(cfg.lengths) * len(cfg.depths) * cfg.trials

    def save(rows, final=False):
        return write_needle(args.out, rows, {**meta, "complete": final or len(rows) >= expected,
                                             "expected_rows": expected}, args.name)

    rows = run_needle(model, tok, text, cfg, log=_log, on_row=save)
    paths = save(rows, final=True)
    _log("wrote " + ", ".join(map(str, paths)))
    return 0


def _git_commit() -> str | None:
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("KVBITS_SOURCE_COMMIT"):  # running from an exported snapshot of a commit
        return os.environ["KVBITS_SOURCE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def register(sub) -> None:
    """Add ``bench`` and ``needle`` to the ``kvbits`` subcommands."""
    from .cli import _device_options

    _register_bench(sub)
    p = sub.add_parser("needle", help="passkey retrieval (needle in a haystack) through the cache",
                       description="Hide a 5-digit pass key at several depths of real text, ask "
                       "for it, score exact matches, per preset, prompt length and depth. The "
                       "question and the answer attend to the document through the cache. "
                       "Writes NAME.json, NAME.md and a heatmap NAME.png into --out.")
    p.add_argument("--model", default="smollm2", help="model name, folder or .gguf (default smollm2)")
    p.add_argument("--text", default="sotu-2010-2016", help="haystack text (default sotu-2010-2016)")
    p.add_argument("--lengths", type=_ints, default=(1024, 2048, 4096, 8192),
                   help="prompt lengths in tokens, comma-separated (default 1k,2k,4k,8k)")
    p.add_argument("--depths", type=_depths, default=(0.0, 0.25, 0.5, 0.75, 1.0),
                   help="needle depths in percent (default 0,25,50,75,100)")
    p.add_argument("--presets", type=_preset_items, default=("fp16", "kivi-4", "kivi-2"),
                   help="comma-separated presets, with overrides as in ppl (kivi-2:S=1) "
                   "(default fp16,kivi-4,kivi-2)")
    p.add_argument("--trials", type=_positive, default=2,
                   help="keys per (length, depth) (default 2)")
    p.add_argument("--max-new-tokens", type=_positive, default=8, help="answer tokens (default 8)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the pass keys and haystack offsets (default 0)")
    p.add_argument("--no-chat", action="store_true", help="plain prompt, no chat template")
    p.add_argument("--calib-text",  # (None: not given; see _check_calib_text)
                   help="calibration text of calibrated presets (kvquant, -hadc, fp8); default "
                   "sotu-pre-2000, disjoint from the haystack")
    p.add_argument("--calib-tokens", type=_positive,  # (None: not given)
                   help="tokens of --calib-text that calibrated presets calibrate on (default "
                   "4096)")
    p.add_argument("--calibration", metavar="PATH",
                   help="kvquant presets: codebooks from this kvbits calibrate file instead of "
                   "calibrating on --calib-text (-hadc and fp8 presets still calibrate on it)")
    _device_options(p, "needle")
    p.add_argument("--threads", type=_positive,
                   help="torch CPU threads (default: torch's own, one per core)")
    p.add_argument("--out", default="kvbits-results",
                   help="output folder (default ./kvbits-results; the committed tables of a "
                   "checkout are in benchmarks/results and are not overwritten by default)")
    p.add_argument("--name", type=_file_stem, default="needle",
                   help="file stem inside --out (default needle)")
    p.set_defaults(func=_cmd_needle)


# -------------------------------------------------------------------------------------- bench
def _check_cpu_weights(model: str, layers: int | None) -> None:
    """A CPU smoke test builds float32 weights: refuse a model whose weights would take more
    than half of this machine's memory (a 7B config needs ~27 GB) instead of running it out."""
    from .eval.speed import model_config

    cfg = model_config(model, layers=layers)
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * cfg.intermediate_size
    tied = getattr(cfg, "tie_word_embeddings", False)
    nbytes = 4 * (n * per_layer + (1 if tied else 2) * cfg.vocab_size * h)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform: no check
        return
    if nbytes > ram / 2:
        raise ValueError(f"--device cpu: --model {model} needs ~{nbytes / 2**30:.0f} GiB of "
                         f"float32 weights, more than half of this machine's "
                         f"{ram / 2**30:.0f} GiB; the CPU run is a smoke test: use a small "
                         "--model (tiny, smollm2) or fewer --layers")


def _device_arg(text: str, *, auto: bool = False) -> str:
    """``--device``: cpu, cuda or cuda:N; with ``auto`` (kvbits generate), auto too."""
    index = text[5:]  # (isascii: "cuda:²" passes isdigit, then fails in int())
    if text in ("cpu", "cuda") or (auto and text == "auto") or (
            text.startswith("cuda:") and index.isascii() and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be {'auto, ' if auto else ''}cpu, cuda or cuda:N, "
                                     f"got {text!r}")


def _cmd_bench(args) -> int:
    import torch

    from .cli import check_device, parse_size
    from .eval.speed import (BenchConfig, bench_rows, environment, parse_variant, run_bench,
                             write_bench)

    kinds = {parse_variant(v).kind for v in args.presets}  # fail before building anything
    budget = parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None
    if budget is not None and budget <= 0:  # (0 skipped the search without a word)
        raise ValueError(f"--memory-budget {args.memory_budget}: must be at least one byte")
    if args.budget_contexts and budget is None:
        raise ValueError("--budget-contexts are the contexts of the --memory-budget search: give "
                         "--memory-budget too")
    # options for some presets only: silently unused where none is of that kind
    if args.batch_cap is not None and budget is None:
        raise ValueError(f"--batch-cap {args.batch_cap} caps the --memory-budget search: give "
                         "--memory-budget too")
    if args.presize and "kvbits" not in kinds:
        raise ValueError("--presize sizes kvbits stores, and no preset in --presets is a kvbits "
                         "one (e.g. kivi-2)")
    if args.hf_max_tokens is not None and "hf" not in kinds:
        raise ValueError(f"--hf-max-tokens {args.hf_max_tokens} applies to the emulated "
                         "QuantizedCache (hf-int2, hf-int4), and no preset in --presets is one")
    if args.device is None and not torch.cuda.is_available():
        raise ValueError("kvbits bench times GPU decoding and found no CUDA device; for a CPU "
                         "smoke test pass --device cpu (with a small --model, e.g. tiny)")
    device = check_device(args.device or "cuda")  # (a GPU torch sees, the index included)
    if device == "cpu" and budget is not None:  # (it ran every row, then skipped the search)
        raise ValueError(f"--memory-budget {args.memory_budget}: the max-batch search measures "
                         "the decode's peak CUDA memory, and --device cpu has none: leave it out "
                         "on the CPU, or run on a GPU")
    if device == "cpu":
        _check_cpu_weights(args.model, args.layers)
    cfg = BenchConfig(model=args.model, layers=args.layers, variants=args.presets,
                      contexts=args.contexts, batches=args.batches, steps=args.steps,
                      warmup=args.warmup, fill=args.fill,
                      budget=budget,
                      budget_contexts=args.budget_contexts or args.contexts[:1],
                      batch_cap=args.batch_cap or BATCH_CAP,
                      hf_max_tokens=HF_MAX_TOKENS if args.hf_max_tokens is None
                      else args.hf_max_tokens,
                      presize=args.presize, device=device)
    env = environment(shlex.join(["kvbits", *args.argv]), device)
    env["git"] = _git_commit()

    expected = bench_rows(cfg)  # (the files written after every row say whether they hold all)

    def save(speed, budget_rows, final=False):  # (final: run_bench returned, whatever the count)
        done = len(speed) + len(budget_rows)
        return write_bench(args.out, args.name, speed, budget_rows,
                           {**env, "complete": final or done >= expected,
                            "expected_rows": expected}, cfg)

    speed, budget_rows = run_bench(cfg, log=_log, on_rows=save)
    paths = save(speed, budget_rows, final=True)
    _log("wrote " + ", ".join(map(str, paths)))
    return 0


def _register_bench(sub) -> None:
    p = sub.add_parser("bench", help="end-to-end generate() decode speed and memory (GPU)",
                       description="Decode tokens/s, time per output token and peak GPU memory of "
                       "model.generate() over a cache holding CONTEXT tokens, for FP16 "
                       "DynamicCache, transformers' QuantizedCache (update rule unchanged, "
                       "quanto-like storage emulated in PyTorch) and kvbits presets; optionally "
                       "the largest batch within a memory budget. Models are built from their "
                       "published configs with RANDOM weights (speed does not depend on them). "
                       "Writes NAME.json, NAME.md and PNG plots into --out.")
    p.add_argument("--model", default="llama-2-7b",
                   help="llama-2-7b, llama-3-8b, mistral-7b, qwen2.5-7b, smollm2, tiny "
                   "(published configs: kvbits.eval.speed.MODEL_CONFIGS), or a config.json or "
                   "a model folder holding one (any architecture with SDPA attention); random "
                   "weights (default llama-2-7b)")
    p.add_argument("--layers", type=_positive, help="decoder layers (default: the model's)")
    p.add_argument("--presets", type=_preset_items,
                   default=("fp16", "hf-int2", "kivi-4", "kivi-2"),
                   help="comma-separated: fp16, fp16-flash (SDPA without the cuDNN backend), "
                   "hf-int2, hf-int4 (emulated QuantizedCache, "
                   "options :G=64,R=128), kvbits-fp16 (FP16 through kvbits' own path) and "
                   "kvbits presets (kivi-2, kivi-2:R=64, ...); +graphs after fp16 or a kvbits "
                   "preset decodes in the CUDA-graph loop, +graphs+fused also compiles the steps' "
                   "norms / MLP activation / RoPE; +eager-steps after a kvbits preset keeps "
                   "eager generate() and runs each layer's step eagerly too, not replayed from "
                   "its per-layer CUDA graph as by default (default fp16,hf-int2,kivi-4,kivi-2)")
    p.add_argument("--contexts", type=_ints, default=(1024, 4096, 16384, 32768),
                   help="tokens in the cache per sequence (default 1k,4k,16k,32k)")
    p.add_argument("--batches", type=_ints, default=(1,), help="batch sizes (default 1)")
    p.add_argument("--steps", type=_positive, default=32, help="timed decode steps (default 32)")
    p.add_argument("--warmup", type=_non_negative, default=4,
                   help="untimed decode steps first (default 4)")
    p.add_argument("--fill", choices=("random", "model"), default="random",
                   help="random K/V through each cache's update path (default) or a real "
                   "prefill forward of random tokens")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="also find the largest batch whose decode peak fits SIZE (e.g. 80GB); CUDA")
    p.add_argument("--budget-contexts", type=_ints,
                   help="contexts for the budget search (default: the first of --contexts)")
    p.add_argument("--batch-cap", type=_positive,  # (None: not given)
                   help=f"largest batch the --memory-budget search tries (default {BATCH_CAP})")
    p.add_argument("--hf-max-tokens", type=_non_negative,  # (None: not given)
                   help="skip the emulated QuantizedCache above batch*context (default 4M)")
    p.add_argument("--presize", action="store_true",
                   help="kvbits stores: allocate the packed buffers for the final length before "
                   "the fill and shrink the FP16 residual buffer to R+G tokens after it, instead "
                   "of LayerStore's own growth policy (labelled in the output)")
    p.add_argument("--device", type=_device_arg,
                   help="cuda (the default; needs a GPU), cuda:N, or cpu (a smoke test)")
    p.add_argument("--out", default="kvbits-results",
                   help="output folder (default ./kvbits-results; the committed tables of a "
                   "checkout are in benchmarks/results and are not overwritten by default)")
    p.add_argument("--name", type=_file_stem, default="e2e",
                   help="file stem inside --out (default e2e)")
    p.set_defaults(func=_cmd_bench)
