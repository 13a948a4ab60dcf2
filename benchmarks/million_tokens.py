"""A one-million-token kivi-2 KV cache on one GPU: a Llama-2-7B-shaped model decodes over it.

    PYTHONPATH=src python3 benchmarks/million_tokens.py --out DIR            # H200, < 5 min
    PYTHONPATH=src python3 benchmarks/million_tokens.py --tokens 4096 --layers 2 --device cpu --out DIR

* Model: Llama-2-7B shape (32 layers, 32 heads x 128, hidden 4096, MLP 11008, vocab 32000),
  **random weights**, FP16. Its FP16 KV cache costs 512 KiB per token: 1M tokens = 524 GB, which
  no single GPU holds. kivi-2 (K2V2, G=32, R=128) costs 96 bytes per token per KV head in the
  packed body: 1M tokens = 98 GB.
* Fill: random K/V (speed does not depend on values) are quantized through the **real append
  path**: ``KVBitsLayer.update`` + ``LayerStore.flush`` (the Triton ``quantize_pack`` kernels on
  CUDA), ``--chunk`` tokens at a time, layer by layer, so the FP16 K/V never exist in full. The
  model's prefill attention over 1M tokens is *not* run (it is not what is measured here).
  Before filling, each layer's packed-body buffers are allocated at their final capacity (tokens
  plus decode steps) and after it the FP16 residual buffer is shrunk to R + G tokens
  (:func:`kvbits.eval.cachefill.presize_store` / ``compact_residual``): ``LayerStore`` grows
  buffers geometrically and never shrinks its residual, and doubling a 3 GB layer would not fit
  next to 31 others. Values still go through ``append``/``flush`` unchanged.
* Decode: ``--steps`` greedy steps of the whole model (one token, batch 1) over the cache with the
  ``"kvbits"`` attention (the fused Triton decode kernel on CUDA); per-step latency
  (CUDA-synchronized wall time), median and p90.

Writes ``million_tokens.json`` and ``million_tokens.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch


def fill(cache, cfg, tokens: int, chunk: int, dtype, device, extra: int, log) -> float:
    """Append ``tokens`` random K/V tokens to every layer through the real append path."""
    from kvbits.eval.cachefill import append_kv, compact_residual, presize_store

    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    for i, layer in enumerate(cache.layers):
        empty = torch.empty(1, H, 0, D, dtype=dtype, device=device)
        layer.lazy_initialization(empty, empty)
        presize_store(layer.store, tokens + extra, residual=layer.spec.residual_length
                      + layer.spec.group_size + chunk)
        for s in range(0, tokens, chunk):
            n = min(chunk, tokens - s)
            k = torch.randn(1, H, n, D, generator=gen, dtype=dtype, device=device)
            k[..., :4] *= 8  # a few large key channels, like real keys
            v = torch.randn(1, H, n, D, generator=gen, dtype=dtype, device=device)
            append_kv(cache, i, k, v)
            del k, v
        compact_residual(layer.store)  # back to R + G tokens of FP16 capacity
        if i == 0 or (i + 1) % 8 == 0:
            mem = (f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated"
                   if torch.device(device).type == "cuda" else "")
            log(f"layer {i + 1}/{len(cache.layers)} filled ({time.perf_counter() - t0:.0f} s{mem})")
    _sync(device)
    return time.perf_counter() - t0


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="cached tokens (default 1M)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (default 32)")
    ap.add_argument("--preset", default="kivi-2", help="kvbits preset (default kivi-2)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps (default 16)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    ap.add_argument("--chunk", type=int, default=65536, help="tokens appended per call")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True, help="output folder")
    args = ap.parse_args(argv)

    from kvbits.integrations.hf import cache_kwargs
    from kvbits.eval.speed import build_model, model_config
    from kvbits.integrations.hf import KVBitsCache

    def log(msg):
        print(f"[million] {msg}", file=sys.stderr, flush=True)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --device cpu (with a small --tokens) for a smoke test")
        return 2
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    extra = args.warmup + args.steps + 8
    cfg = model_config("llama-2-7b", layers=args.layers, max_positions=args.tokens + extra)
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"model: Llama-2-7B shape, {args.layers} layers, random weights, {weights / 1e9:.1f} GB "
        f"({time.perf_counter() - t0:.0f} s)")
    cache = KVBitsCache(model, args.preset)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    fill_s = fill(cache, cfg, args.tokens, args.chunk, dtype, device, extra, log)
    gc.collect()
    cache_alloc = (torch.cuda.memory_allocated() - base) if device.type == "cuda" else None
    nbytes = cache.nbytes()
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    fp16_bytes = 2 * 2 * args.layers * H * D * args.tokens  # K and V, 2 bytes each
    log(f"cache: {cache.get_seq_length():,} tokens, {nbytes / 1e9:.2f} GB held "
        f"(FP16 would be {fp16_bytes / 1e9:.1f} GB), filled in {fill_s:.0f} s")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tok = torch.randint(1, cfg.vocab_size, (1, 1), device=device)
    kw = cache_kwargs(model, cache)
    times = []
    with torch.no_grad():
        for step in range(args.warmup + args.steps):
            _sync(device)
            t = time.perf_counter()
            out = model(tok, use_cache=True, logits_to_keep=1, **kw)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            times.append(time.perf_counter() - t)
            if step < args.warmup:
                log(f"warm-up step {step + 1}: {1e3 * times[-1]:.1f} ms")
    steps = sorted(times[args.warmup:])
    med = statistics.median(steps)
    p90 = steps[max(0, math.ceil(0.9 * len(steps)) - 1)]
    assert cache.get_seq_length() == args.tokens + args.warmup + args.steps
    gpu_total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    result = {
        "model": "llama-2-7b shape, random weights", "layers": args.layers,
        "kv_heads": H, "head_dim": D, "preset": args.preset, "spec": cache.spec.describe(),
        "tokens": args.tokens, "cache_tokens_after": cache.get_seq_length(),
        "cache_bytes": nbytes, "cache_alloc_bytes": cache_alloc,
        "fp16_cache_bytes": fp16_bytes, "weights_bytes": weights,
        "compression": fp16_bytes / nbytes,
        "gpu_total_bytes": gpu_total,
        "fp16_fits": None if gpu_total is None else fp16_bytes + weights <= gpu_total,
        "peak_decode_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "fill_s": fill_s, "step_ms_median": 1e3 * med, "step_ms_p90": 1e3 * p90,
        "step_ms_all": [1e3 * t for t in times], "tokens_per_s": 1 / med,
        "env": _env(),
    }
    log(f"decode: median {1e3 * med:.1f} ms/step (p90 {1e3 * p90:.1f}) over {args.steps} steps")
    write(Path(args.out), result)
    return 0


def _env() -> dict:
    import importlib.metadata as md

    env = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(shlex.quote(a) for a in
                               ["python3", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    for pkg in ("torch", "transformers", "triton"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return env


def write(out: Path, r: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "million_tokens.json").write_text(json.dumps(r, indent=1) + "\n")
    e = r["env"]
    gb = lambda x: "-" if x is None else f"{x / 1e9:.2f} GB"
    fits = {None: "-", True: "yes", False: "**no**"}[r["fp16_fits"]]
    lines = [
        f"# {r['tokens']:,}-token {r['preset']} KV cache, Llama-2-7B shape ({r['layers']} layers)",
        "", "```", e["command"], "```", "",
        (f"- device: {e['device']}; torch {e.get('torch')}, transformers {e.get('transformers')}, "
        f"triton {e.get('triton')}; {e['date']}"),
        ("- **Random weights**; random K/V quantized through the real append path "
        "(`KVBitsLayer.update` + `LayerStore.flush`) in chunks, buffers pre-sized to their final "
        "capacity; the 1M-token prefill attention is not run. Decode: whole-model greedy steps "
        "(batch 1) with the `kvbits` attention."), "",
        "| quantity | value |", "|---|---|",
        f"| spec | {r['spec']} |",
        f"| tokens in the cache after decoding | {r['cache_tokens_after']:,} |",
        f"| kvbits cache bytes (held) | {gb(r['cache_bytes'])} |",
        f"| kvbits cache bytes (allocated) | {gb(r['cache_alloc_bytes'])} |",
        f"| FP16 cache bytes for the same tokens | {gb(r['fp16_cache_bytes'])} |",
        f"| compression | {r['compression']:.2f}x |",
        f"| weights | {gb(r['weights_bytes'])} |",
        f"| GPU memory | {gb(r['gpu_total_bytes'])} |",
        f"| FP16 cache + weights fit on this GPU | {fits} |",
        f"| peak allocated during decode | {gb(r['peak_decode_bytes'])} |",
        f"| fill time | {r['fill_s']:.0f} s |",
        f"| decode step, median (p90) | {r['step_ms_median']:.1f} ms ({r['step_ms_p90']:.1f} ms) |",
        f"| decode tokens/s | {r['tokens_per_s']:.1f} |", ""]
    (out / "million_tokens.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
