"""Probe (CPU): what KVQuant's codebook fit should weight, and whether it beats the uniform grid.

The library fits each layer's codebook by k-means in *code units* (every group normalized by its
own min/max to ``[0, 2**bits - 1]``), weighted by the Fisher information of each element
(squared loss gradients). The error that reaches attention is in value units, ``scale * (u -
c(u))``, so the weight that matches it is ``fisher * scale**2``. This probe collects one
calibration (SmolLM2 by default, 4096 tokens of SOTU 1900-1999, Fisher) and fits the codebooks four ways:

* ``fisher``: the library's rule;
* ``fisher_s2``: Fisher times the group's scale squared (squared error in value units);
* ``s2``: the scale squared alone (unweighted value-unit error);
* ``uniform``: ``arange(2**bits)``, i.e. KIVI's grid inside the same kvquant layer,

then measures perplexity through the cache on held-out text (chunks of 256, as ``kvbits ppl``).

    python benchmarks/probes/codebook_weights.py [PRESET [TEXT [TOKENS [MODES [MODEL]]]]]
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from kvbits import data
from kvbits.eval.perplexity import perplexity
from kvbits.integrations.hf import KVBitsCache
from kvbits.methods import kvquant as kvq
from kvbits.spec import resolve_spec

torch.set_num_threads(2)
preset = sys.argv[1] if len(sys.argv) > 1 else "kvquant-3-dense-post"
text = sys.argv[2] if len(sys.argv) > 2 else "sotu-2010-2016"
ntok = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
model_name = sys.argv[5] if len(sys.argv) > 5 else "smollm2"
model, tok = data.load_model(model_name, dtype=torch.float32, device="cpu", log=print)
spec = resolve_spec(preset)
cal_ids = data.tokenize_text(tok, data.load_text("sotu-pre-2000"), 4096)
ids = data.tokenize_text(tok, data.load_text(text), ntok)
t0 = time.time()
kv = kvq.collect_kv(model, cal_ids, window=512, fisher=True, pre_rope=spec.pre_rope)
print(f"collected in {time.time() - t0:.0f} s", flush=True)

def fit_weighted(k, v, gk, gv, spec, mode):
    """fit_layer with the weights of ``mode``."""
    H, T, D = k.shape
    G = spec.group_size
    n_out = spec.n_outliers(D)
    t1 = T // G * G
    kb, vb = spec.key_bits, spec.value_bits
    kg, ks, kz, kd, _ = kvq._split_keys(k[None, :, :t1], kb, G, n_out, None)
    ku = kvq._normalize(kg, ks, kz)[0]
    vg, vs, vz, vd, _ = kvq._split_values(v[None, :, :t1], vb, spec.value_group(D), n_out, None)
    vu = kvq._normalize(vg, vs, vz)[0]
    kd = torch.ones_like(ku, dtype=torch.bool) if kd is None else kd[0]
    vd = torch.ones_like(vu, dtype=torch.bool) if vd is None else vd[0]
    kf = gk[:, :t1].reshape(ku.shape)
    vf = gv[:, :t1].reshape(vu.shape)
    ks2 = (ks.float()[0] ** 2).expand_as(ku)
    vs2 = (vs.float()[0] ** 2).expand_as(vu)
    kw, vw = {"fisher": (kf, vf), "fisher_s2": (kf * ks2, vf * vs2), "s2": (ks2, vs2),
              "none": (None, None)}[mode]

    def fit(u, w, dense, bits):
        cb, th = kvq._fit_one(u[dense], None if w is None else w[dense], bits, False)
        return cb.expand(H, -1).contiguous(), th.expand(H, -1).contiguous()
    return kvq.LayerCodebooks(*fit(ku, kw, kd, kb), *fit(vu, vw, vd, vb))

probe = kvq.weight_probe(model)
modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["fisher", "fisher_s2", "s2", "uniform"]
for mode in modes:
    if mode == "uniform":
        layers = [kvq.uniform_codebooks(k.shape[0], spec.key_bits, spec.value_bits)
                  for k, *_ in kv]
    else:
        layers = [fit_weighted(*layer, spec, mode) for layer in kv]
    cal = kvq.Calibration(layers, kvq.spec_fields(spec), kvq.model_fingerprint(model, probe),
                          model_name, preset, "sotu-pre-2000", "now",
                          {"tokens": 4096, "window": 512}, probe)
    r = perplexity(model, ids, lambda cal=cal: KVBitsCache(model, spec, calibration=cal),
                   chunk_size=256, progress=False)
    print(f"{model_name} {preset} {text} {ntok} {mode}: ppl {r['ppl']:.3f}", flush=True)
