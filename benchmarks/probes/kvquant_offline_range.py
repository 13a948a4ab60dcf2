"""Range rules for kvquant's offline key rows (``key_scales="calibrated"``), compared through the
same code path as ``kvbits ppl`` (``kvbits.cli.run_ppl``, in-process).

For every rule, ``kvbits.methods.kvquant.offline_key_rows`` is monkeypatched and ``KVBITS_CACHE``
points at a fresh folder whose entries other than ``calibrations/`` are symlinks to the real
cache (models, texts, GGUFs): calibrations are cached by spec and text, not by the range rule, so
each rule calibrates afresh without touching the shared calibration cache.

    P=benchmarks/probes/kvquant_offline_range.py
    python $P --model gemma3-270m --text lee-news --tokens 2048 --calib-tokens 2048 \
        --presets kvquant-3-offline,kvquant-2-offline --once fp16,kvquant-3 \
        --rules 'q0.002 q0 q0.0005 q0.01 mse mse-out wide0.1' --name gemma3_lee_news

Rules (``k [H, T, D]``, the calibration keys of one layer after ``keep``):
  qX        the channel's range between its X/2 and 1-X/2 quantiles (q0.002 = the library's)
  wideF[@X] the qX range (default 0.002) widened by F * range on each side
  mse       per channel, among min/max ranges shrunk symmetrically by SHRINK factors, the one of
            least MSE of uniform 2**bits-level quantization with saturation
  mse-out   the same, each token's n_out largest errors over channels left out of the MSE
            (they become FP16 outliers), two rounds
  mseq / mseq-out  as mse / mse-out with quantile ranges (QCAND) as the candidates
  stdC      mean -/+ C standard deviations of the channel
  layers:A-B=RULE,...;default=RULE  per-layer mixture (layers by call order within one
            calibration; L = the model's layer count)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvbits.methods.kvquant as kq
from kvbits import data
from kvbits.cli import PplConfig, parse_presets, run_ppl

ORIG = kq.offline_key_rows
FP16_MAX = 65504.0
SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
QCAND = (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
OUT_FRAC = 0.01


def _rows(lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """float16 (scale, zero) as the library makes them."""
    lo = lo.clamp(-FP16_MAX, FP16_MAX)
    hi = torch.maximum(hi, lo).clamp(-FP16_MAX, FP16_MAX)
    zero = lo.half()
    scale = ((hi - zero.float()) / ((1 << bits) - 1)).clamp(0, FP16_MAX).half()
    return scale, zero


def _sorted(k, keep):
    if keep is not None:
        k = k[:, keep]
    if k.shape[1] == 0:
        raise ValueError("offline key scales need calibration tokens")
    return k.float(), k.float().sort(dim=1).values


def _qrange(srt, q):
    T = srt.shape[1]
    return srt[:, int(q / 2 * (T - 1))], srt[:, round((1 - q / 2) * (T - 1))]


def uq_err2(x, lo, hi, bits):
    """Squared error of uniform 2**bits-level quantization with saturation of ``x [H, T, D]`` in
    ranges ``lo, hi [..., H, D]`` (leading candidate axes broadcast)."""
    L = (1 << bits) - 1
    lo, hi = lo.unsqueeze(-2), hi.unsqueeze(-2)
    s = (hi - lo) / L
    safe = torch.where(s > 0, s, torch.ones_like(s))
    c = ((x - lo) / safe).round().clamp(0, L)
    deq = torch.where(s > 0, lo + c * s, lo)
    return (x - deq) ** 2


def rule_quantile(q):
    def f(k, bits, keep=None, **_):
        _, srt = _sorted(k, keep)
        return _rows(*_qrange(srt, q), bits)
    return f


def rule_wide(frac, q=0.002):
    def f(k, bits, keep=None, **_):
        _, srt = _sorted(k, keep)
        lo, hi = _qrange(srt, q)
        w = (hi - lo) * frac
        return _rows(lo - w, hi + w, bits)
    return f


def _mse_pick(x, cands_lo, cands_hi, bits, drop_outliers: bool):
    """Per (head, channel), the candidate range (axis 0) of least MSE; ``drop_outliers``: each
    token's ceil(0.01 D) largest errors (with the current pick) left out, two rounds."""
    H, T, D = x.shape
    err = uq_err2(x, cands_lo, cands_hi, bits)  # [C, H, T, D]
    pick = err.mean(2).argmin(0)  # [H, D]
    n_out = math.ceil(OUT_FRAC * D - 1e-9)
    if drop_outliers and n_out:
        for _ in range(2):
            cur = err.gather(0, pick[None, :, None, :].expand(1, H, T, D))[0]  # [H, T, D]
            dense = torch.ones_like(cur, dtype=torch.bool)
            dense.scatter_(-1, cur.topk(n_out, dim=-1).indices, False)
            m = dense.float()
            pick = ((err * m).sum(2) / m.sum(1).clamp_min(1)).argmin(0)
    lo = cands_lo.gather(0, pick[None])[0]
    hi = cands_hi.gather(0, pick[None])[0]
    return lo, hi


def rule_mse(drop_outliers: bool, quantiles: bool = False):
    def f(k, bits, keep=None, **_):
        x, srt = _sorted(k, keep)
        if quantiles:
            lohi = [_qrange(srt, q) for q in QCAND]
            clo = torch.stack([a for a, _ in lohi])
            chi = torch.stack([b for _, b in lohi])
        else:
            mn, mx = srt[:, 0], srt[:, -1]
            mid, half = (mn + mx) / 2, (mx - mn) / 2
            fs = torch.tensor(SHRINK).view(-1, 1, 1)
            clo, chi = mid - fs * half, mid + fs * half
        return _rows(*_mse_pick(x, clo, chi, bits, drop_outliers), bits)
    return f


def rule_std(c):
    """mean -/+ c standard deviations per channel (the shared codebook sees z-scored keys)."""
    def f(k, bits, keep=None, **_):
        x, _ = _sorted(k, keep)
        mu, sd = x.mean(1), x.std(1)
        return _rows(mu - c * sd, mu + c * sd, bits)
    return f


def parse_rule(name: str):
    if name.startswith("layers:"):
        return rule_layers(name[len("layers:"):])
    m = re.fullmatch(r"q([0-9.eE-]+)", name)
    if m:
        return rule_quantile(float(m.group(1)))
    m = re.fullmatch(r"wide([0-9.]+)(?:@([0-9.]+))?", name)
    if m:
        return rule_wide(float(m.group(1)), float(m.group(2) or 0.002))
    m = re.fullmatch(r"std([0-9.]+)", name)
    if m:
        return rule_std(float(m.group(1)))
    table = {"mse": rule_mse(False), "mse-out": rule_mse(True),
             "mseq": rule_mse(False, True), "mseq-out": rule_mse(True, True)}
    if name in table:
        return table[name]
    raise SystemExit(f"unknown rule {name!r}")


class rule_layers:
    """``"0-5=q0,12=mse;default=q0.002"``: layers by call index modulo the layer count (set by
    :func:`main` before each calibration)."""
    n_layers = 0

    def __init__(self, text: str):
        parts, default = text.split(";default=") if ";default=" in text else (text, "q0.002")
        self.default = parse_rule(default)
        self.by_layer = {}
        for item in filter(None, parts.split(",")):
            rng, rule = item.split("=", 1)
            a, _, b = rng.partition("-")
            for i in range(int(a), int(b or a) + 1):
                self.by_layer[i] = parse_rule(rule)
        self.calls = 0

    def __call__(self, k, bits, keep=None, **kw):
        i = self.calls % max(self.n_layers, 1)
        self.calls += 1
        return self.by_layer.get(i, self.default)(k, bits, keep, **kw)


def fresh_cache(base: Path, root: Path, tag: str) -> Path:
    """A cache folder for one rule (reused when ``root`` already holds it: same rule, so the
    calibrations there were made with it)."""
    d = root / re.sub(r"[^A-Za-z0-9_.@=-]+", "_", tag)[:80]
    if d.exists():
        return d
    d.mkdir(parents=True)
    for entry in base.iterdir():
        if entry.name != "calibrations":
            (d / entry.name).symlink_to(entry)
    (d / "calibrations").mkdir()
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="lee-news")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--calib-text", default="sotu-pre-2000")
    ap.add_argument("--presets", default="kvquant-3-offline,kvquant-2-offline")
    ap.add_argument("--once", default="fp16", help="presets run once (no offline rows)")
    ap.add_argument("--rules", default="q0.002", help="space-separated")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--cache-root", default=None,
                    help="folder of per-rule caches to reuse across runs (default: a new one)")
    a = ap.parse_args(argv)

    base = Path(os.environ.get("KVBITS_CACHE") or data.cache_dir())
    os.environ["KVBITS_CACHE"] = str(base)
    root = (Path(a.cache_root) if a.cache_root
            else Path(tempfile.mkdtemp(prefix="kvbits_offline_range_")))
    out_json = Path(a.out) / f"kvquant_offline_range_{a.name}.json"
    cmd = shlex.join(["python", "benchmarks/probes/kvquant_offline_range.py",
                      *(argv or sys.argv[1:])])
    record = {"command": cmd, "model": a.model, "text": a.text, "tokens": a.tokens,
              "chunk": a.chunk, "calib_text": a.calib_text, "calib_tokens": a.calib_tokens,
              "threads": torch.get_num_threads(), "rows": []}

    def run(presets: str, rule_name: str | None):
        cfg = PplConfig(a.model, a.text, parse_presets(presets), a.tokens, a.chunk, None, None,
                        None, None, False, a.calib_text, a.calib_tokens, None)
        os.environ["KVBITS_CACHE"] = str(fresh_cache(base, root, rule_name or "once"))
        rule = ORIG if rule_name is None else parse_rule(rule_name)
        kq.offline_key_rows = rule
        t0 = time.perf_counter()
        try:
            res = run_ppl(cfg, cmd)
        finally:
            kq.offline_key_rows = ORIG
            os.environ["KVBITS_CACHE"] = str(base)
        for r in res:
            record["rows"].append({"rule": rule_name, "preset": r["label"], "spec": r["spec"],
                                   "ppl": r["ppl"], "nll_sum": r["nll_sum"],
                                   "tokens_scored": r["tokens_scored"]})
        print(f"[probe] {rule_name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(record, indent=1) + "\n")

    n_layers = _layer_count(a.model)
    rule_layers.n_layers = n_layers
    if a.once:
        run(a.once, None)
    for name in filter(None, a.rules.split(" ")):
        run(a.presets, name)
    _print_table(record)
    return 0


def _layer_count(model: str) -> int:
    return {"gemma3-270m": 18, "qwen2.5-0.5b": 24, "smollm2": 30}.get(model, 0)


def _print_table(record):
    base = next((r["ppl"] for r in record["rows"] if r["preset"] == "fp16"), None)
    print("| rule | preset | PPL | vs fp16 |\n|---|---|---|---|")
    for r in record["rows"]:
        d = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else ""
        print(f"| {r['rule'] or '-'} | {r['preset']} | {r['ppl']:.3f} | {d} |")


if __name__ == "__main__":
    raise SystemExit(main())
