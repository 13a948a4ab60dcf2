"""kvbits bench on CPU: tiny random model, a few decode steps; the GPU parts skip without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from kvbits.eval.speed import (
    MODEL_CONFIGS,
    build_model,
    emulated_quantized_cache,
    max_batch,
    model_config,
    parse_variant,
    time_decode,
)


@pytest.fixture(scope="module")
def tiny():
    return build_model(model_config("tiny"), device="cpu")


def test_named_configs_have_the_published_shapes():
    l2, l3 = model_config("llama-2-7b"), model_config("llama-3-8b", layers=4, max_positions=40000)
    assert (l2.hidden_size, l2.num_hidden_layers, l2.num_key_value_heads, l2.vocab_size) == \
        (4096, 32, 32, 32000)
    assert (l3.num_hidden_layers, l3.num_key_value_heads, l3.intermediate_size, l3.vocab_size) == \
        (4, 8, 14336, 128256)
    assert l3.max_position_embeddings == 40000
    assert MODEL_CONFIGS["llama-3-8b"]["rope_theta"] == 500000.0
    with pytest.raises(ValueError, match="unknown model config"):
        model_config("gpt-5")


def test_more_named_configs_build_their_own_architecture():
    mistral, qwen = model_config("mistral-7b", layers=2), model_config("qwen2.5-7b")
    assert mistral.model_type == "mistral" and mistral.num_key_value_heads == 8
    assert mistral.sliding_window is None and mistral.num_hidden_layers == 2
    head_dim = qwen.hidden_size // qwen.num_attention_heads
    assert qwen.model_type == "qwen2" and head_dim == 128
    assert (qwen.num_attention_heads, qwen.num_key_value_heads) == (28, 4)
    assert model_config("llama-2-7b").model_type == "llama"  # the default type


TINY_ARCHS = {  # small configs of other architectures, as a config.json would give them
    "qwen2": {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2},  # GQA 3:1
    "mistral": {"num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": None},
    "gemma3_text": {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
                    "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
}


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_bench_takes_a_config_json_of_any_architecture(tmp_path, arch):
    """kvbits bench --model path/config.json: built with random weights, every variant decodes,
    and (without sliding layers) the cache of a kvbits preset is smaller than FP16's."""
    from kvbits.cli import main

    cfg = {"model_type": arch, "architectures": ["X"], "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 512,
           "max_position_embeddings": 1024, **TINY_ARCHS[arch]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main(["bench", "--model", str(tmp_path), "--device", "cpu", "--contexts", "320",
               "--steps", "2", "--warmup", "1", "--presets", "fp16,kivi-2,kivi-2+graphs",
               "--out", str(tmp_path), "--name", "arch"])
    assert rc == 0
    rows = json.loads((tmp_path / "arch.json").read_text())["speed"]
    assert [r["variant"] for r in rows] == ["fp16", "kivi-2", "kivi-2+graphs"]
    assert all(r["tok_s"] > 0 and r["cache_tokens_after"] == 320 + 1 + 1 + 2 for r in rows)
    if not cfg.get("sliding_window"):  # (FP16's sliding layers keep only their window)
        assert rows[1]["cache_bytes"] < rows[0]["cache_bytes"]
    with pytest.raises(ValueError, match="config.json"):
        model_config(str(tmp_path / "missing"))


def test_parse_variant():
    assert parse_variant("fp16").kind == "fp16" and parse_variant("fp16").sdpa_backends is None
    flash = parse_variant("fp16-flash")
    assert flash.kind == "fp16" and "cudnn" not in str(flash.sdpa_backends).lower()
    assert "flash" in flash.describe()
    hf = parse_variant("hf-int4:G=32,R=64")
    assert hf.kind == "hf" and hf.spec == {"nbits": 4, "q_group_size": 32, "residual_length": 64}
    assert "emulated" in hf.describe()
    kv = parse_variant("kivi-2:R=64")
    assert kv.kind == "kvbits" and kv.spec.residual_length == 64
    g = parse_variant("kivi-2+graphs")
    assert g.graphs and g.kind == "kvbits" and "CUDA graph" in g.describe()
    f = parse_variant("fp16+graphs")
    assert f.graphs and f.kind == "fp16" and "StaticCache" in f.describe() and f.sdpa_backends
    k16 = parse_variant("kvbits-fp16+graphs")  # FP16 through kvbits' own path: the control
    assert k16.graphs and k16.kind == "kvbits" and not k16.spec.quantized
    fu = parse_variant("kivi-2+graphs+fused")
    assert fu.graphs and fu.fused and "torch.compile" in fu.describe() and not g.fused
    for bad in ("hf-int3", "hf-int2:X=1", "nope", "hf-int2+graphs", "kivi-2+fused",
                "fp16-flash+fused"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    assert parse_variant("kivi-2:S=1,R=64").spec.sink_tokens == 1


@pytest.mark.parametrize("text,match", [
    ("hf-int2:G=abc", "q_group_size must be an integer >= 1"),  # was int()'s bare message
    ("hf-int2:G=0", "q_group_size must be an integer >= 1"),  # was accepted
    ("hf-int4:R=-1", "residual_length must be an integer >= 0"),  # was accepted
    ("kivi-2,kivi-4", "takes one preset, got 2"),  # was "too many values to unpack"
    # accepted: a suffix twice, the last of two values, and +eager-steps dropped by +graphs
    ("kivi-2+graphs+graphs", r"bad variant 'kivi-2\+graphs\+graphs': \+graphs given twice"),
    ("kivi-2+graphs+fused+fused", r"\+fused given twice"),
    ("kivi-2+eager-steps+eager-steps", r"\+eager-steps given twice"),
    ("kivi-2+eager-steps+graphs", r"\+graphs: .*\+eager-steps .* one or the other"),
    ("hf-int2:R=5,R=6", r"'hf-int2:R=5,R=6' sets residual_length twice"),
])
def test_parse_variant_errors_name_the_field(text, match):
    with pytest.raises(ValueError, match=match):
        parse_variant(text)


@pytest.mark.parametrize("nbits", [2, 4])
def test_emulated_quanto_layer_round_trip(nbits):
    cache = emulated_quantized_cache(model_config("tiny"), nbits=nbits, residual_length=4)
    layer = cache.layers[0]
    x = torch.randn(2, 2, 50, 32, dtype=torch.float16)
    q = layer._quantize(x, axis=0)
    assert q[0].dtype == torch.uint8 and q[0].numel() == x.numel() * nbits // 8
    err = (layer._dequantize(q).float() - x.float()).abs().max().item()
    step = (x.float().amax() - x.float().amin()).item() / (2**nbits - 1)
    assert err <= step / 2 + 1e-2
    # transformers' own update rule: prompt quantized; residual re-quantized every R tokens
    k, _v = cache.update(x, x.clone(), 0)
    assert k.shape[2] == 50
    for _ in range(5):
        k, _ = cache.update(x[:, :, :1], x[:, :, :1], 0)
    assert k.shape[2] == 55 and layer.keys.numel() == 0 or layer.keys.shape[2] < 4


@pytest.mark.parametrize("variant", ["fp16", "fp16-flash", "hf-int2", "kivi-2", "kivi-4:R=32",
                                     "fp16+graphs", "kivi-2+graphs", "kvbits-fp16+graphs"])
def test_time_decode_on_cpu(tiny, variant, monkeypatch):
    from kvbits.eval import speed
    v = parse_variant(variant)
    used = []
    real = speed.sdpa_kernel
    monkeypatch.setattr(speed, "sdpa_kernel", lambda b: used.append(b) or real(b))
    r = time_decode(tiny, v, batch=2, context=224, steps=3, warmup=1)
    assert bool(used) == (variant in ("fp16-flash", "fp16+graphs"))  # those restrict SDPA
    assert r["steps"] == 3 and r["tok_s"] > 0 and r["tpot_ms"] > 0
    # generate fed one token per step on top of the filled cache (no second prefill)
    assert r["cache_tokens_after"] == 224 + 1 + 1 + 3  # prompt C+1, then warmup + steps fed
    if v.kind == "kvbits" and v.spec.quantized:
        # float32 model: the FP residual counts 4 bytes per element, the body 2-4 bits
        assert r["cache_bytes"] < r["fp16_cache_bytes"] * 1.5
    assert "peak_bytes" not in r  # CPU: no CUDA memory numbers
    assert ("graph_captures" in r) == v.graphs and r.get("graph_captures", 0) == 0  # CPU: eager


@pytest.mark.parametrize("kw,match", [
    # an empty batch failed in a reshape, steps=0 in statistics.median, a negative warmup ran
    # as 0 and an unknown fill only after the cache was built
    ({"batch": 0}, "time_decode: batch must be an integer >= 1, got 0"),
    ({"steps": 0}, "time_decode: steps must be an integer >= 1, got 0"),
    ({"warmup": -1}, "time_decode: warmup must be an integer >= 0, got -1"),
    ({"context": -5}, "time_decode: context must be an integer >= 0, got -5"),
    ({"fill": "zeros"}, "fill must be 'random' or 'model', got 'zeros'"),
])
def test_time_decode_refuses_counts_it_cannot_time(kw, match):
    args = {"batch": 1, "context": 64, **kw}
    with pytest.raises(ValueError, match=match):
        time_decode(None, parse_variant("kivi-2"), **args)  # before the model is touched


def test_time_decode_with_a_real_prefill(tiny):
    r = time_decode(tiny, parse_variant("kivi-2"), batch=1, context=80, steps=2, warmup=1,
                    fill="model")
    assert r["cache_tokens_after"] == 80 + 1 + 1 + 2


def test_max_batch_needs_cuda(tiny):
    with pytest.raises(RuntimeError, match="GPU"):
        max_batch(tiny, parse_variant("fp16"), context=64, budget=1 << 30)


def test_bench_cli_smoke(tmp_path):
    from kvbits.cli import main

    rc = main(["bench", "--model", "tiny", "--device", "cpu", "--contexts", "64,128",
               "--steps", "2", "--warmup", "1", "--presets", "fp16,hf-int2,kivi-2",
               "--out", str(tmp_path), "--name", "smoke"])
    assert rc == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert len(data["speed"]) == 6 and data["budget"] == []  # (--memory-budget: CUDA only)
    assert data["env"]["complete"] is True
    assert data["env"]["command"].startswith("kvbits bench")
    md = (tmp_path / "smoke.md").read_text()
    assert "random weights" in md.lower() and "emulated" in md
    assert (tmp_path / "smoke_tokens_per_s.png").stat().st_size > 1000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_max_batch_on_cuda():
    model = build_model(model_config("tiny"), device="cuda")
    free = 256 << 20
    budget = torch.cuda.memory_allocated() + free
    r = max_batch(model, parse_variant("kivi-2"), context=512, budget=budget, cap=64, steps=4)
    assert r["peak_bytes"] <= budget and 1 <= r["max_batch"] <= 64


def test_max_batch_search_against_a_simulated_gpu(monkeypatch):
    """The search logic on CPU: peak = weights + per-sequence bytes * batch (+ a jump at a
    batch, like a buffer doubling), with the decode run replaced by the formula."""
    from kvbits.eval import speed

    class FakeParam:
        device = torch.device("cuda")

    class FakeModel:
        def parameters(self):
            yield FakeParam()

    GiB = 1 << 30
    calls = []

    def fake_time_decode(model, variant, batch, context, steps=0, warmup=0, **kw):
        calls.append(batch)
        peak = 14 * GiB + batch * 2 * GiB + (3 * GiB if batch > 20 else 0)
        return {"variant": variant.label, "kind": variant.kind, "batch": batch, "peak_bytes": peak,
                "tok_s": 10.0 * batch, "tpot_ms": 100.0}

    monkeypatch.setattr(speed, "time_decode", fake_time_decode)
    v = parse_variant("fp16")
    r = max_batch(FakeModel(), v, 4096, budget=80 * GiB, log=lambda m: None)
    assert r["max_batch"] == 31 and r["peak_bytes"] <= 80 * GiB  # (80 - 14 - 3) // 2
    assert len(calls) <= 6
    r = max_batch(FakeModel(), v, 4096, budget=80 * GiB, cap=16, log=lambda m: None)
    assert r["max_batch"] == 16
    r = max_batch(FakeModel(), v, 4096, budget=10 * GiB, log=lambda m: None)
    assert r["max_batch"] == 0


def test_time_decode_presized_kvbits_store(tiny):
    r = time_decode(tiny, parse_variant("kivi-2"), batch=1, context=300, steps=2, warmup=1,
                    presize=True)
    assert r["presize"] and r["cache_tokens_after"] == 300 + 1 + 1 + 2


def test_markdown_compares_each_loop_with_its_own_fp16_control():
    """"vs FP16 same loop": each kvbits row against the FP16 KVBitsCache decoded by the same
    loop (same +graphs / +fused suffix, batch and context); "-" where that control is missing."""
    from kvbits.eval.speed import BenchConfig, bench_markdown

    def row(variant, tok_s, context=4096):
        kind = "fp16" if variant.startswith("fp16") else "kvbits"
        return {"variant": variant, "kind": kind, "batch": 1, "context": context,
                "tok_s": tok_s, "tpot_ms": 1e3 / tok_s, "tpot_p90_ms": 1e3 / tok_s,
                "cache_bytes": 1, "fp16_cache_bytes": 1}
    speed = [row("fp16-flash", 10.0), row("kvbits-fp16+graphs", 100.0),
             row("kivi-2+graphs", 150.0), row("kvbits-fp16+graphs+fused", 200.0),
             row("kivi-2+graphs+fused", 250.0), row("kivi-4+graphs", 50.0, context=8192)]
    md = bench_markdown(speed, [], {"command": "x"}, BenchConfig())
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in md.splitlines() if line.startswith("| ") and "+" in line}
    assert cells["kivi-2+graphs"][6:8] == ["15.00x", "1.50x"]  # vs FP16, vs its loop's control
    assert cells["kivi-2+graphs+fused"][6:8] == ["25.00x", "1.25x"]
    assert cells["kvbits-fp16+graphs+fused"][7] == "1.00x"
    assert cells["kivi-4+graphs"][6:8] == ["-", "-"]  # no FP16 row at 8192


def test_markdown_compares_with_the_fastest_fp16_variant_and_names_it():
    """"vs FP16" took the first FP16 variant listed (cuDNN's `fp16`, host-bound at 2.3-2.8x
    the time of `fp16-flash` in the committed e2e tables), flattering every ratio."""
    from kvbits.eval.speed import BenchConfig, bench_markdown

    def row(variant, kind, tok_s, batch=1):
        return {"variant": variant, "kind": kind, "batch": batch, "context": 4096,
                "tok_s": tok_s, "tpot_ms": 1e3 / tok_s, "tpot_p90_ms": 1e3 / tok_s,
                "cache_bytes": 1, "fp16_cache_bytes": 1}
    speed = [row("fp16", "fp16", 10.0), row("fp16-flash", "fp16", 28.0),
             row("kivi-2", "kvbits", 56.0), row("fp16", "fp16", 40.0, batch=8),
             row("fp16-flash", "fp16", 30.0, batch=8), row("kivi-2", "kvbits", 80.0, batch=8)]
    md = bench_markdown(speed, [], {"command": "x"}, BenchConfig())
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in md.splitlines()
             if line.startswith("| kivi-2")]
    assert [c[6] for c in cells] == ["2.00x", "2.00x"]  # 56 / 28 at batch 1, 80 / 40 at batch 8
    assert "fastest FP16 variant at the same batch and context (`fp16-flash`, `fp16`)" in md
    budget = [{"variant": v, "kind": k, "context": 4096, "budget_bytes": 8e10, "max_batch": b,
               "tok_s": t, "tpot_ms": 1.0} for v, k, b, t in (
        ("fp16", "fp16", 30, 100.0), ("fp16-flash", "fp16", 30, 250.0),
        ("kivi-2", "kvbits", 120, 1000.0))]
    md = bench_markdown(speed, budget, {"command": "x"}, BenchConfig())
    table = md.split("## Largest batch")[1]
    row = next(line for line in table.splitlines() if line.startswith("| kivi-2"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[4] == "4.00x" and cells[6] == "4.00x", row  # 120 / 30 batch, 1000 / 250 tok/s


def _held_bytes(cache) -> int:
    """Bytes of every tensor the layers of a (emulated) QuantizedCache hold, each counted once."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            obj = getattr(layer, name, None)
            parts = obj if isinstance(obj, tuple) else (obj,)
            total += sum(t.numel() * t.element_size() for t in parts
                         if isinstance(t, torch.Tensor))
    return total


def test_cache_bytes_of_the_emulated_quantized_cache_count_each_tensor_once(tiny):
    """The hf-int rows' `cache GiB` was twice the quantized part (e2e.md: Llama-3-8B 4k hf-int2
    cache 0.16 GiB against 0.08 GiB allocated): `cache_nbytes` already walks the emulated
    layers' (codes, scale, min, shape, dtype) tuples, and `_cache_nbytes` added them again."""
    from kvbits.eval.speed import _cache_nbytes

    cache = emulated_quantized_cache(model_config("tiny"), nbits=2, q_group_size=64,
                                     residual_length=16)
    x = torch.randn(2, 2, 100, 32)
    for i in range(2):
        cache.update(x, x.clone(), i)
        for _ in range(5):  # a few decode steps: an FP residual beside the codes
            cache.update(x[:, :, :1], x[:, :, :1].clone(), i)
    assert cache.layers[0].keys.shape[2] == 5
    assert _cache_nbytes(cache) == _held_bytes(cache)
    # through the bench: 2 layers x 2 sequences x 2 KV heads x 224 tokens, K and V each
    # 32 channels of 2-bit codes (8 bytes) + an FP16 scale and minimum per 32 channels (4 bytes)
    r = time_decode(tiny, parse_variant("hf-int2"), batch=2, context=224, steps=1, warmup=0)
    assert r["cache_bytes"] == 2 * 2 * 2 * 224 * 2 * (8 + 4)


def test_quantized_cache_gets_the_whole_context_in_one_prefill_update(tiny, monkeypatch):
    """`generate` hands a QuantizedCache its prompt in one update (the prefill). The random fill
    came in chunks of 8192, and in transformers 5.17 (the GPU machine's version; 5.24 changed
    the rule) an update after the first appends to the full-precision residual whatever its
    length (`if self.keys.dim() == 4 and ...`: empty after a quantization), so at 16k / 32k the
    hf-int rows started decoding with 8192 FP16 tokens per layer (e2e.md, Llama-2-7B 32k hf-int2:
    5.88 GiB allocated = 4 GiB FP16 + 1.88 GiB of codes) until their first step re-quantized."""
    from kvbits.eval import speed

    sizes = []
    layer_cls = speed.emulated_layer_class()
    real = layer_cls.update

    def spy(self, k, v, *args, **kwargs):
        sizes.append(k.shape[2])
        return real(self, k, v, *args, **kwargs)

    monkeypatch.setattr(layer_cls, "update", spy)
    context = 8192 + 40
    time_decode(tiny, parse_variant("hf-int2"), batch=1, context=context, steps=1, warmup=0)
    layers = tiny.config.num_hidden_layers
    assert sizes[:layers] == [context] * layers  # the fill: one update per layer
    assert set(sizes[layers:]) == {1}  # then one token per decode step


def test_bench_reads_the_gpu_it_decodes_on(monkeypatch):
    """bench --device cuda:1: the timer's synchronisation, and the GPU name and memory of the
    run's record, are those of cuda:1, not of the current device (cuda:0 unless set), which
    torch.cuda's calls without a device read; a CPU run records "cpu", not the machine's GPU.
    (time_decode's memory counters take the device the same way: see the CUDA test below.)"""
    from types import SimpleNamespace

    from kvbits.eval import speed

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device=None: seen.append(("name", device)) or f"GPU {device}")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: seen.append(("props", device))
                        or SimpleNamespace(total_memory=7))
    speed._sync("cuda:1")
    env = speed.environment("kvbits bench", "cuda:1")
    assert seen == [("sync", "cuda:1"), ("name", "cuda:1"), ("props", "cuda:1")]
    assert env["device"] == "GPU cuda:1" and env["gpu_memory_bytes"] == 7
    seen.clear()
    env = speed.environment("kvbits bench --device cpu", "cpu")
    assert env["device"] == "cpu" and "gpu_memory_bytes" not in env and seen == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_time_decode_on_the_second_gpu_reads_its_memory():
    """A model on cuda:1 (cuda:0 current): peak memory is cuda:1's, at least weights + cache."""
    model = build_model(model_config("tiny"), device="cuda:1")
    r = time_decode(model, parse_variant("kivi-2"), batch=2, context=512, steps=2, warmup=1)
    assert r["weights_bytes"] >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert r["peak_bytes"] >= r["weights_bytes"] + r["cache_bytes"] > 0


def test_fp16_cache_bytes_keep_only_the_window_of_sliding_layers():
    """The "FP16 cache GiB" column: transformers' DynamicCache keeps window - 1 tokens in a
    sliding layer, so a Gemma-3-style model's FP16 cache is not every layer at full length
    (it was: 2 layers x 324 tokens here, against 324 + 31)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("gemma3_text", hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=64, vocab_size=512, max_position_embeddings=1024,
                               sliding_window=32,
                               layer_types=["sliding_attention", "full_attention"])
    model = build_model(cfg, device="cpu")
    r = time_decode(model, parse_variant("fp16"), batch=2, context=320, steps=2, warmup=1)
    # the tokens cache_bytes counts (after the fill), not the end of decode's context + n_new
    assert r["fp16_cache_bytes"] == 2 * 1 * 64 * 2 * 2 * (320 + 31)
    # what the run's own FP16 cache held after the fill (float32 on the CPU: twice the bytes)
    assert r["cache_bytes"] == 2 * 1 * 64 * 2 * 4 * (320 + 31)
