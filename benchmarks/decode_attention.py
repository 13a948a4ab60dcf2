"""Decode attention over the packed cache vs FP16 flash SDPA, the seed's unfused design and the
Hugging Face QuantizedCache path, on Llama-2-7B / Llama-3-8B attention shapes.

One decode step of one layer: q [B, Hq, 1, D] against a cache of ``context`` tokens per sequence.
Medians from ``triton.testing.do_bench``; bytes moved over the measured time against the copy
bandwidth measured in the same run. Writes benchmarks/results/decode_attention.{json,md}.

    python benchmarks/decode_attention.py            # full table (H200: a few minutes)
    python benchmarks/decode_attention.py --quick    # two shapes, for smoke runs
    python benchmarks/decode_attention.py --rerender benchmarks/results/NAME.json  # no GPU

``--rerender`` re-derives a committed table's FP16 flash rows' TB/s and fraction of the copy
bandwidth from their recorded medians (:func:`rerender`) and rewrites its JSON and Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import shlex
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, batch_slice, copy_bandwidth, environment, host_us,  # noqa: E402
                    packed_nbytes, random_packed_kv, read_graph_us, write_results)
from seed_unfused import SeedCache  # noqa: E402

from kvbits.kernels import decode_gluon, launch  # noqa: E402
from kvbits.kernels.decode_attention import decode_attention  # noqa: E402
from kvbits.kernels.quantize_pack import quantize_keys, quantize_values  # noqa: E402
from kvbits.reference.attention import decode_attention as reference_attention  # noqa: E402
from kvbits.cli import parse_preset, parse_presets
from kvbits.spec import resolve_spec  # noqa: E402

MODELS = {"llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128)}  # q heads, kv heads, head_dim
# Shapes the kernels were not tuned on (--models), from the published configs: GQA 7:1, head
# dims 64, 80, 96, 100 and 256; Gemma-2 (run with --softcap 50, as its global layers are);
# multi-query groups of more than 16 heads (Falcon-7B 71:1, StarCoder-15B 48:1)
OTHER_MODELS = {"qwen2.5-7b": (28, 4, 128), "gemma-2-9b": (16, 8, 256),
                "gemma-2-27b": (32, 16, 128), "phi-3-mini": (32, 32, 96),
                "smollm2-1.7b": (32, 32, 64), "phi-2": (32, 32, 80),
                "openllama-3b": (32, 32, 100), "falcon-7b": (71, 1, 64),
                "starcoder": (48, 1, 128)}
ALL_MODELS = MODELS | OTHER_MODELS


def add_model(text: str) -> str:
    """A model of ``ALL_MODELS`` by name, or ``NAME=HQ/HKV/D`` added to it (any other shape)."""
    name, _, shape = text.partition("=")
    if not shape:
        if name not in ALL_MODELS:
            raise ValueError(f"--models: unknown {name!r}; choose from {', '.join(ALL_MODELS)} "
                             "or give NAME=HQ/HKV/D")
        return name
    try:
        hq, hkv, d = (int(x) for x in shape.split("/"))
    except ValueError:
        raise ValueError(f"--models: {text!r} is not NAME=HQ/HKV/D (integers)") from None
    if min(hq, hkv, d) < 1 or hq % hkv or d % 4:
        raise ValueError(f"--models: {text!r} needs HQ a multiple of HKV and D a multiple of 4")
    ALL_MODELS[name] = (hq, hkv, d)
    return name
# kivi-3, kvquant-3-dense-post (codebooks only) and kvquant-3 (with outliers and pre-RoPE keys,
# decode_gluon.KVQUANT_FULL) go through the Gluon body's 3-bit planes (decode_gluon.PLANES3, on
# unless KVBITS_GLUON_3BIT=0); kvquant-2 / kvquant-4 through its 4- / 16-entry table lookups
# (decode_gluon.KVQUANT2 / KVQUANT4), kvquant-3-offline with its one fixed key-scale row (KFIX)
PRESETS = ("kivi-2", "kivi-4", "k4v2", "uniform-int4", "uniform-int2", "fp8-dynamic", "kvquant-3",
           "kivi-3", "kvquant-3-dense-post", "kvquant-2", "kvquant-4", "kvquant-3-offline")


def bench(fn) -> float:
    """Median microseconds."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def captured(fn):
    """``fn`` run once eagerly on a side stream (compiles, warms up, makes what a capture may
    not), then captured: the CUDA graph and what the captured call returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def captured_ab(fns: dict, rounds: int = 3) -> tuple[dict, dict]:
    """Variants of one call, each :func:`captured` (a variant may set module switches before
    its call: they hold while it is warmed up and captured), then replayed alternately: the
    best of ``rounds`` :func:`bench` medians in µs per variant, and each variant's first
    replayed output as float32."""
    graphs, outs = {}, {}
    for name, fn in fns.items():
        graphs[name], out = captured(fn)
        graphs[name].replay()
        torch.cuda.synchronize()
        outs[name] = out.float().clone()
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(bench(graph.replay))
    return {name: min(t) for name, t in times.items()}, outs


def ab_cells(us: dict, outs: dict, base: str) -> str:
    """:func:`captured_ab`'s result as one line's cells: each variant's µs, its change against
    ``base`` and its output's largest difference from ``base``'s."""
    return "  ".join(f"{n} {t:7.1f} ({t / us[base] - 1:+.1%}, diff "
                     f"{(outs[n] - outs[base]).abs().max().item():.1e})" for n, t in us.items())


def bench_graph(fn) -> float:
    """Median microseconds of ``fn`` captured in a CUDA graph and replayed (decode loops run that
    way: no per-call host work), still with ``do_bench``'s L2 flush between replays."""
    graph, _ = captured(fn)
    us = bench(graph.replay)
    del graph
    return us


SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_fp16(q, k, v, scale):
    """FP16 SDPA with GQA, on the first backend (flash preferred) that accepts the shapes."""
    for backend in list(SDPA_BACKENDS):
        try:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        except RuntimeError:
            SDPA_BACKENDS.remove(backend)
    raise RuntimeError("no SDPA backend accepted the shapes")


def flash_graph_us(batch, hq, hkv, context, d):
    """A decode query ``[batch, hq, 1, d]`` and FP16 flash SDPA's CUDA-graph time over random
    K/V of ``context`` tokens (freed on return): the baseline of the probes' sweeps."""
    q = torch.randn(batch, hq, 1, d, dtype=torch.float16, device="cuda")
    k = torch.randn(batch, hkv, context, d, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    return q, bench_graph(lambda: sdpa_fp16(q, k, v, d ** -0.5))


def variant_graph_us(q, kv, ref, **knobs):
    """``decode_attention`` with launch ``knobs`` (splits, tile, gluon, ...): its CUDA-graph time
    and its relative error against ``ref`` (the same call with the probe's reference knobs)."""
    scale = q.shape[-1] ** -0.5
    out = decode_attention(q, kv, scale=scale, **knobs)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return bench_graph(lambda: decode_attention(q, kv, scale=scale, **knobs)), err


# (num_warps, tile_tokens, prmt) tried by --tune.
TUNE_GRID = [(4, 128, True), (4, 128, False), (8, 128, True), (4, 64, True), (8, 256, True),
             (4, 256, True)]


def spec_of(preset: str):
    """A preset, or one with overrides as ``kvbits ppl`` takes them (``kvquant-3:G=64``)."""
    return parse_preset(preset).spec


def tune(presets, bw) -> dict:
    """Pick (num_warps, tile_tokens, prmt) per preset on a Llama-3-8B batch-8 32k step; returns
    kwargs."""
    best = {}
    q = torch.randn(8, 32, 1, 128, dtype=torch.float16, device="cuda")
    for preset in presets:
        kv = random_packed_kv(8, 8, 32768, 128, spec_of(preset))
        nb = packed_nbytes(kv)
        for warps, tile, prmt in TUNE_GRID:
            kw = dict(num_warps=warps, tile_tokens=tile, prmt=prmt)
            try:
                us = bench(lambda: decode_attention(q, kv, scale=0.088, **kw))
            except Exception as e:  # a configuration the compiler rejects is reported, not fatal
                print(f"tune {preset} {kw}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            print(f"tune {preset} warps={warps} tile={tile} prmt={prmt}: {us:.1f} us "
                  f"({nb / us * 1e6 / bw * 100:.0f}% of copy bw)", flush=True)
            if preset not in best or us < best[preset][0]:
                best[preset] = (us, kw)
        kv = None  # (freed)
    return {p: kw for p, (_, kw) in best.items()}


def _unpack_tokens_torch(words, bits, n_groups, group):
    """[B, H, NG * W, D] words packed along tokens -> [B, H, NG * G, D] int32 codes (2/4/8 bits)."""
    B, H, _, D = words.shape
    w = words[:, :, : n_groups * (group * bits // 32)].view(B, H, n_groups, group * bits // 32, D)
    codes = torch.stack([(w >> (s * bits)) & ((1 << bits) - 1) for s in range(32 // bits)], dim=3)
    return codes.view(B, H, n_groups * group, D)


def dequantize_all_torch(kv):
    """HF QuantizedLayer-style: a full FP16 copy of the history with torch ops, then concat."""
    B, H, _, D = kv.res_k.shape
    G, ng, T = kv.group_size, kv.body_len // kv.group_size, kv.body_len
    k = _unpack_tokens_torch(kv.k_codes, kv.key_bits, ng, G).view(B, H, ng, G, D).half() \
        * kv.k_scale[:, :, :ng, None] + kv.k_zero[:, :, :ng, None]
    Gv = kv.value_group  # (per-token groups; the last may be shorter)
    v = _unpack_tokens_torch(kv.v_codes, kv.value_bits, ng, G).half() \
        * kv.v_scale[:, :, :T].repeat_interleave(Gv, -1)[..., :D] \
        + kv.v_zero[:, :, :T].repeat_interleave(Gv, -1)[..., :D]
    k = torch.cat([k.view(B, H, -1, D), kv.res_k[:, :, : kv.res_len]], dim=2)
    v = torch.cat([v.view(B, H, -1, D), kv.res_v[:, :, : kv.res_len]], dim=2)
    return k, v


def rel_err(out, kv, q, scale, softcap=None, window=None) -> float:
    """Kernel vs the PyTorch reference on sequence 0 (the reference dequantizes in float32)."""
    ref = reference_attention(q[:1], batch_slice(kv, 0), scale=scale, softcap=softcap,
                              window=window)
    return ((out[:1].float() - ref.float()).norm() / ref.float().norm()).item()


def windowed_nbytes(kv, context: int, window: int | None) -> int:
    """:func:`packed_nbytes` of the tokens a query at ``context - 1`` sees through a sliding
    ``window``: the body from the group holding its first visible token, and the FP16 parts."""
    total = packed_nbytes(kv)
    if window is None or kv.body_len == 0:
        return total
    fp = sum(t.numel() * t.element_size() for t in (
        kv.sink_k[:, :, :kv.sink_len], kv.sink_v[:, :, :kv.sink_len],
        kv.res_k[:, :, :kv.res_len], kv.res_v[:, :, :kv.res_len]))
    n_groups = kv.body_len // kv.group_size
    hidden = min(n_groups, max(0, context - window - kv.sink_len) // kv.group_size)
    return fp + (total - fp) * (n_groups - hidden) // n_groups


def fp16_rows(base: dict, backend: str, t_fp: float, g_fp: float, h_fp: float, t_best: float,
              fp_bytes: int, bw: float) -> list[dict]:
    """The FP16 SDPA rows of a shape: flash (eager ``t_fp``, CUDA-graph ``g_fp`` µs) and torch's
    default backend (``t_best``, the faster of flash and it, eager). TB/s and the fraction of the
    copy bandwidth use the faster timing a row has, as the kvbits rows do (the flash row used its
    eager time alone)."""
    t_bw = min(t_fp, g_fp)
    return [dict(base, preset="fp16", provider=f"sdpa_fp16 ({backend})", us=t_fp, speedup=1.0,
                 us_graph=g_fp, speedup_graph=1.0, host_us=h_fp, bytes=fp_bytes,
                 tbps=fp_bytes / t_bw * 1e-6, frac_bw=fp_bytes / t_bw * 1e6 / bw,
                 speedup_best=t_best / t_fp),
            dict(base, preset="fp16", provider="sdpa_fp16 (default backend)", us=t_best,
                 speedup=t_fp / t_best, speedup_best=1.0, bytes=fp_bytes,
                 tbps=fp_bytes / t_best * 1e-6, frac_bw=fp_bytes / t_best * 1e6 / bw)]


def table_columns(q_rows: int = 1) -> list[tuple[str, str]]:
    """The Markdown table's columns, (row key, header), as :func:`main` writes them."""
    return [("model", "model"), ("batch", "B"), ("context", "context"),
            *([("q_rows", "q rows")] if q_rows > 1 else []), ("q_heads", "Hq"),
            ("kv_heads", "Hkv"), ("head_dim", "D"), ("preset", "preset"),
            ("provider", "provider"), ("us", "median µs"), ("speedup", "speedup vs FP16"),
            ("speedup_best", "vs best SDPA"),
            ("us_graph", "CUDA-graph µs"), ("speedup_graph", "graph speedup"),
            ("ceiling", "ceiling vs FP16"), ("of_ceiling", "of ceiling"),
            ("host_us", "host µs/call"),
            ("bytes", "bytes moved"), ("tbps", "TB/s"), ("frac_bw", "of copy bw"),
            ("rel_err", "rel err")]


def rederive_flash_bandwidth(rows: list[dict]) -> list[dict]:
    """Recompute, in place, the TB/s and fraction of the copy bandwidth of the FP16 flash rows
    that divided by their eager median alone (tables written before 5385329) from
    min(eager, CUDA-graph) with :func:`fp16_rows`' formula; nothing is re-measured. Each row's
    copy bandwidth is its own ``tbps / frac_bw`` (rows merged from an earlier run had another).
    Returns the rows changed: those whose graph median is the faster and whose figures are the
    eager ones (a row already re-derived, or written since, is left as it is)."""
    changed = []
    for r in rows:
        if r.get("preset") != "fp16" or r.get("provider") == "sdpa_fp16 (default backend)" \
                or not r.get("us_graph") or not r.get("frac_bw") or r["us_graph"] >= r["us"]:
            continue
        eager_tbps = r["bytes"] / r["us"] * 1e-6
        if abs(r["tbps"] - eager_tbps) > 1e-9 * eager_tbps:
            continue
        bw = r["tbps"] * 1e12 / r["frac_bw"]
        backend = r["provider"].removeprefix("sdpa_fp16 (").removesuffix(")")
        flash = fp16_rows({}, backend, r["us"], r["us_graph"], r.get("host_us"), r["us"],
                          r["bytes"], bw)[0]
        r["tbps"], r["frac_bw"] = flash["tbps"], flash["frac_bw"]
        changed.append(r)
    return changed


def rerender(path: Path, command: str, date: str) -> list[dict]:
    """Re-derive the FP16 flash rows' bandwidth figures of a table this script wrote
    (:func:`rederive_flash_bandwidth`) and rewrite ``path`` and the Markdown beside it with
    :func:`common.write_results`: the same env, notes and columns (read back from the Markdown)
    and one note more, saying what was re-derived, when (``date``) and by what (``command``).
    Refuses a table whose Markdown and JSON the writer does not reproduce as they are (a note
    added by hand outside the notes, another table's columns). Returns the rows changed (none:
    nothing is read but the JSON, nothing is written)."""
    md_path = path.with_suffix(".md")
    data = json.loads(path.read_text())
    rows = json.loads(json.dumps(data["rows"]))
    changed = rederive_flash_bandwidth(rows)
    if not changed:
        return []
    if not md_path.is_file():
        raise ValueError(f"{md_path}: no Markdown beside {path.name}")
    md = md_path.read_text()
    lines = md.split("\n")
    head = next((i for i, line in enumerate(lines) if line.startswith("| ")), None)
    if head is None or head < 4 or not lines[3].startswith("- command: "):
        raise ValueError(f"{md_path}: no Markdown table as decode_attention.py writes it")
    notes = [line.removeprefix("- ") for line in lines[4:head - 1]]
    keys = {h: k for k, h in table_columns(q_rows=2)}
    headers = [h.strip() for h in lines[head].strip("|").split("|")]
    if not set(headers) <= keys.keys():
        raise ValueError(f"{md_path}: columns {sorted(set(headers) - keys.keys())} unknown")
    cols = [(keys[h], h) for h in headers]
    with tempfile.TemporaryDirectory() as tmp:
        write_results(path.stem, data["rows"], cols, data["env"], notes, Path(tmp))
        if (Path(tmp) / md_path.name).read_text() != md \
                or (Path(tmp) / path.name).read_text() != path.read_text():
            raise ValueError(f"{md_path}: not reproduced from {path.name} by the writer")
    notes.append(f"{date}: the FP16 flash rows' TB/s and of copy bw re-derived from the "
                 "recorded medians, bytes over min(median µs, CUDA-graph µs) as the kvbits rows "
                 "(each row's copy bandwidth: its TB/s over its of copy bw; until 5385329 they "
                 "divided by the eager median alone), nothing re-measured, by "
                 f"`{command}`")
    write_results(path.stem, rows, cols, data["env"], notes, path.parent)
    return changed


def ceiling_fields(flash_graph_us: float, read_us: float, graph_us: float) -> dict:
    """A row's ceiling columns: flash SDPA's CUDA-graph time over a plain read of the row's
    bytes timed the same way (the most any kernel reading those bytes could show as its graph
    speedup) and the row's share of it (the read's time over the row's graph time)."""
    return {"ceiling": flash_graph_us / read_us, "of_ceiling": read_us / graph_us}


def ceiling_read_us(nbytes: int) -> float | None:
    """:func:`common.read_graph_us` of ``nbytes`` with this table's ``bench_graph``, or None
    (reported) where the read cannot run (its buffer does not fit, which a capture may report as
    its own error): the row keeps its timings."""
    try:
        return read_graph_us(nbytes, bench_graph)
    except RuntimeError as e:  # out of memory, also as a failed capture
        print(f"  ceiling skipped for {nbytes / 1e9:.1f} GB: {str(e)[:120]}", flush=True)
        torch.cuda.empty_cache()
        return None


def run_shape(model, hq, hkv, d, batch, context, bw, presets, baselines, knobs,
              triton_rows=True, softcap=None, window=None, q_rows=1,
              dtype=torch.float16, ceilings=True) -> list[dict]:
    scale = d ** -0.5
    q = torch.randn(batch, hq, q_rows, d, dtype=dtype, device="cuda")
    base = dict(model=model, batch=batch, context=context, q_heads=hq, kv_heads=hkv, head_dim=d)
    if q_rows > 1:
        base["q_rows"] = q_rows
    rows = []
    seen = context if window is None else min(context, window)  # what FP16's cache holds
    fp_bytes = 2 * batch * hkv * seen * d * 2
    k = torch.randn(batch, hkv, seen, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    # several rows: FP16's best form, every row of a KV head's query heads one query of that
    # head (SDPA's GQA path with 4 rows ran at 16% of copy bandwidth on the H200)
    q_fp = q.view(batch, hkv, hq // hkv * q_rows, d) if q_rows > 1 else q
    t_fp = bench(lambda: sdpa_fp16(q_fp, k, v, scale))
    g_fp = bench_graph(lambda: sdpa_fp16(q_fp, k, v, scale))
    h_fp = host_us(lambda: sdpa_fp16(q_fp, k, v, scale))

    def sdpa_any():  # whatever backend torch picks by default (cuDNN on the H200)
        return torch.nn.functional.scaled_dot_product_attention(
            q_fp, k, v, scale=scale, enable_gqa=hkv != q_fp.shape[1])
    try:
        t_best = min(t_fp, bench(sdpa_any))
    except RuntimeError as e:  # e.g. a backend that refuses the head_dim at run time
        print(f"  default SDPA backend failed ({str(e)[:120]}); rows use the first that ran",
              flush=True)
        t_best = t_fp
    k = v = None  # (freed)
    rows += fp16_rows(base, SDPA_BACKENDS[0].name.lower(), t_fp, g_fp, h_fp, t_best, fp_bytes, bw)
    if ceilings:  # (the flash row: how near a plain read of its bytes it runs)
        fp_read = ceiling_read_us(fp_bytes)
        if fp_read:
            rows[0]["of_ceiling"] = fp_read / g_fp
    for preset in presets:
        spec = spec_of(preset)
        kv = random_packed_kv(batch, hkv, context, d, spec, dtype=dtype)
        nb = windowed_nbytes(kv, context, window)
        kw = dict(knobs.get(preset, {}), softcap=softcap, window=window)
        out = decode_attention(q, kv, scale=scale, **kw)
        err = rel_err(out, kv, q, scale, softcap, window)
        t = bench(lambda: decode_attention(q, kv, scale=scale, **kw))
        tg = bench_graph(lambda: decode_attention(q, kv, scale=scale, **kw))
        h = host_us(lambda: decode_attention(q, kv, scale=scale, **kw))
        gl_used = decode_gluon.serves(kv, q_rows, hq // hkv, batch * hkv)
        row = dict(base, preset=preset, provider="kvbits (gluon)" if gl_used else "kvbits",
                   us=t, speedup=t_fp / t, speedup_best=t_best / t,
                   us_graph=tg, speedup_graph=g_fp / tg, host_us=h, bytes=nb,
                   tbps=nb / min(t, tg) * 1e-6, frac_bw=nb / min(t, tg) * 1e6 / bw, rel_err=err)
        rows.append(row)
        if gl_used and triton_rows:  # the same layer through the Triton kernel alone (v4)
            kw4 = dict(kw, gluon=False)
            err4 = rel_err(decode_attention(q, kv, scale=scale, **kw4), kv, q, scale, softcap,
                           window)
            t4 = bench(lambda: decode_attention(q, kv, scale=scale, **kw4))
            tg4 = bench_graph(lambda: decode_attention(q, kv, scale=scale, **kw4))
            rows.append(dict(base, preset=preset, provider="kvbits (triton v4)", us=t4,
                             speedup=t_fp / t4, speedup_best=t_best / t4, us_graph=tg4, speedup_graph=g_fp / tg4,
                             bytes=nb, tbps=nb / min(t4, tg4) * 1e-6,
                             frac_bw=nb / min(t4, tg4) * 1e6 / bw, rel_err=err4))
        if preset == "kivi-2" and baselines and softcap is None and window is None \
                and q_rows == 1:
            if batch * context <= 32 * 32768:
                def hf_step():
                    kk, vv = dequantize_all_torch(kv)
                    return sdpa_fp16(q, kk, vv, scale)
                th = bench(hf_step)
                rows.append(dict(base, preset=preset, provider="hf_quantized (emulated)", us=th,
                                 speedup=t_fp / th, bytes=nb))
            kv = None  # (freed)
            gc.collect()
            if d % max(32 // spec.key_bits, spec.group_size):  # its V words span whole groups
                print(f"  seed design skipped at head_dim {d}: its layout packs values along "
                      "channels in whole groups", flush=True)
            else:
                seed = SeedCache(batch, hkv, context, d, spec.key_bits, spec.group_size,
                                 spec.residual_length)
                ts = bench(lambda: seed.attend(q, scale))
                rows.append(dict(base, preset=preset, provider="seed_unfused", us=ts,
                                 speedup=t_fp / ts, bytes=nb))
                del seed
        kv = None  # free this preset's layer before building the next
        gc.collect()
        torch.cuda.empty_cache()
        read = ceiling_read_us(nb) if ceilings else None
        if read:
            row.update(ceiling_fields(g_fp, read, tg))
    for r in rows:
        print(f"{r['model']:>10} B={batch:<3} T={context:<7} {r['preset']:>7} "
              f"{r['provider']:<24} {r['us']:9.1f} us  x{r['speedup']:5.2f}  "
              f"graph {r.get('us_graph', float('nan')):9.1f} us x{r.get('speedup_graph', float('nan')):5.2f} "
              f"{r.get('frac_bw', 0) * 100:5.1f}% bw  err={r.get('rel_err', float('nan')):.1e}",
              flush=True)
    return rows


def bench_quantize_pack(bw) -> list[dict]:
    """quantize_pack throughput: bytes read (FP16) + written (codes, scales, zeros) per second,
    for the library's dispatch (the Gluon kernels where they serve the shape) and the Triton
    kernels alone, on a prefill-sized input and on a decode-step flush (one group per head)."""
    from kvbits.kernels import quantize_pack as qp

    rows = []
    for shape in ((8, 8, 32768, 128), (32, 8, 32, 128)):
        x = torch.randn(*shape, dtype=torch.float16, device="cuda")
        for preset, kernel in itertools.product(("kivi-2", "kivi-3", "kivi-4", "kivi-8"),
                                                ("gluon", "triton")):
            spec = resolve_spec(preset)
            qp.GLUON = kernel == "gluon"
            for name, fn in (("keys", lambda: quantize_keys(x, spec.key_bits, spec.group_size)),
                             ("values", lambda: quantize_values(x, spec.value_bits,
                                                                spec.value_group(128),
                                                                spec.group_size))):
                label = dict(op=f"quantize_pack {name}", preset=preset, kernel=kernel,
                             shape="x".join(map(str, shape)))
                try:
                    outs = fn()
                except Exception as e:  # reported in the table rather than losing the run
                    print(f"quantize_pack {name} {preset} {kernel}: {type(e).__name__}: {e}",
                          flush=True)
                    rows.append(dict(label, error=str(e)[:200]))
                    continue
                nbytes = x.numel() * 2 + sum(o.numel() * o.element_size() for o in outs)
                t = bench(fn)
                rows.append(dict(label, us=t, bytes=nbytes, tbps=nbytes / t * 1e-6,
                                 frac_bw=nbytes / t * 1e6 / bw))
                print(f"quantize_pack {name:6} {preset} {kernel:6} {label['shape']}: {t:8.1f} us "
                      f"{nbytes / t * 1e-6:5.2f} TB/s ({nbytes / t * 1e6 / bw * 100:.0f}% of copy)",
                      flush=True)
        qp.GLUON = True
        x = None  # (freed)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes only")
    p.add_argument("--out", type=Path, default=RESULTS, help="result folder")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--tune", action="store_true", help="pick warps/tile per preset first")
    p.add_argument("--shapes", default=None,
                   help="only these shapes, MODEL:B:T with * wildcards, comma-separated")
    p.add_argument("--merge", type=Path, default=None,
                   help="a previous JSON of this benchmark: its rows for shapes not run here are "
                        "kept (the notes say which run produced which rows)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, of {', '.join(ALL_MODELS)} (default: the two Llamas) "
                        "or NAME=HQ/HKV/D for any other shape (e.g. yi-34b=56/8/128)")
    p.add_argument("--batches", default="32,8,1", help="comma-separated (default 32,8,1)")
    p.add_argument("--contexts", default="4096,32768,131072",
                   help="comma-separated tokens per sequence (default 4096,32768,131072)")
    p.add_argument("--name", default=None, help="output file stem (default decode_attention)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the seed-design and QuantizedCache rows (FP16 SDPA stays)")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the ceiling columns (a plain read of each row's bytes, timed)")
    p.add_argument("--softcap", type=float, default=None,
                   help="attention-logit softcapping of the kvbits rows (Gemma2: 50); the FP16 "
                        "rows stay uncapped SDPA (it has no cap), the QuantizedCache and seed "
                        "rows are skipped")
    p.add_argument("--window", type=int, default=None,
                   help="a sliding-window layer: the kvbits rows attend through this window "
                        "over contexts of (typically) 1.25 windows, as a sliding layer's store "
                        "holds; the FP16 rows over the last WINDOW tokens (what transformers' "
                        "sliding DynamicCache layer keeps); QuantizedCache and seed rows skipped")
    p.add_argument("--q-rows", type=int, default=1,
                   help="query rows per sequence (speculative verification of q_rows - 1 "
                        "drafts); the FP16 rows attend without a causal mask among them (the "
                        "flash backend takes no offset mask; the cost is the same)")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                   help="the queries', the FP16 baseline's and the residual's dtype (default "
                        "float16; bfloat16 as Llama-3-style checkpoints run)")
    p.add_argument("--skip-quantize-pack", action="store_true")
    p.add_argument("--quantize-pack-only", action="store_true",
                   help="only the quantize_pack table (no attention shapes)")
    p.add_argument("--rerender", type=Path, nargs="+", default=None, metavar="JSON",
                   help="no measuring: re-derive these tables' FP16 flash rows' TB/s and "
                        "fraction of copy bandwidth from their recorded medians (tables written "
                        "before 5385329 divided by the eager median alone) and rewrite their "
                        "JSON and Markdown, with a note saying so")
    args = p.parse_args(argv)
    if args.rerender:
        date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        for path in args.rerender:
            try:
                changed = rerender(path, f"python benchmarks/decode_attention.py --rerender "
                                         f"{shlex.quote(path.as_posix())}", date)
            except (OSError, ValueError) as e:
                print(f"{path}: left as it is: {e}", flush=True)
                continue
            print(f"{path}: {len(changed)} FP16 flash rows re-derived", flush=True)
        return
    env = environment()
    bw = copy_bandwidth()
    print(f"{env['gpu']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    presets = [v.label for v in parse_presets(args.presets)]  # overrides: kvquant-3:G=64
    try:
        models = [add_model(m) for m in args.models.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
        contexts = [int(t) for t in args.contexts.split(",")]
    except ValueError as e:
        p.error(str(e))
    if min(batches + contexts) < 1:
        p.error("--batches and --contexts must be positive integers")
    # largest batches first: a run cut short by a time limit still has the long rows
    shapes = [(m, b, t) for b in batches for m in models for t in contexts]
    if args.quick:
        shapes = [("llama-3-8b", 8, 32768), ("llama-2-7b", 1, 131072)]
    if args.shapes:
        pats = [tuple(x.split(":")) for x in args.shapes.split(",")]
        shapes = [s for s in shapes if any(all(p in ("*", str(v)) for p, v in zip(pat, s))
                                           for pat in pats)]
    if args.quantize_pack_only:
        shapes = []
    knobs = tune([p for p in presets if p != "k4v2"], bw) if args.tune else {}
    if "kivi-2" in knobs:
        knobs.setdefault("k4v2", knobs["kivi-2"])
    notes = [f"copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s (bytes read + written)",
             "bytes = what one decode step must read: packed codes + FP16 scales/zeros + FP16 "
             "residual (kvbits) or the FP16 K and V (sdpa)",
             "hf_quantized (emulated): transformers QuantizedLayer's update rule with torch ops on "
             "the GPU (dequantize the whole history, concat the residual, SDPA); quanto/HQQ are not "
             "installed on the GPU machine; run only where the FP16 copy fits (B x T <= 1M)",
             "seed_unfused: the seed document's design (Triton GEMV on packed K, torch softmax, "
             "Triton GEMV on packed V; no GQA sharing)",
             "caches hold random codes: speed does not depend on values; rel_err is against the "
             "float32 PyTorch reference on sequence 0",
             "uniform-int4/int2: transformers QuantizedCache's knobs (keys and values per token, "
             "q_group_size 64) served by the same kernels; fp8-dynamic: e4m3 body, one scale per "
             "head; kvquant-3: per-head codebooks, 1% outliers as a fixed count (2 per token "
             "for keys and for values at head_dim 128, counted in bytes), pre-RoPE keys; "
             "kvquant-3-dense-post: the same codebooks without outliers or pre-RoPE keys; "
             "kivi-3 and both kvquant-3 presets through the Gluon body's 3-bit planes "
             "(decode_gluon.PLANES3; kvquant-3's outliers as one-hot MMAs and its keys turned "
             "per element, decode_gluon.KVQUANT_FULL); kvquant-2 / kvquant-4 there too at head "
             "dims 64 / 128 (4- / 16-entry table lookups); kvquant-N-offline: one calibrated "
             "key scale/zero row per layer instead of per-group key scales",
             "speedup vs FP16: against SDPA restricted to the flash backend (the issue's baseline); "
             "vs best SDPA: against the faster of that and torch's default SDPA backend (cuDNN on "
             "the H200, near copy bandwidth for decode), measured in the same run",
             "kvbits (gluon): the body of KIVI and uniform layers (K/V bits 2 or 4, or both 3 as "
             "bit planes, with KVQuant codebooks, outliers and pre-RoPE keys) through "
             "kvbits.kernels.decode_gluon (MMA operands built in registers; on Hopper 2- and "
             "4-bit layers fed by the TMA ring of "
             "decode_gluon_tma inside CUDA-graph capture or for calls of >= 2^23 body tokens x "
             "pairs), the FP16 parts and the merge through the Triton kernel; kvbits (triton v4): "
             "the same layer through the Triton kernel alone",
             f"kernel launch knobs per preset: {knobs or 'library defaults'}",
             "CUDA-graph µs: the same call captured once and replayed (how a decode loop runs it), "
             "with the same L2 flush; host µs/call: Python + launch time to enqueue one call; "
             "TB/s and the fraction of copy bandwidth use the faster of the two timings",
             "ceiling vs FP16: flash SDPA's CUDA-graph µs over a plain read of the row's bytes "
             "captured and timed the same way (the faster of torch.sum and a Triton loop, "
             "common.read_graph_us): the most any kernel reading those bytes could show as its "
             "graph speedup here, since do_bench's L2 flush (256 MB zeroed before each replay, "
             "whose dirty lines the call's first reads write back) and the graph's launch gap "
             "cost every call the same ~12 us (session 64); of ceiling: that read's µs over the "
             "row's CUDA-graph µs (the flash row: over its own)",
             "kvbits launches: "
             + ("a specialization's later launches skip Triton's binder (kernels.launch."
                "FastLaunch, session 26)" if launch.ENABLED else "every launch through Triton's "
                "JIT (KVBITS_FAST_LAUNCH=0)")]
    if args.window is not None:
        if args.window < 1:
            p.error("--window must be a positive number of tokens")
        notes.append(f"window {args.window}: a sliding-window layer; kvbits rows hold `context` "
                     "tokens and attend through the window (bytes: the groups it reaches and the "
                     "FP16 parts); FP16 rows attend over the last min(context, window) tokens, "
                     "which is all transformers' sliding cache layer keeps")
    if args.dtype != "float16":
        notes.append(f"dtype {args.dtype}: queries, the SDPA baseline's K/V and the kvbits "
                     f"layers' sink and residual are {args.dtype} (the packed body's scales stay "
                     "float16, as the store keeps them); the column names keep 'FP16'")
    if args.q_rows > 1:
        notes.append(f"q_rows {args.q_rows}: every sequence has {args.q_rows} query rows (the "
                     "verification of speculative drafts): kvbits rows attend causally among "
                     "them; the FP16 SDPA rows take the rows of a KV head's query heads as "
                     "queries of that head ([B, Hkv, Hq/Hkv x rows, D]: SDPA's own GQA path ran "
                     "at 16% of copy bandwidth with 4 rows) over the whole cache without a mask "
                     "(the flash backend has no bottom-right causal mask; the cost is the same); "
                     "QuantizedCache and seed rows skipped")
    elif args.q_rows < 1:
        p.error("--q-rows must be a positive integer")
    if args.softcap is not None:
        if not args.softcap > 0:
            p.error("--softcap must be positive")
        notes.append(f"softcap {args.softcap:g}: every kvbits row caps its scores (Gemma2's "
                     "attention-logit softcapping, in both kernels' online softmax); the FP16 "
                     "rows are SDPA without a cap (SDPA has none; a capped FP16 flash kernel "
                     "reads the same bytes), so they stand for FP16's cost; rel_err against the "
                     "capped reference")
    cols = table_columns(args.q_rows)
    name = args.name or ("decode_attention_quick" if args.quick else "decode_attention")
    kept = []
    if args.merge:
        prev = json.loads(args.merge.read_text())
        ran = set(shapes)
        kept = [r for r in prev["rows"] if (r["model"], r["batch"], r["context"]) not in ran]
        notes.append(f"rows of {len({(r['model'], r['batch'], r['context']) for r in kept})} "
                     f"shapes come from an earlier run of the same commit's kernel "
                     f"({prev['env']['date']}, `{prev['env']['command']}`); the rest from this run")
    rows = []
    free = torch.cuda.mem_get_info()[0]
    for model, batch, context in shapes:
        hq, hkv, d = ALL_MODELS[model]
        fp_bytes = 2 * batch * hkv * context * d * 2
        if 1.15 * fp_bytes > free:
            print(f"skip {model} B={batch} T={context}: FP16 cache {fp_bytes / 2**30:.0f} GiB "
                  "does not fit beside its copies", flush=True)
            continue
        try:
            rows += run_shape(model, hq, hkv, d, batch, context, bw, presets,
                              not args.no_baselines, knobs, softcap=args.softcap,
                              window=args.window, q_rows=args.q_rows,
                              dtype=getattr(torch, args.dtype), ceilings=not args.no_ceiling)
        except Exception as e:  # noqa: BLE001 (reported; the other shapes still run)
            print(f"FAILED {model} B={batch} T={context}: {type(e).__name__}: {e}\n"
                  + "".join(traceback.format_exception(e)[-4:]), flush=True)
            notes.append(f"{model} B={batch} T={context} failed: {type(e).__name__}: {e}")
            continue
        order = {s: i for i, s in enumerate(
            (m, b, t) for m in ALL_MODELS for b in sorted({1, 8, 32, *batches})
            for t in sorted({4096, 32768, 131072, *contexts}))}
        merged = sorted(kept + rows, key=lambda r: order.get((r["model"], r["batch"],
                                                               r["context"]), -1))
        write_results(name, merged, cols, env, notes, args.out)  # after every shape
    if args.skip_quantize_pack:
        return
    qrows = bench_quantize_pack(bw)
    write_results(name + "_quantize_pack", qrows,
                  [("op", "op"), ("preset", "preset"), ("kernel", "kernel"), ("shape", "shape"),
                   ("us", "median µs"),
                   ("bytes", "bytes"), ("tbps", "TB/s"), ("frac_bw", "of copy bw")],
                  env, notes[:1], args.out)


if __name__ == "__main__":
    main()
