"""KV-cache memory arithmetic: bytes per token, max context, max batch. No model, no download.

For a model with ``L`` layers, ``H`` KV heads of ``D`` channels:

* FP16 (``DynamicCache``): ``L * 2 * H * D * 2`` bytes per token (K and V, 2 bytes each).
* kvbits: every token that reached the packed body costs
  ``L * H * body_bytes_per_token(D, key_bits, value_bits, G, Gv)`` (codes + FP16 scales and
  zeros, see :func:`kvbits.formats.layout.body_bytes_per_token`). On top of that each sequence
  keeps a *fixed* FP16 part: the ``S`` sink tokens and a residual of between ``R`` and
  ``R + G - 1`` recent tokens (keys move to the body a whole group at a time). This module counts
  the worst case, ``S + R + G - 1`` FP16 tokens per sequence (fewer when the sequence is shorter).

Layers with a sliding window of ``W`` tokens hold at most ``W - 1`` tokens in transformers'
``DynamicCache``; kvbits drops the whole quantized groups no later query can see once they are a
quarter of the live ones (:meth:`kvbits.cache.store.LayerStore.evict`), so such a layer holds at
most :func:`sliding_hold` tokens, about 1.25 windows, while it decodes token by token (an
upper bound, like the FP16 part; a prefill chunk of ``c`` tokens adds up to ``c`` more until the
next eviction).

>>> r = kv_memory("llama-3-8b", "kivi-2", context=131072)
>>> r.fp16_bytes_per_token, r.body_bytes_per_token
(131072, 24576.0)
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from fractions import Fraction

from ..checks import require_count
from ..formats.layout import body_bytes_per_token, fp_bytes_per_token
from ..spec import QuantSpec, resolve_spec

__all__ = [
    "NAMED_CONFIGS",
    "KVShape",
    "MemoryReport",
    "format_bytes",
    "kv_memory",
    "kv_shape",
    "memory_table",
    "parse_bytes",
]


@dataclass(frozen=True)
class KVShape:
    """What the KV cache size depends on, plus the parameter count (for FP16 weight bytes)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: int | None = None  # total parameters, None when unknown
    sliding_layers: int = 0  # layers with a sliding window of ``window`` tokens
    window: int = 0
    # which layers those are (indices; () where not known: then per-layer bits cannot be
    # placed, see :meth:`windows`)
    sliding_at: tuple[int, ...] = ()

    @property
    def sliding(self) -> str:
        """e.g. ``"15 of 18 layers, window 512"`` ('' without sliding layers)."""
        return (f"{self.sliding_layers} of {self.layers} layers, window {self.window}"
                if self.sliding_layers else "")

    def windows(self) -> list[int | None]:
        """Per layer: its sliding window, or None for full attention. Where ``sliding_at`` is
        not known the sliding layers are listed first (right for totals over layers of one
        spec, not for per-layer bits: :func:`kv_memory` refuses those)."""
        if self.sliding_at:
            at = set(self.sliding_at)
            return [self.window if i in at else None for i in range(self.layers)]
        return [self.window] * self.sliding_layers + [None] * (self.layers - self.sliding_layers)


# Published configurations (config.json of each model), written here so that no download is needed.
NAMED_CONFIGS: dict[str, KVShape] = {
    "llama-2-7b": KVShape("llama-2-7b", 32, 32, 128, 6_738_415_616),
    "llama-2-13b": KVShape("llama-2-13b", 40, 40, 128, 13_015_864_320),
    "llama-3-8b": KVShape("llama-3-8b", 32, 8, 128, 8_030_261_248),
    "llama-3-70b": KVShape("llama-3-70b", 80, 8, 128, 70_553_706_496),
    "mistral-7b": KVShape("mistral-7b", 32, 8, 128, 7_241_732_096),
    "smollm2": KVShape("smollm2", 30, 3, 64, 134_515_008),
    "qwen2.5-0.5b": KVShape("qwen2.5-0.5b", 24, 2, 64, 494_032_768),
    "gemma3-270m": KVShape("gemma3-270m", 18, 1, 256, 268_098_176, sliding_layers=15, window=512,
                           sliding_at=tuple(i for i in range(18) if i % 6 != 5)),
}


def kv_shape(config) -> KVShape:
    """A :class:`KVShape` from a name in :data:`NAMED_CONFIGS` or a transformers config object.

    A config object needs ``num_hidden_layers`` and ``num_attention_heads``; ``num_key_value_heads``
    defaults to the attention heads and ``head_dim`` to ``hidden_size // num_attention_heads``.
    """
    if isinstance(config, KVShape):
        return config
    if isinstance(config, str):
        if config not in NAMED_CONFIGS:
            raise ValueError(f"unknown config {config!r}; named configs are: "
                             f"{', '.join(NAMED_CONFIGS)} (or pass a transformers config)")
        return NAMED_CONFIGS[config]
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    try:
        layers = int(config.num_hidden_layers)
        q_heads = int(config.num_attention_heads)
    except AttributeError as exc:
        raise ValueError(f"config {type(config).__name__} lacks {exc.name!r}: need "
                         "num_hidden_layers and num_attention_heads") from None
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // q_heads if q_heads > 0 else 0)
    for what, n in (("num_hidden_layers", layers), ("num_attention_heads", q_heads),
                    ("num_key_value_heads", int(kv_heads)), ("head_dim", int(head_dim))):
        if n < 1:
            raise ValueError(f"config {type(config).__name__}: {what} is {n}; a KV cache needs "
                             "at least one layer, head and channel")
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "config")
    # (the model's layers: a config whose num_hidden_layers was lowered keeps its longer list)
    types = list(getattr(config, "layer_types", None) or [])[:layers]
    window = getattr(config, "sliding_window", None)
    at = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if types else (
        tuple(range(layers)) if window and getattr(config, "use_sliding_window", True) else ())
    if not (at and window):
        at, window = (), 0
    return KVShape(str(name), layers, int(kv_heads), int(head_dim), sliding_layers=len(at),
                   window=int(window), sliding_at=at)


@dataclass
class MemoryReport:
    """KV-cache bytes of one model configuration under one QuantSpec (all layers, K + V).

    ``body_bytes_per_token`` is the marginal cost of a token once in the packed body;
    ``fixed_fp16_tokens`` / ``fixed_fp16_bytes`` the worst-case FP16 sink + residual of one
    sequence. ``total_bytes`` = ``batch`` sequences of ``context`` tokens. ``max_context`` (for
    ``batch``) and ``max_batch`` (for ``context``) use ``gpu_memory - weights_bytes``; they are
    None when no GPU memory is given, or where nothing bounds them (``max_context`` of a model
    whose every layer slides: its cache stops growing).
    """

    config: str
    preset: str
    spec: str
    layers: int
    kv_heads: int
    head_dim: int
    fp16_bytes_per_token: int
    body_bytes_per_token: float
    fixed_fp16_tokens: int
    fixed_fp16_bytes: int
    context: int
    batch: int
    total_bytes: int
    fp16_total_bytes: int
    compression: float
    gpu_memory: int | None = None
    weights_bytes: int = 0
    max_context: int | None = None
    max_batch: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _body_bytes(spec: QuantSpec, head_dim: int) -> float:
    return body_bytes_per_token(head_dim, spec.key_bits, spec.value_bits, spec.group_size,
                                spec.value_group(head_dim), spec.n_outliers(head_dim),
                                spec.key_axis, spec.value_axis, spec.method == "fp8",
                                spec.key_scales == "calibrated")


def kv_memory(config, preset: str | QuantSpec = "kivi-2", context: int = 4096, batch: int = 1,
              gpu_memory: int | None = None, weights_bytes: int = 0,
              **overrides) -> MemoryReport:
    """KV-cache memory of ``batch`` sequences of ``context`` tokens, and what fits on a GPU.

    Args:
        config: a name of :data:`NAMED_CONFIGS` (``"llama-3-8b"``, ...) or a transformers config.
        preset: a preset name or a :class:`QuantSpec`; ``overrides`` replace spec fields.
        context, batch: tokens per sequence and number of sequences.
        gpu_memory: bytes of GPU memory; with it, ``max_context`` and ``max_batch`` are filled in.
        weights_bytes: bytes already taken (model weights, activations) out of ``gpu_memory``.
    """
    shape = kv_shape(config)
    spec = resolve_spec(preset, **overrides)
    for name, value, low in (("context", context, 0), ("batch", batch, 1)):
        require_count(name, value, low)
    if gpu_memory is not None and not 0 < gpu_memory < math.inf:  # (NaN compares false)
        raise ValueError(f"gpu_memory must be a number of bytes > 0, got {gpu_memory!r}")
    if not 0 <= weights_bytes < math.inf:  # (a negative one added room)
        raise ValueError(f"weights_bytes must be a number of bytes >= 0, got {weights_bytes!r}")
    fp_tok = shape.layers * shape.kv_heads * fp_bytes_per_token(shape.head_dim)
    if spec.quantized and spec.per_layer and shape.sliding_layers and not shape.sliding_at:
        raise ValueError(f"config {shape.name}: per-layer bits on a model with sliding-window "
                         "layers need to know which layers slide (KVShape.sliding_at); give "
                         "the transformers config")
    specs = [spec.for_layer(i, shape.layers) for i in range(shape.layers)]
    per_layer = _layer_costs(specs, shape)
    body_tok = float(sum(body for _, body, _, _ in per_layer))  # (FP16 layers at FP16 bytes)
    fixed = _fixed_fp16_tokens(spec) if spec.quantized else 0

    def seq_bytes(tokens: int) -> int:  # one sequence, sliding layers bounded
        return _sequence_bytes(tokens, per_layer)

    report = MemoryReport(
        config=shape.name, preset=preset if isinstance(preset, str) else spec.describe(),
        spec=spec.describe(), layers=shape.layers, kv_heads=shape.kv_heads,
        head_dim=shape.head_dim, fp16_bytes_per_token=fp_tok, body_bytes_per_token=body_tok,
        fixed_fp16_tokens=fixed, fixed_fp16_bytes=fixed * fp_tok, context=context, batch=batch,
        total_bytes=batch * seq_bytes(context),
        fp16_total_bytes=batch * fp16_cache_bytes(shape, context), compression=0.0,
        gpu_memory=gpu_memory, weights_bytes=weights_bytes)
    report.compression = report.fp16_total_bytes / report.total_bytes if report.total_bytes else 1.0
    if gpu_memory is not None:
        free = gpu_memory - weights_bytes
        if free <= 0:
            raise ValueError(f"weights_bytes ({format_bytes(weights_bytes)}) leave no room in "
                             f"gpu_memory ({format_bytes(gpu_memory)})")
        report.max_context = _max_context(free // batch, seq_bytes)
        per_seq = seq_bytes(context)
        report.max_batch = int(free // per_seq) if per_seq else None
    return report


def _fixed_fp16_tokens(spec: QuantSpec) -> int:
    """The worst-case FP16 tokens of a quantized sequence: sink, residual and a group waiting
    (offline key scales, ``key_scales="calibrated"``: their FP16 scale and zero row per
    channel, 4 x head_dim bytes, count as one more token)."""
    return (spec.sink_tokens + spec.residual_length + spec.group_size - 1
            + (spec.key_scales == "calibrated"))


def sliding_hold(window: int, spec: QuantSpec) -> int:
    """At most how many tokens a kvbits layer with a sliding window holds: the visible
    ``window`` plus up to a group, and dead ones until they are a quarter of the live ones
    (``EVICT_RATIO``), plus the FP16 sink and residual."""
    from ..cache.store import EVICT_RATIO  # the store's rule (imported only when needed)

    G = spec.group_size if spec.quantized else 1
    fixed = _fixed_fp16_tokens(spec) if spec.quantized else 0
    live = window + G
    return fixed + G * math.ceil(live * (1 + 1 / EVICT_RATIO) / G)


def fp16_cache_bytes(config, tokens: int) -> int:
    """One sequence of ``tokens`` in an FP16 ``DynamicCache`` of model ``config`` (a name of
    :data:`NAMED_CONFIGS`, a :class:`KVShape` or a transformers config), layer by layer: a
    sliding-window layer keeps at most ``window - 1`` tokens, a full one all of them. A config's
    layers are those :func:`kvbits.integrations.hf.layer_windows` reads (as a ``KVBitsCache``
    builds them: ``layer_types`` up to ``num_hidden_layers``, else ``sliding_window`` for all)."""
    shape = kv_shape(config)
    if isinstance(config, (str, KVShape)):
        windows = shape.windows()
    else:
        from ..integrations.hf import layer_windows

        windows = layer_windows(config.get_text_config(decoder=True)
                                if hasattr(config, "get_text_config") else config)
    held = sum(tokens if w is None else min(tokens, max(w - 1, 0)) for w in windows)
    return held * shape.kv_heads * fp_bytes_per_token(shape.head_dim)


def _layer_costs(specs: list[QuantSpec], shape: KVShape) -> list[tuple]:
    """Per layer of ``shape`` (its spec in ``specs``): ``(FP16 bytes per token, body bytes per
    token, worst-case FP16 tokens, most tokens held: None, or :func:`sliding_hold` in a
    sliding-window layer)``, all KV heads. Layer by layer, so that per-layer bits and FP16
    layers grow where they are: a full layer grows with the context, a sliding one does not
    (an average over all layers put the full layers' bits in the sliding ones)."""
    fp = shape.kv_heads * fp_bytes_per_token(shape.head_dim)
    out = []
    for s, window in zip(specs, shape.windows()):
        body = Fraction(shape.kv_heads * _body_bytes(s, shape.head_dim)) if s.quantized else fp
        fixed = _fixed_fp16_tokens(s) if s.quantized else 0
        out.append((fp, body, fixed, None if window is None else sliding_hold(window, s)))
    return out


def _sequence_bytes(tokens: int, layers: list[tuple]) -> int:
    """Worst-case bytes of one sequence, summed over ``layers`` (:func:`_layer_costs`): up to a
    layer's fixed FP16 tokens, the rest in its body; a sliding layer holding at most its
    :func:`sliding_hold` tokens. In exact arithmetic (in floats, contexts past 2^53 bytes were
    rounded, and past 10^308 an OverflowError)."""
    total = Fraction(0)
    for fp, body, fixed, hold in layers:
        n = tokens if hold is None else min(tokens, hold)
        n_fp = min(n, fixed)
        total += n_fp * fp + (n - n_fp) * body
    return math.ceil(total)


_CONTEXT_CAP = 1 << 40  # where the search starts; doubled while a longer context still fits


def _max_context(budget: int, seq_bytes) -> int | None:
    """Largest token count whose ``seq_bytes`` (non-decreasing) fits in ``budget`` bytes; None
    where no count is too long (a model whose every layer slides: its bytes stop growing)."""
    hi = _CONTEXT_CAP
    while seq_bytes(hi) <= budget:  # (it said 2^40 here, silently)
        if seq_bytes(2 * hi) == seq_bytes(hi):  # past the windows: no longer growing
            return None
        hi *= 2
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if seq_bytes(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------------------ units and tables
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` or ``"80G"`` -> 80 * 2**30, ``"1.5e9"`` -> 1500000000.

    GB/MB/KB/TB are decimal (SI), GiB/G and friends binary.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use a number with an optional unit "
                         "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB, K, M, G, T "
                         "(powers of 1024), e.g. 80GB")
    size = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise ValueError(f"cannot read {text!r} as a size: too large")
    return int(size)


def format_bytes(n: float) -> str:
    """``131072`` -> ``"128.0 KiB"``."""
    if isinstance(n, int) and abs(n) >= 1 << 1000:  # past a float (OverflowError): in integers
        tenths = (abs(n) * 10 + (1 << 39)) >> 40
        return f"{'-' if n < 0 else ''}{tenths // 10:,}.{tenths % 10} TiB"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def memory_table(reports: list[MemoryReport]) -> str:
    """A Markdown table of several reports (one row each)."""
    has_gpu = any(r.gpu_memory is not None for r in reports)
    head = ["config", "preset", "spec", "bytes/token (body)", "FP16 bytes/token",
            "fixed FP16/seq", "KV total", "vs FP16"]
    if has_gpu:
        head += ["max context", "max batch"]
    rows = []
    for r in reports:
        row = [r.config, r.preset, r.spec, f"{r.body_bytes_per_token:,.0f}",
               f"{r.fp16_bytes_per_token:,}",
               f"{r.fixed_fp16_tokens} tok = {format_bytes(r.fixed_fp16_bytes)}",
               f"{format_bytes(r.total_bytes)} ({r.batch} x {r.context:,} tok)",
               f"{r.compression:.2f}x"]
        if has_gpu:
            unbounded = "-" if r.gpu_memory is None else "no limit"
            row += [f"{r.max_context:,}" if r.max_context is not None else unbounded,
                    f"{r.max_batch:,}" if r.max_batch is not None else unbounded]
        rows.append(row)
    return markdown_table(head, rows)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table with padded columns."""
    cells = [head] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in cells[1:]])
