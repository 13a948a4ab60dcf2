"""KV memory arithmetic against the formula, against a real LayerStore, and its edge cases."""

from __future__ import annotations

import pytest
import torch

from kvbits.eval.memory import (
    NAMED_CONFIGS,
    KVShape,
    format_bytes,
    kv_memory,
    kv_shape,
    memory_table,
    parse_bytes,
)
from kvbits.spec import resolve_spec


@pytest.mark.parametrize("name,shape", [
    ("llama-2-7b", (32, 32, 128)), ("llama-3-8b", (32, 8, 128)), ("smollm2", (30, 3, 64)),
    ("qwen2.5-0.5b", (24, 2, 64)), ("gemma3-270m", (18, 1, 256))])
def test_named_configs(name, shape):
    s = NAMED_CONFIGS[name]
    assert (s.layers, s.kv_heads, s.head_dim) == shape
    r = kv_memory(name, "fp16", context=1)
    assert r.fp16_bytes_per_token == shape[0] * 2 * shape[1] * shape[2] * 2


def test_llama3_8b_fp16_and_kivi():
    fp = kv_memory("llama-3-8b", "fp16", context=131072)
    assert fp.fp16_bytes_per_token == 131072 and fp.body_bytes_per_token == 131072
    assert fp.fixed_fp16_tokens == 0 and fp.total_bytes == 131072 * 131072 == fp.fp16_total_bytes
    k2 = kv_memory("llama-3-8b", "kivi-2", context=131072)  # G=32, R=128, S=0
    # per head and token: K codes 2*128/8 + K scale/zero 2*2*128/32 + V codes 32 + V meta 16 = 96
    assert k2.body_bytes_per_token == 24576 == 32 * 8 * 96
    assert k2.fixed_fp16_tokens == 128 + 32 - 1
    assert k2.total_bytes == 159 * 131072 + (131072 - 159) * 24576
    assert k2.compression == pytest.approx(131072 * 131072 / k2.total_bytes)
    assert kv_memory("llama-3-8b", "kivi-4").body_bytes_per_token == 32 * 8 * 160


def test_sink_and_overrides_enter_the_fixed_part():
    r = kv_memory("llama-3-8b", "kivi-2", context=1000, sink_tokens=4, residual_length=64,
                  group_size=128)
    assert r.fixed_fp16_tokens == 4 + 64 + 127
    assert r.body_bytes_per_token == 32 * 8 * (32 + 4 + 32 + 4)  # value groups of 128 too


def test_short_context_is_all_fp16():
    r = kv_memory("smollm2", "kivi-2", context=100, batch=3)
    assert r.total_bytes == 3 * 100 * r.fp16_bytes_per_token and r.compression == 1.0


def test_max_context_and_batch_fit_exactly():
    gpu, weights = parse_bytes("80GB"), 16 * 10**9
    for preset in ("fp16", "kivi-4", "kivi-2"):
        r = kv_memory("llama-3-8b", preset, context=32768, batch=4, gpu_memory=gpu,
                      weights_bytes=weights)
        free = gpu - weights
        per_seq = kv_memory("llama-3-8b", preset, context=r.max_context).total_bytes
        over = kv_memory("llama-3-8b", preset, context=r.max_context + 1).total_bytes
        assert 4 * per_seq <= free < 4 * over
        one = kv_memory("llama-3-8b", preset, context=32768).total_bytes
        assert r.max_batch == free // one
    assert kv_memory("llama-3-8b", "fp16", context=131072, gpu_memory=gpu,
                     weights_bytes=weights).max_batch == 3


def test_formula_matches_a_real_layer_store():
    """The worst case is exact when the residual holds R + G - 1 tokens (here 159)."""
    from kvbits.cache.store import LayerStore

    spec = resolve_spec("kivi-2")
    store = LayerStore(spec, batch=1, kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu")
    T = 159 + 4 * 32
    k, v = torch.randn(2, 1, 2, T, 64, dtype=torch.float16)
    store.append(k, v)
    if hasattr(store, "flush"):  # appends may defer the flush to the attention
        store.flush()
    assert store.res_len == 159 and store.body_len == 128
    r = kv_memory(KVShape("one-layer", 1, 2, 64), "kivi-2", context=T)
    assert r.total_bytes == store.nbytes()


def test_hf_config_object_matches_named():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         hidden_size=4096)
    shape = kv_shape(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (32, 8, 128)
    assert kv_memory(config, "kivi-2").body_bytes_per_token == 24576


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="unknown config 'llama-9'.*llama-3-8b"):
        kv_memory("llama-9", "kivi-2")
    with pytest.raises(ValueError, match="unknown preset 'kivi-7'"):
        kv_memory("llama-3-8b", "kivi-7")
    with pytest.raises(ValueError, match="weights_bytes"):
        kv_memory("llama-3-8b", "kivi-2", gpu_memory=10**9, weights_bytes=2 * 10**9)
    with pytest.raises(ValueError, match="batch"):
        kv_memory("llama-3-8b", "kivi-2", batch=0)


@pytest.mark.parametrize("kw,match", [
    ({"context": 2.5}, "context must be an integer >= 0, got 2.5"),  # were accepted
    ({"batch": 1.5}, "batch must be an integer >= 1, got 1.5"),
    ({"gpu_memory": 0}, "gpu_memory must be a number of bytes > 0, got 0"),  # blamed weights
    ({"gpu_memory": -1}, "gpu_memory must be a number of bytes > 0, got -1"),
    # a negative weights_bytes added room (max batch 688 for 671 at 80 GB), NaN and an
    # infinite gpu_memory failed in int() naming neither
    ({"gpu_memory": 8e10, "weights_bytes": -10**9},
     r"weights_bytes must be a number of bytes >= 0, got -1000000000"),
    ({"gpu_memory": 8e10, "weights_bytes": float("nan")}, "weights_bytes must be a number"),
    ({"gpu_memory": float("inf")}, "gpu_memory must be a number of bytes > 0, got inf"),
])
def test_bad_counts_name_the_parameter(kw, match):
    with pytest.raises(ValueError, match=match):
        kv_memory("llama-3-8b", "kivi-2", **kw)


@pytest.mark.parametrize("text,value", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30),
                                        ("80G", 80 * 2**30), ("1.5e9", 1_500_000_000),
                                        ("512 MiB", 512 * 2**20), ("100", 100)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "80XB", "-1GB", "eighty", "1e400GB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_table_and_format():
    assert format_bytes(131072) == "128.0 KiB" and format_bytes(12) == "12 B"
    table = memory_table([kv_memory("smollm2", p, context=4096, gpu_memory=parse_bytes("8GB"))
                          for p in ("fp16", "kivi-2")])
    lines = table.splitlines()
    assert len(lines) == 4 and "max context" in lines[0] and "kivi-2" in lines[3]


def test_sliding_window_layers_are_bounded():
    """A layer with a sliding window holds at most window - 1 tokens in DynamicCache and
    sliding_hold() in kvbits; only the full layers grow with the context (so the context that
    fits is much longer), and a model without such layers is counted as before."""
    from kvbits.eval.memory import sliding_hold
    from kvbits.spec import resolve_spec

    spec = resolve_spec("kivi-2")
    assert 512 < sliding_hold(512, spec) <= 1.25 * (512 + 32) + 32 + 159
    slide = KVShape("s", 4, 2, 64, sliding_layers=3, window=512)
    full = KVShape("f", 4, 2, 64)
    short, long = (kv_memory(slide, "kivi-2", context=c) for c in (256, 100_000))
    assert short.total_bytes == kv_memory(full, "kivi-2", context=256).total_bytes  # < window
    grows = (long.total_bytes - short.total_bytes) / (100_000 - 256)
    assert grows < 0.3 * kv_memory(full, "kivi-2", context=100_000).body_bytes_per_token
    assert long.fp16_total_bytes == (100_000 + 3 * 511) * 2 * 2 * 64 * 2
    budget = kv_memory(slide, "kivi-2", context=4096, gpu_memory=10**9)
    assert budget.max_context > 3 * kv_memory(full, "kivi-2", context=4096,
                                              gpu_memory=10**9).max_context
    every = KVShape("all", 2, 2, 64, sliding_layers=2, window=512)
    # every layer slides: no context runs out of memory (it said 2^40, its search bound)
    unbounded = kv_memory(every, "kivi-2", context=4096, gpu_memory=10**9)
    assert unbounded.max_context is None
    assert "no limit" in memory_table([unbounded]).splitlines()[-1]


def test_offline_key_scales_drop_the_per_group_key_pair():
    """kvquant with key_scales="calibrated": no FP16 key scale and zero per channel per group
    (4 x D / G bytes per token and KV head), one fixed row (counted as one FP16 token)."""
    grp = kv_memory("llama-3-8b", "kvquant-3", context=131072)
    off = kv_memory("llama-3-8b", resolve_spec("kvquant-3-offline"), context=131072)
    D, G, layers, heads = 128, 32, 32, 8
    assert grp.body_bytes_per_token - off.body_bytes_per_token == layers * heads * 4 * D / G
    assert off.fixed_fp16_tokens == grp.fixed_fp16_tokens + 1
    assert off.total_bytes < grp.total_bytes


def _cut_gemma3():
    """A Gemma3 text config cut to 3 layers by setting num_hidden_layers (as for a small test
    model): its layer_types keeps all 8 entries, 7 of them sliding."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=8, sliding_window=16, hidden_size=64,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    cfg.num_hidden_layers = 3
    return cfg


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    small = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 32}
    return {
        "gemma3 cut to 3 layers": _cut_gemma3(),
        "gemma3 (5 sliding, 1 full)": Gemma3TextConfig(num_hidden_layers=6, sliding_window=16,
                                                       **small),
        "layer_types full, sliding, full": Gemma3TextConfig(
            num_hidden_layers=3, sliding_window=16,
            layer_types=["full_attention", "sliding_attention", "full_attention"], **small),
        "qwen2 sliding from layer 2": Qwen2Config(num_hidden_layers=4, use_sliding_window=True,
                                                  sliding_window=16, max_window_layers=2,
                                                  **small),
        "mistral (every layer slides)": MistralConfig(num_hidden_layers=2, sliding_window=16,
                                                      **small),
        "llama (no window)": LlamaConfig(num_hidden_layers=2, **small),
    }


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("tokens", [1, 15, 16, 40])
def test_fp16_cache_bytes_are_what_a_dynamic_cache_holds(name, tokens):
    """fp16_cache_bytes (the FP16 figure of ppl, bench and memory) against a filled FP16
    DynamicCache, layer by layer. It counted the sliding layers over the whole layer_types
    list: the Gemma3 config cut to 3 layers (7 of its 8 types sliding) gave 7 sliding layers
    of 3 (-7,040 bytes at 40 tokens; right only below the window), where DynamicCache builds
    the first 3; kv_memory's fp16_total_bytes likewise."""
    from transformers import DynamicCache

    from kvbits.eval.memory import fp16_cache_bytes
    from kvbits.eval.perplexity import cache_nbytes

    cfg = _configs()[name]
    cache = DynamicCache(config=cfg)
    kv = torch.zeros(1, 1, tokens, 32, dtype=torch.float16)
    for i in range(cfg.num_hidden_layers):
        cache.update(kv, kv, i)
    assert len(cache.layers) == cfg.num_hidden_layers
    want = cache_nbytes(cache)
    assert fp16_cache_bytes(cfg, tokens) == want
    assert kv_memory(cfg, "fp16", context=tokens).fp16_total_bytes == want


def test_max_context_is_not_capped_and_huge_contexts_are_exact():
    """With --gpu-memory 1e30 the max context showed 1,099,511,627,776: the search's bound
    (2^40), silently; a context of 10^400 tokens raised OverflowError (float arithmetic)."""
    gpu = 10**30
    r = kv_memory("llama-3-8b", "kivi-2", context=4096, gpu_memory=gpu)
    body, fp, fixed = 24576, 131072, 159
    want = fixed + (gpu - fixed * fp) // body  # the exact largest context that fits
    assert r.max_context == want > 1 << 40
    huge = 10**400
    big = kv_memory("llama-3-8b", "kivi-2", context=huge)
    assert big.total_bytes == fixed * fp + (huge - fixed) * body
    # its bytes, printed without a float (n /= 1024 overflowed)
    assert format_bytes(big.total_bytes).endswith(" TiB")
    assert format_bytes(big.total_bytes).startswith(f"{big.total_bytes // 2**40:,}"[:20])


def _gemma3_six_layers():
    """A tiny Gemma3 text config: layers 0-4 slide (window 64), layer 5 is full."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                            num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=64, sliding_window=64)


def test_per_layer_bits_on_a_sliding_model_grow_in_the_full_layers():
    """Per-layer bits (an FP16 layer, layer_bits) on a model with sliding-window layers: only
    the full layers grow with the context, at their own bits. kv_memory spread every layer's
    body bytes evenly over full and sliding layers, so an FP16 full layer grew at the average
    rate: its 'worst case' was 22% below what a filled KVBitsCache holds (383,187 bytes
    against 491,520 after 1,200 tokens here), and past the windows about 3x too slowly (82.7
    bytes per token against the FP16 layer's 256)."""
    from kvbits.eval.cachefill import append_kv
    from kvbits.eval.perplexity import cache_nbytes
    from kvbits.integrations.hf import KVBitsCache

    cfg = _gemma3_six_layers()
    spec = resolve_spec("kivi-2").replace(skip_layers=(5,))
    # past the windows only layer 5 grows: FP16, 2 x 64 channels x 2 bytes per token
    grow = kv_memory(cfg, spec, context=100_000).total_bytes - \
        kv_memory(cfg, spec, context=50_000).total_bytes
    assert grow == 50_000 * 2 * 64 * 2
    cache = KVBitsCache(cfg, spec)
    torch.manual_seed(0)
    for _ in range(150):  # 1,200 tokens, 8 at a time (eviction runs before each update)
        x = torch.randn(1, 1, 8, 64)
        for i in range(6):
            append_kv(cache, i, x, x)
    assert cache_nbytes(cache, fp16=True) <= kv_memory(cfg, spec, context=1200).total_bytes
    # the same for the config's KVShape (kvbits memory --config passes one) and a named config
    shape = kv_shape(cfg)
    assert shape.sliding_at == (0, 1, 2, 3, 4) and shape.windows()[5] is None
    assert kv_memory(shape, spec, context=1200).total_bytes == \
        kv_memory(cfg, spec, context=1200).total_bytes
    from transformers import Gemma3TextConfig

    assert kv_shape(Gemma3TextConfig(num_hidden_layers=18, sliding_window=512)).sliding_at == \
        NAMED_CONFIGS["gemma3-270m"].sliding_at
    # one spec for every layer: the totals are those of before (uniform over the layers)
    k2 = kv_memory(cfg, "kivi-2", context=1200).total_bytes
    assert k2 == kv_memory(KVShape("s", 6, 1, 64, sliding_layers=5, window=64), "kivi-2",
                           context=1200).total_bytes
    # where the sliding layers are is not known: per-layer bits are refused, not guessed
    with pytest.raises(ValueError, match="which layers slide"):
        kv_memory(KVShape("s", 6, 1, 64, sliding_layers=5, window=64), spec, context=1200)
