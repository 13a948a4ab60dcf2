"""Probe: kvquant keys with OFFLINE per-channel scales (KVQuant paper) instead of KIVI's per-group
min/max, measured through the cache like ``kvbits ppl``, and compared with KIVI's front at equal
effective bits (the per-group key scale/zero no longer counted).

Nothing under src/ is changed: the probe monkeypatches at run time

* ``kvbits.methods.kvquant.quantize_keys`` (what ``LayerStore._quantize_layer`` calls through the
  module): for a layer registered in ``OFFLINE`` (keyed by its key codebook tensor) the group
  scale/zero are the layer's offline ``[H, D]`` FP16 scale/zero broadcast over groups; codes
  saturate at the codebook ends; each token's ``n_out`` outliers are the channels with the
  largest ``|x - dequant(x)|`` (``sel="err"``) or the original median/MAD group score
  (``sel="mad"``). The broadcast scale/zero are written into the store's ``k_scale``/``k_zero``
  buffers, so ``dequantize_keys`` (reference attention) reads them back unchanged.
* ``kvbits.eval.perplexity._cache_sizes``: also records the bytes of the per-group key
  scale/zero (``2 * 2 * D / G`` bytes per body token per KV head), so that the effective bits of
  an offline row can drop them (and add the offline tables, FP16 scale+zero per channel per head
  per layer).

Calibration (as ``kvbits ppl --calib-tokens 2048``): ``collect_kv`` on 2048 tokens of
sotu-pre-2000 (windows of 512, Fisher weights, pre-RoPE keys) -- the exact data ``calibrate``
uses; ``fit_layer`` gives the unchanged presets' codebooks (and the value codebooks of every
row). Offline key scales per layer, KV head and channel from the same keys (each window's first
token left out: the cache keeps it as the FP16 sink):

* ``a``: asymmetric, zero = q_lo quantile, scale = (q_hi - q_lo) / (2**bits - 1), default
  0.5% / 99.5% (``--q``: the fraction left out in all, half on each side);
* ``b``: symmetric and equal within each RoPE pair (channels i, i + D/2, rotate_half):
  absmax = (1 - q) quantile of |x| pooled over the pair; zero = -absmax,
  scale = 2 absmax / (2**bits - 1) (the variant a kernel could serve by pre-scaling q);
* diagnostics: ``c`` symmetric per channel (not tied within a pair); ``d`` asymmetric, the
  pair's wider (q_hi - q_lo) range for both channels, centred on each channel's own midpoint.

The key codebook is then fitted (weighted 1-D k-means, Fisher weights, one per layer as
``cb=layer``) on calibration keys normalized by these offline scales, leaving out each token's
``n_out`` largest-error channels (two passes: uniform codebook, then the fitted one).

    python benchmarks/probes/kvquant_offline_keys.py --rows fp16,kivi-3,kvquant-3,off-a-3,off-b-3
    python benchmarks/probes/kvquant_offline_keys.py --text sotu-2010-2016 --tokens 1024 ...

Rows: fp16 / kivi-N / kvquant-N (unchanged, any ``:FIELD=V`` overrides), and
``off-{a,b}-N[-mad][:R=0]`` (offline keys, N bits, outlier selection err or mad).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import importlib

from kvbits import cli
from kvbits.data import load_text, tokenize_text
from kvbits.eval import frontier

ppl_mod = importlib.import_module("kvbits.eval.perplexity")
from kvbits.formats.packing import pack_bits
from kvbits.integrations.hf import KVBitsCache
from kvbits.methods import kvquant as kvq

OUT = Path("kvbits-results/kvquant_offline_keys")  # --out
RESULTS = Path(__file__).resolve().parents[1] / "results"
_LOGF = None


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    if _LOGF is not None:
        _LOGF.write(line + "\n")
        _LOGF.flush()


# ------------------------------------------------------------------------------ the monkeypatch
# id(k_codebook tensor) -> dict(scale [H,D] fp16, zero [H,D] fp16, sel, stats, keep=tensor)
OFFLINE: dict[int, dict] = {}
_orig_quantize_keys = kvq.quantize_keys


def _new_stats():
    return {"elems": 0, "end_codes": 0, "overflow": 0, "tokens": 0, "tok_over": [0] * 6,
            "err2_dense": 0.0, "err2_after": 0.0, "x2": 0.0}


def offline_quantize_keys(k, bits, group_size, codebook, thresholds, n_out=0, valid=None):
    ent = OFFLINE.get(id(codebook))
    if ent is None:
        out = _orig_quantize_keys(k, bits, group_size, codebook, thresholds, n_out, valid)
        if valid is None:  # the same statistics for the unchanged (per-group) path
            words, sc, ze, oi, ov = out
            deq = kvq.dequantize_keys(words, sc, ze, bits, group_size, codebook)
            full = kvq._add_outliers(deq, oi, ov) if n_out else deq
            st = STD_STATS
            B, H, T, D = k.shape
            codes = kvq.unpack_bits(words.reshape(B, H, T // group_size, -1, D), bits,
                                    group_size, dim=3)
            st["elems"] += codes.numel()
            st["end_codes"] += int(((codes == 0) | (codes == (1 << bits) - 1)).sum())
            st["err2_dense"] += float(((k.float() - deq) ** 2).sum())
            st["err2_after"] += float(((k.float() - full) ** 2).sum())
            st["x2"] += float((k.float() ** 2).sum())
        return out
    B, H, T, D = k.shape
    G = group_size
    NG = T // G
    kg = k.float().reshape(B, H, NG, G, D)
    scale = ent["scale"].to(k.device).view(1, H, 1, 1, D).expand(B, H, NG, 1, D)
    zero = ent["zero"].to(k.device).view(1, H, 1, 1, D).expand(B, H, NG, 1, D)
    u = kvq._normalize(kg, scale, zero)
    codes = kvq._codes(u, thresholds.to(k.device))
    vmask = None if valid is None else valid.reshape(B, 1, NG, G, 1)
    if vmask is not None:
        codes = torch.where(vmask, codes, 0)
    words = pack_bits(codes, bits, dim=3, check=False).reshape(B, H, -1, D)
    cb = codebook.to(k.device)
    deq = kvq._lookup(cb, codes) * scale.float() + zero.float()
    out_idx = out_val = None
    err = (kg - deq).abs()
    if vmask is not None:
        err = torch.where(vmask, err, 0.0)
    if n_out:
        if ent["sel"] == "err":
            score = err.reshape(B, H, T, D)
        else:
            ok = None if vmask is None else vmask.expand_as(kg)
            score = kvq._robust_score(kg, 3, ok).reshape(B, H, T, D)
        idx = score.topk(n_out, dim=-1).indices.sort(dim=-1).values
        vt = None if valid is None else valid.reshape(B, 1, T, 1)
        out_idx, out_val = kvq._corrections(kg.reshape(B, H, T, D), deq.reshape(B, H, T, D),
                                            idx, vt, D)
    # statistics (valid tokens only; padding never occurs in these runs)
    st = ent["stats"]
    top = (1 << bits) - 1
    c0, cN = cb[:, 0].view(1, H, 1, 1, 1), cb[:, -1].view(1, H, 1, 1, 1)
    h0 = ((cb[:, 1] - cb[:, 0]) / 2).view(1, H, 1, 1, 1)
    hN = ((cb[:, -1] - cb[:, -2]) / 2).view(1, H, 1, 1, 1)
    over = (u < c0 - h0) | (u > cN + hN)  # farther outside than half a step past an end
    st["elems"] += codes.numel()
    st["end_codes"] += int(((codes == 0) | (codes == top)).sum())
    st["overflow"] += int(over.sum())
    per_tok = over.reshape(B, H, T, D).sum(-1).reshape(-1)
    st["tokens"] += per_tok.numel()
    for j in range(6):
        st["tok_over"][j] += int((per_tok > j).sum())
    e2 = err.reshape(B, H, T, D) ** 2
    st["err2_dense"] += float(e2.sum())
    if n_out:
        e2 = e2.scatter(-1, out_idx.long(), 0.0)
    st["err2_after"] += float(e2.sum())
    st["x2"] += float((kg ** 2).sum())
    return words, scale.squeeze(3).contiguous(), zero.squeeze(3).contiguous(), out_idx, out_val


STD_STATS = _new_stats()
kvq.quantize_keys = offline_quantize_keys  # store.py calls kvq.quantize_keys through the module

_orig_cache_sizes = ppl_mod._cache_sizes


def _cache_sizes(cache, model, tokens):
    out = _orig_cache_sizes(cache, model, tokens)
    meta = 0
    for s in getattr(cache, "stores", []):
        if s is None or not s.spec.quantized or s.key_axis != "channel":
            continue
        meta += s.batch * s.kv_heads * s.body_len * 2 * 2 * s.head_dim / s.spec.group_size
    out["key_group_meta_bytes"] = meta
    return out


ppl_mod._cache_sizes = _cache_sizes


# ----------------------------------------------------------------------------------- calibration
def calib_kv(model, tok, tokens: int, text: str = "sotu-pre-2000"):
    path = OUT / f"kv_calib_{text}_{tokens}.pt"
    if path.exists():
        log(f"calibration K/V from {path}")
        return torch.load(path)
    ids = tokenize_text(tok, load_text(text), tokens)
    t0 = time.perf_counter()
    kv = kvq.collect_kv(model, ids, window=512, fisher=True, pre_rope=True)
    log(f"collect_kv on {ids.shape[1]} tokens of {text}: {time.perf_counter() - t0:.0f} s")
    kv = [tuple(t.contiguous() for t in layer) for layer in kv]
    torch.save(kv, path)
    return kv


def keep_mask(T: int, window: int = 512) -> torch.Tensor:
    """Calibration tokens that the cache would quantize: not a window's first (the FP16 sink)."""
    m = torch.ones(T, dtype=torch.bool)
    m[::window] = False
    return m


def offline_scales(k: torch.Tensor, bits: int, variant: str, q: float):
    """``k [H, T, D]`` (kept tokens) -> FP16 ``scale, zero [H, D]``."""
    H, D = k.shape[0], k.shape[2]
    top = (1 << bits) - 1
    if variant == "a":
        lo = torch.quantile(k, q / 2, dim=1)
        hi = torch.quantile(k, 1 - q / 2, dim=1)
        zero = lo.half()
        scale = ((hi - zero.float()) / top).half()
    elif variant == "b":
        half = D // 2
        a = torch.cat([k[..., :half].abs(), k[..., half:].abs()], dim=1)  # [H, 2T, D/2]
        am = torch.quantile(a, 1 - q, dim=1)
        am = torch.cat([am, am], dim=-1)
        zero = (-am).half()
        scale = (2 * am / top).half()
    elif variant == "c":  # diagnostic: symmetric, per channel (not tied within a RoPE pair)
        am = torch.quantile(k.abs(), 1 - q, dim=1)
        zero = (-am).half()
        scale = (2 * am / top).half()
    elif variant == "d":  # diagnostic: asymmetric zero per channel, scale shared by a RoPE pair
        half = D // 2
        lo = torch.quantile(k, q / 2, dim=1)
        hi = torch.quantile(k, 1 - q / 2, dim=1)
        rng = (hi - lo).view(H, 2, half).amax(1).repeat(1, 2)
        mid = (hi + lo) / 2
        zero = (mid - rng / 2).half()
        scale = (rng / top).half()
    else:
        raise ValueError(f"unknown offline variant {variant!r}")
    return scale, zero


def fit_offline_keys(k, gk, bits, variant, q, n_out, fisher=True):
    """Offline scale/zero and a layer codebook fitted on keys normalized by them."""
    T = k.shape[1]
    m = keep_mask(T)
    k, gk = k[:, m], (None if gk is None else gk[:, m])
    scale, zero = offline_scales(k, bits, variant, q)
    s, z = scale.float()[:, None, :], zero.float()[:, None, :]
    u = (k - z) / s
    cb = torch.arange(1 << bits, dtype=torch.float32)
    dense = torch.ones_like(u, dtype=torch.bool)
    for _ in range(2):
        th = kvq.thresholds_of(cb)
        deq = cb[torch.bucketize(u, th)] * s + z
        err = (k - deq).abs()
        dense = torch.ones_like(u, dtype=torch.bool)
        if n_out:
            idx = err.topk(n_out, dim=-1).indices
            dense.scatter_(-1, idx, False)
        w = None if (gk is None or not fisher) else gk[dense]
        cb, th = kvq._fit_one(u[dense], w, bits, False)
    top = (1 << bits) - 1
    info = {"frac_u_outside": float(((u < 0) | (u > top)).float().mean()),
            "codebook": [round(float(x), 3) for x in cb]}
    return scale, zero, cb, th, info


# ----------------------------------------------------------------------------------------- rows
def parse_row(row: str):
    """``off-a-3-mad:R=0`` -> (kind, bits, variant, sel, overrides)."""
    name, _, rest = row.partition(":")
    fields = {}
    for part in filter(None, rest.split(",")):
        key, _, val = part.partition("=")
        key = {"R": "residual_length", "S": "sink_tokens", "G": "group_size"}.get(key, key)
        fields[key] = int(val) if val.lstrip("-").isdigit() else float(val)
    if name.startswith("off-"):
        bits_sel = name.split("-")
        variant, bits = bits_sel[1], int(bits_sel[2])
        sel = bits_sel[3] if len(bits_sel) > 3 else "err"
        return "offline", bits, variant, sel, fields
    return "preset", None, None, None, fields


def main() -> int:
    global _LOGF, OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=OUT, help="results, logs and the K/V cache")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="lee-news")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--q", type=float, default=0.01, help="fraction left outside the offline range")
    ap.add_argument("--rows", default="fp16,kivi-3,kivi-2,kvquant-3,off-a-3,off-b-3,off-a-2,off-b-2")
    ap.add_argument("--name", default=None, help="result stem under --out")
    ap.add_argument("--front", default="ppl_lee_news+ppl_group64_lee_news",
                    help="committed tables giving KIVI's front (A+B as ppl_frontier.py)")
    ap.add_argument("--with", dest="with_", default="",
                    help="other result stems under --out (comma-separated) whose fp16 "
                    "and kivi rows join this table and KIVI's front (e.g. the q sweeps)")
    ap.add_argument("--report-only", action="store_true", help="no runs, only the table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    name = args.name or f"{args.text}_{args.tokens}"
    _LOGF = open(OUT / f"{name}.log", "a")  # noqa: SIM115 - open for the whole run
    log("argv: " + " ".join(sys.argv))
    if args.report_only:
        results = json.loads((OUT / f"{name}.json").read_text())["results"]
        report(results, args.front, name, args.with_)
        return 0

    model, tok, ids = cli._load(args.model, args.text, args.tokens)
    kv = calib_kv(model, tok, args.calib_tokens)
    probe = kvq.weight_probe(model)
    fp = kvq.model_fingerprint(model, probe)
    std_cache: dict = {}

    def std_calibration(spec):
        key = (spec.key_bits, spec.value_bits, spec.group_size, spec.outliers, spec.codebook,
               spec.fisher, spec.pre_rope)
        if key not in std_cache:
            t0 = time.perf_counter()
            layers = [kvq.fit_layer(*layer, spec) for layer in kv]
            log(f"fit_layer x{len(layers)} for {spec.describe()}: {time.perf_counter() - t0:.0f} s")
            std_cache[key] = layers
        return kvq.Calibration(std_cache[key], kvq.spec_fields(spec), fp, args.model, "", "",
                               "", {}, probe)

    results_path = OUT / f"{name}.json"
    results = json.loads(results_path.read_text())["results"] if results_path.exists() else []
    done = {r["label"] for r in results}
    for row in args.rows.split(";") if ";" in args.rows else cli._split_items(args.rows):
        if row in done:
            log(f"{row}: already in {results_path}, skipped")
            continue
        kind, bits, variant, sel, fields = parse_row(row)
        OFFLINE.clear()
        STD_STATS.update(_new_stats())
        extra = {}
        if kind == "preset":
            v = cli.parse_presets(row)[0]
            spec = v.spec
            if spec.method == "kvquant":
                cal = std_calibration(spec)
                factory = lambda s=spec, c=cal: KVBitsCache(model, s, calibration=c)
            else:
                factory = lambda s=spec: KVBitsCache(model, s)
            method = spec.method
        else:
            spec = cli.parse_presets(f"kvquant-{bits}")[0].spec.replace(**fields)
            base = std_calibration(spec)
            n_out = spec.n_outliers(kv[0][0].shape[-1])
            layers, infos = [], []
            t0 = time.perf_counter()
            for (k, _v, gk, _gv), std in zip(kv, base.layers):
                sc, ze, cb, th, info = fit_offline_keys(k, gk, bits, variant, args.q, n_out,
                                                        spec.fisher)
                H = k.shape[0]
                lc = kvq.LayerCodebooks(cb.expand(H, -1).contiguous(),
                                        th.expand(H, -1).contiguous(),
                                        std.v_codebook, std.v_thresholds)
                OFFLINE[id(lc.k_codebook)] = {"scale": sc, "zero": ze, "sel": sel,
                                              "stats": _new_stats(), "keep": lc.k_codebook}
                layers.append(lc)
                infos.append(info)
            log(f"{row}: offline key scales + codebooks in {time.perf_counter() - t0:.0f} s; "
                f"calib frac outside range {sum(i['frac_u_outside'] for i in infos) / len(infos):.4f}; "
                f"layer0 cb {infos[0]['codebook']}")
            cal = kvq.Calibration(layers, kvq.spec_fields(spec), fp, args.model, "", "", "", {},
                                  probe)
            factory = lambda s=spec, c=cal: KVBitsCache(model, s, calibration=c)
            method = "kvquant-offline"
            extra["calib_layer_info"] = infos
        log(f"{row}: {spec.describe()}")
        r = ppl_mod.perplexity(model, ids, factory, chunk_size=args.chunk, progress=False,
                               desc=row)
        bits_std = 16 * r["cache_bytes_fp16"] / r["fp16_cache_bytes"]
        res = {"label": row, "kind": "kvbits", "spec": spec.describe(),
               "spec_fields": {**dataclasses.asdict(spec), "method": method}, **r, **extra,
               "bits_elem": bits_std}
        if kind == "offline":
            L = len(kv)
            H, _, D = kv[0][0].shape
            tables = L * H * D * 2 * 2  # FP16 scale + zero per channel, head, layer
            off_bytes = r["cache_bytes_fp16"] - r["key_group_meta_bytes"] + tables
            res["bits_elem"] = 16 * off_bytes / r["fp16_cache_bytes"]
            res["bits_elem_as_stored"] = bits_std
            agg = _new_stats()
            for ent in OFFLINE.values():
                for key, val in ent["stats"].items():
                    if key == "tok_over":
                        agg[key] = [a + b for a, b in zip(agg[key], val)]
                    else:
                        agg[key] += val
            res["key_stats"] = agg
            n = max(agg["elems"], 1)
            tt = max(agg["tokens"], 1)
            log(f"{row}: end codes {agg['end_codes'] / n:.4f}, overflow (> half step past an end) "
                f"{agg['overflow'] / n:.5f} of key elements; token vectors with > j overflowing "
                f"channels j=0..5: " + ", ".join(f"{x / tt:.4f}" for x in agg["tok_over"]) +
                f"; key rel. MSE dense {agg['err2_dense'] / agg['x2']:.5f}, after outliers "
                f"{agg['err2_after'] / agg['x2']:.5f}")
        if kind == "preset" and STD_STATS["elems"]:
            agg = dict(STD_STATS)
            res["key_stats"] = agg
            log(f"{row}: end codes {agg['end_codes'] / agg['elems']:.4f}; key rel. MSE dense "
                f"{agg['err2_dense'] / agg['x2']:.5f}, after outliers "
                f"{agg['err2_after'] / agg['x2']:.5f}")
        log(f"{row}: ppl {r['ppl']:.3f}, {res['bits_elem']:.3f} bits/elem ({r['seconds']:.0f} s)")
        results.append(res)
        results_path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))

    report(results, args.front, name, args.with_)
    return 0


def report(results, front_names, name, with_=""):
    main_q = json.loads((OUT / f"{name}.json").read_text())["args"]["q"]
    results = [{**r, "label": f"{r['label']} q={main_q}"}
               if r["spec_fields"].get("method") == "kvquant-offline" else r for r in results]
    have = {r["label"] for r in results}
    for stem in filter(None, with_.split(",")):
        doc = json.loads((OUT / f"{stem}.json").read_text())
        for r in doc["results"]:
            if r["spec_fields"].get("method") in ("fp16", "kivi"):
                if r["label"] not in have:
                    results.append(r)
                    have.add(r["label"])
            elif r["spec_fields"].get("method") == "kvquant-offline":
                results.append({**r, "label": f"{r['label']} q={doc['args']['q']}"})
    fp16 = next((r["ppl"] for r in results if r["label"] == "fp16"), None)
    ref = []
    for tname in filter(None, front_names.split("+")):
        p = RESULTS / f"{tname}.json"
        if p.exists():
            for r in json.loads(p.read_text())["results"]:
                if r.get("kind") == "kvbits" and r["spec_fields"].get("method") == "kivi" \
                        and not r["spec_fields"].get("hadamard"):
                    ref.append(frontier.Point(f"{tname}:{r['label']}", frontier.effective_bits(r),
                                              r["ppl"]))
    # KIVI rows measured here join the front too
    for r in results:
        if r["spec_fields"].get("method") == "kivi":
            ref.append(frontier.Point("here:" + r["label"], r["bits_elem"], r["ppl"]))
    pts = [frontier.Point(r["label"], r["bits_elem"], r["ppl"]) for r in results
           if r["spec_fields"].get("method") in ("kvquant", "kvquant-offline")]
    cmp = frontier.compare_at_equal_bits(pts, ref)
    front = frontier.pareto_front(ref)
    lines = ["KIVI front: " + ", ".join(f"{p.label} ({p.bits:.2f} b, {p.ppl:.3f})" for p in front),
             "", "| row | bits/elem | PPL | vs fp16 | KIVI front at these bits | gap | verdict |",
             "|---|---|---|---|---|---|---|"]
    by = {c["label"]: c for c in cmp}
    for r in results:
        c = by.get(r["label"])
        vs = f"{100 * (r['ppl'] / fp16 - 1):+.2f}%" if fp16 else "-"
        refp = "-" if not c or c["reference_ppl"] is None else (
            f"{c['reference_ppl']:.3f} ({100 * (c['reference_ppl'] / fp16 - 1):+.2f}%)" if fp16
            else f"{c['reference_ppl']:.3f}")
        gap = "-" if not c or c["gap"] is None else f"{100 * c['gap']:+.2f}%"
        lines.append(f"| {r['label']} | {r['bits_elem']:.2f} | {r['ppl']:.3f} | {vs} | {refp} | "
                     f"{gap} | {c['verdict'] if c else '-'} |")
    text = "\n".join(lines)
    (OUT / f"{name}.md").write_text(text + "\n")
    log("\n" + text)


if __name__ == "__main__":
    raise SystemExit(main())
