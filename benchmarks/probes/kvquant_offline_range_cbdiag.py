"""Per-layer key error through the real fitted codebooks of calibration files (those that
``kvquant_offline_range.py`` leaves in its temporary cache folders), on the evaluation text's
pre-RoPE keys (one window, token 0 = the FP16 sink left out) and on the calibration keys.

    python benchmarks/probes/kvquant_offline_range_cbdiag.py --model gemma3-270m --text lee-news \
        --tokens 2048 --name gemma3_lee_news  LABEL=PATH.safetensors ...

Error: each token's ceil(0.01 D) largest errors dropped (the cache's outliers), mean squared
error over the rest divided by the mean squared key; a file with per-group key scales
(kvquant-3) is applied with each 32-token group's min/max, as the cache does.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kvquant_offline_range_diag as diag

from kvbits.methods.kvquant import Calibration, collect_kv


def deq(x, cb, th, s, z):
    u = torch.where(s > 0, (x - z) / torch.where(s > 0, s, 1.0), 0.0)
    c = torch.searchsorted(th.contiguous(), u.contiguous())
    return cb[c] * s + z, c


def err(x, d, n_out, w=None):
    """Relative MSE over dense elements; with ``w`` (squared loss gradients, Fisher), the
    weighted error sum(w e^2) over dense elements (an estimate of 2x the loss increase)."""
    e = (x - d) ** 2
    dense = torch.ones_like(e, dtype=torch.bool)
    if n_out:
        dense.scatter_(-1, e.topk(n_out, dim=-1).indices, False)
    if w is not None:
        return (w * e * dense).sum().item()
    return ((e * dense).sum() / dense.sum() / (x ** 2).mean()).item()


def main():
    ap = diag.parser()
    ap.add_argument("--fisher", action="store_true",
                    help="also the Fisher-weighted error on the evaluation text (windows of 512)")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    model, ca, ev = diag.model_and_texts(a)
    with torch.no_grad():
        ke = [l[0][:, 1:].float() for l in collect_kv(model, ev, window=ev.shape[1], fisher=False)]
        kc_all = [l[0].float() for l in collect_kv(model, ca, window=512, fisher=False)]
    fe = None
    if a.fisher:
        fe = [(l[0][:, 1:].float(), l[2][:, 1:].float())
              for l in collect_kv(model, ev, window=512, fisher=True)]
        k0 = torch.ones(fe[0][0].shape[1], dtype=torch.bool)
        k0[511::512] = False  # each later window's first token (positions 512, 1024, ... - 1)
        fe = [(k[:, k0], g[:, k0]) for k, g in fe]
    keep = torch.ones(kc_all[0].shape[1], dtype=torch.bool)
    keep[::512] = False
    kc = [k[:, keep] for k in kc_all]
    out = {"command": " ".join(["python", *sys.argv]), "rows": {}}
    for item in a.files:
        label, path = item.split("=", 1)
        cal = Calibration.load(path)
        per = []
        for i, L in enumerate(cal.layers):
            H, _, D = ke[i].shape
            n_out = math.ceil(0.01 * D - 1e-9)
            r = {}
            sets = [("eval", ke[i], None), ("cal", kc[i], None)]
            if fe is not None:
                sets.append(("fisher", *fe[i]))
            for name, x, w in sets:
                cb, th = L.k_codebook[0].float(), L.k_thresholds[0].float()
                if L.k_scale is not None:
                    s = L.k_scale.float()[:, None]
                    z = L.k_zero.float()[:, None]
                    d, c = deq(x, cb, th, s, z)
                    r[f"{name}_end"] = ((c == 0) | (c == cb.numel() - 1)).float().mean().item()
                    r[f"{name}_err"] = err(x, d, n_out, w)
                else:
                    T = x.shape[1] // 32 * 32
                    g = x[:, :T].reshape(H, T // 32, 32, D)
                    lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
                    s = (hi - lo) / (cb.numel() - 1)
                    d, c = deq(g, cb, th, s, lo)
                    r[f"{name}_end"] = ((c == 0) | (c == cb.numel() - 1)).float().mean().item()
                    r[f"{name}_err"] = err(g.reshape(H, T, D), d.reshape(H, T, D), n_out,
                                           None if w is None else w[:, :T])
            r["codebook"] = [round(v, 3) for v in L.k_codebook[0].tolist()]
            per.append(r)
        out["rows"][label] = per
        ev_mean = sum(r["eval_err"] for r in per) / len(per)
        cal_mean = sum(r["cal_err"] for r in per) / len(per)
        fi = (f", fisher-weighted eval err sum {sum(r['fisher_err'] for r in per):.4g}"
              if fe is not None else "")
        print(f"{label:>24}: eval err {ev_mean:.4f}, cal err {cal_mean:.4f}{fi}, per layer eval "
              + " ".join(f"{r['eval_err']:.3f}" for r in per), flush=True)
    Path(f"benchmarks/results/kvquant_offline_range_cbdiag_{a.name}.json").write_text(
        json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
