"""Automatic calibrations are keyed by the model's dtype (``kvbits ppl --dtype``, ``--device
cuda``): kvquant's cached files (float32 keys as before, so the files cached until then still
match; a half-precision model takes a cached float32 calibration), fp8 scales and Hadamard
channels kept in memory."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kvbits.methods import dtype_key, model_dtype
from kvbits.methods import fp8 as fp8m
from kvbits.methods import hadamard as hadm
from kvbits.methods import kvquant as kvq
from kvbits.spec import resolve_spec

TEXT, TOKENS = "sotu-pre-2000", 4096


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return LlamaForCausalLM(cfg).eval()


def old_digest(spec, text: str, tokens: int, outlier_rule: bool = False) -> str:
    """The digest of :func:`kvq.calibration_path` before the dtype was keyed (commit ab48460),
    for a named text: its key held the spec fields off their defaults, the offline key rule
    where the keys' scales are calibrated, the text and the tokens. ``outlier_rule``: with the
    outlier rule of session 57 (its calibrations are not the earlier rule's)."""
    fields = {k: v for k, v in kvq.spec_fields(spec).items()
              if k not in kvq._FIELD_DEFAULTS or v != kvq._FIELD_DEFAULTS[k]}
    if spec.key_scales == "calibrated":
        fields["offline_key_rule"] = kvq.OFFLINE_KEY_RULE
    if outlier_rule and spec.outliers and spec.key_scales == "group":
        fields["outlier_rule"] = kvq.OUTLIER_RULE
    key = json.dumps({**fields, "text": text, "tokens": tokens}, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:10]


def test_dtype_key():
    model = tiny_llama()
    assert model_dtype(model) is torch.float32 and dtype_key(model) == {}
    assert dtype_key(model, torch.float16) == {"dtype": "float16"}
    assert dtype_key(model.half()) == {"dtype": "float16"}
    assert dtype_key(model.half(), torch.float32) == {}
    assert dtype_key(model.to(torch.bfloat16)) == {"dtype": "bfloat16"}
    assert model_dtype(object()) is None and dtype_key(object()) == {}


# (what kvbits gave for these presets, on SOTU 1900-1999 at 4096 tokens, before the key)
BEFORE = {"kvquant-3": "c2e6e34492", "kvquant-4-offline": "ba80a6fba5"}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_calibration_path_of_float32_keeps_its_key_and_half_precision_has_its_own(name):
    """The float32 key is the one before the dtype was keyed, plus the outlier rule where it
    shapes the fit: per-group key scales' fits of the earlier rule (BEFORE) are not reused; the
    offline presets (outliers by largest error) and a preset without outliers keep their files."""
    spec, model = resolve_spec(name), tiny_llama()
    f32 = kvq.calibration_path(model, spec, TEXT, TOKENS)
    digest = old_digest(spec, TEXT, TOKENS, outlier_rule=True)
    assert f32.name == f"{kvq.model_fingerprint(model)}-{digest}.safetensors"
    assert BEFORE[name] == old_digest(spec, TEXT, TOKENS)
    assert (digest != BEFORE[name]) == (spec.key_scales == "group")
    dense = spec.replace(outliers=0.0)
    assert kvq.calibration_path(model, dense, TEXT, TOKENS).name.endswith(
        f"-{old_digest(dense, TEXT, TOKENS)}.safetensors")
    half = model.half()
    assert kvq.model_fingerprint(half) == kvq.model_fingerprint(tiny_llama())  # same weights
    f16 = kvq.calibration_path(half, spec, TEXT, TOKENS)
    assert f16 != f32 and f16.parent == f32.parent
    assert kvq.calibration_path(half, spec, TEXT, TOKENS, dtype=torch.float32) == f32
    bf16 = kvq.calibration_path(model.to(torch.bfloat16), spec, TEXT, TOKENS)
    assert bf16 not in (f16, f32)


@pytest.fixture
def calibrations(tmp_path, monkeypatch):
    """An empty kvbits cache; ``auto_calibration`` calibrates on random ids (no text fetched),
    recording the dtype of each model it calibrates."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    made = []
    real = kvq.calibrate
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))

    def calibrate(model, _ids, spec, **kw):
        made.append(model_dtype(model))
        return real(model, ids, spec, window=128, **{k: v for k, v in kw.items()
                                                    if k != "log"})

    monkeypatch.setattr(kvq, "calibrate", calibrate)
    monkeypatch.setattr("kvbits.data.load_text", lambda text, log=None: "unused")
    monkeypatch.setattr("kvbits.data.tokenize_text", lambda tok, text, n=None: ids)
    return made


def auto(model, spec):
    model._kvbits_tokenizer = object()  # (tokenize_text is patched)
    return kvq.auto_calibration(model, spec, text=TEXT, tokens=TOKENS)


def test_half_precision_model_takes_the_cached_float32_calibration(calibrations):
    spec = resolve_spec("kvquant-3")
    cal = auto(tiny_llama(), spec)
    assert calibrations == [torch.float32] and cal.extra["dtype"] == "float32"
    assert kvq.calibration_path(tiny_llama(), spec, TEXT, TOKENS).is_file()
    logs = []
    half = tiny_llama().half()
    half._kvbits_tokenizer = object()
    got = kvq.auto_calibration(half, spec, text=TEXT, tokens=TOKENS, log=logs.append)
    assert calibrations == [torch.float32]  # not calibrated again
    assert got.extra["dtype"] == "float32"
    assert torch.equal(got.layers[1].k_codebook, cal.layers[1].k_codebook)
    assert any("the float32 calibration cached at" in line and "serves this float16 model"
               in line for line in logs), logs
    assert not kvq.calibration_path(half, spec, TEXT, TOKENS).exists()
    got.check(half, spec)  # accepted for the float16 model


def test_float32_model_never_takes_a_half_precision_calibration(calibrations):
    spec = resolve_spec("kvquant-3")
    half = tiny_llama().half()
    cal16 = auto(half, spec)  # none cached: calibrated in float16, cached under float16
    assert calibrations == [torch.float16] and cal16.extra["dtype"] == "float16"
    assert kvq.calibration_path(half, spec, TEXT, TOKENS).is_file()
    assert auto(tiny_llama().half(), spec).extra["dtype"] == "float16"  # from the cache
    assert calibrations == [torch.float16]
    cal32 = auto(tiny_llama(), spec)
    assert calibrations == [torch.float16, torch.float32] and cal32.extra["dtype"] == "float32"
    # bfloat16 takes the float32 one now, not the float16 one
    assert auto(tiny_llama().to(torch.bfloat16), spec).extra["dtype"] == "float32"
    assert calibrations == [torch.float16, torch.float32]


# ------------------------------------------------------------------- in-memory fp8 and hadamard
@pytest.mark.parametrize("module,spec,compute", [
    (fp8m, "fp8", "calibrate_fp8"), (hadm, "kivi-2-hadc", "calibrate_hadamard")])
def test_in_memory_calibrations_distinguish_the_dtype(monkeypatch, module, spec, compute):
    """A model converted in place (same id) is measured again in its new dtype, and each dtype's
    values are kept."""
    spec = resolve_spec(spec)
    made = []
    monkeypatch.setattr(module, "_AUTO", {})
    monkeypatch.setattr(module, "calibration_ids", lambda *a, **k: torch.zeros(1, 8, dtype=int))
    monkeypatch.setattr(module, compute,
                        lambda model, ids, spec: made.append(model_dtype(model)) or [len(made)])
    go = module.auto_fp8_scales if module is fp8m else module.auto_hadamard_channels
    model = tiny_llama()
    assert go(model, spec) == [1]
    assert go(model, spec) == [1] and made == [torch.float32]
    model.half()
    assert go(model, spec) == [2] and made == [torch.float32, torch.float16]
    assert go(model, spec) == [2]
    model.float()
    assert go(model, spec) == [1] and len(made) == 2


@pytest.mark.parametrize("module,spec,compute", [
    (fp8m, "fp8", "calibrate_fp8"), (hadm, "kivi-2-hadc", "calibrate_hadamard")])
def test_in_memory_calibrations_never_serve_another_model(monkeypatch, module, spec, compute):
    """A model freed and another built at its address (CPython reuses ids; simulated here by an
    ``id`` that gives every model the same number) is calibrated for itself: it was served the
    freed model's scales / channels, keyed by ``id(model)``. The freed model's entry goes with
    it."""
    import gc

    spec = resolve_spec(spec)
    monkeypatch.setattr(module, "_AUTO", type(module._AUTO)())
    monkeypatch.setattr(module, "id", lambda obj: 12345, raising=False)
    monkeypatch.setattr(module, "calibration_ids", lambda *a, **k: torch.zeros(1, 8, dtype=int))
    monkeypatch.setattr(module, compute, lambda model, ids, spec: [
        float(model.model.layers[0].self_attn.k_proj.weight[0, 0])])
    go = module.auto_fp8_scales if module is fp8m else module.auto_hadamard_channels
    a = tiny_llama(seed=0)
    got_a = go(a, spec)
    del a
    gc.collect()
    b = tiny_llama(seed=1)
    want_b = [float(b.model.layers[0].self_attn.k_proj.weight[0, 0])]
    assert want_b != got_a and go(b, spec) == want_b
    assert go(b, spec) == want_b and len(module._AUTO) == 1  # kept for b
    del b
    gc.collect()
    assert len(module._AUTO) == 0
