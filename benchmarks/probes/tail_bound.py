"""Probe (GPU): how much of a captured decode call is its Gluon body, timed the decode table's
way, so that the speedup over flash SDPA a call could show with *no* FP16 part and *no* merge
(a free tail) is measured, not estimated.

For each row, in one process and alternated over three rounds (best of the medians):
- flash SDPA over the FP16 K and V (the table's baseline);
- the library's call (``kvbits.ops.decode_attention``), as the table times it;
- the body alone: the same ``decode_gluon.attend_body`` launch the call makes (its split count,
  the TMA ring inside the capture), without the FP16 splits, the finish kernel or the merge;
- a plain read of the row's bytes (``common.read_graph_us``: the table's ceiling column; the
  faster of ``torch.sum`` and a Triton loop, since ``torch.sum`` into an int64 reads at ~0.6
  TB/s on an H100).

Each is timed two ways: ``flushed`` (captured, ``triton.testing.do_bench`` with its 256 MB L2
flush before every replay: the decode table) and ``b2b`` (``do_bench_cudagraph``: replays back
to back, no flush). ``flash / body`` is then the most any design that keeps this body and hides
the rest of the call completely could show in the table; ``read / body`` is how close the body
alone comes to a plain read of the same bytes.

    PYTHONPATH=src python3 benchmarks/probes/tail_bound.py [--out DIR] [MODEL:B:T:preset,...]
"""
import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, packed_nbytes, random_packed_kv, read_graph_us, write_results
from decode_attention import MODELS, bench_graph, sdpa_fp16

from kvbits.kernels import decode_attention as da
from kvbits.kernels import decode_gluon
from kvbits.kernels import decode_gluon_tma as dt
from kvbits.ops import decode_attention
from kvbits.spec import resolve_spec

ROWS = ["llama-3-8b:8:32768:uniform-int4", "llama-3-8b:8:32768:kivi-2",
        "llama-3-8b:8:32768:kivi-4", "llama-3-8b:8:131072:uniform-int4",
        "llama-3-8b:32:32768:uniform-int4", "llama-2-7b:8:32768:uniform-int4"]
ROUNDS = 3


def b2b_us(fn) -> float:
    """Median µs of ``fn`` replayed back to back in ``do_bench_cudagraph``'s own capture (no L2
    flush), after an eager call (compiles; builds what a capture may not)."""
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def body_call(q, kv, scale):
    """The body launch the library's captured call makes, alone (its partial columns only)."""
    B, hq, lq, D = q.shape
    dev = q.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    mode, dt.MODE = dt.MODE, "1"  # the split count a captured call takes (the ring serves it)
    try:
        splits = decode_gluon.split_count(kv.body_len,
                                          da.gluon_splits(kv, sms, dev, hq // kv.kv_heads * lq))
    finally:
        dt.MODE = mode
    out = torch.empty(B * hq * lq, splits, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B * hq * lq, splits, dtype=torch.float32, device=dev)

    def call():
        decode_gluon.attend_body(q, kv, out, lse, scale_log2=scale * da.LOG2E,
                                 starts=q, lengths=q, has_starts=False, has_lens=False,
                                 n_out=splits, splits=splits)
    call.out, call.lse = out, lse  # (the partials of the last run, for probes that compare)
    return call, splits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rows", nargs="?", default=",".join(ROWS))
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}: µs, best of {ROUNDS} medians; flushed = do_bench of the captured call (the "
          "decode table), b2b = do_bench_cudagraph (no flush)", flush=True)
    rows = []
    for spec in a.rows.split(","):
        model, B, T, preset = spec.split(":")
        B, T = int(B), int(T)
        hq, hkv, D = MODELS[model]
        scale = D ** -0.5
        q = torch.randn(B, hq, 1, D, dtype=torch.float16, device="cuda")
        k = torch.randn(B, hkv, T, D, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        kv = random_packed_kv(B, hkv, T, D, resolve_spec(preset))
        nbytes = packed_nbytes(kv)
        body, splits = body_call(q, kv, scale)
        calls = {"sdpa": lambda q=q, k=k, v=v: sdpa_fp16(q, k, v, scale),
                 "kvbits": lambda q=q, kv=kv: decode_attention(q, kv, scale=scale),
                 "body": body}
        times = {f"{n}_{how}": [] for n in (*calls, "read") for how in ("flushed", "b2b")}
        for _ in range(ROUNDS):
            for name, fn in calls.items():
                times[f"{name}_flushed"].append(bench_graph(fn))
                times[f"{name}_b2b"].append(b2b_us(fn))
            times["read_flushed"].append(read_graph_us(nbytes, bench_graph))
            times["read_b2b"].append(read_graph_us(nbytes, b2b_us))
        del k, v, kv
        torch.cuda.empty_cache()
        best = {n: min(t) for n, t in times.items()}
        row = {"model": model, "batch": B, "context": T, "preset": preset, "bytes": nbytes,
               "splits": splits, **best}
        for how in ("flushed", "b2b"):
            row[f"speedup_{how}"] = best[f"sdpa_{how}"] / best[f"kvbits_{how}"]
            row[f"free_tail_{how}"] = best[f"sdpa_{how}"] / best[f"body_{how}"]
            row[f"ceiling_{how}"] = best[f"sdpa_{how}"] / best[f"read_{how}"]
            row[f"body_of_read_{how}"] = best[f"read_{how}"] / best[f"body_{how}"]
            row[f"tail_{how}"] = best[f"kvbits_{how}"] - best[f"body_{how}"]
        rows.append(row)
        print(f"{model} B={B} T={T} {preset} ({nbytes / 1e6:.0f} MB, {splits} splits)", flush=True)
        for how in ("flushed", "b2b"):
            print(f"  {how:>7}: sdpa {best[f'sdpa_{how}']:7.1f}  kvbits {best[f'kvbits_{how}']:7.1f} "
                  f"(x{row[f'speedup_{how}']:.2f})  body {best[f'body_{how}']:7.1f} "
                  f"(free tail x{row[f'free_tail_{how}']:.2f}; tail {row[f'tail_{how}']:.1f})  "
                  f"read {best[f'read_{how}']:7.1f} (ceiling x{row[f'ceiling_{how}']:.2f}; body at "
                  f"{row[f'body_of_read_{how}']:.0%} of it)", flush=True)
    if a.out:
        cols = [("model", "model"), ("batch", "B"), ("context", "context"), ("preset", "preset"),
                ("bytes", "bytes"), ("splits", "body splits")]
        for how in ("flushed", "b2b"):
            cols += [(f"sdpa_{how}", f"flash SDPA µs ({how})"),
                     (f"kvbits_{how}", f"kvbits µs ({how})"), (f"speedup_{how}", "speedup"),
                     (f"body_{how}", f"body alone µs ({how})"),
                     (f"free_tail_{how}", "speedup with a free tail"),
                     (f"read_{how}", f"plain read µs ({how})"), (f"ceiling_{how}", "ceiling"),
                     (f"body_of_read_{how}", "read / body")]
        tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu"
        write_results(f"tail_bound_{tag}", rows, cols, environment(), notes=[
            f"GPU: {gpu}",
            "flushed: triton.testing.do_bench median of the call captured in a CUDA graph (its "
            "256 MB L2 flush before each replay), as the decode table; b2b: "
            "do_bench_cudagraph median (replays back to back, no flush); best of three rounds, "
            "the callables alternated",
            "body alone: decode_gluon.attend_body with the library's split count (the TMA ring "
            "inside the capture), without the FP16 part, the finish kernel or the merge; "
            "speedup with a free tail = flash SDPA / body alone",
            "plain read: the faster of torch.sum and a Triton loop over the bytes a decode step "
            "must read (common.read_graph_us, timed each way)"], out_dir=a.out)


if __name__ == "__main__":
    main()
