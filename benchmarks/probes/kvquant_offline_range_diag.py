"""Why do offline key rows lose on a model? Per layer: saturation of the offline range (fitted
as the library does on the calibration text) on calibration and evaluation keys, and key error
proxies (uniform 2**bits levels, each token's ceil(0.01 D) largest errors left out as the cache's
outliers) of the offline rows against KIVI-style per-group ranges and against rows fitted on the
evaluation keys themselves (an oracle that isolates the calibration/evaluation shift).

    python benchmarks/probes/kvquant_offline_range_diag.py --model gemma3-270m --text lee-news \
        --tokens 2048 --calib-tokens 2048 --name gemma3_lee_news

Pre-RoPE keys from ``kvbits.methods.kvquant.collect_kv`` (calibration: windows of 512 as
``calibrate``, each window's first token left out; evaluation: one window of ``--tokens`` as
``kvbits ppl`` scores it, token 0 (the FP16 sink) left out).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import kvquant_offline_range as P

from kvbits import data
from kvbits.methods.kvquant import collect_kv, offline_key_rows


def rel_err(x, deq, n_out):
    """Mean squared error over dense elements (each token's n_out largest errors dropped) divided
    by the mean squared key."""
    e = (x - deq) ** 2
    if n_out:
        e = e.sort(dim=-1).values[..., : e.shape[-1] - n_out]
    return (e.mean() / (x ** 2).mean()).item()


def deq_rows(x, scale, zero, bits):
    L = (1 << bits) - 1
    s, z = scale.float()[:, None], zero.float()[:, None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    c = ((x - z) / safe).round().clamp(0, L)
    return z + c * s


def deq_group(x, bits, G=32):
    H, T, D = x.shape
    t = T // G * G
    xg = x[:, :t].reshape(H, t // G, G, D)
    lo, hi = xg.amin(2, keepdim=True), xg.amax(2, keepdim=True)
    L = (1 << bits) - 1
    s = (hi - lo) / L
    safe = torch.where(s > 0, s, torch.ones_like(s))
    c = ((xg - lo) / safe).round().clamp(0, L)
    return x[:, :t], (lo + c * s).reshape(H, t, D)


def parser() -> argparse.ArgumentParser:
    """The model, evaluation text and calibration text options (shared with the cbdiag probe)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="lee-news")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calib-text", default="sotu-pre-2000")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--name", required=True)
    return ap


def model_and_texts(a):
    """The float32 model and the token ids of the calibration and evaluation texts."""
    model, tok = data.load_model(a.model, dtype=torch.float32)
    cal_ids = data.tokenize_text(tok, data.load_text(a.calib_text), a.calib_tokens)
    ev_ids = data.tokenize_text(tok, data.load_text(a.text), a.tokens)
    return model, cal_ids, ev_ids


def main():
    a = parser().parse_args()
    model, cal_ids, ev_ids = model_and_texts(a)
    with torch.no_grad():
        kc = [l[0] for l in collect_kv(model, cal_ids, window=512, fisher=False)]
        ke = [l[0] for l in collect_kv(model, ev_ids, window=ev_ids.shape[1], fisher=False)]
    cfg = model.config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full"] * len(kc)
    rows = []
    for i, (c, e) in enumerate(zip(kc, ke)):
        H, T, D = c.shape
        keep = torch.ones(T, dtype=torch.bool)
        keep[::512] = False
        cf, ef = c[:, keep].float(), e[:, 1:].float()
        n_out = math.ceil(0.01 * D - 1e-9)
        row = {"layer": i, "type": types[i][:7]}
        for bits in (3, 2):
            s, z = offline_key_rows(c, bits, keep, q=0.002)  # (the rule of session 44)
            lo, hi = z.float()[:, None], z.float()[:, None] + s.float()[:, None] * ((1 << bits) - 1)
            out_c = ((cf < lo) | (cf > hi))
            out_e = ((ef < lo) | (ef > hi))
            far_e = ((ef < lo - s.float()[:, None]) | (ef > hi + s.float()[:, None]))
            row["sat_cal"] = out_c.float().mean().item()
            row["sat_eval"] = out_e.float().mean().item()
            row[f"far_eval_b{bits}"] = far_e.float().mean().item()
            # token vectors with more saturated channels than outlier slots
            row["tok_over_nout_eval"] = (out_e.sum(-1) > n_out).float().mean().item()
            row[f"err_off_b{bits}"] = rel_err(ef, deq_rows(ef, s, z, bits), n_out)
            s0, z0 = P.rule_quantile(0.0)(c, bits, keep)
            row[f"err_q0_b{bits}"] = rel_err(ef, deq_rows(ef, s0, z0, bits), n_out)
            sm, zm = P.rule_mse(True)(c, bits, keep)
            row[f"err_mse_b{bits}"] = rel_err(ef, deq_rows(ef, sm, zm, bits), n_out)
            so, zo = offline_key_rows(e[:, 1:], bits, q=0.002)  # oracle: on the evaluation keys
            row[f"err_oracle_b{bits}"] = rel_err(ef, deq_rows(ef, so, zo, bits), n_out)
            xg, dg = deq_group(ef, bits)
            row[f"err_group_b{bits}"] = rel_err(xg, dg, n_out)
            row[f"err_off_cal_b{bits}"] = rel_err(cf, deq_rows(cf, s, z, bits), n_out)
        # range shift: per channel, evaluation q0.002 range / calibration q0.002 range
        rc = offline_key_rows(c, 3, keep, q=0.002)[0].float() * 7
        re_ = offline_key_rows(e[:, 1:], 3, q=0.002)[0].float() * 7
        ratio = (re_ / rc.clamp_min(1e-6)).flatten()
        row["range_ratio_med"] = ratio.median().item()
        row["range_ratio_max"] = ratio.max().item()
        # concentration: share of the key energy in the top 1% / 5% of channels
        en = (ef ** 2).mean(1).flatten().sort(descending=True).values
        row["energy_top1pct"] = (en[: max(1, D * H // 100)].sum() / en.sum()).item()
        # within-channel spread: mean over channels of std / (q0.002 range)
        row["std_over_range"] = (cf.std(1) / rc.clamp_min(1e-6)).mean().item()
        # how much the channel's mean drifts within the text (std over 32-token groups of the
        # group mean, over the channel's std): large -> per-group ranges win
        g = ef[:, : ef.shape[1] // 32 * 32].reshape(H, -1, 32, D)
        row["group_mean_drift"] = (g.mean(2).std(1) / ef.std(1).clamp_min(1e-6)).mean().item()
        row["group_range_over_offline"] = ((g.amax(2) - g.amin(2)).mean(1)
                                           / rc.clamp_min(1e-6)).mean().item()
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
    out = Path("benchmarks/results") / f"kvquant_offline_range_diag_{a.name}.json"
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
