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
* ``hqq``: nbits 1, 2, 3, 4 or 8, min-max refined by HQQ's half-quadratic optimizer.
  ``axis=1``: groups of consecutive channels of one token (**per-token**); ``axis=0`` (default):
  the flattened ``[B, H, T, D]`` tensor is cut into ``q_group_size`` equal slices and a group is
  the elements at one offset in every slice: one channel, every ``B*H*T / q_group_size``-th row of
  the flattened (sequence, head, token) rows, so a group mixes heads (and sequences). On SmolLM2
  that is unusable at 2 bits (PPL in the thousands); ``axis=1`` is the axis HQQ itself
  recommends.

Only full-attention models are accepted by ``QuantizedCache`` (not Gemma3's sliding layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BACKENDS", "HFQuantSpec", "available_backends", "hf_quantized_cache_factory"]

# backend -> (PyPI package, import name, allowed nbits, allowed axes)
BACKENDS: dict[str, tuple[str, str, tuple[int, ...], tuple[int, ...]]] = {
    "quanto": ("optimum-quanto", "optimum.quanto", (2, 4), (0, -1)),
    "hqq": ("hqq", "hqq", (1, 2, 3, 4, 8), (0, 1)),
}


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
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown QuantizedCache backend {self.backend!r}; "
                             f"backends: {', '.join(BACKENDS)}")
        _, _, bits, axes = BACKENDS[self.backend]
        if self.nbits not in bits:
            raise ValueError(f"nbits for backend {self.backend!r} must be one of "
                             f"{', '.join(map(str, bits))}; got {self.nbits!r}")
        for name in ("axis_key", "axis_value"):
            value = getattr(self, name)
            if value is not None and value not in axes:
                raise ValueError(f"{name} for backend {self.backend!r} must be one of "
                                 f"{', '.join(map(str, axes))}; got {value!r}")
        for name, low in (("q_group_size", 1), ("residual_length", 0)):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def kwargs(self) -> dict:
        """Keyword arguments for ``QuantizedCache`` (unset ones left to transformers)."""
        names = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def describe(self) -> str:
        k = self.axis_key if self.axis_key is not None else 0
        v = self.axis_value if self.axis_value is not None else 0
        g = self.q_group_size if self.q_group_size is not None else 64
        r = self.residual_length if self.residual_length is not None else 128
        return (f"HF QuantizedCache {self.backend} int{self.nbits} axis_key={k} axis_value={v} "
                f"G={g} R={r}")


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

    spec = HFQuantSpec(**kwargs) if spec is None else spec
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
