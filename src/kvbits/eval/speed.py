"""End-to-end decode speed and memory of ``generate()`` with FP16, QuantizedCache and kvbits caches.

What is measured
----------------
A model built from a configuration with **random weights** (decode speed does not depend on the
weights or on the cached values) decodes ``steps`` tokens with ``model.generate`` over a cache
that already holds ``context`` tokens per sequence, for ``batch`` sequences:

* **tokens/s** = ``batch / median step time``; **TPOT** (time per output token of one
  sequence) = the median step time. A step is the wall time between two successive calls of a
  ``StoppingCriteria`` inside ``generate`` (CUDA synchronized), i.e. one forward of one token per
  sequence plus generate's own per-token work; the first ``warmup`` steps are dropped.
* **peak memory**: ``torch.cuda.max_memory_allocated`` during the decode steps (weights + cache +
  activations; the allocator's view, so buffer capacity beyond the used length counts), and the
  cache's own bytes (``cache_bytes``, what its tensors hold for the tokens).
* **max batch under a memory budget**: the largest batch whose decode peak stays within
  ``budget`` bytes, found by fitting peak memory against batch at two small batches, then
  checking (and correcting) the prediction by running it.

How the cache is filled (``fill``)
----------------------------------
``"random"`` (default): every layer gets ``context`` random K/V tokens through the cache's own
update path (:mod:`kvbits.eval.cachefill`): ``DynamicCache.update``, ``QuantizedLayer.update``
(the whole context in one call, which quantizes it, as at prefill), and for kvbits
``KVBitsLayer.update`` + the store's ``flush``, i.e. the real quantize+pack path, in chunks.
The prefill's attention is not run: it is not part of decode. ``"model"``: one real prefill
forward of random token ids (``logits_to_keep=1``), which costs prefill activations and time but
is exactly what ``generate`` does.

Caches compared
---------------
* ``fp16``: transformers' ``DynamicCache`` with SDPA attention, torch's default backend (cuDNN
  on the H200 with torch 2.11, ~1 ms of host time per call); ``fp16-flash``: the same with the
  cuDNN backend excluded (flash, then mem-efficient, then math).
* ``hf-int2`` / ``hf-int4`` (``hf-intN[:G=..,R=..]``): transformers' ``QuantizedCache`` update rule
  (``transformers.cache_utils.QuantizedLayer.update``, used unchanged: every step dequantizes the
  whole history, every ``R`` steps everything is re-quantized) with a **PyTorch re-implementation
  of the quanto backend's storage** (``emulated_layer_class()``: per-token groups of ``G`` channels,
  min-max, 2/4-bit codes packed in uint8, FP16 scale and minimum), because optimum-quanto is not
  installed on the GPU machine. Labelled "emulated" in every table.
* kvbits presets (``kivi-2``, ``kivi-4``, ``kivi-2:R=64``, ...): :class:`KVBitsCache` with the
  ``"kvbits"`` attention (Triton kernels on CUDA, the PyTorch reference elsewhere).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..checks import require_count
from .memory import fp16_cache_bytes

__all__ = ["MODEL_CONFIGS", "BenchConfig", "build_model", "emulated_layer_class",
           "emulated_quantized_cache", "make_cache", "max_batch", "model_config", "parse_variant",
           "run_bench", "time_decode", "write_bench"]

# Published sizes (config.json of each model); weights are random here.
MODEL_CONFIGS: dict[str, dict] = {
    "smollm2": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5},
    "llama-2-7b": {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "llama-3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5},
    "mistral-7b": {  # v0.3: no sliding window
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32768, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "sliding_window": None, "rms_norm_eps": 1e-5},
    "qwen2.5-7b": {  # q/k/v projections with bias, GQA 7:1
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "use_sliding_window": False, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    # for tests: 2 layers, head_dim 32, GQA 2:1
    "tiny": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
}


def model_config(name: str, layers: int | None = None, max_positions: int | None = None):
    """The config of a named model (:data:`MODEL_CONFIGS`, ``model_type`` default llama) or of
    ``name`` as a path: a ``config.json`` or a folder holding one (any architecture transformers
    builds with SDPA attention; no weights are read). ``layers`` overrides the depth;
    ``max_positions`` raises ``max_position_embeddings`` (the field only sizes caches here)."""
    from transformers import AutoConfig

    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        kw = json.loads(path.read_text())
    elif name in MODEL_CONFIGS:
        kw = dict(MODEL_CONFIGS[name])
    else:
        raise ValueError(f"unknown model config {name!r}; known: {', '.join(MODEL_CONFIGS)}, or a "
                         "config.json / a model folder holding one")
    model_type = kw.pop("model_type", "llama")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "auto_map"):
        kw.pop(key, None)
    if layers is not None:
        kw["num_hidden_layers"] = layers
        kw.pop("layer_types", None)  # rebuilt for the new depth from the sliding-window pattern
    if max_positions is not None:
        kw["max_position_embeddings"] = max(kw.get("max_position_embeddings", 0), max_positions)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._name_or_path = name
    return cfg


def build_model(config, device="cuda", dtype=None, seed: int = 0):
    """The causal LM of ``config`` with random weights (transformers' init) on ``device``, eval
    mode, SDPA attention; FP16 on CUDA, float32 on CPU (FP16 matmuls are slow there) by
    default."""
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


# ------------------------------------------------------------------ emulated HF QuantizedCache
def _quantized_layer_base():
    from transformers.cache_utils import QuantizedLayer

    return QuantizedLayer


def emulated_layer_class():
    """The emulated quanto layer class, created on first use (it subclasses transformers'
    ``QuantizedLayer``, imported lazily)."""
    if "cls" in _EMULATED:
        return _EMULATED["cls"]

    class _Emulated(_quantized_layer_base()):
        """transformers' ``QuantizedLayer`` (its ``update`` unchanged) over a PyTorch
        re-implementation of quanto's storage: per-token groups of ``q_group_size`` channels
        (quanto's ``axis=0``), min-max, codes packed ``8 // nbits`` per uint8, FP16 scale/min."""

        def __init__(self, nbits=2, axis_key=0, axis_value=0, q_group_size=64, residual_length=128):
            super().__init__(nbits=nbits, axis_key=axis_key, axis_value=axis_value,
                             q_group_size=q_group_size, residual_length=residual_length)

        def _quantize(self, tensor, axis=0):
            bits, G = self.nbits, self.q_group_size
            shape = tensor.shape
            D = shape[-1]
            g = G if D % G == 0 else math.gcd(G, D)
            x = tensor.reshape(*shape[:-1], D // g, g)
            lo = x.amin(-1, keepdim=True)
            scale = ((x.amax(-1, keepdim=True) - lo) / (2**bits - 1)).clamp_min(1e-6)
            q = ((x - lo) / scale).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
            per = 8 // bits
            q = q.view(*q.shape[:-1], g // per, per)
            packed = q[..., 0].clone()
            for i in range(1, per):
                packed |= q[..., i] << (bits * i)
            return (packed, scale.to(torch.float16), lo.to(torch.float16), shape, tensor.dtype)

        def _dequantize(self, q_tensor):
            packed, scale, lo, shape, dtype = q_tensor
            bits = self.nbits
            per = 8 // bits
            mask = 2**bits - 1
            codes = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1)
            codes = codes.view(*packed.shape[:-1], -1).to(torch.float16)
            return (codes * scale + lo).view(shape).to(dtype)

    _Emulated.__name__ = _Emulated.__qualname__ = "EmulatedQuantoLayer"
    _EMULATED["cls"] = _Emulated
    return _Emulated


_EMULATED: dict = {}


def emulated_quantized_cache(config, nbits: int = 2, q_group_size: int = 64,
                             residual_length: int = 128):
    """A transformers ``Cache`` of emulated quanto layers (``QuantizedCache``'s
    update rule, quanto-like storage in PyTorch), one per decoder layer."""
    from transformers import Cache

    cls = emulated_layer_class()
    n = config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[cls(nbits=nbits, q_group_size=q_group_size,
                             residual_length=residual_length) for _ in range(n)])


# ------------------------------------------------------------------------------------ variants
@dataclass
class Variant:
    label: str
    kind: str  # "fp16", "hf", "kvbits"
    spec: object = None  # QuantSpec for kvbits; dict(nbits, q_group_size, residual_length) for hf
    graphs: bool = False  # decode steps captured in CUDA graphs (integrations.decode_loop)
    fused: bool = False  # and their norms, MLP activations, RoPE compiled (fused_pointwise)
    step_graphs: bool = True  # kvbits eager: each layer's step replayed (integrations.step_graphs)

    @property
    def sdpa_backends(self):
        """SDPA backends the variant's generate() may use (None: torch's default choice, which
        is cuDNN on H100/H200 with torch >= 2.5; ``fp16-flash`` excludes it, see
        :func:`flash_backends`)."""
        return flash_backends() if isinstance(self.spec, dict) and self.spec.get("sdpa") == \
            "flash" else None

    def describe(self) -> str:
        if self.graphs:
            base = ("StaticCache FP16, SDPA (flash / mem-efficient backends)" if self.kind == "fp16"
                    else f"KVBitsCache {self.spec.describe()}")
            base += "; greedy loop with each decode step replayed from a CUDA graph"
            if self.fused:
                base += ("; norms, MLP activation and RoPE fused by torch.compile (inductor), "
                         "attention and cache eager")
            return base
        if self.kind == "kvbits" and not self.step_graphs:
            return f"KVBitsCache {self.spec.describe()}, layer steps eager (no step graphs)"
        if self.kind == "fp16":
            return ("DynamicCache FP16, SDPA (flash / mem-efficient backends)"
                    if self.sdpa_backends else "DynamicCache FP16, SDPA (torch's default backend)")
        if self.kind == "hf":
            s = self.spec
            return (f"QuantizedCache update rule, quanto-like int{s['nbits']} storage "
                    f"G={s['q_group_size']} R={s['residual_length']} (emulated in PyTorch)")
        return f"KVBitsCache {self.spec.describe()}"


def flash_backends() -> list:
    """Flash first, then mem-efficient, then math: everything but cuDNN, whose forward costs
    ~1 ms of host time per call on the H200 (benchmarks/results/e2e_host_profile.log)."""
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def parse_variant(text: str) -> Variant:
    """``fp16`` | ``fp16-flash`` (SDPA without the cuDNN backend) | ``kvbits-fp16`` (an FP16
    ``KVBitsCache``: the same decode path and kernels as the presets, nothing quantized) |
    ``hf-int2[:G=64,R=128]`` |
    a kvbits preset with overrides (``kivi-2:R=64``); ``+graphs`` after ``fp16`` or a kvbits
    preset (``fp16+graphs``, ``kivi-2+graphs``): decode with each step replayed from a CUDA
    graph (:mod:`kvbits.integrations.decode_loop`; FP16 then uses transformers' ``StaticCache``
    and SDPA without cuDNN) instead of eager ``generate``; ``+graphs+fused``: the same with the
    steps' elementwise work compiled (:mod:`kvbits.integrations.fused_pointwise`);
    ``+eager-steps`` after a kvbits preset: eager ``generate`` with each layer's steps run
    eagerly too, not replayed from per-layer CUDA graphs (:mod:`kvbits.integrations.
    step_graphs`, the default)."""
    text = text.strip()
    for suffix in ("+graphs", "+fused", "+eager-steps"):  # (a second one was accepted)
        if text.count(suffix) > 1:
            raise ValueError(f"bad variant {text!r}: {suffix} given twice")
    if text.endswith("+eager-steps"):
        base = parse_variant(text[: -len("+eager-steps")])
        if base.kind != "kvbits" or base.graphs:
            raise ValueError(f"bad variant {text!r}: +eager-steps follows a kvbits preset "
                             "decoded by generate (e.g. kivi-2+eager-steps)")
        return Variant(text, base.kind, base.spec, step_graphs=False)
    if text.endswith("+fused"):
        base = parse_variant(text[: -len("+fused")])
        if not base.graphs:
            raise ValueError(f"bad variant {text!r}: +fused follows +graphs "
                             "(e.g. kivi-2+graphs+fused)")
        return Variant(text, base.kind, base.spec, graphs=True, fused=True)
    if text.endswith("+graphs"):
        base = parse_variant(text[: -len("+graphs")])
        if base.kind not in ("fp16", "kvbits"):
            raise ValueError(f"bad variant {text!r}: +graphs applies to fp16 or a kvbits preset")
        if not base.step_graphs:  # (it was dropped without a word)
            raise ValueError(f"bad variant {text!r}: +graphs: the graph loop replays whole "
                             "decode steps, +eager-steps keeps generate() with eager layer "
                             "steps; give one or the other")
        spec = {"sdpa": "flash"} if base.kind == "fp16" else base.spec
        return Variant(text, base.kind, spec, graphs=True)
    if text == "fp16":
        return Variant("fp16", "fp16")
    if text == "fp16-flash":
        return Variant("fp16-flash", "fp16", {"sdpa": "flash"})
    if text == "kvbits-fp16":  # FP16 history in a KVBitsCache: kvbits' kernels, no quantization
        from ..spec import resolve_spec

        return Variant(text, "kvbits", resolve_spec("fp16"))
    if text.startswith("hf-int"):
        name, _, rest = text.partition(":")
        try:
            nbits = int(name[len("hf-int"):])
        except ValueError:
            raise ValueError(f"bad variant {text!r}: use hf-int2 or hf-int4") from None
        if nbits not in (2, 4, 8):
            raise ValueError(f"bad variant {text!r}: nbits must be 2, 4 or 8")
        spec = {"nbits": nbits, "q_group_size": 64, "residual_length": 128}
        alias = {"G": "q_group_size", "R": "residual_length"}
        seen = set()
        for pair in filter(None, rest.split(",")):
            k, eq, v = pair.partition("=")
            k = alias.get(k.strip(), k.strip())
            if not eq or k not in spec or k == "nbits":
                raise ValueError(f"bad override {pair!r} in {text!r}: use G=.. or R=..")
            if k in seen:  # (the last one won)
                raise ValueError(f"bad variant {text!r}: {text!r} sets {k} twice; give it once")
            seen.add(k)
            low = 1 if k == "q_group_size" else 0
            try:
                spec[k] = int(v)
                ok = spec[k] >= low
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"bad override {pair!r} in {text!r}: {k} must be an integer "
                                 f">= {low}")
        return Variant(text, "hf", spec)
    from ..cli import parse_preset

    v = parse_preset(text, "--presets")
    if not v.spec.quantized:
        return Variant(text, "fp16")
    return Variant(text, "kvbits", v.spec)


def make_cache(model, variant: Variant, max_len: int | None = None):
    """A fresh cache of ``variant`` for ``model``; sets the model's attention implementation.
    ``max_len``: the capacity of the ``StaticCache`` that ``fp16+graphs`` uses."""
    from transformers import DynamicCache

    if variant.kind == "kvbits":
        from ..integrations.hf import KVBitsCache

        # switches the model to "kvbits"
        return KVBitsCache(model, variant.spec, step_graphs=None if variant.step_graphs else False)
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    if variant.kind == "fp16" and variant.graphs:
        from transformers import StaticCache

        if max_len is None:
            raise ValueError("make_cache: fp16+graphs needs max_len (the StaticCache capacity)")
        return StaticCache(config=model.config, max_cache_len=max_len)
    if variant.kind == "fp16":
        return DynamicCache(config=model.config)
    return emulated_quantized_cache(model.config, **variant.spec)


# ---------------------------------------------------------------------------------------- timing
def _sync(device) -> None:
    """Wait for ``device``'s work: its own, not the current device's (``bench --device cuda:1``
    synchronized cuda:0)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _step_timer(device):
    from transformers import StoppingCriteria

    class StepTimer(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            _sync(device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepTimer()


def _cache_nbytes(cache) -> int:
    """Bytes the cache's tensors hold. :func:`~kvbits.eval.perplexity.cache_nbytes` already
    walks the tuples the emulated quanto layers keep (codes, scale, minimum, shape, dtype), so
    nothing is added here (adding them again counted the quantized part twice)."""
    from .perplexity import cache_nbytes

    return cache_nbytes(cache)


@torch.no_grad()
def time_decode(model, variant: Variant, batch: int, context: int, steps: int = 32,
                warmup: int = 4, fill: str = "random", seed: int = 0,
                presize: bool = False) -> dict:
    """One measurement: fill a fresh cache with ``context`` tokens per sequence, then time
    ``steps`` decode steps of ``generate``. Returns a result row (see module docstring).

    ``presize`` (kvbits only): allocate the stores' packed buffers for the final length before
    filling and shrink their FP16 residual buffers to ``R + G`` tokens after it
    (:func:`~kvbits.eval.cachefill.presize_store`, :func:`~kvbits.eval.cachefill.compact_residual`)
    instead of ``LayerStore``'s own growth policy."""
    from ..integrations.hf import cache_kwargs
    from .cachefill import compact_residual, fill_random, presize_store

    for name, n, low in (("batch", batch, 1), ("context", context, 0), ("steps", steps, 1),
                         ("warmup", warmup, 0)):  # before any work (they failed obscurely)
        require_count(f"time_decode: {name}", n, low)
    if fill not in ("random", "model"):
        raise ValueError(f"fill must be 'random' or 'model', got {fill!r}")
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        # the model's GPU, not the current one (cuda:0 unless set): with --device cuda:1 the
        # memory columns and the budget search read cuda:0's counters
        base_alloc = torch.cuda.memory_allocated(device)
    n_new = warmup + steps + 1
    cache = make_cache(model, variant, max_len=context + n_new + 1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (batch, context + 1), generator=gen).to(device)
    presize = presize and variant.kind == "kvbits"
    # kvbits and DynamicCache take the fill in chunks of 8192 (the same state as one prefill).
    # transformers' QuantizedCache gets the whole context in one update, as generate's prefill
    # gives it: in transformers 5.17 an update after the first appends to the full-precision
    # residual whatever its length, so a second chunk stayed FP16 until the first decode step.
    fill_chunk = max(1, context) if variant.kind == "hf" else 8192
    if presize:
        spec = variant.spec
        for layer in cache.layers:
            empty = torch.empty(batch, cfg.num_key_value_heads, 0, D, device=device,
                                dtype=next(model.parameters()).dtype)
            layer.lazy_initialization(empty, empty)
            presize_store(layer.store, context + n_new + spec.group_size,
                          residual=spec.residual_length + spec.group_size + fill_chunk)
    t0 = time.perf_counter()
    if fill == "random":
        fill_random(cache, cfg.num_hidden_layers, batch, cfg.num_key_value_heads, D, context,
                    dtype=next(model.parameters()).dtype, device=device, chunk=fill_chunk,
                    seed=seed)
    elif fill == "model":
        model(ids[:, :context], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    else:
        raise ValueError(f"fill must be 'random' or 'model', got {fill!r}")
    if presize:
        for layer in cache.layers:
            compact_residual(layer.store)
    _sync(device)
    fill_s = time.perf_counter() - t0
    cache_bytes = _cache_nbytes(cache)
    if cuda:
        gc.collect()
        cache_alloc = torch.cuda.memory_allocated(device) - base_alloc
        torch.cuda.reset_peak_memory_stats(device)
    timer = _step_timer(device)
    t0 = time.perf_counter()
    backends = variant.sdpa_backends
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        if variant.graphs:  # the prompt's last token is the first decode input, as in generate
            from ..integrations.decode_loop import GreedyDecoder

            decoder = GreedyDecoder(model, cache, step_done=lambda _, ids=ids: timer(ids, None),
                                    fuse="inductor" if variant.fused else None)
            decoder.decode(ids[:, context:], context, n_new + 1)
        else:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                           min_new_tokens=n_new, do_sample=False, stopping_criteria=[timer],
                           temperature=None, top_p=None, top_k=None,
                           **cache_kwargs(model, cache))
    _sync(device)
    total_s = time.perf_counter() - t0
    step_s = [b - a for a, b in zip(timer.times, timer.times[1:])][warmup:]
    med = statistics.median(step_s)
    row = {"variant": variant.label, "kind": variant.kind, "spec": variant.describe(),
           "batch": batch, "context": context, "steps": len(step_s), "fill": fill,
           "presize": presize,
           "tpot_ms": 1e3 * med, "tpot_mean_ms": 1e3 * statistics.fmean(step_s),
           "tpot_p90_ms": 1e3 * sorted(step_s)[max(0, math.ceil(0.9 * len(step_s)) - 1)],
           "tok_s": batch / med, "cache_bytes": cache_bytes,
           # the same tokens as cache_bytes, measured after the fill (until session 62 the
           # context + n_new of the end of decode: up to 3.6% more at 1k)
           "fp16_cache_bytes": batch * fp16_cache_bytes(cfg, context),
           "fill_s": fill_s, "generate_s": total_s,
           # prompt C+1 (the last token fed by the first step) + n_new - 1 generated ones
           "cache_tokens_after": int(cache.get_seq_length())}
    if variant.graphs:  # kvbits: a plain and a flushing step; StaticCache: one step
        row["graph_captures"] = decoder.captures
    if cuda:
        row["cache_alloc_bytes"] = cache_alloc
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row["weights_bytes"] = base_alloc
    del cache, ids
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def max_batch(model, variant: Variant, context: int, budget: int, cap: int = 512,
              steps: int = 16, warmup: int = 2, probe: int = 4, log=print,
              presize: bool = False) -> dict:
    """The largest batch (<= ``cap``) whose decode peak memory stays within ``budget`` bytes,
    with its speed. CUDA only. Fits ``peak = a + b * batch`` on batches 1 and ``probe``, runs
    the predicted batch and corrects it (at most 4 tries)."""
    if next(model.parameters()).device.type != "cuda":
        raise RuntimeError("max_batch measures CUDA memory; it needs a GPU")
    run = lambda b: time_decode(model, variant, b, context, steps=steps, warmup=warmup,
                                presize=presize)
    r1 = run(1)
    if r1["peak_bytes"] > budget:
        return {**r1, "budget_bytes": budget, "max_batch": 0, "tries": [(1, r1["peak_bytes"])]}
    rp = run(probe)
    tries = [(1, r1["peak_bytes"]), (probe, rp["peak_bytes"])]
    per = max(1.0, (rp["peak_bytes"] - r1["peak_bytes"]) / (probe - 1))
    fixed = r1["peak_bytes"] - per
    best = rp if rp["peak_bytes"] <= budget else r1
    b = min(cap, int((budget - fixed) // per))
    for _ in range(4):
        if b <= best["batch"]:
            break
        try:
            r = run(b)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            if not _is_oom(exc):
                raise
            gc.collect()
            torch.cuda.empty_cache()
            tries.append((b, None))
            b = int(b * 0.9)
            continue
        tries.append((b, r["peak_bytes"]))
        log(f"  {variant.label} ctx {context}: batch {b} peak {r['peak_bytes'] / 2**30:.1f} GiB")
        if r["peak_bytes"] <= budget:
            best = r
            if b == cap:
                break
            # one correction upwards, from the measured slope
            per = max(per, (r["peak_bytes"] - fixed) / b)
            nb = min(cap, int((budget - fixed) // per))
            if nb <= b:
                break
            b = nb
        else:
            per = (r["peak_bytes"] - fixed) / b
            b = min(b - 1, int((budget - fixed) // per))
    return {**best, "budget_bytes": budget, "max_batch": best["batch"], "batch_cap": cap,
            "tries": tries}


# -------------------------------------------------------------------------------------- runner
@dataclass
class BenchConfig:
    model: str = "llama-2-7b"
    layers: int | None = None
    variants: tuple[str, ...] = ("fp16", "hf-int2", "kivi-4", "kivi-2")
    contexts: tuple[int, ...] = (1024, 4096, 16384, 32768)
    batches: tuple[int, ...] = (1,)
    steps: int = 32
    warmup: int = 4
    fill: str = "random"
    budget: int | None = None  # bytes: also find the max batch within it
    budget_contexts: tuple[int, ...] = (4096,)
    batch_cap: int = 512
    hf_max_tokens: int = 1 << 22  # skip the emulated QuantizedCache above batch*context
    presize: bool = False  # kvbits stores: allocate once, compact the residual (see time_decode)
    device: str = "cuda"
    seed: int = 0
    extra: dict = field(default_factory=dict)


def _hf_skipped(variant, batch: int, context: int, cfg: BenchConfig) -> bool:
    """Whether run_bench skips this row: the emulated QuantizedCache over ``hf_max_tokens``."""
    return variant.kind == "hf" and batch * context > cfg.hf_max_tokens


def bench_rows(cfg: BenchConfig) -> int:
    """The rows :func:`run_bench` writes for ``cfg`` (speed rows but the skipped ones, and with a
    budget one max-batch row per variant and budget context): what its result files count to
    before they say they are complete."""
    variants = [parse_variant(v) for v in cfg.variants]
    speed = sum(not _hf_skipped(v, b, c, cfg) for c in cfg.contexts for b in cfg.batches
                for v in variants)
    return speed + (len(cfg.budget_contexts) * len(variants) if cfg.budget else 0)


def run_bench(cfg: BenchConfig, log=print, on_rows=None) -> tuple[list[dict], list[dict]]:
    """Speed rows (every variant x context x batch) and, with a budget, max-batch rows."""
    variants = [parse_variant(v) for v in cfg.variants]
    config = model_config(cfg.model, cfg.layers,
                          max_positions=max(cfg.contexts + cfg.budget_contexts) + cfg.steps + 64)
    t0 = time.perf_counter()
    model = build_model(config, cfg.device, seed=cfg.seed)
    log(f"{cfg.model} ({config.num_hidden_layers} layers, random weights) built on {cfg.device} "
        f"in {time.perf_counter() - t0:.1f} s")
    speed, budget_rows = [], []
    # One short untimed run per variant first: the first generate() of a cache type pays
    # one-time costs (measured on the H200: FP16 DynamicCache 80 ms/step on its first run of a
    # process, 33 ms/step on the next), which would otherwise land in the first timed rows.
    for v in variants:
        time_decode(model, v, 1, min(cfg.contexts), steps=2, warmup=1, fill=cfg.fill,
                    seed=cfg.seed, presize=cfg.presize)
    for context in cfg.contexts:
        for batch in cfg.batches:
            for v in variants:
                if _hf_skipped(v, batch, context, cfg):
                    log(f"skip {v.label} batch {batch} ctx {context}: over hf_max_tokens")
                    continue
                try:
                    r = time_decode(model, v, batch, context, cfg.steps, cfg.warmup, cfg.fill,
                                    cfg.seed, presize=cfg.presize)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                    if not _is_oom(exc):
                        raise
                    log(f"OOM {v.label} batch {batch} ctx {context}")
                    r = {"variant": v.label, "kind": v.kind, "spec": v.describe(), "batch": batch,
                         "context": context, "oom": True}
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                speed.append(r)
                if "tok_s" in r:
                    log(f"{v.label:>10} batch {batch:>3} ctx {context:>6}: {r['tok_s']:9.1f} tok/s, "
                        f"TPOT {r['tpot_ms']:.2f} ms"
                        + (f", peak {r['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in r else ""))
                if on_rows:
                    on_rows(speed, budget_rows)
    if cfg.budget:
        if torch.device(cfg.device).type != "cuda":
            log("memory budget: skipped (needs CUDA)")
        else:
            for context in cfg.budget_contexts:
                for v in variants:
                    r = max_batch(model, v, context, cfg.budget, cap=cfg.batch_cap,
                                  steps=max(8, cfg.steps // 2), warmup=2, log=log,
                                  presize=cfg.presize)
                    budget_rows.append(r)
                    log(f"{v.label:>10} ctx {context}: max batch {r['max_batch']} within "
                        f"{cfg.budget / 1e9:.0f} GB, {r.get('tok_s', 0):.0f} tok/s")
                    if on_rows:
                        on_rows(speed, budget_rows)
    del model
    gc.collect()
    return speed, budget_rows


# ------------------------------------------------------------------------------------- reports
def environment(command: str, device: str = "cuda") -> dict:
    """Versions, date, command and the ``device`` the run decodes on: its GPU's name and memory
    (those of the current device were recorded, cuda:0's for ``--device cuda:1``, a GPU's for
    ``--device cpu``)."""
    import datetime
    import importlib.metadata as md
    import platform

    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    env = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "python": platform.python_version(), "command": command,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    for pkg in ("kvbits", "torch", "transformers", "triton"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    if cuda:
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _loop(label: str) -> str:
    """The decode loop part of a variant label: ``kivi-2+graphs+fused`` -> ``+graphs+fused``."""
    return label[label.index("+"):] if "+" in label else ""


def bench_markdown(speed: list[dict], budget_rows: list[dict], env: dict, cfg: BenchConfig) -> str:
    from .memory import markdown_table

    from .report import incomplete_note

    lines = [f"# End-to-end decode: {cfg.model}"
             + (f" ({cfg.layers} layers)" if cfg.layers else "") + ", random weights", "",
             "```", env.get("command", ""), "```", "",
             # (files written after every row: a run stopped early looked whole)
             *([incomplete_note(len(speed) + len(budget_rows), env.get("expected_rows"),
                                "rows"), ""] if env.get("complete") is False else []),
             f"- device: {env.get('device')}; " + ", ".join(
                 f"{k} {env[k]}" for k in ("torch", "transformers", "triton", "kvbits", "python")
                 if k in env) + f"; {env.get('date')}",
             ("- **Random weights** (speed does not depend on them); model shape from the "
             "published config. " + ("FP16 model and activations." if str(cfg.device).startswith(
                 "cuda") else "FP32 model and activations (a CPU smoke test: `+graphs` "
                 "variants run their steps eagerly, nothing is captured).")),
             "- Cache filled with "
             + ("random K/V through each cache's own update path (kvbits: the real quantize+pack "
                "append path); prefill attention not timed" if cfg.fill == "random" else
                "one real prefill forward of random tokens"),
             (f"- Timed: {cfg.steps} decode steps of `generate` after {cfg.warmup} warm-up steps "
              "(and one short untimed run of every variant before the first row); "
             "TPOT = median step time, tok/s = batch / TPOT; peak = max allocated during decode."),
             ("- kvbits store buffers: " + (
                 "**pre-sized** for the final length before the fill, FP16 residual buffer shrunk "
                 "to R + G tokens after it (`--presize`)"
                 if cfg.presize else "`LayerStore`'s own growth policy (grow by 1/8; the FP16 "
                 "residual buffer shrinks to R + G tokens once a prompt's groups are "
                 "quantized). `cache GiB` is what the tokens need, `alloc GiB` what the buffers "
                 "hold")),
             ("- `hf-int*`: transformers' `QuantizedLayer.update` (unchanged) over a PyTorch "
             "re-implementation of quanto's int storage (**emulated**, on every machine: "
             "optimum-quanto is not installed on the GPU machine, so the rows compare alike)."),
             ""]
    # "vs FP16": against the fastest FP16 variant at the same batch and context (it was the first
    # listed: cuDNN's `fp16`, 2.3-2.8x slower than `fp16-flash` in host-bound eager rows, which
    # flattered every ratio); "vs hf": the first hf variant listed
    fp, hf = {}, {}
    for r in speed:
        if "tok_s" in r and r["kind"] == "fp16":
            key = (r["batch"], r["context"])
            if key not in fp or r["tok_s"] > fp[key]["tok_s"]:
                fp[key] = r
        elif "tok_s" in r and r["kind"] == "hf":
            hf.setdefault((r["batch"], r["context"]), r)
    if fp or hf:
        named = lambda d: ", ".join(f"`{v}`" for v in dict.fromkeys(
            r["variant"] for r in d.values()))
        lines.insert(-1, "- vs FP16: tok/s over the fastest FP16 variant at the same batch and "
                     f"context ({named(fp) or 'none measured'}); vs hf: over "
                     f"{named(hf) or 'no hf variant'}.")
    # the control: an FP16 KVBitsCache decoded by the same loop (same +graphs / +fused suffix)
    loop = {(r["batch"], r["context"], _loop(r["variant"])): r for r in speed
            if "tok_s" in r and r["variant"].split("+")[0] == "kvbits-fp16"}
    head = ["variant", "batch", "context", "tok/s", "TPOT ms", "TPOT p90 ms", "vs FP16",
            "vs FP16 same loop", "vs hf", "cache GiB", "alloc GiB", "FP16 cache GiB",
            "peak GiB"]
    rows = []
    for r in speed:
        if "tok_s" not in r:
            rows.append([r["variant"], str(r["batch"]), str(r["context"]), "OOM", *["-"] * 9])
            continue
        key = (r["batch"], r["context"])
        ctl = loop.get((*key, _loop(r["variant"])))
        rows.append([r["variant"], str(r["batch"]), str(r["context"]), f"{r['tok_s']:.1f}",
                     f"{r['tpot_ms']:.2f}", f"{r['tpot_p90_ms']:.2f}",
                     f"{r['tok_s'] / fp[key]['tok_s']:.2f}x" if key in fp else "-",
                     f"{r['tok_s'] / ctl['tok_s']:.2f}x" if ctl else "-",
                     f"{r['tok_s'] / hf[key]['tok_s']:.2f}x" if key in hf else "-",
                     _gib(r["cache_bytes"]), _gib(r.get("cache_alloc_bytes")),
                     _gib(r["fp16_cache_bytes"]), _gib(r.get("peak_bytes"))])
    lines += ["## Decode speed", "", markdown_table(head, rows), ""]
    if budget_rows:
        base = {}  # the FP16 variant that serves the most tokens/s at that context
        for r in budget_rows:
            if r["kind"] == "fp16" and (r["context"] not in base or (
                    r["max_batch"] and r["tok_s"] > (base[r["context"]].get("tok_s") or 0))):
                base[r["context"]] = r
        head = ["variant", "context", "budget GB", "max batch", "vs FP16 batch", "tok/s",
                "vs FP16 tok/s", "TPOT ms", "peak GiB", "tries (batch, peak GiB)"]
        rows = []
        for r in budget_rows:
            b = base.get(r["context"])
            rows.append([r["variant"], str(r["context"]), f"{r['budget_bytes'] / 1e9:.0f}",
                         str(r["max_batch"]) + (" (cap)" if r["max_batch"] == r.get("batch_cap") else ""),
                         f"{r['max_batch'] / b['max_batch']:.2f}x" if b and b["max_batch"] else "-",
                         f"{r['tok_s']:.0f}" if r["max_batch"] else "-",
                         f"{r['tok_s'] / b['tok_s']:.2f}x" if b and b["max_batch"] and r["max_batch"] else "-",
                         f"{r['tpot_ms']:.1f}" if r["max_batch"] else "-", _gib(r.get("peak_bytes")),
                         " ".join(f"({t[0]}, {_gib(t[1])})" for t in r.get("tries", []))])
        lines += ["## Largest batch within a memory budget", "",
                  ("Peak allocated memory during decode (weights + cache + activations) must stay "
                  "within the budget; the batch comes from a linear fit of peak vs batch, checked "
                  "by running it."), "", markdown_table(head, rows), ""]
    return "\n".join(lines)


def plot_bench(speed: list[dict], budget_rows: list[dict], out_dir, name: str, title: str) -> list:
    """``NAME_tokens_per_s.png`` (tok/s vs context at the smallest batch) and, with budget rows,
    ``NAME_max_batch.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in speed if "tok_s" in r]
    if ok:
        b0 = min(r["batch"] for r in ok)
        fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
        for label in dict.fromkeys(r["variant"] for r in ok):
            pts = sorted((r["context"], r["tok_s"]) for r in ok
                         if r["variant"] == label and r["batch"] == b0)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"decode tokens/s (batch {b0})")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        p = Path(out_dir) / f"{name}_tokens_per_s.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    if budget_rows:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), constrained_layout=True)
        contexts = sorted({r["context"] for r in budget_rows})
        labels = list(dict.fromkeys(r["variant"] for r in budget_rows))
        w = 0.8 / max(1, len(contexts))
        for j, c in enumerate(contexts):
            by = {r["variant"]: r for r in budget_rows if r["context"] == c}
            xs = [i + j * w for i in range(len(labels))]
            axes[0].bar(xs, [by[v]["max_batch"] if v in by else 0 for v in labels], w,
                        label=f"ctx {c}")
            axes[1].bar(xs, [by[v].get("tok_s", 0) if v in by and by[v]["max_batch"] else 0
                             for v in labels], w, label=f"ctx {c}")
        for ax, yl in zip(axes, ("max batch", "total tokens/s at max batch")):
            ax.set_xticks([i + w * (len(contexts) - 1) / 2 for i in range(len(labels))], labels,
                          rotation=20)
            ax.set_ylabel(yl)
            ax.legend(fontsize=8)
        budget = budget_rows[0]["budget_bytes"]
        fig.suptitle(f"{title}: memory budget {budget / 1e9:.0f} GB", fontsize=9)
        p = Path(out_dir) / f"{name}_max_batch.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def write_bench(out_dir, name: str, speed: list[dict], budget_rows: list[dict], env: dict,
                cfg: BenchConfig) -> list:
    """``NAME.json``, ``NAME.md`` and the PNG plots in ``out_dir``; ``env["complete"] is False``
    (with ``env["expected_rows"]``) marks the files of a run not finished (kvbits bench writes
    them after every row)."""
    from ..files import write_text_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{name}.json", json.dumps(
        {"env": env, "config": asdict(cfg), "speed": speed, "budget": budget_rows}, indent=1) + "\n")
    write_text_atomic(out / f"{name}.md", bench_markdown(speed, budget_rows, env, cfg))
    title = f"{cfg.model}" + (f" ({cfg.layers} layers)" if cfg.layers else "") + \
        f", random weights, {env.get('device')}"
    return [out / f"{name}.json", out / f"{name}.md",
            *plot_bench(speed, budget_rows, out, name, title)]
