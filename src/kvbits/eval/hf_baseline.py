"""The incumbent: transformers' own ``QuantizedCache``, as a ``make_cache`` factory.

``QuantizedCache`` keeps the last ``residual_length`` tokens in full precision; when the residual
fills up it dequantizes the *whole* history, appends the residual and re-quantizes everything
(each step, attention reads a dequantized FP copy of the history). Backends, from the optional
extra ``pip install "kvbits[incumbents]"``:

* ``quanto`` (``optimum-quanto``): nbits 2 or 4, min-max per group of ``q_group_size`` (default
  64). ``axis=0`` (default for keys and values): groups of consecutive channels of one token,
  i.e. **per-token**; ``axis=-1``: groups of consecutive tokens of one channel, i.e.
  **per-channel** (KIVI's choice for keys). With ``axis=-1`` quanto needs ``batch * kv_heads *
  tokens`` divisible by ``q_group_size`` at every re-quantization (the prompt, then each time the
  residual fills): chunks of 256 are fine, token-by-token decoding from a 1-token prompt fails.
* ``hqq``: nbits 1, 2, 3, 4 or 8, min-max, refined by HQQ's half-quadratic optimizer where the
  installed hqq turns it on by default (transformers passes no ``optimize``: off in hqq 0.2.5,
  on in 0.2.8).
  ``axis=1``: groups of consecutive channels of one token (**per-token**); ``axis=0`` (default):
  the flattened ``[B, H, T, D]`` tensor is cut into ``q_group_size`` equal slices and a group is
  the elements at one offset in every slice: one channel, every ``B*H*T / q_group_size``-th row of
  the flattened (sequence, head, token) rows, so a group mixes heads (and sequences). On SmolLM2
  that is unusable at 2 bits (PPL in the thousands); ``axis=1`` is the axis HQQ itself
  recommends. hqq packs ``8 // nbits`` codes per byte along a group when ``axis=0``, so there
  ``q_group_size`` must be a multiple of 8 (int1), 4 (int2) or 2 (int4); its 3-bit unpacking with
  ``axis=1`` assumes a 2-D weight, so int3 takes ``axis=0`` only.

Every field is checked by :class:`HFQuantSpec` from the arguments alone; what depends on the
tensors (quanto's and hqq's groups must divide the elements quantized at each re-quantization)
is only known when the cache runs.

Only full-attention models are accepted by ``QuantizedCache`` (not Gemma3's sliding layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BACKENDS", "DEFAULTS", "HFQuantSpec", "available_backends", "hf_quantized_cache_factory"]

# backend -> (PyPI package, import name, allowed nbits, allowed axes)
BACKENDS: dict[str, tuple[str, str, tuple[int, ...], tuple[int, ...]]] = {
    "quanto": ("optimum-quanto", "optimum.quanto", (2, 4), (0, -1)),
    "hqq": ("hqq", "hqq", (1, 2, 3, 4, 8), (0, 1)),
}
# transformers' QuantizedLayer defaults, for the fields left unset
DEFAULTS = {"axis_key": 0, "axis_value": 0, "q_group_size": 64, "residual_length": 128}
# hqq with axis 0: codes packed per byte along a group (3 bits are padded to 10 per int32)
HQQ_PACK = {1: 8, 2: 4, 4: 2}


@dataclass(frozen=True)
class HFQuantSpec:
    """Arguments of transformers' ``QuantizedCache`` (None: transformers' default)."""

    backend: str = "quanto"
    nbits: int = 4
    axis_key: int | None = None
    axis_value: int | None = None
    q_group_size: int | None = None
    residual_length: int | None = None

    def __post_init__(self) -> None:
        """Every field, against what its backend accepts: a value it cannot use failed only when
        the cache first quantized, after the model had loaded and other variants had run."""
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:  # (a list: unhashable)
            raise ValueError(f"unknown QuantizedCache backend {self.backend!r}; "
                             f"backends: {', '.join(BACKENDS)}")
        _, _, bits, axes = BACKENDS[self.backend]
        if type(self.nbits) is not int or self.nbits not in bits:  # True == 1, 2.0 == 2
            raise ValueError(f"nbits for backend {self.backend!r} must be one of "
                             f"{', '.join(map(str, bits))}; got {self.nbits!r}")
        for name in ("axis_key", "axis_value"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value not in axes):
                raise ValueError(f"{name} for backend {self.backend!r} must be one of "
                                 f"{', '.join(map(str, axes))}; got {value!r}")
        for name, low in (("q_group_size", 1), ("residual_length", 0)):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.backend == "hqq":
            self._check_hqq()

    def _check_hqq(self) -> None:
        """hqq's bit packing: with axis 0 a group whose size is not a multiple of the codes per
        byte is packed wrong (a shape error, or garbage, at the first re-quantization), and its
        3-bit unpacking with axis 1 cuts a [B, H, T, D] cache to the wrong rows."""
        axes = {n: self.get(n) for n in ("axis_key", "axis_value")}
        if self.nbits == 3:
            for name, axis in axes.items():
                if axis != 0:
                    raise ValueError(f"{name} for backend 'hqq' int3 must be 0 (hqq's 3-bit "
                                     f"unpacking along axis 1 garbles a 4-D cache); got {axis!r}")
        pack = HQQ_PACK.get(self.nbits, 1)
        on_axis0 = [f"{n}={a}" for n, a in axes.items() if a == 0]
        if on_axis0 and self.get("q_group_size") % pack:
            raise ValueError(f"q_group_size for backend 'hqq' int{self.nbits} with "
                             f"{', '.join(on_axis0)} must be a multiple of {pack} (hqq packs "
                             f"{pack} codes per byte along a group); got {self.q_group_size!r}")

    def get(self, name: str) -> int:
        """A field's value, transformers' default where unset."""
        value = getattr(self, name)
        return DEFAULTS[name] if value is None else value

    def kwargs(self) -> dict:
        """Keyword arguments for ``QuantizedCache`` (unset ones left to transformers)."""
        names = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def describe(self) -> str:
        return (f"HF QuantizedCache {self.backend} int{self.nbits} "
                f"axis_key={self.get('axis_key')} axis_value={self.get('axis_value')} "
                f"G={self.get('q_group_size')} R={self.get('residual_length')}")


def available_backends() -> dict[str, bool]:
    """Which QuantizedCache backends import here."""
    import importlib.util

    out = {}
    for name, (_, module, _, _) in BACKENDS.items():
        try:
            out[name] = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            out[name] = False
    return out


def hf_quantized_cache_factory(model, spec: HFQuantSpec | None = None,
                               **kwargs) -> Callable[[], object]:
    """A ``make_cache`` callable returning a fresh transformers ``QuantizedCache`` for ``model``.

    >>> make_cache = hf_quantized_cache_factory(model, backend="quanto", nbits=2, axis_key=-1)  # doctest: +SKIP
    >>> perplexity(model, ids, make_cache)  # doctest: +SKIP
    """
    from transformers import QuantizedCache

    if spec is not None and not isinstance(spec, HFQuantSpec):
        raise TypeError(f"hf_quantized_cache_factory: spec must be an HFQuantSpec or None, got "
                        f"{type(spec).__name__}")
    if spec is not None and kwargs:  # (they were ignored silently: the spec's values ran)
        raise TypeError(f"hf_quantized_cache_factory: give spec or its fields as keywords, not "
                        f"both (got spec and {', '.join(kwargs)})")
    spec = HFQuantSpec(**kwargs) if spec is None else spec
    if not hasattr(model, "config"):  # (None or a name was an AttributeError inside)
        raise TypeError(f"hf_quantized_cache_factory: model must be a transformers model, got "
                        f"{type(model).__name__}")
    if not available_backends()[spec.backend]:
        package = BACKENDS[spec.backend][0]
        raise ImportError(f"QuantizedCache backend {spec.backend!r} needs `pip install {package}` "
                          "(or `pip install \"kvbits[incumbents]\"`)")
    config = model.config
    cache_kwargs = spec.kwargs()

    def make_cache():
        return QuantizedCache(backend=spec.backend, config=config, **cache_kwargs)

    make_cache()  # fail now (unsupported model, bad arguments), not in the middle of a run
    return make_cache
