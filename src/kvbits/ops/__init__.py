"""Public tensor ops, one signature each: Triton kernels on CUDA, the PyTorch reference elsewhere.

``KVBITS_KERNELS=reference`` forces the reference everywhere (debugging, A/B checks);
``KVBITS_KERNELS=triton`` forces the kernels (CPU tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from ..formats.layout import PackedKV
from ..reference import attention as _ref_attention
from ..reference import quant as _ref_quant


def use_kernels(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run the Triton kernels."""
    mode = os.environ.get("KVBITS_KERNELS", "auto")
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    return x.is_cuda and _triton_available()


def on_device(x: torch.Tensor):
    """A context that makes ``x``'s CUDA device the current one for the kernels launched inside.

    Triton launches on the *current* device, not on its arguments': a layer of a model spread
    over GPUs (``device_map="auto"``) holds tensors on ``cuda:1`` while ``cuda:0`` is current,
    and an unguarded launch there fails ("cannot be accessed from Triton") or reads another
    GPU's memory. A no-op when ``x`` is already on the current device (or not on CUDA)."""
    if x.is_cuda and x.device.index is not None and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_keys(k: torch.Tensor, bits: int, group_size: int, valid: torch.Tensor | None = None):
    """Per-channel key quantization + packing; see :func:`kvbits.reference.quant.quantize_keys`."""
    if use_kernels(k):
        from ..kernels.quantize_pack import quantize_keys as kernel
        with on_device(k):
            return kernel(k, bits, group_size, valid)
    return _ref_quant.quantize_keys(k, bits, group_size, valid)


def quantize_values(v: torch.Tensor, bits: int, value_group: int, group_size: int,
                    valid: torch.Tensor | None = None):
    """Per-token value quantization + packing; see :func:`kvbits.reference.quant.quantize_values`."""
    if use_kernels(v):
        from ..kernels.quantize_pack import quantize_values as kernel
        with on_device(v):
            return kernel(v, bits, value_group, group_size, valid)
    return _ref_quant.quantize_values(v, bits, value_group, group_size, valid)


def kernel_reads(kv: PackedKV) -> bool:
    """Whether the fused decode kernel reads this layer (call only where kernels are used)."""
    from ..kernels.decode_attention import reads

    return reads(kv)


def decode_attention(q: torch.Tensor, kv: PackedKV, *, scale: float, starts=None, lengths=None,
                     window: int | None = None, lens_dev: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over a packed layer; see the reference for the rules.

    The fused kernel reads KIVI, uniform (scales on either axis), FP8 and KVQuant layers
    (codebooks, outliers, pre-RoPE keys); only pre-RoPE keys with a head_dim that is not a power
    of two run the reference (see :func:`kvbits.kernels.decode_attention.reads`). Hadamard
    layers are plain: the caller passes rotated queries. ``lens_dev`` (kernels only): the true
    int32 (sink, body, residual) lengths on the device, ``kv``'s being bounds
    (:meth:`kvbits.cache.store.LayerStore.view_dev`); the reference path ignores it (there the
    view's host lengths are the true ones). ``softcap``: attention-logit softcapping (Gemma2),
    a positive number or None.
    """
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"decode_attention: softcap must be a positive finite number or None, "
                         f"got {softcap!r}")
    if use_kernels(q) and kernel_reads(kv):
        from ..kernels.decode_attention import decode_attention as kernel
        with on_device(q):
            return kernel(q, kv, scale=scale, starts=starts, lengths=lengths, window=window,
                          lens_dev=lens_dev, softcap=softcap)
    return _ref_attention.decode_attention(q, kv, scale=scale, starts=starts, lengths=lengths,
                                           window=window, softcap=softcap)
