"""Calibrated Hadamard channel subsets for per-channel (KIVI) key quantization.

Why not rotate every channel: KIVI quantizes keys per channel over ``G`` tokens, so a channel's
error is proportional to its own range. With query ``q`` the score error variance is about
``sum_j E[q_j^2] * range_j^2``. A Hadamard over ``n`` channels replaces both factors by their
block means, ``(sum q^2)(sum range^2) / n``: it lowers the error when the queries weigh the
wide-range channels (the outliers get spread out) and raises it when they weigh the narrow ones
(every channel inherits the outliers' range). On Qwen2.5-0.5B's first layer (k_proj bias,
rotated by RoPE into channels of range ~300 that the queries barely read) a full rotation gives
8x the score error of plain KIVI at 2 bits (benchmarks/results/ppl_breadth_qwen.md: kivi-3-had
+59% perplexity vs +0.7%).

So per layer and KV head a short calibration text picks the channel subset to rotate:

1. ``Q_c = E[q_c^2]`` over the head's query heads and ``s_c`` = mean within-group variance of
   key channel ``c`` (groups of ``G`` tokens, as the quantizer sees them);
2. greedily drop from the rotated set the channel whose removal lowers the variance model
   ``sum_{c not in S} Q_c s_c + (sum_S Q)(sum_S s) / |S|`` most, recording the set at every
   power-of-two size (a Hadamard needs one);
3. keep, of those sets, no rotation and the full rotation, the one with the lowest measured
   cost ``sum_j E[(qM)_j^2] * mean_groups(range_j(kM))^2`` on the calibration keys.

The result (lists of channel indices per layer and head; an empty list = plain KIVI) does not
depend on the bit width. Keys stay per-channel with FP16 scales/zeros and queries are rotated
by the same (symmetric, orthonormal) matrix, so the kernels and the byte count are unchanged.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch

from ..checks import as_int, is_count, repeated
from ..reference import hadamard as ref_hadamard
from ..spec import QuantSpec
from . import (
    CALIBRATION_WINDOW,
    calibration_chunks,
    calibration_ids,
    calibration_windows,
    check_made_for,
    kv_geometry,
    made_for,
    model_dtype,
    per_layer_calibration,
)
from .model_calls import full_attention

__all__ = ["auto_hadamard_channels", "calibrate_hadamard", "check_channels", "choose_channels",
           "collect_qk", "layer_channels", "load_hadamard_channels", "rotation_cost",
           "save_hadamard_channels"]

FORMAT = "kvbits-hadamard-channels-1"
# model -> {(dtype, group_size, text, tokens): channels}; weakly keyed, not by id(model): a
# model built where a freed one was took the freed one's channels
_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rotation_cost(q: torch.Tensor, k: torch.Tensor, matrix: torch.Tensor,
                  group_size: int) -> float:
    """Score-error proxy of per-channel key quantization after ``matrix``:
    ``sum_j mean((q M)_j^2) * mean_groups(range_j(k M))^2`` for ``q [N, D]``, ``k [T, D]``
    (the quantization step of channel j is its group range over ``2**bits - 1``: the bit width
    only scales the cost)."""
    m = matrix.to(torch.float64)
    qm, km = q.double() @ m, k.double() @ m
    t = km.shape[0] // group_size * group_size
    if t == 0:
        raise ValueError(f"rotation_cost: need at least group_size={group_size} key tokens")
    kg = km[:t].reshape(-1, group_size, km.shape[1])
    rng2 = (kg.amax(1) - kg.amin(1)).pow(2).mean(0)
    return float((qm.pow(2).mean(0) * rng2).sum())


def choose_channels(q: torch.Tensor, k: torch.Tensor, group_size: int = 32) -> list[int]:
    """The channels of one KV head to rotate (see the module docstring): ``q [N, D]`` the
    queries of its query heads, ``k [T, D]`` its keys (post-RoPE, as the cache stores them).
    An empty list means no rotation."""
    q, k = q.double(), k.double()
    D = k.shape[1]
    Q = q.pow(2).mean(0)
    t = k.shape[0] // group_size * group_size
    kg = k[:t].reshape(-1, group_size, D)
    s = (kg - kg.mean(1, keepdim=True)).pow(2).mean((0, 1))
    keep = torch.ones(D, dtype=torch.bool)
    # the whole head is a candidate only where it is one Hadamard block (a power of two); the
    # subsets below always are (session 41 QA: head_dim 80 failed here)
    cands: list[list[int]] = [list(range(D))] if D & (D - 1) == 0 else []
    base = Q * s
    n = D
    while n > 8:  # smallest Hadamard block tried: 8 channels
        # cost of S \ {c} for every c in S (vectorized): the dropped channel joins the plain part
        qs, ss = Q[keep].sum(), s[keep].sum()
        plain = base[~keep].sum()
        cost = plain + base + (qs - Q) * (ss - s) / (n - 1)
        cost[~keep] = torch.inf
        keep[int(cost.argmin())] = False
        n -= 1
        if n & (n - 1) == 0:
            cands.append(torch.nonzero(keep).flatten().tolist())
    best, best_cost = [], rotation_cost(q, k, torch.eye(D, dtype=torch.float64), group_size)
    for chans in cands:
        c = rotation_cost(q, k, ref_hadamard.subset_matrix(D, chans), group_size)
        if c < best_cost:
            best, best_cost = chans, c
    return best


def _capture(store: dict):
    """An attention function recording each layer's post-RoPE queries and keys, then SDPA (or
    with Gemma2's logit cap, which SDPA refuses, the capped eager form: :func:`full_attention`)."""
    def fn(module, query, key, value, attention_mask, **kwargs):
        store[module.layer_idx] = (query.detach()[0].float().cpu(), key.detach()[0].float().cpu())
        return full_attention(module, query, key, value, attention_mask, **kwargs)
    return fn


@torch.no_grad()
def collect_qk(model, input_ids: torch.Tensor, window: int = CALIBRATION_WINDOW) -> list:
    """Per layer ``(Q [Hq, T, D], K [H, T, D])``, post-RoPE as attention sees them, over
    ``input_ids [1, T]`` cut into windows of ``window`` tokens (each from position 0:
    :func:`calibration_chunks`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = "kvbits_hadamard_calibrate"
    old_impl = model.config._attn_implementation
    out: dict[int, list] = {}
    try:
        for chunk in calibration_chunks(input_ids, window):
            rec: dict[int, tuple] = {}
            AttentionInterface.register(name, _capture(rec))
            AttentionMaskInterface.register(name, sdpa_mask)
            model.set_attn_implementation(name)
            model(chunk.to(model.device), use_cache=False)
            for i, qk in rec.items():
                out.setdefault(i, []).append(qk)
    finally:
        model.set_attn_implementation(old_impl)
    return [(torch.cat([p[0] for p in out[i]], 1), torch.cat([p[1] for p in out[i]], 1))
            for i in sorted(out)]


def calibrate_hadamard(model, input_ids: torch.Tensor, spec: QuantSpec,
                       window: int = CALIBRATION_WINDOW) -> list:
    """Per layer, per KV head: the channels to rotate (:func:`choose_channels`) on
    ``input_ids [1, T]``."""
    G = spec.group_size
    tokens = sum(b - a for a, b in calibration_windows(input_ids.numel(), window))
    if tokens < G:  # (failed after the forward, in rotation_cost, naming that function)
        raise ValueError(f"Hadamard channel calibration needs at least {G} tokens of "
                         f"calibration text (one key group, group_size {G}), got {tokens}: give "
                         "a longer calibration text or more of its tokens (the commands' "
                         "--calib-text / --calib-tokens; text= / tokens= of "
                         "auto_hadamard_channels)")
    out = []
    for q, k in collect_qk(model, input_ids, window):
        H, D = k.shape[0], k.shape[-1]
        rep = q.shape[0] // H
        out.append([choose_channels(q[h * rep:(h + 1) * rep].reshape(-1, D), k[h],
                                    G) for h in range(H)])
    return out


HADAMARD_FIELDS = ("group_size", "pre_rope")  # the spec fields the channel choice depends on


def save_hadamard_channels(path, channels: list, model=None, spec: QuantSpec | None = None,
                           **info) -> Path:
    """Write the per-layer, per-head channel lists as JSON (``info`` stored beside them). With
    the ``model`` and ``spec`` they were chosen for, the file records both and
    :func:`load_hadamard_channels` refuses it for another model or spec."""
    path = Path(path)
    doc = {"format": FORMAT, "layers": channels, "info": info}
    if model is not None and spec is not None:
        doc["made_for"] = made_for(model, spec, HADAMARD_FIELDS)
    path.write_text(json.dumps(doc) + "\n")
    return path


def check_channels(channels, model_or_config, what: str, n_layers: int | None = None) -> None:
    """Refuse (ValueError, ``what`` naming the file or the list) channel lists that the cache
    of ``model_or_config`` cannot use: not one list per layer (``n_layers``, else the config's
    count) and KV head, or a head's list not distinct channel indices below ``head_dim``
    whose count is a power of two. (Such lists loaded, and failed at the first forward, inside
    the cache store, naming no file: a QA pass.)"""
    layers, heads, head_dim = kv_geometry(model_or_config)
    n_layers = layers if n_layers is None else n_layers
    if not isinstance(channels, (list, tuple)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvbits)
            f"{what} must hold one list per layer (of one channel list per KV head), got "
            f"{type(channels).__name__}")
    if is_count(n_layers) and len(channels) != n_layers:
        raise ValueError(f"{what} has {len(channels)} layers, the model {n_layers}")
    for i, layer in enumerate(channels):
        if not isinstance(layer, (list, tuple)):
            raise ValueError(  # noqa: TRY004 (as above)
                f"{what}: layer {i} must be a list of channel lists, one per KV head, got "
                f"{type(layer).__name__}")
        if is_count(heads) and len(layer) != heads:
            raise ValueError(f"{what}: layer {i} has {len(layer)} channel lists, the model "
                             f"{heads} KV heads (one list per KV head)")
        for h, chans in enumerate(layer):
            where = f"{what}: layer {i} head {h}"
            if not isinstance(chans, (list, tuple)):
                raise ValueError(  # noqa: TRY004 (as above)
                    f"{where} must be a list of channel indices, got {type(chans).__name__}")
            idx = [as_int(c) for c in chans]
            bad = next((c for c, n in zip(chans, idx)
                        if n is None or n < 0 or (is_count(head_dim) and n >= head_dim)), None)
            if bad is not None:
                top = head_dim - 1 if is_count(head_dim) else "head_dim - 1"
                raise ValueError(f"{where}: channel {bad!r} is not a channel index of the "
                                 f"model's heads (an integer in 0 .. {top})")
            if len(set(idx)) != len(idx):
                dup = repeated(idx)
                raise ValueError(f"{where} lists channel(s) {dup} more than once (each channel "
                                 "once)")
            if len(idx) & (len(idx) - 1):
                raise ValueError(f"{where} lists {len(idx)} channels, not a power of two (a "
                                 "Hadamard block rotates 1, 2, 4, 8, ... channels; an empty "
                                 "list rotates none)")


def load_hadamard_channels(path, model_or_config=None, spec: QuantSpec | None = None) -> list:
    """The channel lists of a :func:`save_hadamard_channels` file; given the model (or config)
    and spec that will use them, a file that records another is refused, as are lists that
    the model's cache cannot use (:func:`check_channels`)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:  # (UnicodeDecodeError: a
        # binary file, e.g. a safetensors one, was a bare "'utf-8' codec can't decode ...")
        raise ValueError(f"cannot read Hadamard channels from {str(path)!r}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a kvbits Hadamard channel file ({FORMAT})")
    if model_or_config is not None and spec is not None:
        check_made_for(doc.get("made_for"), model_or_config, spec, "Hadamard channel file", path)
    if model_or_config is not None:
        check_channels(doc.get("layers"), model_or_config,
                       f"Hadamard channel file {str(path)!r}")
    return doc["layers"]


def auto_hadamard_channels(model, spec: QuantSpec, text: str = "sotu-pre-2000",
                           tokens: int = 2048, log=None) -> list:
    """Channels calibrated on ``text`` (SOTU 1900-1999 by default, disjoint from the evaluation
    text), computed once per model (and dtype: a model converted in place is measured again)
    and group size and kept in memory."""
    key = (model_dtype(model), spec.group_size, text, tokens)
    entries = _AUTO.setdefault(model, {})
    if key not in entries:
        ids = calibration_ids(model, text, tokens, "channels", log)
        if log:
            log(f"hadamard: choosing channel subsets on {ids.shape[1]} tokens of {text!r}")
        entries[key] = calibrate_hadamard(model, ids, spec)
    return entries[key]


def layer_channels(model_or_config, spec: QuantSpec, calibration, n_layers: int) -> list:
    """Per layer: the per-KV-head channel lists a ``hadamard_calibrated`` cache rotates (None
    for other specs). ``calibration``: ``"auto"``, a list from :func:`calibrate_hadamard` or a
    file from :func:`save_hadamard_channels`."""
    if not spec.hadamard_calibrated:
        return [None] * n_layers
    if calibration is None:
        raise ValueError("hadamard_calibrated needs the channel subsets: KVBitsCache(model, "
                         "spec, calibration='auto') (chosen on SOTU 1900-1999), a list from "
                         "kvbits.methods.hadamard.calibrate_hadamard or a file from "
                         "save_hadamard_channels")
    channels = per_layer_calibration(calibration, model_or_config,
                                     lambda model: auto_hadamard_channels(model, spec),
                                     lambda path: load_hadamard_channels(path, model_or_config,
                                                                         spec),
                                     "Hadamard calibration", n_layers)
    # lists checked here, before any layer is built or attended (files: when loaded)
    if isinstance(calibration, (list, tuple)):
        check_channels(channels, model_or_config, "Hadamard calibration", n_layers)
    return channels
