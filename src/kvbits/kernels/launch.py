"""Kernel launches with less host time: a specialization's second launch skips Triton's binder.

An eager decode step launches two or three kernels per layer, and Triton's JIT spends most of a
launch's host time binding and specializing the ~35-50 arguments before it reaches the compiled
launcher: on the H200 host 30-51 us per launch through the JIT against 8-13 us through the
launcher itself (``benchmarks/results/host_breakdown_s26.log``), against 17-26 us for the whole
FP16 SDPA call. :class:`FastLaunch` wraps a ``@triton.jit`` / ``@gluon.jit`` kernel: the first
launch of a specialization goes through the JIT (which compiles it), and later launches with the
same key call the compiled kernel's launcher directly.

The key is what the JIT's specialization reads, in the JIT's own classes: each tensor
argument's dtype and 16-byte alignment, each TMA descriptor's dtype, block shape and shared
layout (what its ``__mangle__`` holds; the launcher encodes the descriptor's buffer, shape and
strides at every launch), each specialized integer's class (equal to 1, divisible by 16, or
neither, and its 32/64-bit range), the range of the integers it does not specialize
(``do_not_specialize``), the exact value of bools, the keyword arguments (constexprs and launch
options) and the device. The first launch of a key checks those classes against the binder's
own specialization and keeps no plan if they differ (a Triton with other rules), so a plan is
only reused for arguments that satisfy every assumption its kernel was compiled under. An
argument of any other type (a tuple) sends the launch through the JIT, as do launch hooks
(profilers), the interpreter, CPU tensors and a Triton older than 3.4 or with other JIT internals
(no ``knobs``, no per-device binder, another launcher signature: the wrapper then stays on the
JIT for good). Not re-checked on the fast path: Triton's guard against module
globals changed after compilation (kvbits reads its switches once, at import) and its ``debug``
knob.
"""

from __future__ import annotations

import functools

import torch

from .switches import env_switch

# KVBITS_FAST_LAUNCH=0 sends every launch through Triton's JIT (A/B checks, debugging).
ENABLED = env_switch("KVBITS_FAST_LAUNCH", "1")
_I32 = 2**31
_I64 = 2**63
MAX_PLANS = 4096  # plans per kernel before the cache starts over


def device_index(device: torch.device) -> int:
    """A CUDA device's index (``cuda`` without one: the current device), the key of the kernels'
    per-device caches (SM counts, side streams, capabilities)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None, or a ``HookChain`` without calls (Triton
    3.6+ keeps an empty chain), is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _int_class(x: int) -> int:
    """The integer type the JIT gives an integer argument: i32 (0), i64 (1) or u64 (2)."""
    if -_I32 <= x < _I32:
        return 0
    return 1 if -_I64 <= x < _I64 else 2


def _spec_class(x: int):
    """The JIT's specialization of an integer: a constexpr 1, divisible by 16 ("D"), or ""."""
    if x == 1:
        return 1
    return "D" if x % 16 == 0 else ""


def _expected(part):
    """The binder's specialization value (second element) implied by a key part, or a marker
    that matches anything (floats, bools, None: typed, not specialized)."""
    kind = part[0] if isinstance(part, tuple) else None
    if kind == "t":
        return "D" if part[2] else ""
    if kind == "i":
        return part[1]
    return None if kind == "n" else ...


def _is_descriptor(x) -> bool:
    """A host TMA tensor descriptor (Triton's or Gluon's ``TensorDescriptor``)."""
    return all(hasattr(x, a) for a in ("base", "block_shape", "layout"))


def _descriptor_class(d) -> tuple:
    """What the JIT specializes a descriptor on (its ``__mangle__``: the base's dtype, the block
    shape, the shared layout) and the fields its launcher reads besides the buffer."""
    return ("d", d.base.dtype, tuple(d.block_shape), d.layout, getattr(d, "padding", None),
            getattr(d, "round_f32_to_tf32", False))


def _key_function(args, specialized, aligned):
    """Code for :meth:`FastLaunch.classes` at the argument types of ``args`` (a tensor, int,
    float, bool, None or TMA descriptor at each position; else None): one expression per
    argument, no loop, as Triton's own binder is generated. Arguments of other types at a later launch make it return
    None (or raise), and the launch goes through the JIT."""
    names = [f"a{i}" for i in range(len(args))]
    guards, parts = [], []
    scope = {"T": torch.Tensor, "_descriptor_class": _descriptor_class}
    for n, a, spec, align in zip(names, args, specialized, aligned):
        if isinstance(a, torch.Tensor):
            guards.append(f"isinstance({n}, T)")
            parts.append(f"('t', {n}.dtype, {n}.data_ptr() % 16 == 0)" if align
                         else f"('t', {n}.dtype, False)")
        elif isinstance(a, bool):
            guards.append(f"type({n}) is bool")
            parts.append(f"('b', {n})")
        elif isinstance(a, int):
            guards.append(f"type({n}) is int")
            rng = (f"(0 if -{_I32} <= {n} < {_I32} else 1 if -{_I64} <= {n} < {_I64} "
                   "else 2)")  # _int_class, inline (test_generated_key_is_the_classes)
            parts.append(f"('i', 1 if {n} == 1 else 'D' if {n} % 16 == 0 else '', {rng})"
                         if spec else f"('n', {rng})")  # _spec_class, inline
        elif isinstance(a, float):
            guards.append(f"type({n}) is float")
            parts.append("float")
        elif a is None:
            guards.append(f"{n} is None")
            parts.append("None")
        elif _is_descriptor(a):  # the class of this launch's descriptor (Gluon's or Triton's)
            scope[f"D{n}"] = type(a)
            guards.append(f"type({n}) is D{n}")
            parts.append(f"_descriptor_class({n})")
        else:
            return lambda *args: None
    src = (f"def key({', '.join(names)}):\n"
           f"    if not ({' and '.join(guards) or 'True'}):\n        return None\n"
           f"    return ({', '.join(parts)},)\n")
    exec(src, scope)  # noqa: S102 - code built above from the argument kinds only
    return scope["key"]


class Keywords:
    """The keyword arguments of a launch (constexprs, launch options) as one value a caller
    builds once and reuses on every step: hashed once, so a plan lookup does not rebuild and
    rehash ~30 (name, value) pairs per launch (~2 us per launch on a desktop CPU, more on the
    H200's slower host).
    Pass it as the only keyword source: ``FastLaunch.launch(grid, args, keywords)``."""

    __slots__ = ("_hash", "_items", "kwargs")

    def __init__(self, kwargs: dict):
        self.kwargs = dict(kwargs)
        self._items = tuple(self.kwargs.items())  # in order, as a dict launch's key has them
        self._hash = hash(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Keywords) and self._items == other._items)

    def __repr__(self) -> str:
        return f"Keywords({self.kwargs!r})"


def keyword_maker(names, maxsize: int = 1024):
    """``(*values) -> Keywords`` for the keyword ``names`` (values given in that order), each
    combination built once: a decode step launches each kernel with the keywords of the step
    before."""
    names = tuple(names)

    @functools.lru_cache(maxsize=maxsize)
    def make(*values) -> Keywords:
        if len(values) != len(names):
            raise TypeError(f"expected {len(names)} keyword values ({', '.join(names)}), got "
                            f"{len(values)}")
        return Keywords(dict(zip(names, values)))
    return make


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` for a JIT kernel, with the launch of a specialization
    already compiled going straight to its launcher (module docstring). Positional arguments
    are the kernel's leading parameters; keywords are the rest (constexprs) and launch
    options."""

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)  # absent from the interpreter's functions
        self._jit_only = params is None
        self._specialized = [not p.do_not_specialize for p in params or ()]
        self._aligned = [not p.do_not_specialize_on_alignment for p in params or ()]
        self._plans: dict = {}
        self._fast_key = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def launch(self, grid, args, keywords: Keywords):
        """``kernel[grid](*args, **keywords.kwargs)`` with the keywords' key part made once."""
        return self.run(grid, args, keywords)

    def key(self, args, kwargs):
        """The plan key of a launch, or None where the launch must go through the JIT: the
        positional arguments' classes (as :meth:`classes` gives them, by code generated for
        the argument types of the kernel's first launch), the keywords (a dict, or
        :class:`Keywords`) and the device."""
        if self._fast_key is None:
            if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args):
                return None
            self._fast_key = _key_function(args, self._specialized, self._aligned)
        try:
            parts = self._fast_key(*args)
        except (TypeError, ValueError, AttributeError):  # other types or count: the JIT's
            return None
        if parts is None:
            return None
        if isinstance(kwargs, Keywords):
            return (torch.cuda.current_device(), *parts, kwargs)
        return (torch.cuda.current_device(), *parts, *kwargs.items())

    def classes(self, args):
        """Each positional argument's specialization class (see the module docstring), or None
        for an argument of a type the fast path does not take."""
        parts = []
        for a, spec, align in zip(args, self._specialized, self._aligned):
            if isinstance(a, torch.Tensor):
                parts.append(("t", a.dtype, align and a.data_ptr() % 16 == 0))
            elif isinstance(a, bool):
                parts.append(("b", a))
            elif isinstance(a, int):
                parts.append(("i", _spec_class(a), _int_class(a)) if spec
                             else ("n", _int_class(a)))
            elif isinstance(a, float):
                parts.append(float)
            elif a is None:
                parts.append(None)
            elif _is_descriptor(a):
                parts.append(_descriptor_class(a))
            else:
                return None
        return parts

    @staticmethod
    def agrees(parts, specialization) -> bool:
        """Whether the binder specialized the positional arguments as their classes say."""
        for part, (ty, value) in zip(parts, specialization):
            want = _expected(part)
            if want is ...:
                continue
            if want == 1:  # an integer equal to 1 becomes a constexpr
                if ty != "constexpr" or value != 1:
                    return False
            elif ty == "constexpr" or value != want:
                return False
        return True

    def run(self, grid, args, kwargs):
        """Launch; the first launch of a key compiles and launches through the JIT. ``kwargs``:
        a dict, or :class:`Keywords`."""
        runtime = _runtime()
        kw = kwargs.kwargs if isinstance(kwargs, Keywords) else kwargs
        if (not ENABLED or self._jit_only or runtime is None
                or hooked(runtime.launch_enter_hook) or hooked(runtime.launch_exit_hook)):
            return self.fn[grid](*args, **kw)
        key = self.key(args, kwargs)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            kernel = self.fn[grid](*args, **kw)
            if key is not None and kernel is not None and not hasattr(kernel, "result"):
                self._plan(key, kernel, args, kw)
            return kernel
        kernel, tail = plan
        g = (*grid, 1, 1)
        stream = _DRIVER.active.get_current_stream(key[0])
        try:
            kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None,
                       None, None, *args, *tail)
        except TypeError:  # a launcher of another signature (before it launched): the JIT's
            self._jit_only = True
            return self.fn[grid](*args, **kw)
        return kernel

    def _plan(self, key, kernel, args, kwargs) -> None:
        """Keep the plan of a key just launched through the JIT, where the binder's
        specialization confirms the key's classes. A Triton whose JIT internals differ from
        3.4-3.9's (no per-device binder) keeps no plans at all."""
        try:
            binder = self.fn.device_caches[key[0]][-1]
            bound, specialization, _ = binder(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any other internals: the JIT for good
            self._jit_only = True
            return
        parts = key[1:1 + len(args)]
        if parts == tuple(self.classes(args) or ()) and self.agrees(parts, specialization):
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = (kernel, tuple(bound.values())[len(args):])


_DRIVER = None
_RUNTIME = None


def _runtime():
    """Triton's launch-hook settings (``triton.knobs.runtime``, Triton 3.4+), or None on an
    older Triton (then every launch goes through the JIT). Imported on first use."""
    global _DRIVER, _RUNTIME
    if _RUNTIME is None:
        try:
            from triton import knobs
            from triton.runtime import driver
        except ImportError:
            return None
        _DRIVER, _RUNTIME = driver, knobs.runtime
    return _RUNTIME
