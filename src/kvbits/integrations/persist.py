"""A :class:`~kvbits.integrations.hf.KVBitsCache` saved to a safetensors file and loaded back.

Prefix caching across sessions: a long document or system prompt is prefilled and quantized once,
and later sessions load its packed cache instead of recomputing it, at the cache's packed size on
disk (a kivi-2 file is ~5x smaller than the FP16 K/V it stands for). The file holds, per layer,
the used rows of the store's buffers (codes, scales, zeros, outliers, the FP16 sink and residual,
left padding) with its lengths, and the inputs a layer was built from that a new cache could not
recompute by itself: KVQuant codebooks, calibrated FP8 scales, Hadamard channel subsets. Its
metadata holds the spec, the shape of the model and a sample of its weights (refused on load when
they differ: codes of another model or spec, or another checkpoint of the same shape, would
decode to garbage silently).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..files import write_file_atomic
from ..methods.kvquant import probes_match, weight_probe

FORMAT = "kvbits-cache"
VERSION = 1
# Config fields that must match between the model that wrote a cache and the one that loads it.
_SHAPE_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_size", "vocab_size", "sliding_window", "layer_types",
                 "rope_theta", "rope_parameters", "rope_scaling")
_CODEBOOKS = ("k_codebook", "k_thresholds", "v_codebook", "v_thresholds")
_KEY_ROWS = ("k_scale", "k_zero")  # offline key scales (key_scales="calibrated"), when present


def model_shape(config) -> dict:
    """The fields of ``config`` (its text config) that a saved cache must agree with, as JSON;
    ``rope_theta`` also from ``rope_parameters``, where recent transformers keep it."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    shape = {k: getattr(text, k, None) for k in _SHAPE_FIELDS}
    if shape["rope_theta"] is None and isinstance(shape["rope_parameters"], dict):
        shape["rope_theta"] = shape["rope_parameters"].get("rope_theta")
    return json.loads(json.dumps(shape, default=str))


def save_cache(cache, path, **info) -> Path:
    """Write ``cache`` to ``path`` (safetensors); ``info`` (JSON-able) is kept in the metadata.
    Returns the path."""
    from safetensors.torch import save as safetensors_bytes
    from safetensors.torch import save_file

    from .. import __version__
    from .hf import KVBitsCache

    if not isinstance(cache, KVBitsCache):  # (another cache was an AttributeError inside)
        raise TypeError(f"save: cache must be a KVBitsCache, got {type(cache).__name__}")
    path = Path(path)
    if path.is_dir():  # (was safetensors' "I/O error: Is a directory", naming no path)
        raise ValueError(f"save: path {str(path)!r} is a folder; give a file name, e.g. "
                         f"{str(path / 'cache.safetensors')!r}")
    try:
        json.dumps(info)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"save: the info keywords must be JSON-able ({exc})") from None
    cache.end_step_graphs()  # the stores' lengths back on the host (step graphs)
    for layer in cache.layers:  # a sliding layer holds a whole prompt until its next step drops
        # what no later token can see: dropped now, as that step would (the file held ~10x the
        # window for Gemma3's sliding layers after an 8k-token prompt)
        if getattr(layer, "is_sliding", False) and getattr(layer, "store", None) is not None:
            layer._evict_unseen()
    tensors, layers, channels = {}, [], []
    for i, layer in enumerate(cache.layers):
        if layer.codebooks is not None:
            for n in _CODEBOOKS + _KEY_ROWS:
                if getattr(layer.codebooks, n) is not None:
                    tensors[f"layers.{i}.codebooks.{n}"] = getattr(layer.codebooks, n)
        if layer.fp8_scales is not None:
            for n, t in zip(("k", "v"), layer.fp8_scales):
                tensors[f"layers.{i}.fp8_scales.{n}"] = t
        channels.append(None if layer.hadamard_channels is None
                        else [[int(c) for c in head] for head in layer.hadamard_channels])
        store = layer.store
        if store is None:
            layers.append(None)
            continue
        buffers, scalars = store.state()
        for n, t in buffers.items():
            tensors[f"layers.{i}.store.{n}"] = t
        layers.append({"batch": store.batch, "kv_heads": store.kv_heads,
                       "head_dim": store.head_dim, **scalars})
    model = cache._model_ref() if getattr(cache, "_model_ref", None) is not None else None
    doc = {"format": FORMAT, "version": VERSION, "kvbits": __version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "spec": cache.spec.to_dict(),
           "model": model_shape(cache.config), "layers": layers, "hadamard_channels": channels,
           # which layers' codebooks the file holds (the others quantized with uniform tables),
           # so that a file that lost a table is refused rather than read as uniform
           "codebook_layers": [i for i, layer in enumerate(cache.layers)
                               if layer.codebooks is not None],
           # (a cache loaded for a config alone has no model: the file's sample travels on)
           "weights": (getattr(cache, "_kvbits_weights", None) if model is None
                       else weight_probe(model)),
           **({"info": info} if info else {})}
    host = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}
    meta = {FORMAT: json.dumps(doc)}
    write_file_atomic(path, lambda target: save_file(host, str(target), metadata=meta),
                      lambda: safetensors_bytes(host, metadata=meta))
    return path


def read_cache_file(path, tensors: bool = True) -> tuple[dict, dict]:
    """The metadata document and the tensors of a file written by :func:`save_cache`
    (``tensors=False``: the document alone, the tensors left on disk)."""
    from safetensors import SafetensorError, safe_open

    if Path(path).is_dir():  # (safetensors said "No such device (os error 19)")
        raise ValueError(f"cannot read kvbits cache file {str(path)!r}: it is a folder")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            data = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"cannot read kvbits cache file {str(path)!r}: {exc}") from None
    if FORMAT not in meta:
        raise ValueError(f"{str(path)!r} is not a kvbits cache file (no {FORMAT!r} metadata)")
    try:
        doc = json.loads(meta[FORMAT])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r}: its {FORMAT!r} metadata is not JSON ({exc})") from None
    if isinstance(doc, dict) and doc.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{str(path)!r} is not a kvbits cache file: its {FORMAT!r} metadata is "
                         f"of format {doc.get('format')!r}")
    if not isinstance(doc, dict) or type(doc.get("version")) is not int \
            or doc.get("version") != VERSION:
        version = doc.get("version") if isinstance(doc, dict) else None
        raise ValueError(f"{str(path)!r} is a kvbits cache file of version {version!r}; "
                         f"this kvbits reads version {VERSION!r}")
    problem = _doc_problem(doc)
    if problem:
        raise ValueError(f"{str(path)!r}: malformed kvbits cache metadata: {problem}")
    return doc, data


def _doc_problem(doc: dict) -> str | None:
    """What is missing or of the wrong type in a cache file's document (None when it is whole):
    a damaged file was a KeyError or a TypeError deep in the loader (session 41 QA)."""
    for key in ("model", "spec"):
        if not isinstance(doc.get(key), dict):
            return f"{key!r} must be an object, got {type(doc.get(key)).__name__}"
    layers = doc.get("layers")
    if not isinstance(layers, list):
        return f"'layers' must be a list, got {type(layers).__name__}"
    cb = doc.get("codebook_layers", [])  # (files before session 47 have none)
    if not isinstance(cb, list) or any(type(i) is not int for i in cb):
        return f"'codebook_layers' must be a list of layer indices, got {cb!r}"
    for i, meta in enumerate(layers):
        if meta is None:
            continue
        if not isinstance(meta, dict):
            return f"layer {i} must be an object or null, got {type(meta).__name__}"
        for key in ("batch", "kv_heads", "head_dim"):
            v = meta.get(key)
            if type(v) is not int or v < 1:
                return f"layer {i} {key!r} must be a positive integer, got {v!r}"
    return None


def _check_tensor_names(path, tensors: dict, n: int, spec) -> None:
    """Every tensor of the file is one that the loader reads: a tensor of a layer the file does
    not have, or of a kind its spec does not take (FP8 scales in a KIVI file), was skipped
    silently, a sign of a file put together from others."""
    parts = {"store": None}  # (the store refuses names it does not know, and says so)
    if spec.method == "kvquant":
        parts["codebooks"] = _CODEBOOKS + _KEY_ROWS
    if spec.method == "fp8" and spec.fp8_scale == "calibrated":
        parts["fp8_scales"] = ("k", "v")
    odd = []
    for key in tensors:
        _, layer, part, name = (key.split(".", 3) + ["", "", ""])[:4]
        ok = (key.startswith("layers.") and layer.isdigit() and int(layer) < n and part in parts
              and (parts[part] is None or name in parts[part]))
        if not ok:
            odd.append(key)
    if odd:
        raise ValueError(f"{str(path)!r} holds tensors that its {spec.describe()!r} cache of {n} "
                         f"layers does not: {', '.join(sorted(odd)[:5])}"
                         + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
                         + ": the file is damaged or not one kvbits wrote")


def layer_devices(model) -> dict:
    """``{layer index: device}`` of the model's attention modules (those with an integer
    ``layer_idx`` and parameters): where each layer's cache must live when the model is spread
    over devices (``device_map="auto"``)."""
    out = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        p = next(m.parameters(recurse=True), None) if isinstance(idx, int) else None
        if p is not None:
            out.setdefault(idx, p.device)
    return out


def load_cache(cls, path, model_or_config, device=None, dtype=None):
    """A new ``cls`` (:class:`~kvbits.integrations.hf.KVBitsCache`) holding the cache saved at
    ``path``, for ``model_or_config`` (the model is switched to the kvbits attention, as by the
    constructor). ``device`` / ``dtype``: where the stores live and the dtype of their FP parts
    (default: each layer's attention module's device, as on a model spread over GPUs, and the
    model's dtype; without a model, the CPU and the file's dtype)."""
    from ..methods.kvquant import LayerCodebooks
    from ..spec import QuantSpec

    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"load: dtype must be torch.float16, torch.bfloat16, torch.float32 or "
                         f"None (the model's), got {dtype!r}")
    if device is not None:
        try:  # (a bad name was torch's "Expected one of cpu, cuda, ..." naming no parameter)
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"load: device must be a torch device or its name, got {device!r} "
                             f"({exc})") from None
    doc, tensors = read_cache_file(path)
    model = model_or_config if hasattr(model_or_config, "parameters") else None
    config = model.config if model is not None else model_or_config
    saved, here = doc["model"], model_shape(config)
    # a field one side lacks (transformers versions name the RoPE fields differently) is not
    # compared; every field both have must agree
    differ = [k for k in _SHAPE_FIELDS if None not in (saved.get(k), here.get(k))
              and saved.get(k) != here.get(k)]
    if differ:
        raise ValueError(f"{str(path)!r} holds a cache of another model: "
                         + ", ".join(f"{k} {saved.get(k)!r} there, {here.get(k)!r} here"
                                     for k in differ))
    probe = weight_probe(model) if model is not None and doc.get("weights") else None
    if probe is not None and not probes_match(probe, doc["weights"]):
        raise ValueError(f"{str(path)!r} holds a cache of another model of this shape: its first "
                         "key projection's weights differ (another checkpoint or fine-tune)")
    try:
        spec = QuantSpec.from_dict(doc["spec"])
    except ValueError as exc:  # (named neither the file nor its spec)
        raise ValueError(f"{str(path)!r}: its spec is not valid: {exc}") from None
    n = len(doc["layers"])
    _check_tensor_names(path, tensors, n, spec)

    def layer_tensor(i, part, name):
        key = f"layers.{i}.{part}.{name}"
        if key not in tensors:
            raise ValueError(f"{str(path)!r} lacks {key!r}, which its {spec.describe()!r} cache "
                             "needs: the file is damaged")
        return tensors[key]
    # the calibrated inputs come from the file: no calibration runs here
    calibration = None
    if spec.method == "kvquant":
        calibration = "uniform"  # codebooks set from the file below
    elif spec.method == "fp8" and spec.fp8_scale == "calibrated":
        calibration = [tuple(layer_tensor(i, "fp8_scales", k) for k in ("k", "v"))
                       for i in range(n)]
    elif spec.hadamard_calibrated:
        calibration = doc.get("hadamard_channels")
        if not isinstance(calibration, list) or len(calibration) != n:
            raise ValueError(f"{str(path)!r}: its metadata lacks the Hadamard channels of its "
                             f"{spec.describe()!r} cache, one list per layer: the file is damaged")
    cache = cls(model_or_config, spec, calibration=calibration)
    cache._kvbits_weights = doc.get("weights")  # (saved again from a cache for a config alone)
    if len(cache.layers) != n:
        raise ValueError(f"{str(path)!r} has {n} layers, the model {len(cache.layers)}")
    devices = {}  # per layer, where the model puts the layers on several devices
    if model is not None:
        param = next(model.parameters(), None)
        if param is not None:
            if device is None:
                devices, device = layer_devices(model), param.device
            dtype = param.dtype if dtype is None else dtype
    device = torch.device("cpu" if device is None else device)
    for i, (layer, meta) in enumerate(zip(cache.layers, doc["layers"])):
        if f"layers.{i}.codebooks.k_codebook" in tensors or i in doc.get("codebook_layers", ()):
            layer.codebooks = LayerCodebooks(*(layer_tensor(i, "codebooks", c)
                                               for c in _CODEBOOKS),
                                             *(tensors.get(f"layers.{i}.codebooks.{c}")
                                               for c in _KEY_ROWS))
        if meta is None:
            continue
        prefix = f"layers.{i}.store."
        buffers = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        fp_dtype = dtype or next((buffers[n].dtype for n in ("res_k", "sink_k") if n in buffers),
                                 torch.float32)
        layer.lazy_initialization(torch.empty(meta["batch"], meta["kv_heads"], 0,
                                              meta["head_dim"], dtype=fp_dtype,
                                              device=devices.get(i, device)), None)
        scalars = {k: v for k, v in meta.items() if k not in ("batch", "kv_heads", "head_dim")}
        try:  # (the store's errors named neither the file nor the layer)
            layer.store.load_state(buffers, scalars)
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}, layer {i}: {exc}") from None
        # as after a prompt through the kvbits attention: decode steps take the packed path
        # (for a config alone, once the calling module shows it runs that attention; a model
        # on another attention gets the slow, correct path)
        layer._attended = cache._model_config is not None
    return cache
