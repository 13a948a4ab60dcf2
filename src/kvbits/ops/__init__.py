"""Public tensor ops, one signature each: Triton kernels on CUDA, the PyTorch reference elsewhere.

``KVBITS_KERNELS=reference`` forces the reference everywhere (debugging, A/B checks);
``KVBITS_KERNELS=triton`` forces the kernels (CPU tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..checks import is_count
from ..formats.layout import WINDOW_NONE, PackedKV, check_buffers, check_query
from ..reference import attention as _ref_attention
from ..reference import quant as _ref_quant


def use_kernels(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run the Triton kernels. ``KVBITS_KERNELS`` (unset or empty: auto)
    other than auto / triton / reference is refused: a typo would silently run the other path."""
    mode = os.environ.get("KVBITS_KERNELS") or "auto"
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    if mode != "auto":
        raise ValueError(f"KVBITS_KERNELS must be 'auto', 'triton' or 'reference', got {mode!r}")
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


_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels multiply ``scale`` and ``softcap`` by log2(e) in float32: past this they are inf
# there (NaN outputs), although finite as Python floats.
_F32_LIMIT = torch.finfo(torch.float32).max / 1.4426950408889634
# ``starts`` / ``lengths`` lie within +-POSITION_LIMIT: the kernels add group and tile sizes (and
# windows) to positions in int32, which wrapped at lengths within a group of 2**31 (the body read
# as past the end, silently).
POSITION_LIMIT = 2**30


def _positive(x) -> bool:
    """A positive number (not a bool) that stays finite in the kernels' float32."""
    return (isinstance(x, (int, float)) and not isinstance(x, bool)
            and 0 < x <= _F32_LIMIT)


def _check_call(q: torch.Tensor, kv: PackedKV, scale: float, window, starts=None,
                lengths=None, bounds: bool = False) -> None:
    """Shapes, dtypes and lengths of a decode_attention call, from metadata only (no host sync):
    a mismatch would otherwise read past a buffer or attend to the wrong rows, silently.
    ``bounds``: ``kv``'s lengths are bounds (``lens_dev`` has the true ones), which the buffers
    need not hold."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _Q_DTYPES:
        raise ValueError("decode_attention: q must be a [batch, heads, rows, head_dim] float16, "
                         f"bfloat16 or float32 tensor, got {getattr(q, 'dtype', type(q))} "
                         f"{tuple(getattr(q, 'shape', ()))}")
    if not isinstance(kv, PackedKV):
        raise TypeError(f"decode_attention: kv must be a PackedKV (a layer's view), got "
                         f"{type(kv).__name__}")
    B = q.shape[0]
    if q.device != kv.res_k.device:
        raise ValueError(f"decode_attention: q is on {q.device}, the layer on "
                         f"{kv.res_k.device}; they must share a device")
    check_query(q, kv)
    bh = kv.res_k.shape[:2]
    for name in ("sink_k", "sink_v", "res_v", "k_codes", "k_scale", "v_codes", "v_scale"):
        t = getattr(kv, name)
        if t is not None and t.shape[:2] != bh:
            raise ValueError(f"decode_attention: kv.{name} is {tuple(t.shape)}, not "
                             f"[{kv.batch}, {kv.kv_heads}, ...] like the residual")
    for name, n, buf in (("sink_len", kv.sink_len, kv.sink_k), ("res_len", kv.res_len, kv.res_k)):
        if not 0 <= n <= buf.shape[2]:
            raise ValueError(f"decode_attention: kv.{name} = {n} does not fit its buffer of "
                             f"{buf.shape[2]} tokens")
    for name in ("key_bits", "value_bits"):
        if getattr(kv, name) not in (2, 3, 4, 8):
            raise ValueError(f"decode_attention: kv.{name} must be 2, 3, 4 or 8, got "
                             f"{getattr(kv, name)!r}")
    if not is_count(kv.group_size, 1):  # (a ZeroDivisionError below)
        raise ValueError(f"decode_attention: kv.group_size must be a positive int, got "
                         f"{kv.group_size!r}")
    if kv.body_len < 0 or kv.body_len % kv.group_size:
        raise ValueError(f"decode_attention: kv.body_len = {kv.body_len} must be a whole number "
                         f"of groups of {kv.group_size} tokens")
    if kv.body_len and not kv.fp8 and kv.k_codes.dtype != torch.int32:
        raise ValueError(f"decode_attention: kv.k_codes must be int32 words, got "
                         f"{kv.k_codes.dtype}")
    if kv.owner is None:  # (lengths past a buffer, another head_dim or grouping); a LayerStore's
        # own view holds its layout by construction, and the check costs ~6 us a call
        check_buffers(kv, rows=not bounds)
    if not _positive(scale):
        raise ValueError(f"decode_attention: scale must be a positive finite number (at most "
                         f"{_F32_LIMIT:.3g}: float32 times log2(e)), got {scale!r}")
    for name, x in (("starts", starts), ("lengths", lengths)):
        _check_positions(name, x, B)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"decode_attention: window must be a positive integer (tokens) or "
                         f"None, got {window!r}")


def _check_positions(name: str, x, batch: int) -> None:
    """``starts`` / ``lengths``: None, an int, or integers per sequence (``[batch]``, or one
    for all); a float would be truncated and a wrong length broadcast or fail deep in a kernel.
    Values must lie within +-``POSITION_LIMIT`` (the kernels take int32 and add group and tile
    sizes to them: a larger one would wrap; a start may be negative, after a sliding layer
    evicted), checked for Python ints and CPU tensors; values on a GPU are not read here (that
    would wait for it)."""
    if x is None:
        return
    if isinstance(x, int) and not isinstance(x, bool):
        lo, hi, got = x, x, f"{x}"
    else:
        t = x if isinstance(x, torch.Tensor) else None
        if t is None:
            try:
                t = torch.as_tensor(x)
            except (TypeError, ValueError, RuntimeError):
                t = None
        if t is None or t.dtype.is_floating_point or t.dtype.is_complex \
                or t.dtype == torch.bool or t.dim() > 1 \
                or (t.dim() == 1 and t.numel() not in (1, batch)):
            what = (f"{t.dtype} {tuple(t.shape)}" if t is not None else type(x).__name__)
            raise ValueError(f"decode_attention: {name} must be None, an int or {batch} "
                             f"integers (one per sequence), got {what}")
        if t.device.type != "cpu" or not t.numel():
            return
        lo, hi = int(t.min()), int(t.max())  # (Python ints: 2**31 does not fit an int32)
        got = f"values from {lo} to {hi}"
    if lo < -POSITION_LIMIT or hi > POSITION_LIMIT:
        raise ValueError(f"decode_attention: {name} must fit an int32 with headroom, within "
                         f"+-2**30 (the kernels add group and tile sizes to positions), got {got}")


def decode_attention(q: torch.Tensor, kv: PackedKV, *, scale: float, starts=None, lengths=None,
                     window: int | None = None, lens_dev: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q [B, Hq, Lq, D]`` over a packed layer; see the reference for the rules.

    The fused kernel reads KIVI, uniform (scales on either axis), FP8 and KVQuant layers
    (codebooks, outliers, pre-RoPE keys) at any head_dim that is a multiple of 4; pre-RoPE keys
    at head dims below 32 (or per-token key scales with pre-RoPE keys at a head_dim that is not
    a power of two) run the reference (see :func:`kvbits.kernels.decode_attention.reads`). Hadamard
    layers are plain: the caller passes rotated queries. ``lens_dev`` (kernels only): the true
    int32 (sink, body, residual) lengths on the device, ``kv``'s being bounds
    (:meth:`kvbits.cache.store.LayerStore.view_dev`); the reference path ignores it (there the
    view's host lengths are the true ones). ``softcap``: attention-logit softcapping (Gemma2),
    a positive number or None.
    """
    if softcap is not None and not _positive(softcap):
        raise ValueError(f"decode_attention: softcap must be a positive finite number or None "
                         f"(at most {_F32_LIMIT:.3g}: float32 times log2(e)), got {softcap!r}")
    _check_call(q, kv, scale, window, starts, lengths, lens_dev is not None)  # (bounds)
    if window is not None and window >= WINDOW_NONE:
        window = None  # (exact: see WINDOW_NONE)
    if use_kernels(q) and kernel_reads(kv):
        from ..kernels.decode_attention import _INTERPRETED, LOG2E
        from ..kernels.decode_attention import decode_attention as kernel
        # The kernels scale float16 queries by scale * log2(e) before rounding them to float16:
        # above 1 that can overflow (|q| near 65504 at scale 1); float32 queries cannot. Triton's
        # interpreter computes bfloat16 queries wrong (outputs ~1e9; numpy has no bfloat16), so
        # there they go in as float32 too.
        wide = (q.dtype == torch.float16 and scale * LOG2E > 1
                or q.dtype == torch.bfloat16 and _INTERPRETED)
        with on_device(q):
            out = kernel(q.float() if wide else q, kv, scale=scale, starts=starts,
                         lengths=lengths, window=window, lens_dev=lens_dev, softcap=softcap)
        return out.to(q.dtype) if wide else out
    return _ref_attention.decode_attention(q, kv, scale=scale, starts=starts, lengths=lengths,
                                           window=window, softcap=softcap)
