"""QuantSpec: the validated, frozen description of how a KV cache is quantized.

Everything below the spec (formats, reference ops, kernels, the cache store) takes a QuantSpec
and never re-validates it, so every bad value is caught here with an error that names the field
and the allowed values.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

METHODS = ("fp16", "kivi", "kvquant", "uniform", "fp8")
CODEBOOKS = ("layer", "head")
KEY_SCALES = ("group", "calibrated")
AXES = ("channel", "token")
FP8_SCALES = ("dynamic", "calibrated")
FP8_GRANULARITIES = ("head", "tensor")
# transformers' QuantizedCache (quanto) axis numbers -> kvbits axes: axis 0 groups consecutive
# channels of one token (per-token), axis -1 consecutive tokens of one channel (per-channel).
# The hqq backend numbers them otherwise: its per-token axis is 1 (refused here, the error says
# to pass 0), and its axis 0 (one channel, every (B*H*T / q_group_size)-th row of the flattened
# tensor, across heads) has no kvbits counterpart.
HF_AXES = {0: "token", -1: "channel"}
# Ranges QuantSpec takes, named once for its checks and the spec-string parser's errors: FP16
# tokens per sequence and KV head (residual_length, sink_tokens), and the outlier fraction.
FP16_TOKENS_TEXT = "in [0, 2**20)"
OUTLIERS_TEXT = "a fraction in [0, 0.25]"
# Methods whose per-layer bits / FP16 skip list (layer_bits, skip_layers) may be set.
PER_LAYER_METHODS = ("kivi", "uniform")
BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)
SPEC_FILE_VERSION = 1  # "kvbits_spec" of the files QuantSpec.save writes and load reads


@dataclass(frozen=True)
class QuantSpec:
    """How one KV cache is stored.

    Attributes:
        method: "kivi" (asymmetric min-max; keys per-channel over ``group_size`` tokens, values
            per-token over ``group_size`` channels), "uniform" (the same min-max with the axis
            of keys and of values chosen by ``key_axis`` / ``value_axis``: transformers'
            ``QuantizedCache`` knobs), "fp8" (float8 e4m3 elements times one float32 scale per
            head; ``fp8_scale``, ``fp8_granularity``), "kvquant" or "fp16" (nothing quantized).
        key_bits / value_bits: code width of keys and values, one of 2, 3, 4, 8.
        group_size: G, tokens per key group and channels per value group (32, 64 or 128).
            Where G does not divide the head dimension, values use :meth:`value_group`
            channels (head_dim 100 at G = 32: groups of 32, 32, 32 and 4).
        residual_length: R, the most recent tokens kept in FP16. Keys and values move to the
            packed body a whole group of G tokens at a time once more than R + G - 1 tokens
            wait, so between R and R + G - 1 recent tokens are FP16, the prompt's included
            (transformers' ``QuantizedCache`` quantizes the whole prompt and keeps 0 to R - 1
            new tokens; KIVI's code fewer than R keys and exactly R values).
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
        key_scales: "group" (an FP16 scale and zero per channel per group of G tokens, from
            the group's min/max, as KIVI) or "calibrated" (one FP16 scale and zero per layer,
            KV head and channel, fitted offline on the calibration text, as the KVQuant paper:
            no per-group key metadata, ~1 bit per key element less at G = 32; codes saturate at
            the codebook's ends and the outliers take the largest errors); kvquant only.
        key_axis / value_axis: "channel" (scale/zero per channel over a group of G tokens) or
            "token" (scale/zero per token over a group of ``value_group(D)`` channels); kivi is
            keys "channel", values "token"; "uniform" takes either for each (transformers'
            ``axis_key`` / ``axis_value`` as the quanto backend numbers them: 0 = "token",
            -1 = "channel"; hqq's per-token axis is 1).
        hadamard: rotate keys (and queries, right before attention) by a fixed normalized
            Hadamard matrix per head before quantizing (outlier smoothing; scores unchanged).
            Block-diagonal over the largest power-of-two blocks when head_dim is not a power
            of two. Methods kivi, uniform and fp8.
        hadamard_calibrated: with ``hadamard``, rotate per layer and KV head only the channel
            subset (a power-of-two count, possibly none) that a short calibration text says
            lowers the query-weighted key quantization error (:mod:`kvbits.methods.hadamard`).
            A full rotation spreads every key channel's range over all channels; that pays
            when queries weigh the wide channels and hurts when they weigh the narrow ones
            (Qwen2.5's first layer: 8x the score error of plain KIVI). Methods kivi, uniform.
        fp8_scale: "dynamic" (the scale of each sequence and head is set from the amax of its
            first quantized tokens, the prompt) or "calibrated" (per layer from calibration
            text); method "fp8" only.
        fp8_granularity: "head" (one scale per KV head) or "tensor" (one per layer).
        layer_bits: per-layer ``(layer, key_bits, value_bits)`` overriding key_bits/value_bits
            for that layer (negative layer indices count from the end: -1 = last layer).
        skip_layers: layers kept in FP16 (negative indices count from the end).
        model_layers: the depth ``layer_bits`` / ``skip_layers`` were chosen for (``kvbits
            tune`` sets it); a model of another depth is refused. 0: any depth.
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
    key_scales: str = "group"
    key_axis: str = "channel"
    value_axis: str = "token"
    hadamard: bool = False
    hadamard_calibrated: bool = False
    fp8_scale: str = "dynamic"
    fp8_granularity: str = "head"
    layer_bits: tuple = ()
    skip_layers: tuple = ()
    model_layers: int = 0

    def __post_init__(self) -> None:
        _check_choice("method", self.method, METHODS)
        _check_choice("key_bits", self.key_bits, BITS)
        _check_choice("value_bits", self.value_bits, BITS)
        _check_choice("group_size", self.group_size, GROUP_SIZES)
        for name in ("residual_length", "sink_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**20:
                raise ValueError(f"QuantSpec.{name} must be an integer {FP16_TOKENS_TEXT} (FP16 "
                                 f"tokens per sequence and KV head), got {value!r}")
        for name in ("pre_rope", "qnorm", "fisher", "hadamard", "hadamard_calibrated"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvbits)
                    f"QuantSpec.{name} must be True or False, got {getattr(self, name)!r}")
        out = self.outliers
        if isinstance(out, bool) or not isinstance(out, (int, float)) or not 0 <= out <= 0.25:
            raise ValueError(f"QuantSpec.outliers must be {OUTLIERS_TEXT} of each token "
                             f"vector (e.g. 0.01 for 1%), got {out!r}")
        _check_choice("codebook", self.codebook, CODEBOOKS)
        _check_choice("key_scales", self.key_scales, KEY_SCALES)
        if self.method != "kvquant":
            for name, default in (("outliers", 0.0), ("codebook", "layer"), ("qnorm", False),
                                  ("fisher", True), ("key_scales", "group")):
                if getattr(self, name) != default:
                    raise ValueError(f"QuantSpec.{name} applies to method 'kvquant' only; "
                                     f"method is {self.method!r}")
        self._check_breadth()

    def _check_breadth(self) -> None:
        """Fields of the uniform / fp8 / Hadamard / per-layer methods."""
        _check_choice("key_axis", self.key_axis, AXES)
        _check_choice("value_axis", self.value_axis, AXES)
        _check_choice("fp8_scale", self.fp8_scale, FP8_SCALES)
        _check_choice("fp8_granularity", self.fp8_granularity, FP8_GRANULARITIES)
        if self.method != "uniform" and (self.key_axis, self.value_axis) != ("channel", "token"):
            raise ValueError(
                f"QuantSpec.key_axis / value_axis other than 'channel' / 'token' (KIVI's) need "
                f"method 'uniform'; method is {self.method!r} (key_axis={self.key_axis!r}, "
                f"value_axis={self.value_axis!r})")
        if self.method != "fp8" and (self.fp8_scale, self.fp8_granularity) != ("dynamic", "head"):
            raise ValueError(f"QuantSpec.fp8_scale / fp8_granularity apply to method 'fp8' only; "
                             f"method is {self.method!r}")
        if self.method == "fp8" and (self.key_bits, self.value_bits) != (8, 8):
            raise ValueError(f"QuantSpec.key_bits / value_bits must be 8 for method 'fp8' "
                             f"(float8 e4m3); got {self.key_bits} / {self.value_bits}")
        if self.hadamard and self.method not in ("kivi", "uniform", "fp8"):
            raise ValueError(f"QuantSpec.hadamard applies to methods 'kivi', 'uniform', 'fp8'; "
                             f"method is {self.method!r}")
        if self.hadamard_calibrated and not (self.hadamard
                                             and self.method in ("kivi", "uniform")):
            raise ValueError("QuantSpec.hadamard_calibrated needs hadamard=True and method 'kivi' "
                             f"or 'uniform' (hadamard={self.hadamard}, method={self.method!r})")
        if self.method in ("fp8", "fp16") and self.pre_rope:
            raise ValueError("QuantSpec.pre_rope applies to methods 'kivi', 'uniform', 'kvquant' "
                             "(their key scales follow pre-RoPE channels); method 'fp8' keeps "
                             "one scale per head and its keys post-RoPE, method 'fp16' "
                             f"quantizes nothing (method is {self.method!r})")
        if self.hadamard and self.pre_rope:
            raise ValueError("QuantSpec.hadamard cannot be combined with pre_rope=True (the "
                             "rotation would not commute with re-applying RoPE)")
        if not isinstance(self.layer_bits, tuple) or not isinstance(self.skip_layers, tuple):
            raise ValueError(  # noqa: TRY004 (as above)
                "QuantSpec.layer_bits and skip_layers must be tuples, got "
                f"{self.layer_bits!r} / {self.skip_layers!r}")
        if (self.layer_bits or self.skip_layers) and self.method not in PER_LAYER_METHODS:
            raise ValueError(f"QuantSpec.layer_bits / skip_layers apply to methods "
                             f"{', '.join(map(repr, PER_LAYER_METHODS))}; method is "
                             f"{self.method!r}")
        for entry in self.layer_bits:
            ok = (isinstance(entry, tuple) and len(entry) == 3
                  and all(type(x) is int for x in entry))
            if not ok:
                raise ValueError("QuantSpec.layer_bits entries must be (layer, key_bits, "
                                 f"value_bits) integer triples; got {entry!r}")
            for name, bits in (("key_bits", entry[1]), ("value_bits", entry[2])):
                if bits not in BITS:
                    raise ValueError(f"QuantSpec.layer_bits: {name} of layer {entry[0]} must be "
                                     f"one of {', '.join(map(repr, BITS))}; got {bits!r}")
        if type(self.model_layers) is not int or self.model_layers < 0:
            raise ValueError("QuantSpec.model_layers must be an integer >= 0 (0: any depth), got "
                             f"{self.model_layers!r}")
        for layer in self.skip_layers:
            if type(layer) is not int:
                raise ValueError(f"QuantSpec.skip_layers entries must be layer indices "
                                 f"(integers); got {layer!r}")

    @property
    def per_layer(self) -> bool:
        """Whether layers differ (``layer_bits`` or ``skip_layers`` set)."""
        return bool(self.layer_bits or self.skip_layers)

    def for_layer(self, index: int, n_layers: int) -> QuantSpec:
        """The plain spec of layer ``index`` of ``n_layers``: its bits, FP16 if skipped.

        Raises ``ValueError`` when ``layer_bits`` / ``skip_layers`` name a layer out of range.
        """
        self.check_layers(n_layers)
        if not self.per_layer:
            return self
        skip = {i % n_layers for i in self.skip_layers}
        if index in skip:
            return PRESETS["fp16"]
        kb, vb = self.key_bits, self.value_bits
        for layer, k, v in self.layer_bits:
            if layer % n_layers == index:
                kb, vb = k, v
        return self.replace(key_bits=kb, value_bits=vb, layer_bits=(), skip_layers=(),
                            model_layers=0)

    def check_layers(self, n_layers: int) -> None:
        """Every layer named is in range, and given one setting: in ``layer_bits`` or in
        ``skip_layers`` (``-1`` and ``n_layers - 1`` are the same layer), for a model of the
        depth they were chosen for (``model_layers``)."""
        if self.model_layers and n_layers != self.model_layers:
            raise ValueError(f"QuantSpec: these per-layer bits were chosen for a model with "
                             f"{self.model_layers} layers (model_layers), this one has {n_layers}: "
                             "run kvbits tune for it (its other layers would silently keep the "
                             "base bits)")
        named = [e[0] for e in self.layer_bits] + list(self.skip_layers)
        for layer in named:
            if not -n_layers <= layer < n_layers:
                raise ValueError(f"QuantSpec.layer_bits / skip_layers: layer {layer} is out of "
                                 f"range for a model with {n_layers} layers (allowed "
                                 f"{-n_layers} .. {n_layers - 1}); a spec tuned for another "
                                 "model names that model's layers")
        # the same layer named twice with the same setting is harmless (k4v2-edge8's first and
        # last layer on a one-layer model); two different settings for it are refused
        settings = [(e[0], ("bits", e[1], e[2])) for e in self.layer_bits] \
            + [(layer, ("fp16",)) for layer in self.skip_layers]
        seen: dict = {}
        for layer, setting in settings:
            first = seen.get(layer % n_layers)
            if first is not None and first[1] != setting:
                raise ValueError(f"QuantSpec.layer_bits / skip_layers: layer {layer} is named "
                                 f"twice (as {first[0]} too), with different settings, for a "
                                 f"model with {n_layers} layers; name each layer once")
            seen.setdefault(layer % n_layers, (layer, setting))

    def average_bits(self, n_layers: int) -> float:
        """Mean code bits per K/V element over the layers (FP16 layers count 16)."""
        total = 0
        for i in range(n_layers):
            s = self.for_layer(i, n_layers)
            total += 32 if not s.quantized else s.key_bits + s.value_bits
        return total / (2 * n_layers)

    def to_dict(self) -> dict:
        """JSON-able fields (tuples as lists)."""
        out = dataclasses.asdict(self)
        out["layer_bits"] = [list(e) for e in self.layer_bits]
        out["skip_layers"] = list(self.skip_layers)
        return out

    @classmethod
    def from_dict(cls, fields: dict) -> QuantSpec:
        if not isinstance(fields, dict):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvbits)
                f"a QuantSpec is read from a dict of its fields, got {fields!r}")
        fields = dict(fields)
        _check_field_names(fields, "field(s)")
        lists = (list, tuple)
        if "layer_bits" in fields:
            lb = fields["layer_bits"]
            if not isinstance(lb, lists) or not all(isinstance(e, lists) for e in lb):
                raise ValueError("QuantSpec.layer_bits must be a list of [layer, key_bits, "
                                 f"value_bits] triples; got {lb!r}")
            fields["layer_bits"] = tuple(tuple(e) for e in lb)
        if "skip_layers" in fields:
            if not isinstance(fields["skip_layers"], lists):
                raise ValueError("QuantSpec.skip_layers must be a list of layer indices; got "
                                 f"{fields['skip_layers']!r}")
            fields["skip_layers"] = tuple(fields["skip_layers"])
        return cls(**fields)

    def save(self, path, **info) -> None:
        """Write a spec file (JSON) that ``resolve_spec(path)`` / ``KVBitsCache(model, path)``
        read back; ``info`` (e.g. how it was tuned) is stored beside it."""
        import json
        from pathlib import Path

        from .files import write_text_atomic

        doc = {"kvbits_spec": SPEC_FILE_VERSION, "spec": self.to_dict(),
               **({"info": info} if info else {})}
        try:
            text = json.dumps(doc, indent=1) + "\n"
        except (TypeError, ValueError) as exc:  # (was json's bare "not JSON serializable")
            raise TypeError(f"QuantSpec.save: the info keywords must be JSON-able ({exc})") \
                from None
        path = Path(path)
        if path.is_dir():  # (was a bare IsADirectoryError)
            raise ValueError(f"QuantSpec.save: path {str(path)!r} is a folder; give a file name, "
                             f"e.g. {str(path / 'spec.json')!r}")
        # through a temporary file renamed over the name: a run stopped mid-write (Ctrl-C, a
        # full disk) left a cut file that a later run refused, over the good one saved before
        write_text_atomic(path, text)

    @classmethod
    def load(cls, path) -> QuantSpec:
        """Read a spec file written by :meth:`save` (e.g. by ``kvbits tune``)."""
        import json
        from pathlib import Path

        def unique(pairs):  # a key given twice kept the last value, silently
            keys = [k for k, _ in pairs]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"{', '.join(map(repr, twice))} given twice in one object")
            return dict(pairs)
        try:  # (utf-8-sig: an editor's byte-order mark is no error)
            doc = json.loads(Path(path).read_text(encoding="utf-8-sig"),
                             object_pairs_hook=unique)
        except (OSError, ValueError) as exc:  # (JSON's, a duplicate key, UnicodeDecodeError:
            # a binary file was the codec's bare error, naming no file)
            raise ValueError(f"cannot read spec file {str(path)!r}: {exc}") from None
        if not isinstance(doc, dict) or "spec" not in doc:
            raise ValueError(f"{str(path)!r} is not a kvbits spec file (no 'spec' key)")
        version = doc.get("kvbits_spec", SPEC_FILE_VERSION)
        if type(version) is not int or version != SPEC_FILE_VERSION:
            # a later format would be read as this one, its new meaning silently lost
            raise ValueError(f"spec file {str(path)!r} has format kvbits_spec={version!r}; this "
                             f"kvbits reads format {SPEC_FILE_VERSION} (write it again with this "
                             "version, e.g. kvbits tune)")
        try:
            return cls.from_dict(doc["spec"])
        except ValueError as exc:  # (the field's error named no file)
            raise ValueError(f"spec file {str(path)!r}: {exc}") from None

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
        """Whether this spec needs a calibration: method "kvquant" (codebooks) or "fp8" with
        ``fp8_scale="calibrated"`` (scales)."""
        return self.method == "kvquant" or (self.method == "fp8" and self.fp8_scale == "calibrated")

    def value_group(self, head_dim: int) -> int:
        """Channels per per-token scale group (values; keys with ``key_axis="token"``).

        ``gcd(G, head_dim)`` when that divisor is at least ``min(G, head_dim, 32)`` (every
        head_dim that is a multiple of 32 or of G: whole groups); otherwise ``min(G, head_dim)``
        with a shorter last group (head_dim 100 at G = 32: groups of 32, 32, 32 and 4 channels,
        where the divisor would be 4 channels and cost one FP16 scale and zero per 4 values)."""
        import math

        g = math.gcd(self.group_size, head_dim)
        return g if g >= min(self.group_size, head_dim, 32) else min(self.group_size, head_dim)

    def value_groups(self, head_dim: int) -> int:
        """Per-token scale groups per vector: ``ceil(head_dim / value_group(head_dim))``."""
        return -(-head_dim // self.value_group(head_dim))

    def replace(self, **changes) -> QuantSpec:
        """A copy with some fields changed (validated again); an unknown field is refused with
        the list of fields (``dataclasses.replace`` gives a bare TypeError)."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise ValueError(f"QuantSpec.replace: unknown field(s) {', '.join(unknown)}; "
                             f"fields: {', '.join(names)}")
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
            text += " keys=calibrated" if self.key_scales == "calibrated" else ""
        if self.method == "uniform":
            text += f" K:{self.key_axis} V:{self.value_axis}"
        if self.method == "fp8":
            text = (f"fp8 e4m3 {self.fp8_scale} per-{self.fp8_granularity} "
                    f"G={self.group_size} R={self.residual_length} S={self.sink_tokens}")
        if self.hadamard:
            text += " hadamard" + ("-calibrated" if self.hadamard_calibrated else "")
        if self.layer_bits:
            text += " layers=" + ";".join(f"{i}:K{k}V{v}" for i, k, v in self.layer_bits)
        if self.skip_layers:
            text += " fp16-layers=" + ",".join(map(str, self.skip_layers))
        if self.model_layers:
            text += f" ({self.model_layers}-layer model)"
        return text


def _check_field_names(fields: dict, what: str, also: str = "") -> None:
    """Refuse names that are not QuantSpec fields (a bare TypeError from ``__init__`` otherwise)."""
    known = {f.name for f in dataclasses.fields(QuantSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown QuantSpec {what} {', '.join(map(str, unknown))}; fields are "
                         f"{', '.join(sorted(known))}{also}")


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
# KVQuant: pre-RoPE keys, Fisher-weighted non-uniform codebooks, 1% outliers per vector, the
# first token kept in FP16 (attention sink, S=1: chosen by measurement in
# benchmarks/results/ppl_kvquant_sinks.md; kvquant-2 on SmolLM2 +3.92% -> +1.45% vs FP16, more
# FP16 recent tokens at the same bytes do not help, S=4/16 are not consistently better); the KIVI
# grouping (keys per channel over G tokens, values per token) and residual.
_KVQUANT = QuantSpec(method="kvquant", pre_rope=True, outliers=0.01, sink_tokens=1)
for _b in (2, 3, 4):
    PRESETS[f"kvquant-{_b}"] = _KVQUANT.replace(key_bits=_b, value_bits=_b)
    PRESETS[f"kvquant-{_b}-dense"] = _KVQUANT.replace(key_bits=_b, value_bits=_b, outliers=0.0)
    PRESETS[f"kvquant-{_b}-post"] = _KVQUANT.replace(key_bits=_b, value_bits=_b, pre_rope=False)
    # codebooks only (no outliers, post-RoPE keys): at 3 bits the layers the Gluon body serves
    PRESETS[f"kvquant-{_b}-dense-post"] = _KVQUANT.replace(key_bits=_b, value_bits=_b,
                                                           outliers=0.0, pre_rope=False)
    # key scales fitted offline per channel (the paper's): ~1 bit per key element less at G=32
    PRESETS[f"kvquant-{_b}-offline"] = _KVQUANT.replace(key_bits=_b, value_bits=_b,
                                                        key_scales="calibrated")

# Uniform: transformers' QuantizedCache knobs and defaults (quanto backend: nbits 4, axis_key 0,
# axis_value 0 = per-token, q_group_size 64, residual_length 128); history quantized once.
PRESETS["uniform"] = QuantSpec(method="uniform", key_bits=4, value_bits=4, group_size=64,
                               residual_length=128, key_axis="token", value_axis="token")
for _b in (2, 4, 8):
    PRESETS[f"uniform-int{_b}"] = PRESETS["uniform"].replace(key_bits=_b, value_bits=_b)
# Hadamard-rotated keys (KIVI grouping otherwise).
for _b in (2, 3, 4):
    PRESETS[f"kivi-{_b}-had"] = PRESETS[f"kivi-{_b}"].replace(hadamard=True)
# Hadamard over the channel subsets a calibration picks per layer and KV head (none where a
# rotation does not lower the key error): see kvbits.methods.hadamard.
for _b in (2, 3, 4):
    PRESETS[f"kivi-{_b}-hadc"] = PRESETS[f"kivi-{_b}-had"].replace(hadamard_calibrated=True)
# FP8 (e4m3): every token but the residual's stored in 8 bits, one float32 scale per head.
PRESETS["fp8"] = QuantSpec(method="fp8", key_bits=8, value_bits=8, residual_length=0,
                           fp8_scale="calibrated")
PRESETS["fp8-dynamic"] = PRESETS["fp8"].replace(fp8_scale="dynamic")
PRESETS["fp8-tensor"] = PRESETS["fp8"].replace(fp8_granularity="tensor")
# Per-layer mixed precision: keys 4 / values 2, first and last layers at 8 bits.
PRESETS["k4v2-edge8"] = PRESETS["k4v2"].replace(layer_bits=((0, 8, 8), (-1, 8, 8)))


# Short names of the fields a spec string overrides (``"kivi-2:G=64,R=0"``), and the fields it may
# override (``bits``: key_bits and value_bits; transformers' names too, see resolve_spec).
SPEC_ALIASES = {"R": "residual_length", "G": "group_size", "S": "sink_tokens", "K": "key_bits",
                "V": "value_bits", "O": "outliers", "P": "pre_rope"}
SPEC_FIELDS = ("key_bits", "value_bits", "group_size", "residual_length", "sink_tokens", "bits",
               "pre_rope", "outliers", "codebook", "qnorm", "fisher", "key_scales", "hadamard",
               "hadamard_calibrated", "key_axis", "value_axis", "fp8_scale", "fp8_granularity",
               "nbits", "axis_key", "axis_value", "q_group_size")
# Names that set the same field: a spec string may give only one of each.
_SYNONYMS = {"nbits": "bits", "q_group_size": "group_size", "axis_key": "key_axis",
             "axis_value": "value_axis"}
_BOOL_FIELDS = ("pre_rope", "qnorm", "fisher", "hadamard", "hadamard_calibrated")
_FLOAT_FIELDS = ("outliers",)
_STR_FIELDS = ("codebook", "key_scales", "key_axis", "value_axis", "fp8_scale", "fp8_granularity")
# How a number is written in a spec string: ASCII decimal digits, a '-' allowed so that a
# negative value meets the field's own range check (axis_key=-1 takes one). (int() and float()
# also took '+64', '6_4' and non-ASCII digits as 64, float() 'inf' and 'nan': a QA pass.)
_INT_TEXT = re.compile(r"-?[0-9]+")
_FLOAT_TEXT = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
# the allowed values a number field's parse error names (group sizes only for kvbits' own
# field: --hf-quantized's q_group_size takes others)
_BITS_TEXT, _GROUPS_TEXT = (f"one of {', '.join(map(str, t))}" for t in (BITS, GROUP_SIZES))
_NUMBER_VALUES = {"key_bits": _BITS_TEXT, "value_bits": _BITS_TEXT, "bits": _BITS_TEXT,
                  "nbits": _BITS_TEXT, "group_size": _GROUPS_TEXT,
                  "residual_length": FP16_TOKENS_TEXT, "sink_tokens": FP16_TOKENS_TEXT,
                  "outliers": f"{OUTLIERS_TEXT}, e.g. 0.01"}


def parse_overrides(label: str, text: str, aliases: dict = SPEC_ALIASES,
                    allowed: tuple = SPEC_FIELDS, option: str = "spec") -> dict:
    """``"G=64,R=0"`` -> ``{"group_size": 64, "residual_length": 0}``, typed per field
    (``bits`` -> key_bits and value_bits). ``label``/``option`` name the text in errors.

    >>> parse_overrides("kivi-2:G=64,bits=3", "G=64,bits=3")
    {'group_size': 64, 'key_bits': 3, 'value_bits': 3}
    """
    if isinstance(label, str) and label.rstrip().endswith(":"):  # ran as the bare preset,
        # under a label ('kivi-2:') that tables and files then carried
        raise ValueError(f"{option}: {label!r} ends in ':' with no overrides after it; give "
                         "FIELD=VALUE pairs (e.g. 'kivi-2:G=64') or drop the ':'")
    if text.strip() and not any(p.strip() for p in text.split(",")):  # (the same, 'kivi-2:,')
        raise ValueError(f"{option}: {label!r} has no overrides after its ':', only commas; give "
                         "FIELD=VALUE pairs (e.g. 'kivi-2:G=64') or drop the ':'")
    out = {}
    given: dict = {}  # field (or its synonym group) -> the pair that set it
    for pair in filter(None, text.split(",")):
        name, eq, value = pair.partition("=")
        name = aliases.get(name.strip(), name.strip())
        if not eq or name not in allowed:
            raise ValueError(f"{option}: bad override {pair!r} in {label!r}; use FIELD=VALUE with "
                             f"FIELD one of {', '.join(allowed)} (or {', '.join(aliases)})")
        # a field set twice (G=64,G=128; residual_length=64,R=32; bits=4,nbits=2) kept only
        # one of the values, silently
        key = _SYNONYMS.get(name, name)
        if key in given:
            raise ValueError(f"{option}: {label!r} sets {key} twice ({given[key]!r} and "
                             f"{pair.strip()!r}); give each field once")
        given[key] = pair.strip()
        value = value.strip()
        if name in _BOOL_FIELDS:
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{option}: {name} in {label!r} must be 0/1/true/false, "
                                 f"got {value!r}")
            out[name] = value.lower() in ("1", "true")
        elif name in _STR_FIELDS:
            out[name] = value
        else:
            is_float = name in _FLOAT_FIELDS
            if not (_FLOAT_TEXT if is_float else _INT_TEXT).fullmatch(value):
                kind = "a number in plain decimal" if is_float else \
                    "an integer in plain decimal digits"
                values = f" ({_NUMBER_VALUES[name]})" if name in _NUMBER_VALUES else ""
                raise ValueError(f"{option}: {name} in {label!r} must be {kind}{values}, got "
                                 f"{value!r}")
            # (+ 0.0: '-0' was kept as -0.0, another label and calibration cache key than 0)
            out[name] = float(value) + 0.0 if is_float else int(value)
    if "bits" in out:
        bits = out.pop("bits")
        out.setdefault("key_bits", bits)
        out.setdefault("value_bits", bits)
    return out


def resolve_spec(spec, **overrides) -> QuantSpec:
    """A QuantSpec from a preset name, a spec string (a preset or ``.json`` file and
    ``:FIELD=VALUE,...`` overrides, as the CLI's ``--presets`` take them), a spec file
    (``.json``, e.g. from ``kvbits tune``) or a spec, with optional field overrides (which win
    over the string's).

    transformers' ``QuantizedCache`` names are accepted too: ``nbits`` (key_bits and
    value_bits), ``q_group_size`` (group_size), ``axis_key`` / ``axis_value`` (0: per-token,
    -1: per-channel, as with the quanto backend; the hqq backend's per-token axis is 1, which
    is refused with that advice).

    >>> resolve_spec("kivi-2", residual_length=0).residual_length
    0
    >>> resolve_spec("kivi-3:S=1,G=64").describe()
    'kivi K3V3 G=64 R=128 S=1'
    >>> resolve_spec("uniform", nbits=2, axis_key=-1).key_axis
    'channel'
    """
    import os

    # transformers' names become fields in each source first, so that a keyword wins over the
    # string's field whichever name either used
    overrides = hf_field_names({k: v for k, v in overrides.items() if v is not None})
    written: dict = {}  # the fields the string itself sets ('fp16:R=3')
    if isinstance(spec, str) and ":" in spec:
        name, _, rest = spec.partition(":")
        if name in PRESETS or name.endswith(".json"):
            written = hf_field_names(parse_overrides(spec, rest))
            overrides = {**written, **overrides}
            spec = name
    if isinstance(spec, QuantSpec):
        base = spec
    elif isinstance(spec, str) and spec in PRESETS:
        base = PRESETS[spec]
    elif isinstance(spec, (str, os.PathLike)) and str(spec).endswith(".json"):
        if not os.path.exists(spec):
            raise ValueError(f"spec file {str(spec)!r} does not exist")
        base = QuantSpec.load(spec)
    else:
        raise ValueError(f"unknown preset {spec!r}; presets are: {', '.join(PRESETS)} "
                         "(or a spec file, .json; either may take overrides: 'kivi-2:G=64,R=0')")
    _check_field_names(overrides, "override(s)", " (or transformers' nbits, q_group_size, "
                       "axis_key, axis_value)")
    _check_bits_reach_a_layer(base, overrides)
    # a loop's shared knobs pass harmlessly; a spec string that names one asks for it
    asked = sorted(k for k in overrides if k not in FP16_IGNORES or k in written)
    if asked and not base.quantized:  # they would be kept and silently do nothing
        what = f"preset {spec!r}" if isinstance(spec, str) and spec in PRESETS else \
            f"spec {base.describe()!r}"
        raise ValueError(f"{what} quantizes nothing and takes no overrides of how to quantize "
                         f"(got {', '.join(asked)}); start from a quantized preset, e.g. "
                         "'kivi-2'")
    return base.replace(**overrides) if overrides else base


# Keyword overrides an FP16 spec takes as harmless no-ops: the knobs a loop over presets (FP16
# the baseline among them) passes to all; any other field, or one of these written in the spec
# string itself ('fp16:R=3'), asks for quantization and is refused.
FP16_IGNORES = ("group_size", "residual_length", "sink_tokens")

# Where ``calibration=`` is taken (the error of a spec that takes none names them all).
CALIBRATION_USES = ("calibration= applies to fp8_scale='calibrated' (preset 'fp8'), method "
                    "'kvquant' (codebooks) and hadamard_calibrated=True (presets 'kivi-N-hadc')")


def hf_field_names(overrides: dict) -> dict:
    """transformers' QuantizedCache keyword names -> QuantSpec fields. ``nbits`` (or ``bits``, its
    name in spec strings) sets both widths unless ``key_bits`` / ``value_bits`` refine one; a
    transformers name and the field it stands for given with different values are refused (one
    was silently lost)."""
    out = dict(overrides)
    widths = {name: out.pop(name) for name in ("nbits", "bits") if name in out}
    if len(widths) == 2 and widths["nbits"] != widths["bits"]:  # (no set: [4] is unhashable)
        raise ValueError(f"nbits and bits (both set key_bits and value_bits) disagree: "
                         f"nbits={widths['nbits']!r}, bits={widths['bits']!r}; give one of them")
    for bits in widths.values():  # (as the spec strings' bits=N)
        out.setdefault("key_bits", bits)
        out.setdefault("value_bits", bits)
    pairs = [("q_group_size", "group_size", None)]
    pairs += [(hf, field, HF_AXES) for hf, field in (("axis_key", "key_axis"),
                                                      ("axis_value", "value_axis"))]
    for hf, field, table in pairs:
        if hf not in out:
            continue
        value = out.pop(hf)
        if table is not None:
            if type(value) is not int or value not in table:
                hqq = (" (as the quanto backend numbers them: the hqq backend's per-token "
                       f"axis 1 is {hf}=0 here)" if type(value) is int and value == 1 else "")
                raise ValueError(f"{hf} must be 0 (per-token: groups of channels of one token, "
                                 f"transformers' default) or -1 (per-channel: groups of tokens "
                                 f"of one channel){hqq}; got {value!r}")
            value = table[value]
        if field in out and out[field] != value:
            raise ValueError(f"{hf} (transformers' name of {field}) and {field} disagree: "
                             f"{hf} gives {value!r}, {field}={out[field]!r}; give one of them")
        out[field] = value
    return out


def _check_bits_reach_a_layer(base: QuantSpec, overrides: dict) -> None:
    """Refuse key_bits / value_bits overrides of a per-layer spec that names every layer of the
    model it was tuned for: each layer keeps its own bits (``layer_bits``) or FP16, so the
    override would silently change nothing (e.g. ``smollm2-avg3.json:bits=4``)."""
    asked = [f for f in ("key_bits", "value_bits")
             if f in overrides and overrides[f] != getattr(base, f)]
    # the per-layer fields as they will be (an override may replace them too)
    n, layer_bits, skip = (overrides.get(f, getattr(base, f))
                           for f in ("model_layers", "layer_bits", "skip_layers"))
    if not asked or type(n) is not int or n <= 0:
        return
    try:
        named = {e[0] % n for e in layer_bits} | {i % n for i in skip}
    except (TypeError, IndexError):
        return  # malformed: QuantSpec refuses it by name
    if len(named) >= n:
        raise ValueError(f"{', '.join(asked)}: this spec sets the bits of each of its {n} layers "
                         "(layer_bits / skip_layers), so the override would change no layer; "
                         "edit layer_bits, or run kvbits tune for another --avg-bits")
