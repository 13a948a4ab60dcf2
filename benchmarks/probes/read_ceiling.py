"""Probe (GPU): the largest speedup over FP16 flash SDPA that the decode table could show for a
layer's bytes, measured the table's way.

The table times each captured call with ``triton.testing.do_bench``, whose 256 MB L2 flush
before every replay leaves dirty lines that the call's first reads must write back (~10 us on
an H100, ``bench_overhead.py``), on top of the graph's launch gap (~2.5 us). Both sides pay
these fixed costs, so on rows where flash SDPA itself reads at the copy bandwidth they cap the
ratio below the bytes' ratio. Here a kernel that does nothing but read the bytes a preset's
step must read (``packed_nbytes``) is timed the same way (captured, ``do_bench`` median): the
faster of ``torch.sum`` and a plain Triton read loop. ``sdpa / read`` is then a ceiling for
any kernel that reads those bytes; the library's own call is timed beside it. The read of
SDPA's own bytes checks the read kernels against flash SDPA (where memory allows).

    PYTHONPATH=src python3 benchmarks/probes/read_ceiling.py [--out DIR] [MODEL:B:T,...]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, packed_nbytes, random_packed_kv, read_graph_us, write_results
from decode_attention import MODELS, bench_graph, ceiling_fields, sdpa_fp16

from kvbits.ops import decode_attention
from kvbits.spec import resolve_spec

PRESETS = ("kivi-2", "kivi-4", "uniform-int4", "kvquant-3")
SHAPES = [("llama-3-8b", 8, 32768), ("llama-3-8b", 8, 131072), ("llama-3-8b", 32, 32768),
          ("llama-2-7b", 8, 32768), ("llama-2-7b", 8, 131072), ("llama-2-7b", 32, 32768)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="?", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--presets", default=",".join(PRESETS))
    a = p.parse_args()
    shapes = ([(m, int(b), int(t)) for m, b, t in (s.split(":") for s in a.shapes.split(","))]
              if a.shapes else SHAPES)
    free = torch.cuda.mem_get_info()[0]
    rows = []
    print(f"# {torch.cuda.get_device_name()}: us, do_bench medians of captured calls", flush=True)
    for model, B, T in shapes:
        hq, hkv, D = MODELS[model]
        sdpa_bytes = 2 * B * hkv * T * D * 2
        if 1.1 * sdpa_bytes > free:
            print(f"{model} B={B} T={T}: skipped (FP16 K and V do not fit)", flush=True)
            continue
        q = torch.randn(B, hq, 1, D, dtype=torch.float16, device="cuda")
        k = torch.randn(B, hkv, T, D, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        sdpa_us = bench_graph(lambda q=q, k=k, v=v: sdpa_fp16(q, k, v, D ** -0.5))
        del k, v
        torch.cuda.empty_cache()
        sdpa_read = read_graph_us(sdpa_bytes, bench_graph) if 2.1 * sdpa_bytes < free else float("nan")
        print(f"{model} B={B} T={T}: flash SDPA {sdpa_us:.1f} us, a read of its "
              f"{sdpa_bytes / 1e6:.0f} MB {sdpa_read:.1f} us", flush=True)
        for preset in a.presets.split(","):
            kv = random_packed_kv(B, hkv, T, D, resolve_spec(preset))
            nbytes = packed_nbytes(kv)
            lib_us = bench_graph(lambda kv=kv: decode_attention(q, kv, scale=D ** -0.5))
            del kv
            torch.cuda.empty_cache()
            ceiling_us = read_graph_us(nbytes, bench_graph)
            row = {"model": model, "batch": B, "context": T, "preset": preset,
                   "bytes": nbytes, "sdpa_us": sdpa_us, "sdpa_bytes_read_us": sdpa_read,
                   "read_us": ceiling_us, "kvbits_us": lib_us, "speedup": sdpa_us / lib_us,
                   "ceiling": ceiling_fields(sdpa_us, ceiling_us, lib_us)["ceiling"]}
            rows.append(row)
            print(f"   {preset:>13}: {nbytes / 1e6:7.0f} MB, read {ceiling_us:7.1f} us -> "
                  f"ceiling x{row['ceiling']:.2f}; kvbits {lib_us:7.1f} us x{row['speedup']:.2f}",
                  flush=True)
    if a.out:
        env = environment()
        write_results("read_ceiling", rows, [
            ("model", "model"), ("batch", "B"), ("context", "context"), ("preset", "preset"),
            ("bytes", "bytes read"), ("sdpa_us", "flash SDPA µs"),
            ("sdpa_bytes_read_us", "read of SDPA's bytes µs"), ("read_us", "read of these bytes µs"),
            ("ceiling", "ceiling (SDPA / read)"), ("kvbits_us", "kvbits µs"),
            ("speedup", "kvbits speedup")], env, notes=[
            f"GPU: {torch.cuda.get_device_name()}",
            "every time: triton.testing.do_bench median of the call captured in a CUDA graph "
            "(its 256 MB L2 flush before each replay, as the decode table)",
            "read: the faster of torch.sum and a Triton loop over an int32 buffer of the bytes a "
            "decode step of the preset must read (packed codes, scales, outliers, FP16 sink and "
            "residual); ceiling: flash SDPA's time over it, the most any kernel reading those "
            "bytes could show in the table"], out_dir=a.out)


if __name__ == "__main__":
    main()
