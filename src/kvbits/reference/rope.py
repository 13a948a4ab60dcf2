"""Rotary position embedding (RoPE) in the convention of transformers' Llama family.

``rotate(x, pos, inv_freq)`` is ``x * cos + rotate_half(x) * sin`` with ``angle = pos * inv_freq``
computed in float32 and duplicated over the two halves of the head dimension (``rotate_half``
pairs channel ``i`` with ``i + D/2``). ``unrotate`` applies the inverse rotation (``sin -> -sin``).

The model's ``attention_scaling`` (YaRN, LongRoPE) multiplies cos and sin, i.e. the post-RoPE key
is ``s * R(pos) k``. kvbits un-rotates with the *pure* rotation, so the stored pre-RoPE key is
``s * k`` and re-rotating it with the pure rotation gives back exactly the model's key: the
scaling never needs to be known. Only ``inv_freq`` (which carries the default / linear / llama3
frequency scaling) matters; it is read from the model's own rotary module
(:func:`model_inv_freqs`), per layer type for Gemma3.

A partial rotary embedding (Phi, StableLM, GPT-NeoX: rotate-half over the first ``2n`` of ``D``
channels, the rest passed through) is the whole-head convention in another channel order:
:func:`partial_rotary_layout` gives that order and its frequencies (zero for the passed-through
channels), so the cache and the kernels serve it unchanged.

A model without a rotary embedding (GPT-2, OPT, StarCoder: learned or no positions) has keys
that are position-free already: :func:`model_inv_freqs` gives ``None`` for its layers, which
then store keys as they come. Interleaved pairs (GPT-J, CodeGen's ``rotate_every_two``) are
refused: their pre-RoPE keys are not this module's.
"""

from __future__ import annotations

import sys

import torch

# rope types whose frequencies depend on the sequence length at run time: the cache cannot
# re-rotate stored keys consistently with them.
_DYNAMIC_TYPES = ("dynamic", "longrope")


def _cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor):
    """cos, sin ``[..., D]`` for integer positions ``pos [...]``."""
    freqs = pos.float()[..., None] * inv_freq.float().to(pos.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check(op: str, x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """``x [B, H, T, D]``, ``pos [B or 1, T]``, ``inv_freq [D / 2]`` (metadata only): a
    ``[B, 1]`` pos turned every token by its first position silently, the rest failed in a
    broadcast naming no argument."""
    ok = (x.dim() == 4 and pos.dim() == 2 and pos.shape[1] == x.shape[2]
          and pos.shape[0] in (1, x.shape[0]) and inv_freq.dim() == 1
          and 2 * inv_freq.numel() == x.shape[3])
    if not ok:
        raise ValueError(f"{op}: x must be [B, H, T, D], pos [B or 1, T] and inv_freq [D / 2]; "
                         f"got x {list(x.shape)}, pos {list(pos.shape)}, inv_freq "
                         f"{list(inv_freq.shape)}")


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` rotated at positions ``pos [B, T]`` (float32 result)."""
    _check("rotate", x, pos, inv_freq)
    cos, sin = _cos_sin(pos, inv_freq)
    cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    return xf * cos + _rotate_half(xf) * sin


def unrotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rotate` (float32 result)."""
    _check("unrotate", x, pos, inv_freq)
    cos, sin = _cos_sin(pos, inv_freq)
    cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    return xf * cos - _rotate_half(xf) * sin


def token_positions(starts: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """RoPE positions ``[B, n]`` of stored tokens ``first .. first + n - 1``.

    Token ``t`` of sequence ``b`` sits at position ``t - starts[b]`` (``starts``: left padding),
    which is what transformers gives it (``position_ids = cumsum(attention_mask) - 1`` in
    ``generate``, ``past_seen_tokens + arange`` without a mask). Padding gets negative positions,
    clamped to 0 (it is never attended).
    """
    t = first + torch.arange(n, device=starts.device)
    return (t[None, :] - starts[:, None].long()).clamp_(min=0)


def model_inv_freqs(model_or_config,
                    layer_types: list[str] | None = None) -> list[torch.Tensor | None]:
    """float32 ``inv_freq [D/2]`` of every decoder layer, from the model's rotary module.

    A model's ``rotary_emb`` module is read (``inv_freq``, or ``{layer_type}_inv_freq`` for models
    with one rotary embedding per layer type such as Gemma3); for a bare config the frequencies
    come from transformers' ``ROPE_INIT_FUNCTIONS`` (or the default formula). ``None`` for every
    layer of a model without a rotary embedding (:func:`_has_rope`); neighbour-pair rotary
    embeddings are refused (:func:`_check_rotate_half`).
    """
    config = model_or_config.config if hasattr(model_or_config, "config") else model_or_config
    config = config.get_text_config(decoder=True)
    n = config.num_hidden_layers
    types = layer_types or getattr(config, "layer_types", None) or ["full_attention"] * n
    module = None
    if hasattr(model_or_config, "modules"):
        _check_rotate_half(model_or_config)
        module = next((m for name, m in model_or_config.named_modules()
                       if name.endswith("rotary_emb")), None)
    if module is None and not _has_rope(model_or_config, config):
        return [None] * n
    out = []
    for i in range(n):
        lt = types[i]
        params = _rope_params(config, lt)
        rtype = (params or {}).get("rope_type", "default")
        if rtype in _DYNAMIC_TYPES:
            raise NotImplementedError(
                f"pre_rope: rope_type {rtype!r} (layer {i}) changes frequencies with the sequence "
                "length; use pre_rope=False for this model")
        inv = None
        if module is not None:
            inv = getattr(module, f"{lt}_inv_freq", None)
            if inv is None:
                inv = getattr(module, "inv_freq", None)
        if inv is None:
            inv = _inv_freq_from_config(config, lt, rtype)
        inv = inv.detach().float().cpu().clone()
        if not _uses_rope(config, i):  # a NoPE layer (SmolLM3, Llama 4): rotation by angle 0
            inv.zero_()
        out.append(inv)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for i, inv in enumerate(out):  # (fewer: a partial rotary embedding, partial_rotary_layout)
        if 2 * inv.numel() > head_dim:
            raise ValueError(f"pre_rope: layer {i} has {inv.numel()} RoPE frequencies for its "
                             f"{head_dim} key channels; at most head_dim / 2 can pair up")
    return out


def _modeling_modules(model) -> list:
    """The Python modules (modeling files) that define the model's submodules."""
    return [sys.modules[n] for n in sorted({type(m).__module__ for m in model.modules()})
            if n in sys.modules]


def _has_rope(model_or_config, config) -> bool:
    """Whether the model turns keys by position: its config names RoPE parameters, or (a
    model) a modeling file of its defines ``apply_rotary_pos_emb``. GPT-2, OPT, Bloom and
    GPT-BigCode have neither."""
    if any(getattr(config, a, None) is not None for a in (
            "rope_parameters", "rope_theta", "rotary_dim", "rotary_pct", "rotary_emb_base")):
        return True
    return hasattr(model_or_config, "modules") and any(
        hasattr(mod, "apply_rotary_pos_emb") for mod in _modeling_modules(model_or_config))


def partial_rotary_layout(inv_freq: torch.Tensor, head_dim: int):
    """``(order, inv_full)`` for a head whose RoPE turns only its first ``2n`` channels
    (``n = len(inv_freq)``; rotate-half pairs ``i`` with ``i + n``, the other ``D - 2n`` pass
    through): ``x[..., order]`` puts those pairs at ``i`` and ``i + D/2`` and the passed-through
    channels in pairs of their own, whose frequency in ``inv_full [D/2]`` is zero, so the
    whole-head rotation of the reordered channels is the model's partial one. ``(None,
    inv_freq)`` when the whole head turns."""
    n, D = inv_freq.numel(), head_dim
    if 2 * n == D:
        return None, inv_freq
    if 2 * n > D or D % 2:
        raise ValueError(f"pre_rope: {n} RoPE frequencies cannot turn part of a head of {D} "
                         "channels (at most head_dim / 2, and head_dim even)")
    h = D // 2 - n  # passed-through channels per half
    order = torch.cat([torch.arange(0, n), torch.arange(2 * n, 2 * n + h),
                       torch.arange(n, 2 * n), torch.arange(2 * n + h, D)])
    return order, torch.cat([inv_freq, inv_freq.new_zeros(h)])


def _uses_rope(config, layer: int) -> bool:
    """False for the layers a ``no_rope_layers`` config (SmolLM3, Llama 4: 1 = RoPE, 0 = none)
    leaves unrotated."""
    flags = getattr(config, "no_rope_layers", None)
    return not isinstance(flags, (list, tuple)) or layer >= len(flags) or bool(flags[layer])


def _check_rotate_half(model) -> None:
    """Refuse models whose RoPE pairs channels other than ``i`` with ``i + D/2`` (Cohere,
    GLM, Helium, GPT-J and CodeGen pair neighbours): re-rotating their stored keys in this
    module's convention would still give back the model's keys, but the stored keys would not
    be pre-RoPE ones. The model's own ``rotate_half`` (in its modeling file) is probed on
    ``[1, 2, 3, 4]``; a ``rotate_every_two`` (GPT-J, CodeGen) is refused by name."""
    probe = torch.arange(1.0, 5.0)
    for mod in _modeling_modules(model):
        name = mod.__name__
        neighbours = callable(getattr(mod, "rotate_every_two", None))
        if neighbours:
            raise ValueError(
                f"pre_rope: {name} turns neighbouring channels (rotate_every_two), not channel i "
                "with i + D/2 as the Llama convention does; use pre_rope=False (e.g. "
                "kvquant-3-post) for this model")
        fn = getattr(mod, "rotate_half", None)
        if callable(fn):
            got = fn(probe)
            if not torch.equal(got, _rotate_half(probe)):
                raise ValueError(
                    f"pre_rope: {name}.rotate_half pairs channels differently (it maps [1, 2, "
                    f"3, 4] to {got.tolist()}, the Llama convention to [-3, -4, 1, 2]); use "
                    "pre_rope=False (e.g. kvquant-3-post) for this model")


def _rope_params(config, layer_type: str):
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
        return params[layer_type]
    return params if isinstance(params, dict) else None


def _inv_freq_from_config(config, layer_type: str, rope_type: str) -> torch.Tensor:
    params = _rope_params(config, layer_type) or {}
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS[rope_type]
        per_type = isinstance(getattr(config, "rope_parameters", None), dict) and \
            layer_type in config.rope_parameters
        inv, _ = fn(config, None, layer_type=layer_type) if per_type else fn(config, None)
        return inv
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
