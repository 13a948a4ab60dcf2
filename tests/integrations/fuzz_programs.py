"""Differential fuzzer: KVBitsCache against transformers' DynamicCache on tiny random models.

Random valid programs of cache operations (left padding, prefill in chunks down to one token,
decode steps, crops, beam reorders and row selections, save/load and deepcopy, draft
verification) on Llama, Mistral, Qwen2, Gemma2, Gemma3, Phi, GPT-2 and OPT shapes. Session 62
ran ~8,000 programs (no wrong logits or lengths; one misleading crop message, fixed);
``test_fuzz_programs.py`` runs a few seeds of each mode on every push. By hand:

    python tests/integrations/fuzz_programs.py --mode lossless --n 200 --seed 0
    python tests/integrations/fuzz_programs.py --mode twin --n 100
    python tests/integrations/fuzz_programs.py --mode lossless --replay SEED   (prints the program)

lossless: presets that quantize nothing (fp16; quantized presets with R=512 > any length),
          logits at every forward must equal DynamicCache's (rtol 1e-4 of the logit scale).
lossy:    invariants only: no crash (a refusal must be a clear ValueError), finite logits at
          real positions, get_seq_length equal to DynamicCache's.
rows:     lossy presets, left padding a whole number of groups, whole-prompt prefill then
          steps: each row's logits equal that row run alone.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
import traceback
import warnings

import torch
import transformers as tf
from transformers import DynamicCache

from kvbits.integrations.hf import KVBitsCache


V = 128
LP_MAX = int(os.environ.get('LP_MAX', 60))
_TMP = []  # a scratch folder for save/load, made on first use


def scratch() -> str:
    if not _TMP:
        _TMP.append(tempfile.mkdtemp(prefix="kvfuzz"))
    return _TMP[0]


def _arch(name):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=512)
    ref_impl = "sdpa"
    if name == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif name == "mistral":
        m = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=16, **common))
    elif name == "qwen2":
        c = dict(common, num_hidden_layers=3)
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(use_sliding_window=True, sliding_window=16,
                                               max_window_layers=1, **c))
    elif name == "gemma2":
        c = dict(common, num_hidden_layers=2)
        m = tf.Gemma2ForCausalLM(tf.Gemma2Config(sliding_window=16, attn_logit_softcapping=5.0,
                                                 query_pre_attn_scalar=32,
                                                 attn_implementation="eager", **c))
        ref_impl = "eager"
    elif name == "gemma3":
        c = dict(common, num_hidden_layers=3)
        m = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            sliding_window=16, layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention"], **c))
    elif name == "phi":  # partial rotary
        m = tf.PhiForCausalLM(tf.PhiConfig(vocab_size=V, hidden_size=128, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           partial_rotary_factor=0.5,
                                           max_position_embeddings=512))
    elif name == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=128, n_layer=2, n_head=4,
                                             n_positions=512, bos_token_id=None,
                                             eos_token_id=None))
    elif name == "opt":
        m = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=128, ffn_dim=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           max_position_embeddings=512, word_embed_proj_dim=128,
                                           bos_token_id=None, eos_token_id=None, pad_token_id=0))
    else:
        raise KeyError(name)
    m = m.eval()
    ref = copy.deepcopy(m)
    if ref_impl == "sdpa":
        ref.set_attn_implementation("sdpa")
    return m, ref


ARCHS = ["llama", "mistral", "qwen2", "gemma2", "gemma3", "phi", "gpt2", "opt"]
_MODELS = {}


def models(arch):
    if arch not in _MODELS:
        _MODELS[arch] = _arch(arch)
    return _MODELS[arch]


LOSSLESS = ["fp16", "kivi-4:R=512", "kivi-2:R=512,S=2", "kvquant-3:R=512", "kvquant-3-post:R=512",
            "uniform-int4:R=512", "fp8-dynamic:R=512", "k4v2:R=512,S=1", "kivi-2-had:R=512"]
LOSSY = ["kivi-2:G=32,R=8", "kivi-4:G=32,R=0", "kivi-2:G=32,R=16,S=2", "kvquant-3:G=32,R=16",
         "kvquant-3-post:G=32,R=8", "uniform-int4:G=32,R=8", "fp8-dynamic:G=32,R=4",
         "k4v2:G=32,R=16,S=1", "kivi-2-had:G=32,R=8", "uniform-int2:G=32,R=0,axis_key=-1",
         "kivi-8:G=32,R=32"]


def make_cache(model, preset, graphs):
    kw = {"calibration": "uniform"} if preset.startswith("kvquant") else {}
    return KVBitsCache(model, preset, step_graphs=graphs, **kw)


def group_of(preset):
    if ":" in preset:
        for part in preset.split(":")[1].split(","):
            if part.startswith("G="):
                return int(part[2:])
    return 32


OPS = {}


def count(name):
    OPS[name] = OPS.get(name, 0) + 1


class Refused(Exception):
    pass


# clear, documented refusals
OK_REFUSALS = ("pre_rope: the model's position_ids", "crop: cannot", "cannot keep",
               "prefill_chunk_size", "left padding only", "not croppable", "cannot be cropped")


def gen_program(rng, lossy, twin=False):
    B = rng.randint(1, 3)
    Lp = rng.randint(1, LP_MAX)
    pads = [0 if rng.random() < 0.35 else rng.randint(0, Lp - 1) for _ in range(B)]
    ops = []
    t = 0
    style = rng.choice(["one", "small", "mixed", "whole"])
    while t < Lp:
        if style == "one":
            n = 1
        elif style == "small":
            n = rng.randint(1, 5)
        elif style == "whole":
            n = Lp - t
        else:
            n = rng.choice([1, 1, rng.randint(2, 8), rng.randint(1, Lp)])
        n = min(n, Lp - t)
        ops.append(("feed", n))
        t += n
    total = Lp
    for _ in range(rng.randint(2, 14)):
        r = rng.random()
        if twin and rng.random() < 0.3:
            k = rng.randint(2, 10)
            ops.append(("crop_refeed", k, rng.randint(1, k - 1)))
            continue
        if r < 0.35:
            ops.append(("feed", 1))
            total += 1
        elif r < 0.5:
            n = rng.randint(2, 9)
            ops.append(("feed", n))
            total += n
        elif r < 0.62:
            ops.append(("crop", rng.randint(1, 12)))
        elif r < 0.68:
            ops.append(("crop_into", rng.random()))  # crop to a fraction of the length
        elif r < 0.74:
            ops.append(("reorder", [rng.randrange(3) for _ in range(3)]))
        elif r < 0.79:
            ops.append(("repeat", rng.choice([1, 2, 3])))
        elif r < 0.85:
            ops.append(("select", rng.random(), rng.random() < 0.5))
        elif r < 0.91:
            ops.append(("saveload",))
        elif r < 0.95:
            ops.append(("deepcopy",))
        elif r < 0.97:
            ops.append(("record",))
        elif r < 0.96 and twin:
            k = rng.randint(2, 10)
            ops.append(("crop_refeed", k, rng.randint(1, k - 1)))
        elif r < 0.985:
            ops.append(("roundtrip", rng.random() < 0.5))
        else:
            k = rng.randint(2, 10)
            ops.append(("crop_refeed", k, rng.randint(1, k - 1)))
        if total > 150:
            break
    return dict(B=B, Lp=Lp, pads=pads, ops=ops, use_pos=rng.random() < 0.6,
                dc_config=rng.random() < 0.5, positive_crop=rng.random() < 0.3, graphs=rng.random() < 0.5, graphs2=rng.random() < 0.5, mask_always=rng.random() < 0.8)


def close(a, b, tol=1e-4):
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    d = float((a - b).abs().max()) if a.numel() else 0.0
    return d <= tol * scale, d


def run_program(arch, preset, prog, seed, lossy, verbose=False, twin=False):
    """Returns None (ok), ('refused', msg), or ('FAIL', description)."""
    model, ref = models(arch)
    tol = 1e-4
    if twin:
        ref, lossy = model, False
    g = torch.Generator().manual_seed(seed)
    B, Lp = prog["B"], prog["Lp"]
    plan_len = Lp + 200
    ids = torch.randint(1, V, (B, plan_len), generator=g)
    plan_mask = torch.ones(B, plan_len, dtype=torch.long)
    for b, p in enumerate(prog["pads"]):
        plan_mask[b, :p] = 0
    kv = make_cache(model, preset, prog["graphs"])
    if twin:
        dc = make_cache(model, preset, prog.get("graphs2", False))
    elif prog.get("dc_config"):
        dc = DynamicCache(config=ref.config)
    else:
        dc = DynamicCache()
    t = 0  # tokens seen so far
    mask = plan_mask[:, :0]
    refused_crops = []
    singles = 0  # trailing tokens fed in one-token steps (not the prompt's first forward)
    for step, op in enumerate(prog["ops"]):
        if verbose:
            print("  op", step, op, "t", t, "B", ids.shape[0])
        kind = op[0]
        count("tried " + kind)
        try:
            if kind == "feed":
                n = op[1]
                t1 = t + n
                mask = plan_mask[:, :t1]
                # real tokens are copies of the argmax of the reference (a generation) after the
                # prompt
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, t:t1]
                kw = dict(attention_mask=mask) if (prog["mask_always"] or bool((mask == 0).any())) \
                    else {}
                if prog["use_pos"]:
                    kw["position_ids"] = pos
                x = ids[:, t:t1]
                with torch.no_grad():
                    try:
                        want = ref(input_ids=x, past_key_values=dc, use_cache=True, **kw).logits
                    except Exception as e:  # noqa: BLE001
                        return ("refused", f"REF {type(e).__name__}: {str(e)[:100]}")
                    try:
                        got = model(input_ids=x, past_key_values=kv, use_cache=True, **kw).logits
                    except (ValueError, NotImplementedError) as e:
                        msg = str(e)
                        if any(s in msg for s in OK_REFUSALS):
                            return ("refused", f"{type(e).__name__}: {msg[:150]}")
                        raise
                real = mask[:, t:t1].bool()
                if not lossy:
                    ok, d = close(got[real], want[real], tol)
                    if not ok:
                        return ("FAIL", f"logits differ by {d:.3g} at op {step} {op} (t={t})")
                else:
                    if not bool(torch.isfinite(got[real]).all()):
                        return ("FAIL", f"non-finite logits at op {step} {op}")
                singles = singles + 1 if (n == 1 and t > 0) else 0
                t = t1
            elif kind in ("crop", "crop_into"):
                n = op[1] if kind == "crop" else t - int(op[1] * t)
                n = min(n, t - 1)
                if n <= 0:
                    continue
                dc_err = None
                if not twin:
                    try:
                        dc.crop(-n)
                    except RuntimeError as e:  # DynamicSlidingWindowLayer without recording
                        dc_err = str(e)
                try:
                    if twin and prog.get("positive_crop"):
                        kv.crop(t - n)  # legacy: tokens to keep
                    else:
                        kv.crop(-n)
                except (ValueError, RuntimeError) as e:
                    msg = str(e)
                    if any(s in msg for s in OK_REFUSALS):
                        refused_crops.append(msg[:60])
                        count("crop refused: " + msg[:40])
                        if dc_err is not None:
                            return ("refused", "both refused a crop")
                        if dc_err is None and not twin:
                            count("crop refused by kvbits only")
                            if any(w in msg for w in ("sliding-window", "own sink tokens", "quantized in groups")):
                                return ("refused", "kvbits-only crop refusal: " + msg[:50])
                            return ("FAIL", f"kvbits refused a crop DynamicCache made ("
                                    f"dc_config={prog.get('dc_config')}) at op {step}: {msg}")
                        continue  # the cache is left whole: go on
                    raise
                if dc_err is not None:  # (it may have cropped some layers: stop here)
                    count("crop refused by DynamicCache")
                    return ("refused", "DynamicCache refused a crop kvbits made")
                if twin:
                    try:
                        dc.crop(-n)
                    except ValueError as e:  # twin: the other cache evicted more (step mode)
                        if any(s in str(e) for s in OK_REFUSALS):
                            return ("refused", "twin crop asymmetry: " + str(e)[:60])
                        raise
                t -= n
                singles = max(0, singles - n)
            elif kind == "reorder":
                singles = 0
                Bn = ids.shape[0]
                idx = torch.tensor([i % Bn for i in op[1][:Bn]])
                kv.reorder_cache(idx)
                dc.reorder_cache(idx)
                ids, plan_mask = ids[idx], plan_mask[idx]
            elif kind == "repeat":
                singles = 0
                r = op[1]
                if ids.shape[0] * r > 4:
                    continue
                kv.batch_repeat_interleave(r)
                dc.batch_repeat_interleave(r)
                ids, plan_mask = ids.repeat_interleave(r, 0), plan_mask.repeat_interleave(r, 0)
            elif kind == "select":
                singles = 0
                Bn = ids.shape[0]
                k = max(1, int(op[1] * Bn + 0.5))
                rows = sorted(random.Random(seed + step).sample(range(Bn), k))
                if op[2]:
                    sel = torch.zeros(Bn, dtype=torch.bool)
                    sel[rows] = True
                else:
                    sel = torch.tensor(rows)
                    if op[1] < 0.3:
                        sel = sel - Bn
                kv.batch_select_indices(sel)
                dc.batch_select_indices(sel)
                ids, plan_mask = ids[sel], plan_mask[sel]
            elif kind == "roundtrip":
                Bn = ids.shape[0]
                if op[1] and Bn * 2 <= 4:
                    kv.batch_repeat_interleave(2)
                    kv.batch_select_indices(torch.arange(0, 2 * Bn, 2))
                else:
                    perm = torch.randperm(Bn, generator=torch.Generator().manual_seed(seed))
                    kv.reorder_cache(perm)
                    kv.reorder_cache(torch.argsort(perm))
                if not twin:
                    continue
            elif kind == "crop_refeed":
                # speculative verification: A sees k - m real tokens and m rejected drafts in
                # one forward, then crops the drafts; B sees the real tokens alone
                k, m = op[1], op[2]
                if not twin or t < Lp or k - m < 1:
                    continue
                real_ids = ids[:, t:t + k - m]
                drafts = torch.randint(1, V, (ids.shape[0], m),
                                       generator=torch.Generator().manual_seed(seed + step))
                outs = []
                for cache, x in ((kv, torch.cat([real_ids, drafts], 1)), (dc, real_ids)):
                    mm = plan_mask[:, :t + x.shape[1]]
                    kw = dict(attention_mask=mm)
                    if prog["use_pos"]:
                        kw["position_ids"] = (mm.cumsum(-1) - 1).clamp(min=0)[:, t:]
                    with torch.no_grad():
                        outs.append(model(input_ids=x, past_key_values=cache, use_cache=True,
                                          **kw).logits[:, :k - m])
                try:
                    kv.crop(-m)
                except ValueError as e:
                    if any(s in str(e) for s in OK_REFUSALS):
                        return ("refused", "draft crop: " + str(e)[:60])
                    raise
                ok, d = close(outs[0], outs[1], 1e-3)
                if not ok:
                    return ("FAIL", f"draft rows differ by {d:.3g} at op {step} {op}")
                t += k - m
            elif kind == "saveload":
                if t == 0:
                    continue
                path = os.path.join(scratch(), f"c{seed}.safetensors")
                kv.save(path)
                kv = KVBitsCache.load(path, model)
            elif kind == "deepcopy":
                kv = copy.deepcopy(kv)
            elif kind == "record":
                try:
                    kv.activate_past_recording()
                except ValueError as e:
                    if "cannot be cropped" not in str(e):
                        raise
                    continue
                dc.activate_past_recording()
            count("done " + kind)
            mask = plan_mask[:, :t]
            if t:
                nl = len(kv.layers)
                a_ = [kv.get_seq_length(i) for i in range(nl)]
                b_ = [dc.get_seq_length(i) for i in range(nl)]
                if a_ != b_:
                    return ("FAIL", f"get_seq_length {a_} != {b_} after op {step} {op}")
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc(limit=-3)
            return ("FAIL", f"crash at op {step} {op}: {type(e).__name__}: {e}\n{tb}")
    return None


# ------------------------------------------------------------------------- row independence
def run_rows(arch, preset, seed, rng, verbose=False):
    model, _ = models(arch)
    G = group_of(preset)
    B = rng.randint(2, 3)
    L = rng.randint(2, 70)
    pads = [G * rng.randint(0, max(0, (L - 1) // G)) for _ in range(B)]
    pads[0] = 0
    g = torch.Generator().manual_seed(seed)
    steps = [rng.choice([1, 1, 1, rng.randint(2, 9)]) for _ in range(rng.randint(3, 12))]
    total = L + sum(steps)
    ids = torch.randint(1, V, (B, total), generator=g)
    mask = torch.ones(B, total, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    graphs = rng.random() < 0.5
    onebyone = rng.random() < 0.4

    def run(x, m):
        cache = make_cache(model, preset, graphs)
        outs, t = [], 0
        plan = [1] * x.shape[1] if onebyone else [x.shape[1] - sum(steps)] + steps
        for n in plan:
            mm = m[:, :t + n]
            pos = (mm.cumsum(-1) - 1).clamp(min=0)[:, t:t + n]
            with torch.no_grad():
                outs.append(model(input_ids=x[:, t:t + n], attention_mask=mm, position_ids=pos,
                                  past_key_values=cache, use_cache=True).logits)
            t += n
        return torch.cat(outs, 1)

    try:
        both = run(ids, mask)
    except ValueError as e:
        if any(s in str(e) for s in OK_REFUSALS):
            return ("refused", str(e)[:150])
        return ("FAIL", f"crash: {e}")
    worst = 0.0
    for b in range(B):
        p = pads[b]
        alone = run(ids[b:b + 1, p:], mask[b:b + 1, p:])
        got = both[b:b + 1, p:]
        d = float((got - alone).abs().max())
        worst = max(worst, d / max(1.0, float(alone.abs().max())))
    if worst > 1e-3:
        return ("FAIL", f"row differs from alone by rel {worst:.3g} (pads {pads}, L {L}, "
                f"steps {steps}, graphs {graphs}, onebyone {onebyone})")
    return None


def run_gen(arch, preset, seed, rng, verbose=False):
    """transformers' generate through both caches: greedy / beam search / chunked prefill /
    prompt lookup, left padding; tokens and per-step logits compared."""
    model, ref = models(arch)
    B = rng.randint(1, 3)
    L = rng.randint(2, 50)
    pads = [0 if rng.random() < 0.4 else rng.randint(0, L - 1) for _ in range(B)]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, L), generator=g)
    if rng.random() < 0.3:  # repetitive prompt: prompt lookup finds drafts
        ids = ids[:, :5].repeat(1, L // 5 + 1)[:, :L]
    mask = torch.ones(B, L, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(max_new_tokens=rng.randint(1, 20), do_sample=False, pad_token_id=0,
              eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    feature = rng.choice(["greedy", "beams", "chunked", "lookup"])
    if feature == "beams":
        kw["num_beams"] = rng.randint(2, 3)
        kw.pop("output_logits")
        kw["output_scores"] = True
    elif feature == "chunked":
        kw["prefill_chunk_size"] = rng.choice([1, 2, 3, 7, 16])
    elif feature == "lookup":
        kw["prompt_lookup_num_tokens"] = rng.randint(1, 8)
        if B > 1:
            return ("refused", "lookup needs batch 1")
    desc = f"B={B} L={L} pads={pads} {feature} {kw}"
    with torch.no_grad():
        try:
            want = ref.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(),
                                **kw)
        except Exception as e:  # noqa: BLE001
            return ("refused", f"REF {type(e).__name__}: {str(e)[:100]}")
        try:
            got = model.generate(input_ids=ids, attention_mask=mask,
                                 past_key_values=make_cache(model, preset, rng.random() < 0.5),
                                 **kw)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, ValueError) and any(s in str(e) for s in OK_REFUSALS):
                return ("refused", str(e)[:100])
            return ("FAIL", f"crash {desc}: {type(e).__name__}: {e}\n"
                    + traceback.format_exc(limit=-3))
    count("gen " + feature)
    if not torch.equal(got.sequences, want.sequences):
        return ("FAIL", f"sequences differ {desc}\n{got.sequences}\n{want.sequences}")
    key = "scores" if feature == "beams" else "logits"
    for i, (a, b) in enumerate(zip(getattr(got, key), getattr(want, key))):
        fin = torch.isfinite(b)
        ok, d = close(a[fin], b[fin])
        if not ok or not torch.equal(fin, torch.isfinite(a)):
            return ("FAIL", f"{key} differ by {d:.3g} at step {i} {desc}")
    return None


def main():
    warnings.filterwarnings("ignore")  # (here, not at import: the test suite imports this file)
    tf.logging.set_verbosity_error()
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="lossless", choices=["lossless", "lossy", "rows", "twin", "gen"])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, default=None)
    ap.add_argument("--arch", default=None)
    ap.add_argument("--preset", default=None)
    a = ap.parse_args()
    seeds = [a.replay] if a.replay is not None else range(a.seed, a.seed + a.n)
    stats = {"ok": 0, "refused": 0, "FAIL": 0}
    refusals = {}
    for seed in seeds:
        rng = random.Random(seed)
        arch = a.arch or rng.choice(ARCHS)
        pool = LOSSLESS if a.mode == "lossless" else LOSSY
        preset = a.preset or rng.choice(pool)
        if a.mode == "gen":
            preset = a.preset or rng.choice(LOSSLESS)
            res = run_gen(arch, preset, seed, rng)
            prog = None
        elif a.mode == "rows":
            res = run_rows(arch, preset, seed, rng, verbose=a.replay is not None)
            prog = None
        else:
            prog = gen_program(rng, a.mode == "lossy", a.mode == "twin")
            if a.replay is not None:
                print(arch, preset, prog)
            res = run_program(arch, preset, prog, seed, a.mode == "lossy",
                              verbose=a.replay is not None, twin=a.mode == "twin")
        if res is None:
            stats["ok"] += 1
        else:
            stats[res[0]] += 1
            if res[0] == "refused":
                key = res[1][:60]
                refusals[key] = refusals.get(key, 0) + 1
            if res[0] == "FAIL" or a.replay is not None:
                print(f"[{res[0]}] seed={seed} arch={arch} preset={preset} "
                      f"prog={prog}\n    {res[1]}", flush=True)
    print(a.mode, stats)
    for k in sorted(OPS):
        print(f"  {k}: {OPS[k]}")
    for k, v in sorted(refusals.items(), key=lambda kv: -kv[1]):
        print(f"  refused x{v}: {k}")


if __name__ == "__main__":
    sys.exit(main())
