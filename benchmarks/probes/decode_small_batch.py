"""Probe (GPU): launch choices at small batch and the cost of KVQuant's parts, in CUDA-graph time.

1. Batch-1 and small-batch shapes (kivi-2, kivi-4): the Triton kernel at its default split count,
   at half and double that, at 64-token tiles; the Gluon body forced on at its default split count
   and at half / double. Which kernel and split count to use where ``decode_gluon.serves`` now
   sends small steps to Triton.
2. KVQuant-3 layers with every part (codebooks, 2 outliers per token, pre-RoPE keys) and with
   parts removed, at a few warps / tile sizes: what each part costs and the best launch knobs.
3. (``splits`` argument) The Gluon body's split count as programs per SM, 4 to 64, over
   batch 1 to 8 shapes: the rule of ``decode_gluon.body_splits``.

    PYTHONPATH=src python3 benchmarks/probes/decode_small_batch.py [splits] > probe.log
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import copy_bandwidth, packed_nbytes, random_packed_kv  # noqa: E402
from decode_attention import MODELS, bench_graph, flash_graph_us, rel_err  # noqa: E402

from kvbits.kernels import decode_gluon  # noqa: E402
from kvbits.kernels.decode_attention import _sm_count, decode_attention, num_splits  # noqa: E402
from kvbits.spec import resolve_spec  # noqa: E402


def emit(**row):
    print(json.dumps(row), flush=True)


def query_and_flash(part, model, B, T):
    """A decode query for the shape, and FP16 flash SDPA's graph time over random K/V (reported)."""
    hq, hkv, d = MODELS[model]
    q, fp = flash_graph_us(B, hq, hkv, T, d)
    emit(part=part, model=model, B=B, T=T, cfg="flash", us=fp)
    return q, hkv, d, fp


def small_batch(bw):
    sms = _sm_count(torch.device("cuda"))
    shapes = [("llama-2-7b", 1, 4096), ("llama-2-7b", 1, 32768), ("llama-3-8b", 1, 4096),
              ("llama-3-8b", 1, 32768), ("llama-3-8b", 1, 131072), ("llama-3-8b", 8, 4096),
              ("llama-2-7b", 8, 4096), ("llama-3-8b", 4, 32768)]
    for model, B, T in shapes:
        q, hkv, d, fp = query_and_flash("small", model, B, T)
        for preset in ("kivi-2", "kivi-4"):
            kv = random_packed_kv(B, hkv, T, d, resolve_spec(preset))
            nb = packed_nbytes(kv)
            n_groups = kv.body_len // kv.group_size
            dflt = num_splits(B * hkv, -(-n_groups // 4), sms)
            gdef = decode_gluon.body_splits(B * hkv, kv.body_len, sms)
            cfgs = [("triton", {}), ("triton s/2", dict(splits=max(1, dflt // 2))),
                    ("triton 2s", dict(splits=2 * dflt)), ("triton tile64", dict(tile_tokens=64)),
                    ("triton tile64 2s", dict(tile_tokens=64, splits=2 * dflt)),
                    ("gluon", dict(gluon=True)), ("gluon s/2", dict(gluon=True, splits=max(1, gdef // 2))),
                    ("gluon s/4", dict(gluon=True, splits=max(1, gdef // 4))),
                    ("gluon 2s", dict(gluon=True, splits=2 * gdef))]
            for name, kw in cfgs:
                try:
                    us = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, **kw))
                except Exception as e:  # noqa: BLE001 (a probe reports and goes on)
                    emit(part="small", model=model, B=B, T=T, preset=preset, cfg=name,
                         error=f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                emit(part="small", model=model, B=B, T=T, preset=preset, cfg=name, us=us,
                     speedup=fp / us, frac_bw=nb / us * 1e6 / bw, default_splits=dflt,
                     gluon_splits=gdef)
            kv = None  # (freed)


def kvquant_parts(bw):
    full = resolve_spec("kvquant-3")
    variants = {"full": full, "no-outliers": dataclasses.replace(full, outliers=0.0),
                "no-prerope": dataclasses.replace(full, pre_rope=False),
                "codebook-only": dataclasses.replace(full, outliers=0.0, pre_rope=False)}
    for model, B, T in [("llama-3-8b", 8, 32768), ("llama-2-7b", 8, 32768), ("llama-3-8b", 32, 4096)]:
        q, hkv, d, fp = query_and_flash("kvq", model, B, T)
        for vname, spec in variants.items():
            kv = random_packed_kv(B, hkv, T, d, spec)
            nb = packed_nbytes(kv)
            err = rel_err(decode_attention(q, kv, scale=d ** -0.5), kv, q, d ** -0.5)
            knobs = [("default", {})] if vname != "full" else [
                ("default", {}), ("w8", dict(num_warps=8)), ("tile64", dict(tile_tokens=64)),
                ("tile32", dict(tile_tokens=32)), ("tile64 w2", dict(tile_tokens=64, num_warps=2)),
                ("tile32 w2", dict(tile_tokens=32, num_warps=2))]
            for name, kw in knobs:
                try:
                    us = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, **kw))
                except Exception as e:  # noqa: BLE001
                    emit(part="kvq", model=model, B=B, T=T, variant=vname, cfg=name,
                         error=f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                emit(part="kvq", model=model, B=B, T=T, variant=vname, cfg=name, us=us,
                     speedup=fp / us, frac_bw=nb / us * 1e6 / bw, bytes=nb, rel_err=err)
            kv = None  # (freed)


def gluon_splits(bw):
    sms = _sm_count(torch.device("cuda"))
    for model, B, T in [("llama-3-8b", 1, 32768), ("llama-3-8b", 1, 131072), ("llama-2-7b", 1, 32768),
                        ("llama-2-7b", 1, 131072), ("llama-3-8b", 4, 32768), ("llama-3-8b", 8, 32768),
                        ("llama-3-8b", 8, 131072), ("llama-2-7b", 8, 32768)]:
        hq, hkv, d = MODELS[model]
        q = torch.randn(B, hq, 1, d, dtype=torch.float16, device="cuda")
        kv = random_packed_kv(B, hkv, T, d, resolve_spec("kivi-2"))
        nb = packed_nbytes(kv)
        for per_sm in (4, 8, 16, 32, 64):
            splits = -(-per_sm * sms // (B * hkv))
            us = bench_graph(lambda: decode_attention(q, kv, scale=d ** -0.5, gluon=True,
                                                      splits=splits))
            steps = -(-kv.body_len // 64)
            emit(part="splits", model=model, B=B, T=T, per_sm=per_sm,
                 splits=decode_gluon.split_count(kv.body_len, splits), steps=steps, us=us,
                 frac_bw=nb / us * 1e6 / bw)
        kv = None  # (freed)


if __name__ == "__main__":
    bw = copy_bandwidth()
    emit(part="bw", tbps=bw / 1e12, gpu=torch.cuda.get_device_name())
    if sys.argv[1:] == ["splits"]:
        gluon_splits(bw)
    else:
        small_batch(bw)
        kvquant_parts(bw)
