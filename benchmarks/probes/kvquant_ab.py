"""Probe (GPU): cheap knobs for KVQuant layers in the Gluon register body, whole captured calls.

KVQuant's full layer (3-bit codebooks, two outliers per token and side, pre-RoPE keys) runs
~4640 SASS instructions per 64-token step at 255 registers, yet at Llama-3-8B batch 8 32k it
takes ~15 us per step and program, ~3x what its issue alone needs: its loads wait. Variants:

* ``lib``: the library as it is;
* ``pf_out``: the outliers of the next step prefetched with its codes
  (``decode_gluon.PREFETCH_OUTLIERS``);
* ``pf_out_l1``: that, every prefetch into L1 instead of L2 (``PREFETCH_L1``);
* ``1w`` / ``2w``: split counts of one / two whole waves of 8 programs per SM instead of
  ``body_splits``' rule (~4 waves of 8-step programs at 64 pairs).

``ABLATE=1``: instead, the layer with its parts taken away (wrong outputs, timing only):
``lib``, ``no-rope`` (keys read as post-RoPE), ``no-outliers``, ``codebooks`` (neither), which
says what each part of the full layer costs on the GPU.

``ROPE_AB=1``: the pre-RoPE turn two ways (``decode_gluon.ROPE_BLOCKS``): ``blocks`` (four
16-row blocks, each with its rows of the cos/sin table), ``whole`` (the whole table beside both
key halves, before session 39). Session 39's run also had ``turned`` (one table for the four
blocks, the query turned per block; since removed): ``kvquant_rope_ab_s39.log``.

Variants alternated, best of 3 ``do_bench`` medians (CUDA-graph replays, L2 flushed), each
output compared with ``lib``'s.

    PYTHONPATH=src python3 benchmarks/probes/kvquant_ab.py [B:Hq:Hkv:T:preset,...]
"""
import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import parse_rows, random_packed_kv
from decode_attention import captured_ab, flash_graph_us

from kvbits.kernels import decode_gluon as dg
from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

ROWS = parse_rows(sys.argv[1] if len(sys.argv) > 1 else None, [
    (8, 32, 8, 32768, "kvquant-3"), (8, 32, 8, 131072, "kvquant-3"),
    (8, 32, 32, 32768, "kvquant-3"), (1, 32, 8, 131072, "kvquant-3"),
    (8, 32, 8, 32768, "kivi-3")])
SMS = torch.cuda.get_device_properties(0).multi_processor_count
ROPE_BLOCKS = dg.ROPE_BLOCKS


ABLATIONS = {"lib": (), "no-rope": ("rope_inv_freq",),
             "no-outliers": ("k_out_idx", "k_out_val", "v_out_idx", "v_out_val"),
             "codebooks": ("rope_inv_freq", "k_out_idx", "k_out_val", "v_out_idx", "v_out_val")}


def without(kv, names):
    """A shallow copy of ``kv`` with the parts ``names`` removed."""
    kv = copy.copy(kv)
    for n in names:
        setattr(kv, n, None)
    return kv


def variant(q, kv, pf_out=False, l1=False, splits=None, rope_blocks=dg.ROPE_BLOCKS):
    def fn():
        dg.PREFETCH_OUTLIERS, dg.PREFETCH_L1, dg.ROPE_BLOCKS = pf_out, l1, rope_blocks
        return decode_attention(q, kv, scale=q.shape[-1] ** -0.5, splits=splits)
    return fn


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: whole captured calls, us "
          "(best of 3 do_bench medians, alternated); max |out - first variant's| per variant", flush=True)
    for B, hq, hkv, T, preset in ROWS:
        kv = random_packed_kv(B, hkv, T, 128, resolve_spec(preset))
        q, flash = flash_graph_us(B, hq, hkv, T, 128)
        steps = -(-kv.body_len // dg.STEP)
        pairs = B * hkv
        if os.environ.get("ROPE_AB") == "1":
            fns = {name: variant(q, kv, rope_blocks=mode)
                   for name, mode in (("blocks", True), ("whole", False))}
        elif os.environ.get("ABLATE") == "1":
            fns = {name: variant(q, without(kv, drop)) for name, drop in ABLATIONS.items()}
        else:
            fns = {"lib": variant(q, kv), "pf_out": variant(q, kv, pf_out=True),
                   "pf_out_l1": variant(q, kv, pf_out=True, l1=True)}
            for w in (1, 2):
                n = min(steps, max(1, w * 8 * SMS // pairs))
                fns[f"{w}w ({n} splits)"] = variant(q, kv, splits=n)
        times, outs = captured_ab(fns)
        dg.PREFETCH_OUTLIERS, dg.PREFETCH_L1, dg.ROPE_BLOCKS = False, False, ROPE_BLOCKS
        first = next(iter(times))  # each variant against the first
        base = times[first]
        print(f"B={B} Hq={hq} Hkv={hkv} T={T} {preset} (flash SDPA {flash:.1f} us): " + ", ".join(
            f"{name} {us:.1f} us ({base / us - 1:+.1%}, {flash / us:.2f}x, "
            f"diff {(outs[name] - outs[first]).abs().max().item():.1e})"
            for name, us in times.items()), flush=True)


if __name__ == "__main__":
    main()
