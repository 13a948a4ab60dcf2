"""Random layers through the library's own path on the GPU, against the reference (a sweep).

The kernel tests build their layers by hand at chosen shapes; this probe draws shapes, presets
and lengths nobody picked (seeded), fills a real :class:`LayerStore` through its append path (a
prefill, then single-token decode appends that cross flushes), and compares what
``kvbits.ops.decode_attention`` returns on the GPU, whichever kernel its dispatch picks (Triton,
the Gluon register body, the TMA ring), with the float32 reference over the same stored codes.
Half the layers also run a step with the lengths on the device inside a captured CUDA graph
(how ``generate`` with graphs calls it). Prints one line per layer and a summary; exit status 1
if any layer is off its error budget or not finite.

    PYTHONPATH=src python3 benchmarks/probes/random_layers_gpu.py --layers 150 --seed 0

``--gluon-all`` lifts the size limits that send small steps (and plain KIVI layers with many
blocks of query columns) to the Triton kernel, as the tests' ``gluon_calls`` fixture does, so
every layer a Gluon body is eligible for runs there (most random layers are too small for the
library's own choice); ``--wide-groups`` also draws 12-32 query heads per KV head (column
blocks). Each line then says which body served it (``body=gluon``: the register body or the
TMA ring).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings

import torch

from kvbits import ops
from kvbits.cache.store import LayerStore
from kvbits.methods.kvquant import LayerCodebooks, thresholds_of
from kvbits.reference import attention as ref
from kvbits.spec import resolve_spec

PRESETS = ["kivi-2", "kivi-3", "kivi-4", "kivi-8", "k4v2", "k8v4", "kivi-2:G=64",
           "kivi-4:G=128", "kivi-2:S=4", "kivi-4:R=0", "uniform-int2", "uniform-int4",
           "uniform-int8", "fp8-dynamic", "fp8", "kivi-2-had", "kvquant-3", "kvquant-2",
           "kvquant-4", "kvquant-3-dense-post", "kvquant-3:G=64", "kvquant-3-offline",
           "kvquant-2-offline", "kvquant-4-offline", "fp16"]
HEAD_DIMS = [64, 64, 128, 128, 128, 80, 96, 256]
# relative error budget, global / worst row: the kernel tests' (tests/kernels/test_decode_attention.py)
BUDGETS = {torch.float16: (1e-2, 2e-2), torch.bfloat16: (1e-2, 3e-2)}


GROUPS = [1, 2, 3, 4, 5, 7, 8]
WIDE_GROUPS = GROUPS + [12, 16, 24, 32]  # --wide-groups: past 16 columns, column blocks


def draw(rng: torch.Generator, groups: list[int] = GROUPS) -> dict:
    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=rng))]
    D = pick(HEAD_DIMS)
    Hkv = pick([1, 2, 4, 8])
    HG = pick(groups)
    B = pick([1, 1, 2, 3, 5, 8])
    tokens = int(math.exp(float(torch.empty(1).uniform_(math.log(2), math.log(70000),
                                                         generator=rng))))
    tokens = max(1, min(tokens, 2_000_000 // (B * Hkv)))  # bounds the reference's float32 copy
    return {"preset": pick(PRESETS), "D": D, "Hkv": Hkv, "HG": HG, "B": B, "tokens": tokens,
            "Lq": pick([1, 1, 1, 2, 4]), "decode": pick([0, 1, 5, 40]),
            "dtype": pick([torch.float16, torch.float16, torch.bfloat16]),
            "ragged": bool(torch.rand(1, generator=rng) < 0.4),
            "window": pick([None, None, None, 700]),
            "seed": int(torch.randint(1 << 30, (1,), generator=rng))}


def codebooks(spec, H: int, g: torch.Generator, device) -> LayerCodebooks:
    """Sorted random non-uniform tables on the code range, as a calibration would give."""
    def one(bits):
        n = 1 << bits
        steps = torch.rand(H, n, generator=g) + 0.3
        cb = torch.cumsum(steps, -1)
        cb = (cb - cb[:, :1]) / (cb[:, -1:] - cb[:, :1]) * (n - 1)
        return cb.contiguous(), thresholds_of(cb).contiguous()
    return LayerCodebooks(*one(spec.key_bits), *one(spec.value_bits)).to(device)


def build(c: dict, device: str = "cuda"):
    spec = resolve_spec(c["preset"])
    g = torch.Generator().manual_seed(c["seed"])
    B, H, D = c["B"], c["Hkv"], c["D"]
    kw = {}
    if spec.method == "kvquant":
        kw["codebooks"] = codebooks(spec, H, g, device)
        if spec.key_scales == "calibrated":  # offline key rows: ranges of their own (the keys'
            # channel magnitudes below differ, so some codes saturate), own generator
            gr = torch.Generator().manual_seed(c["seed"] + 7)
            mag = 3 * 10 ** (torch.rand(H, D, generator=gr) - 0.5)
            kw["codebooks"] = dataclasses.replace(
                kw["codebooks"], k_scale=(2 * mag / ((1 << spec.key_bits) - 1)).half().to(device),
                k_zero=(0.5 - mag).half().to(device))
        if spec.pre_rope:
            kw["inv_freq"] = (1e4 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)).to(device)
    if spec.method == "fp8" and spec.fp8_scale == "calibrated":
        kw["fp8_scales"] = (torch.rand(H, generator=g).to(device) * 0.05 + 0.01,
                            torch.rand(H, generator=g).to(device) * 0.02 + 0.005)
    store = LayerStore(spec, B, H, D, c["dtype"], device, **kw)
    kmag = 10 ** (torch.rand(D, generator=g) - 0.5)
    kmag[D // 3] = 8.0  # an outlier channel, as real keys have

    def kv(n):
        k = torch.randn(B, H, n, D, generator=g) * kmag + 0.5
        v = torch.randn(B, H, n, D, generator=g)
        return k.to(c["dtype"]).to(device), v.to(c["dtype"]).to(device)

    left = c["tokens"] - c["decode"] if c["tokens"] > c["decode"] else c["tokens"]
    store.append(*kv(left))
    for _ in range(c["tokens"] - left):
        store.append(*kv(1))
    total = store.sink_len + store.body_len + store.res_len
    lengths = None
    if c["ragged"] and B > 1:
        lengths = torch.randint(1, total + 1, (B,), generator=g, dtype=torch.int32)
        lengths[0] = total
        lengths = lengths.to(device)
    q = (torch.randn(B, H * c["HG"], c["Lq"], D, generator=g) * 1.5).to(c["dtype"]).to(device)
    return store, q, lengths, kv


def errors(o: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    of, rf = o.float(), r.float()
    if not torch.isfinite(of).all():
        return float("inf"), float("inf")
    glob = ((of - rf).norm() / rf.norm().clamp_min(1e-30)).item()
    rows = (of - rf).norm(dim=-1) / rf.norm(dim=-1).clamp_min(1e-30)
    rows = torch.where(rf.norm(dim=-1) == 0, (of.norm(dim=-1) > 0).float() * 1e9, rows)
    return glob, rows.max().item() if rows.numel() else 0.0


def one_layer(c: dict, device: str) -> dict:
    store, q, lengths, kv = build(c, device)
    scale = c["D"] ** -0.5
    args = {"scale": scale, "starts": store.starts, "lengths": lengths, "window": c["window"]}
    qr = store.rotate_query(q)
    kvw = store.view()
    out = ops.decode_attention(qr, kvw, **args)
    want = ref.decode_attention(qr.float(), kvw, **args).to(q.dtype)
    res = {"eager": errors(out, want), "kernel": ops.kernel_reads(kvw)}
    if device == "cuda" and c["seed"] % 2 == 0 and lengths is None and c["Lq"] == 1 and store.device_lengths_ok():
        # a captured decode step: append one token at the device length, then attend
        lens = store.begin_device_lengths(store.sink_len + store.body_len + store.res_len + 8)
        k1, v1 = kv(1)
        q1 = q[:, :, :1].clone()
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up launches (compiles) outside the capture
            o_warm = ops.decode_attention(store.rotate_query(q1), store.view_dev(),
                                          scale=scale, starts=store.starts,
                                          window=c["window"], lens_dev=lens)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            store.append_dev(k1, v1, host=False)
            o_cap = ops.decode_attention(store.rotate_query(q1), store.view_dev(),
                                         scale=scale, starts=store.starts, window=c["window"],
                                         lens_dev=lens)
        graph.replay()
        store.device_step_done(False)
        torch.cuda.synchronize()
        store.end_device_lengths()
        kvh = store.view()
        want1 = ref.decode_attention(store.rotate_query(q1).float(), kvh, scale=scale,
                                     starts=store.starts, window=c["window"]).to(q.dtype)
        res["graph"] = errors(o_cap, want1)
        del o_warm
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (the reference twice)")
    ap.add_argument("--seconds", type=float, default=420.0, help="stop drawing after this")
    ap.add_argument("--gluon-all", action="store_true",
                    help="every layer a Gluon body is eligible for runs there (size limits lifted)")
    ap.add_argument("--wide-groups", action="store_true",
                    help="also draw 12-32 query heads per KV head")
    a = ap.parse_args()
    served = []
    if a.gluon_all:
        from kvbits.kernels import decode_gluon  # (it hands TMA-ring layers on itself)
        for name in ("MIN_BODY_TOKENS", "MIN_BODY_TOKENS_PLANES", "MIN_BODY_TOKENS_WIDE"):
            setattr(decode_gluon, name, 1)
        decode_gluon.MAX_PLAIN_BLOCKS = 1 << 10
        real = decode_gluon.attend_body
        decode_gluon.attend_body = lambda *x, **k: served.append(1) or real(*x, **k)
    warnings.filterwarnings("ignore", message="group_size .* does not divide head_dim")
    torch.manual_seed(a.seed)
    rng = torch.Generator().manual_seed(a.seed)
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"# {name}; torch {torch.__version__}", flush=True)
    bad, done, t0 = [], 0, time.time()
    worst = {}
    for i in range(a.layers):
        if time.time() - t0 > a.seconds:
            break
        c = draw(rng, WIDE_GROUPS if a.wide_groups else GROUPS)
        served.clear()
        label = (f"{i:3d} {c['preset']:<22} B={c['B']} Hkv={c['Hkv']} HG={c['HG']} D={c['D']} "
                 f"T={c['tokens']} Lq={c['Lq']} dec={c['decode']} "
                 f"{str(c['dtype']).replace('torch.', '')} ragged={c['ragged']} "
                 f"window={c['window']}")
        try:
            r = one_layer(c, a.device)
        except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
            print(f"{label}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            bad.append(label)
            continue
        done += 1
        parts = []
        for key in ("eager", "graph"):
            if key in r:
                glob, row = r[key]
                budget = BUDGETS[c["dtype"]]
                ok = glob <= budget[0] and row <= budget[1]
                parts.append(f"{key} {glob:.2e}/{row:.2e}{'' if ok else ' OFF'}")
                worst[key] = max(worst.get(key, 0.0), glob)
                if not ok:
                    bad.append(label + " " + key)
        body = (" body=gluon" if served else " body=triton") if a.gluon_all else ""
        print(f"{label}: kernel={r['kernel']}{body} " + "; ".join(parts), flush=True)
    print(f"# {done} layers in {time.time() - t0:.0f} s; worst global error {worst}; "
          f"{len(bad)} off budget or failed", flush=True)
    for b in bad:
        print("# BAD", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
