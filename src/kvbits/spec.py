"""QuantSpec: the validated, frozen description of how a KV cache is quantized.

Everything below the spec (formats, reference ops, kernels, the cache store) takes a QuantSpec
and never re-validates it, so every bad value is caught here with an error that names the field
and the allowed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHODS = ("fp16", "kivi", "kvquant")
CODEBOOKS = ("layer", "head")
BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantSpec:
    """How one KV cache is stored.

    Attributes:
        method: "kivi" (asymmetric min-max; keys per-channel over ``group_size`` tokens, values
            per-token over ``group_size`` channels) or "fp16" (nothing quantized).
        key_bits / value_bits: code width of keys and values, one of 2, 3, 4, 8.
        group_size: G, tokens per key group and channels per value group (32, 64 or 128).
            Values use ``gcd(G, head_dim)`` channels when G does not divide the head dimension.
        residual_length: R, the most recent tokens kept in FP16. Keys move to the packed body a
            whole group at a time once more than R + G - 1 tokens wait, so between R and
            R + G - 1 recent tokens are FP16.
        sink_tokens: S, the first tokens of each sequence kept in FP16 (attention sinks).
        pre_rope: store keys *before* the rotary embedding (KVQuant): the cache un-rotates the
            keys it quantizes and attention re-rotates them after dequantizing. The FP16 sink
            and residual keep the model's post-RoPE keys (exact either way).
        outliers: fraction of each token vector (per head, K and V separately) kept in FP16
            outside the dense codes (KVQuant dense-and-sparse), as a fixed count
            ``ceil(outliers * head_dim)`` per vector (1 for head_dim 64 at 0.01); 0 disables.
        codebook: "layer" (one non-uniform codebook per layer, shared by its KV heads) or
            "head" (one per KV head); kvquant only.
        qnorm: match the mean and standard deviation of the dequantized calibration data to the
            original by an affine correction of each codebook (KVQuant's Q-Norm, applied once at
            calibration so it costs nothing at run time); kvquant only.
        fisher: weight the k-means of the codebooks by squared gradients of the loss w.r.t. K
            and V (Fisher information) when calibrating; False weights every element by 1.
    """

    method: str = "kivi"
    key_bits: int = 2
    value_bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    sink_tokens: int = 0
    pre_rope: bool = False
    outliers: float = 0.0
    codebook: str = "layer"
    qnorm: bool = False
    fisher: bool = True

    def __post_init__(self) -> None:
        _check_choice("method", self.method, METHODS)
        _check_choice("key_bits", self.key_bits, BITS)
        _check_choice("value_bits", self.value_bits, BITS)
        _check_choice("group_size", self.group_size, GROUP_SIZES)
        for name in ("residual_length", "sink_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"QuantSpec.{name} must be an integer >= 0, got {value!r}")
        for name in ("pre_rope", "qnorm", "fisher"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantSpec.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        out = self.outliers
        if isinstance(out, bool) or not isinstance(out, (int, float)) or not 0 <= out <= 0.25:
            raise ValueError(f"QuantSpec.outliers must be a fraction in [0, 0.25] of each token "
                             f"vector (e.g. 0.01 for 1%), got {out!r}")
        _check_choice("codebook", self.codebook, CODEBOOKS)
        if self.method != "kvquant":
            for name, default in (("outliers", 0.0), ("codebook", "layer"), ("qnorm", False)):
                if getattr(self, name) != default:
                    raise ValueError(f"QuantSpec.{name} applies to method 'kvquant' only; "
                                     f"method is {self.method!r}")

    @property
    def quantized(self) -> bool:
        """False for the FP16 passthrough: every token then stays in the residual."""
        return self.method != "fp16"

    def n_outliers(self, head_dim: int) -> int:
        """Outliers kept per token vector: ``ceil(outliers * head_dim)`` (0 when disabled)."""
        import math

        return math.ceil(self.outliers * head_dim - 1e-9) if self.outliers > 0 else 0

    @property
    def calibrated(self) -> bool:
        """Whether this spec needs a calibration (codebooks): method "kvquant"."""
        return self.method == "kvquant"

    def value_group(self, head_dim: int) -> int:
        """Channels per value group for this head dimension (a power of two dividing it)."""
        import math

        return math.gcd(self.group_size, head_dim)

    def replace(self, **changes) -> QuantSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        if not self.quantized:
            return "fp16"
        text = (
            f"{self.method} K{self.key_bits}V{self.value_bits} G={self.group_size} "
            f"R={self.residual_length} S={self.sink_tokens}"
        )
        if self.pre_rope:
            text += " pre-RoPE"
        if self.method == "kvquant":
            text += f" out={self.outliers:g} cb={self.codebook}"
            text += (" qnorm" if self.qnorm else "") + ("" if self.fisher else " no-fisher")
        return text


def _check_choice(field: str, value, allowed: tuple) -> None:
    # type() rather than isinstance: True == 1 and 2.0 == 2 must not pass as bit widths.
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(
            f"QuantSpec.{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )


PRESETS: dict[str, QuantSpec] = {
    "fp16": QuantSpec(method="fp16", residual_length=0),
    "kivi-2": QuantSpec(key_bits=2, value_bits=2),
    "kivi-3": QuantSpec(key_bits=3, value_bits=3),
    "kivi-4": QuantSpec(key_bits=4, value_bits=4),
    "kivi-8": QuantSpec(key_bits=8, value_bits=8),
    "k4v2": QuantSpec(key_bits=4, value_bits=2),
    "k8v4": QuantSpec(key_bits=8, value_bits=4),
}
# KVQuant: pre-RoPE keys, Fisher-weighted non-uniform codebooks, 1% outliers per vector; the
# KIVI grouping (keys per channel over G tokens, values per token), residual and sink defaults.
_KVQUANT = QuantSpec(method="kvquant", pre_rope=True, outliers=0.01)
for _b in (2, 3, 4):
    PRESETS[f"kvquant-{_b}"] = _KVQUANT.replace(key_bits=_b, value_bits=_b)
    PRESETS[f"kvquant-{_b}-dense"] = _KVQUANT.replace(key_bits=_b, value_bits=_b, outliers=0.0)
    PRESETS[f"kvquant-{_b}-post"] = _KVQUANT.replace(key_bits=_b, value_bits=_b, pre_rope=False)


def resolve_spec(spec: str | QuantSpec, **overrides) -> QuantSpec:
    """A QuantSpec from a preset name or a spec, with optional field overrides.

    >>> resolve_spec("kivi-2", residual_length=0).residual_length
    0
    """
    if isinstance(spec, QuantSpec):
        base = spec
    elif isinstance(spec, str) and spec in PRESETS:
        base = PRESETS[spec]
    else:
        raise ValueError(f"unknown preset {spec!r}; presets are: {', '.join(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return base.replace(**overrides) if overrides else base
