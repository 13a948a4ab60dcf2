"""Probe (CPU): is the scale fold numerically safe? An emulation, in exact PyTorch arithmetic, of
the Gluon body's decode step as it is and as the fold would compute it (docs/KERNEL_LOG.md, "Fewer
instructions per token"), on real queries, keys and values of SmolLM2 (SOTU text), quantized
the KIVI way at 2 bits (keys per channel over 32 tokens, values per token over 32 channels).

* **now**: each element dequantized to fp16 by one fused multiply-add (``c s + z``, rounded
  once, as ``HFMA2`` does), then fp16 x fp16 products summed in fp32 by the MMA;
* **fold**: the MMA reads the magic-number halves ``1024 + c 4^p`` (exact fp16; ``p`` the
  code's 2-bit slot in its half, 0..4) against a query scaled per key group, ``q' = fp16(q s)``,
  and P scaled per value group, ``p' = fp16(P s 4^-p 2^E)``; the offsets come back from per-group
  sums: ``S = 4^-p (A q' - 1024 sum q') + sum q z`` for keys, ``O = 2^-E (A p' - 1024 sum p') +
  sum P z`` for values (``E``: a power of two that keeps p' above fp16's subnormals).

The MMA is emulated as fp32 accumulation over 16-element chunks (each chunk's sum of exact
products rounded to fp32, then added). Both are compared with the same quantized cache
dequantized in float64: relative error of the attention output per layer, and of the scores.
It answers whether the fold's cancellation (``A q'`` against ``1024 sum q'``) costs precision
that the fp16 dequantization does not already lose.

    PYTHONPATH=src python3 benchmarks/probes/scale_fold_numerics.py [TOKENS] [E]
"""
import sys

import torch

from kvbits.data import load_model, load_text

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
E = int(sys.argv[2]) if len(sys.argv) > 2 else 10
G, BITS = 32, 2
LEVELS = (1 << BITS) - 1
torch.manual_seed(0)


def capture(model, ids):
    """Post-RoPE query of the last token and keys/values of every token, per layer."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    out = {}

    def hook(module, args, kwargs, idx):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        B, L, _ = h.shape
        D = module.head_dim
        q = module.q_proj(h).view(B, L, -1, D).transpose(1, 2)
        k = module.k_proj(h).view(B, L, -1, D).transpose(1, 2)
        v = module.v_proj(h).view(B, L, -1, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out[idx] = (q[0, :, -1].double(), k[0].double(), v[0].double())

    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw, i=i: hook(m, a, kw, i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return out


def minmax(x, dim):
    """fp16 (as float64) scale and zero of asymmetric min-max quantization over ``dim``."""
    lo = x.amin(dim, keepdim=True).half().double()
    hi = x.amax(dim, keepdim=True)
    s = ((hi - lo) / LEVELS).half().double()
    codes = torch.where(s > 0, ((x - lo) / torch.where(s > 0, s, 1)).round(), 0).clamp(0, LEVELS)
    return codes, s, lo


def mma(a, b):
    """``a [M, K] @ b [K, N]`` with fp32 accumulation over 16-wide chunks of K."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k0 in range(0, a.shape[1], 16):
        acc = acc + (a[:, k0:k0 + 16].double() @ b[k0:k0 + 16].double()).float()
    return acc.double()


def fp16(x):
    return x.half().double()


def attend(q, k, v, hg):
    """float64 softmax attention of each query head over its KV head's keys/values."""
    kk = k.repeat_interleave(hg, 0)
    s = torch.einsum("hd,htd->ht", q, kk) / q.shape[-1] ** 0.5
    p = torch.softmax(s, -1)
    return torch.einsum("ht,htd->hd", p, v.repeat_interleave(hg, 0)), s


def layer_errors(q, k, v):
    hq, hkv = q.shape[0], k.shape[0]
    hg, D = hq // hkv, q.shape[-1]
    # keys per channel over G tokens, values per token over G channels
    kc, ks, kz = minmax(k.view(hkv, T // G, G, D), 2)  # [H, ng, G, D], [H, ng, 1, D]
    vc, vs, vz = minmax(v.view(hkv, T, D // G, G), 3)  # [H, T, ngv, G], [H, T, ngv, 1]
    kref = (kc * ks + kz).view(hkv, T, D)
    vref = (vc * vs + vz).view(hkv, T, D)
    o_ref, s_ref = attend(q, kref, vref, hg)
    scale = D ** -0.5
    q16 = fp16(q * scale)
    p_slot = torch.arange(T) % 5  # the code's 2-bit slot within its half (0..4, after shifts)
    out = {}
    for how in ("now", "fold"):
        o_all, s_all = [], []
        for h in range(hq):
            j = h // hg
            if how == "now":
                k16 = fp16(kc[j] * ks[j] + kz[j]).view(T, D)  # one rounding (HFMA2)
                s = mma(k16, q16[h][:, None])[:, 0]
            else:
                a = (1024 + kc[j] * 4.0 ** p_slot.view(T // G, G, 1)).view(T, D)  # exact fp16
                s = torch.empty(T, dtype=torch.float64)
                for g in range(T // G):
                    rows = slice(g * G, (g + 1) * G)
                    qp = fp16(q16[h] * ks[j, g, 0])  # q' = q s_g, fp16
                    raw = mma(a[rows], qp[:, None])[:, 0]
                    x = mma(torch.ones(1, D), qp[:, None])[0, 0]  # sum q'
                    y = mma(fp16(kz[j, g]), q16[h][:, None])[0, 0]  # sum q z
                    s[rows] = (4.0 ** -p_slot[rows]) * (raw - 1024 * x) + y
            p = torch.exp(s - s.max())
            p16 = fp16(p)
            if how == "now":
                v16 = fp16(vc[j] * vs[j] + vz[j]).view(T, D)
                o = mma(p16[None, :], v16)[0]
            else:
                a = 1024 + vc[j] * 4.0 ** p_slot.view(T, 1, 1)  # [T, ngv, G]
                o = torch.empty(D, dtype=torch.float64)
                for g in range(D // G):
                    cols = slice(g * G, (g + 1) * G)
                    pp = fp16(p * vs[j, :, g, 0] * 4.0 ** -p_slot * 2.0 ** E)  # p', fp16
                    raw = mma(pp[None, :], a[:, g])[0]
                    x = mma(pp[None, :], torch.ones(T, 1))[0, 0]
                    y = mma(p16[None, :], fp16(vz[j, :, g]))[0, 0]
                    o[cols] = 2.0 ** -E * (raw - 1024 * x) + y
            o_all.append(o / p.sum())
            s_all.append(s)
        o_all, s_all = torch.stack(o_all), torch.stack(s_all)
        out[how] = ((o_all - o_ref).norm() / o_ref.norm()).item(), \
            ((s_all - s_ref).norm() / s_ref.norm()).item()
    return out


def main():
    model, tok = load_model("smollm2")
    model = model.float().eval()
    ids = tok(load_text("sotu-2010-2016"), return_tensors="pt").input_ids[:, :T]
    layers = capture(model, ids)
    print(f"# SmolLM2, {T} SOTU tokens, kivi-2 (G={G}); attention output / scores relative "
          f"error against the quantized cache in float64; E={E}")
    worst = {"now": [0, 0], "fold": [0, 0]}
    for i in sorted(layers)[:: max(1, len(layers) // 8)]:
        r = layer_errors(*layers[i])
        print(f"layer {i:2d}: now out {r['now'][0]:.2e} scores {r['now'][1]:.2e} | "
              f"fold out {r['fold'][0]:.2e} scores {r['fold'][1]:.2e}", flush=True)
        for how in r:
            worst[how] = [max(a, b) for a, b in zip(worst[how], r[how])]
    print(f"worst: now out {worst['now'][0]:.2e} scores {worst['now'][1]:.2e} | "
          f"fold out {worst['fold'][0]:.2e} scores {worst['fold'][1]:.2e}")


if __name__ == "__main__":
    main()
