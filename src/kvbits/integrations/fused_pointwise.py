"""Fuse the small elementwise kernels of a transformers decoder step with ``torch.compile``.

Why: at batch 1 a decode step of a 7-8B model is ~1560 kernels, and the ~1100 that are not
matrix products (RMSNorm's cast, square, mean, rsqrt and two multiplies; rotate-half RoPE's
neg, cat, two multiplies and an add per tensor; SiLU times up) run ~1.6 us each even replayed
from a CUDA graph: ~1.8 ms per step that FP16 and every quantized cache pay alike, and that
hides the KV bytes a 2-bit cache saves (H200 census: ``benchmarks/results/step_kernels.log``;
fused, 786 kernels and 0.55 ms).

What is compiled is only what holds no cache state, so no guard depends on a layer index or a
cache length and each function compiles once per shape kind for the whole model:

* the ``forward`` of every module whose class name ends in ``RMSNorm`` (layer norms, final norm,
  Qwen3 / Gemma3 q/k norms), compiled per class;
* the ``forward`` of every decoder layer's ``mlp`` (gate/up/down products stay cuBLAS; the
  activation and product fuse), per class;
* the module-level ``apply_rotary_pos_emb`` of the model's attention modules (Llama, Mistral,
  Qwen2/3, Gemma, SmolLM, Phi-3), looked up in each attention class's Python module.

Modules whose ``forward`` is already replaced on the instance (accelerate's offload hooks) are
left alone: compiling the class's ``forward`` would bypass the hook.

The attention, the cache update and the decoder layer's own code stay eager (the cache's Python
decides lengths and flushes; compiling it would guard on them and recompile every step).
:func:`fused_pointwise` installs the compiled functions for the duration of a ``with`` block
and restores the model after, so prefill and later calls see the model unchanged.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

__all__ = ["fused_pointwise", "check_backend", "BACKENDS"]

BACKENDS = ("inductor", "aot_eager", "eager")


def check_backend(backend: str, where: str) -> None:
    """Refuse a backend outside :data:`BACKENDS`, naming the parameter (``where``)."""
    if backend not in BACKENDS:
        raise ValueError(f"{where} must be one of {BACKENDS}, got {backend!r}")

_COMPILED: dict = {}  # (function, backend) -> compiled function, shared by every model and call


def _compiled(fn, backend: str):
    """One compiled wrapper per (function, backend): a second ``torch.compile`` of the same
    function would start a second cache of compiled graphs."""
    key = (fn, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, backend=backend)
    return _COMPILED[key]


def _targets(model):
    """(module, class forward) pairs to compile, and the Python modules of the model's attention
    classes that define ``apply_rotary_pos_emb``. A module whose ``forward`` is already set on
    the instance (an accelerate offload hook, another wrapper) is left as it is."""
    mods, rope_modules = [], {}
    for name, sub in model.named_modules():
        cls = type(sub)
        if "forward" in sub.__dict__:
            continue
        if cls.__name__.endswith("RMSNorm") or name.endswith(".mlp") or name == "mlp":
            mods.append((sub, cls.forward))
        if name.endswith("self_attn"):
            py = sys.modules.get(cls.__module__)
            if callable(getattr(py, "apply_rotary_pos_emb", None)):
                rope_modules[py.__name__] = py
    return mods, list(rope_modules.values())


@contextlib.contextmanager
def fused_pointwise(model, backend: str = "inductor"):
    """Within the block, ``model``'s norms, MLPs and RoPE application run compiled by
    ``torch.compile(backend=backend)``; on exit the model is as before.

    ``backend``: one of :data:`BACKENDS` (``"inductor"`` fuses; the others trace without
    generating kernels, for tests on machines without a compiler). Compilation happens on the
    first call of each function at each shape, so run one step eagerly before a CUDA-graph
    capture (``GreedyDecoder`` does)."""
    check_backend(backend, "fused_pointwise: backend")
    mods, rope_modules = _targets(model)
    ropes = [(py, py.apply_rotary_pos_emb) for py in rope_modules]
    try:
        for sub, fwd in mods:
            sub.forward = types.MethodType(_compiled(fwd, backend), sub)
        for py, rope in ropes:
            py.apply_rotary_pos_emb = _compiled(rope, backend)
        yield len(mods) + len(ropes)
    finally:
        for py, rope in ropes:
            py.apply_rotary_pos_emb = rope
        for sub, _ in mods:
            sub.__dict__.pop("forward", None)
