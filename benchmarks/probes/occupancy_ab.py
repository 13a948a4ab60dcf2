"""Probe (GPU): does the TMA ring's body run faster with more programs resident per SM?

The ring holds ~210 registers per thread at 2 bits, so a scheduler keeps two one-warp programs
(8 per SM). Every plan that would raise that (a 32-token half step, two warps sharing a stage)
is a rewrite of the step, so this measures the lever first, at fixed code:

* ``full``: the library's body kernel, its residency lowered by padding its shared memory
  (``PAD``, int32 words of a live allocation) to 6 and 4 programs per SM, against its own 8;
* ``keys``: the same kernel with the values' math removed (``KEYS_ONLY``; every byte is still
  copied into the ring, the scores and softmax kept, results wrong, time only) and two ring
  stages: ~128 registers, so 16 programs fit an SM; padded to 12, 8 and 4.

If time falls from 8 to 16 programs per SM at fixed code, the half step is worth building; if
it is flat, the body is bound by something the residency does not change. The kernel is a
source copy of ``decode_gluon_tma`` with the two constexprs added (the library is untouched).
CUDA-graph time, best of three medians, alternated; residency read back from the compiled
kernel (registers, shared memory). (Session 35 ran it before ``attend_body`` took ``extra``: it
then patched the launch too, with the same keywords.)

    PYTHONPATH=src python3 benchmarks/probes/occupancy_ab.py [B:Hq:Hkv:T:preset,...]
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import best_graph_us, copy_bandwidth, packed_nbytes, parse_rows, random_packed_kv

from kvbits.kernels import decode_gluon as dg
from kvbits.spec import resolve_spec

ROOT = Path(__file__).resolve().parents[2]
SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KB per SM, 1 KB of it reserved per resident CTA


def variant_module():
    """``decode_gluon_tma`` with ``PAD`` and ``KEYS_ONLY`` constexprs in its body kernel."""
    src = (ROOT / "src/kvbits/kernels/decode_gluon_tma.py").read_text()
    src = src.replace("from . import decode_gluon as dg",
                      "from kvbits.kernels import decode_gluon as dg")
    src = src.replace("from .launch import", "from kvbits.kernels.launch import")
    pad = ("        for i in gl.static_range(len(PAD)):  # live padding (powers of two)\n"
           "            pad = gl.allocate_shared_memory(gl.int32, [PAD[i]], gl.SwizzledSharedLayout("
           "1, 1, 1, [0]))\n"
           "            pad.slice(0, 32).store(gl.zeros([32], gl.int32, gl.BlockedLayout([1], [32],"
           " [1], [0])))\n")
    ring = "        fence_async_shared()\n        for i in gl.static_range(NS - 1):  # the ring's"
    edits = [
        ("        PDL: gl.constexpr = False,\n    ):",
         ("        PDL: gl.constexpr = False, PAD: gl.constexpr = (),\n"
          "        KEYS_ONLY: gl.constexpr = False,\n    ):")),
        (ring, pad + ring),
    ]
    for old, new in edits:
        if old not in src:
            raise SystemExit(f"occupancy_ab: decode_gluon_tma changed, cannot patch {old[:50]!r}")
        src = src.replace(old, new)
    # the values' math under `if not KEYS_ONLY` (keys only: the accumulators just rescale)
    a = src.index("            vsw = vs_s.index(st).load(VSS)")
    b = src.index("        for i in gl.static_range(NS):\n            mbarrier.invalidate")
    block = "".join("    " + line if line.strip() else line
                    for line in src[a:b].splitlines(keepends=True))
    src = (src[:a] + "            if KEYS_ONLY:\n                acc0 = acc0 * alpha[None, :]\n"
           "                acc1 = acc1 * alpha[None, :]\n            else:\n" + block + src[b:])
    path = Path(tempfile.mkdtemp()) / "decode_gluon_tma_occupancy.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("decode_gluon_tma_occupancy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def powers_of_two(words: int) -> tuple:
    """``words`` rounded down to 32, as the powers of two that sum to it (Gluon's shared
    allocations have power-of-two shapes)."""
    words -= words % 32
    return tuple(1 << b for b in reversed(range(words.bit_length())) if words >> b & 1)


def make(mod, q, kv, splits, keys_only, ns, pad):
    """A call of ``mod``'s body kernel on its own partials; ``ns``: ring stages (None: the
    library's), ``pad``: :func:`powers_of_two` words of live shared-memory padding. Returns the
    compiled kernel."""
    B, hq = q.shape[:2]
    out = torch.zeros(B * hq, splits, 128, dtype=torch.float32, device="cuda")
    lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

    extra = {"PAD": pad, "KEYS_ONLY": keys_only, **({"NS": ns} if ns else {})}

    def call():
        return mod.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                               has_starts=False, has_lens=False, n_out=splits, splits=splits,
                               extra=extra)
    return call


def main() -> None:
    rows = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
        (8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"), (8, 32, 8, 131072, "kivi-4")])
    mod = variant_module()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: TMA ring body kernel alone, CUDA-graph us (best of "
          f"3 medians, alternated); copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for B, hq, hkv, T, preset in rows:
        kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
        q = torch.randn(B, hq, 1, 128, dtype=torch.float16, device="cuda")
        splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, 128))
        nbytes = packed_nbytes(kv)
        # compile each unpadded variant to read its registers and shared memory, then pad
        calls, info = {}, {}

        for name, keys_only, ns in (("full", False, None), ("keys", True, 2)):
            kern = make(mod, q, kv, splits, keys_only, ns, ())()  # the compiled kernel
            torch.cuda.synchronize()
            regs, smem = kern.n_regs, kern.metadata.shared
            by_regs = 4 * (65536 // 4 // (32 * ((regs + 7) // 8 * 8)))
            by_smem = SMEM_PER_SM // (smem + 1024)
            natural = min(by_regs, by_smem, 32)
            info[name] = (regs, smem, natural)
            targets = [natural] + [n for n in (12, 8, 6, 4) if n < natural]
            for n in targets:
                need = SMEM_PER_SM // n - 1024  # bytes per program for n per SM
                pad = () if n == natural else powers_of_two(max(32, (need - smem) // 4 - 16))
                calls[f"{name} {n}/SM"] = make(mod, q, kv, splits, keys_only, ns, pad)
        for fn in calls.values():  # compile every variant before timing
            fn()
        torch.cuda.synchronize()
        times = best_graph_us(calls)
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} splits={splits} ({B * hkv * splits} "
              f"programs); " + "; ".join(f"{k}: {r} regs, {s} B smem, {n}/SM natural"
                                          for k, (r, s, n) in info.items()), flush=True)
        for name, us in times.items():
            print(f"   {name:12s} {us:8.1f} us  {nbytes / us * 1e6 / bw:6.1%} of copy bw",
                  flush=True)


if __name__ == "__main__":
    main()
