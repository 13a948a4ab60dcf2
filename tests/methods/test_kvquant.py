"""Tests for kvbits.methods.kvquant: k-means codebooks, NUQ quantization with outliers,
calibration files (round trip and refusal)."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from tiny_decoders import tiny_gemma2

from kvbits.methods import kvquant as kvq
from kvbits.reference import quant as ref_quant
from kvbits.spec import resolve_spec


# ------------------------------------------------------------------------------------ k-means
def brute_force(x, w, k, ends=None):
    """Best objective over all splits of the sorted values into k contiguous runs, each at its
    weighted mean; with ``ends = (lo, hi)`` the first and last runs sit at ``lo`` and ``hi`` and
    may be empty (the inner ones never are)."""
    order = x.double().argsort()
    xs, ws = x.double()[order], w.double()[order]
    n = xs.numel()
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        runs = list(itertools.pairwise((0, *cuts, n)))
        if any(b <= a for a, b in (runs if ends is None else runs[1:-1])):
            continue
        total = 0.0
        for m, (a, b) in enumerate(runs):
            if ends is not None and m in (0, k - 1):
                c = ends[0] if m == 0 else ends[1]
            else:
                c = (ws[a:b] * xs[a:b]).sum() / ws[a:b].sum()
            total += float((ws[a:b] * (xs[a:b] - c) ** 2).sum())
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_kmeans_matches_brute_force(seed, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, generator=g) * 3
    w = torch.rand(10, generator=g) + 0.05
    cb = kvq.kmeans_1d(x, w, k)
    assert cb.shape == (k,) and bool((cb[1:] >= cb[:-1]).all())
    got = kvq.kmeans_objective(x, w, cb)
    want = brute_force(x, w, k)
    # kmeans_1d normalizes weights to mean 1 (+1e-9): same argmin, objective scaled back here
    assert got <= want * (1 + 1e-5) + 1e-9, (got, want)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [2, 3, 4])
def test_kmeans_pinned_ends_matches_brute_force(seed, k):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(9, generator=g) * 3
    w = torch.rand(9, generator=g) + 0.05
    cb = kvq.kmeans_1d(x, w, k, ends=(0.0, 3.0))
    assert cb.shape == (k,) and float(cb[0]) == 0.0 and float(cb[-1]) == 3.0
    assert bool((cb[1:] >= cb[:-1]).all())
    wn = w.double() / w.double().mean()  # kmeans_1d's own normalization of the weights
    got = kvq.kmeans_objective(x, wn, cb)
    assert got <= brute_force(x, wn, k, ends=(0.0, 3.0)) * (1 + 1e-5) + 1e-9


def test_kmeans_pinned_ends_few_values_and_bad_k():
    cb = kvq.kmeans_1d(torch.tensor([1.0, 1.0, 2.0]), None, 8, ends=(0.0, 7.0))
    assert cb.tolist()[0] == 0.0 and cb.tolist()[-1] == 7.0 and {1.0, 2.0} <= set(cb.tolist())
    with pytest.raises(ValueError, match="k >= 2"):
        kvq.kmeans_1d(torch.rand(10), None, 1, ends=(0.0, 1.0))
    for bad in (0, -1, 2.0):  # were an IndexError / a negative-size error inside
        with pytest.raises(ValueError, match="kmeans_1d: k must be a positive int"):
            kvq.kmeans_1d(torch.rand(10), None, bad)


def test_kmeans_histogram_path_beats_uniform():
    g = torch.Generator().manual_seed(0)
    u = (torch.randn(20000, generator=g).clamp(-3, 3) + 3) / 6 * 7  # bell shape on [0, 7]
    cb = kvq.kmeans_1d(u, None, 8)
    assert kvq.kmeans_objective(u, None, cb) < 0.8 * kvq.kmeans_objective(
        u, None, torch.arange(8.0))


def test_kmeans_fewer_values_than_clusters():
    cb = kvq.kmeans_1d(torch.tensor([1.0, 1.0, 2.0]), None, 4)
    assert cb.shape == (4,) and set(cb.tolist()) == {1.0, 2.0}


# ------------------------------------------------------------------------ quantize / dequantize
def data(B=2, H=3, T=64, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_uniform_codebook_is_kivi(bits):
    """arange(2**bits) as codebook: KIVI's scales and zeros exactly, its codes except where an
    element sits exactly on a .5 boundary (round-half-even vs the upper threshold bucket)."""
    k, v = data()
    cb = kvq.uniform_codebooks(3, bits, bits)
    for got, want, n in (
        (kvq.quantize_keys(k, bits, 32, cb.k_codebook, cb.k_thresholds),
         ref_quant.quantize_keys(k, bits, 32), k.numel()),
        (kvq.quantize_values(v, bits, 32, 32, cb.v_codebook, cb.v_thresholds),
         ref_quant.quantize_values(v, bits, 32, 32), v.numel())):
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert got[3] is None and got[4] is None
        same = (got[0] == want[0]).float().mean()
        assert same > 1 - 1e-3, f"{bits} bits: {1 - same:.2%} of words differ"


def test_codes_are_nearest_codebook_entry():
    k, _ = data()
    g = torch.Generator().manual_seed(3)
    cb = torch.sort(torch.rand(3, 8, generator=g) * 7).values
    th = kvq.thresholds_of(cb)
    codes, scale, zero, _, _ = kvq.quantize_keys(k, 3, 32, cb, th)
    deq = kvq.dequantize_keys(codes, scale, zero, 3, 32, cb)
    # every element dequantizes to its nearest candidate codebook[h, j] * scale + zero
    s = scale.float().repeat_interleave(32, dim=2)
    z = zero.float().repeat_interleave(32, dim=2)
    cand = cb[None, :, None, None, :] * s[..., None] + z[..., None]  # [B,H,T,D,8]
    best = (cand - k[..., None]).abs().min(-1).values
    assert ((deq - k).abs() - best).max() < 1e-4


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_outliers_recovered_and_excluded_from_range(kind):
    k, v = data()
    x = (k if kind == "keys" else v).clone()
    spikes = [(0, 1, 5, 7), (1, 2, 40, 63), (0, 0, 33, 0)]
    for b, h, t, d in spikes:
        x[b, h, t, d] = 50.0
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, :3] = False  # padding
    cb = kvq.uniform_codebooks(3, 2, 2)
    if kind == "keys":
        codes, scale, zero, oi, ov = kvq.quantize_keys(x, 2, 32, cb.k_codebook, cb.k_thresholds,
                                                       1, valid)
        deq = kvq.dequantize_keys(codes, scale, zero, 2, 32, cb.k_codebook, oi, ov)
    else:
        codes, scale, zero, oi, ov = kvq.quantize_values(x, 2, 32, 32, cb.v_codebook,
                                                         cb.v_thresholds, 1, valid)
        deq = kvq.dequantize_values(codes, scale, zero, 2, 32, 32, cb.v_codebook, oi, ov)
    assert oi.shape == ov.shape == (2, 3, 64, 1) and oi.dtype == torch.uint8
    assert ov.dtype == torch.float16
    for b, h, t, d in spikes:
        assert oi[b, h, t, 0] == d, "the spike must be the token's outlier"
        assert abs(float(deq[b, h, t, d]) - 50.0) < 50.0 * 2**-10, "outlier recovered"
    assert float(scale.max()) < 5.0, "spikes excluded from the dense range (50 / 3 otherwise)"
    # every outlier position is recovered to FP16 precision of its correction
    got = deq.gather(-1, oi.long())
    want = x.gather(-1, oi.long())
    real = valid[:, None, :, None].expand_as(got)
    assert ((got - want).abs()[real] <= ov.float().abs()[real] * 2**-10 + 1e-6).all()
    assert (ov[1, :, :3] == 0).all() and (oi[1, :, :3] == 0).all(), "padding has no outliers"


@pytest.mark.parametrize("rows", [False, True], ids=["group-scales", "offline-rows"])
def test_zero_tokens_give_empty_outputs(rows):
    """An empty body (T = 0, a multiple of G): quantize_keys returned empty outputs of the
    documented shapes already; quantize_values raised "cannot reshape tensor of 0 elements"
    (the shared ungroup). Both now give empty codes, scales and outliers, and dequantize back."""
    B, H, D, G, bits, n_out = 2, 2, 64, 32, 3, 1
    cb = kvq.uniform_codebooks(H, bits, bits)
    x = torch.randn(B, H, 0, D, dtype=torch.float16)
    valid = torch.ones(B, 0, dtype=torch.bool)
    fixed = (torch.ones(H, D), torch.zeros(H, D)) if rows else None
    kc, ks, kz, ki, kv_ = kvq.quantize_keys(x, bits, G, cb.k_codebook, cb.k_thresholds, n_out,
                                            valid, fixed)
    assert kc.shape == (B, H, 0, D) and ks.shape == kz.shape == (B, H, 1 if rows else 0, D)
    assert ki.shape == kv_.shape == (B, H, 0, n_out)
    got = kvq.dequantize_keys(kc, ks, kz, bits, G, cb.k_codebook, ki, kv_,
                              groups=0 if rows else None)
    assert got.shape == (B, H, 0, D)
    vc, vs, vz, vi, vv = kvq.quantize_values(x, bits, 32, G, cb.v_codebook, cb.v_thresholds,
                                             n_out, valid)
    assert vc.shape == (B, H, 0, D) and vs.shape == vz.shape == (B, H, 0, 2)
    assert vi.shape == vv.shape == (B, H, 0, n_out)
    got = kvq.dequantize_values(vc, vs, vz, bits, 32, G, cb.v_codebook, vi, vv)
    assert got.shape == (B, H, 0, D)


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_outlier_rule_keys_absolute_values_per_spread(kind):
    """A token 10 spreads out in a channel of small spread (0.01 -> 0.1) and 3 spreads out in a
    channel of large spread (10 -> 30). Keys (two channels of one 32-token group): its one
    outlier is the large channel, whose range it stretches by ~20 against ~0.1 (the rule before
    session 57 divided by each channel's spread and took the small one). Values (two channel
    groups of one token): the distance is still divided by each group's spread, so the small
    group's element, 10 spreads out, is the outlier (session 57 measured both ways for values:
    equal perplexity, more of Gemma3's passkey margin kept this way)."""
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 1, 1, 32, 64
    x = torch.randn(B, H, T, D, generator=g) * 0.5
    cb = kvq.uniform_codebooks(H, 3, 3)
    if kind == "keys":
        x[..., 3] = torch.randn(T, generator=g) * 0.01
        x[..., 9] = torch.randn(T, generator=g) * 10
        x[0, 0, 17, 3], x[0, 0, 17, 9] = 0.1, 30.0 + x[..., 9].abs().max()
        *_, oi, _ = kvq.quantize_keys(x, 3, 32, cb.k_codebook, cb.k_thresholds, 1)
        t, want = 17, 9
    else:  # token 5: channels 0-31 of small spread, 32-63 of large
        x[0, 0, 5, :32] = torch.randn(32, generator=g) * 0.01
        x[0, 0, 5, 32:] = torch.randn(32, generator=g) * 10
        x[0, 0, 5, 3], x[0, 0, 5, 40] = 0.1, 3 * x[0, 0, 5, 32:].abs().median()
        *_, oi, _ = kvq.quantize_values(x, 3, 32, 32, cb.v_codebook, cb.v_thresholds, 1)
        t, want = 5, 3
    assert int(oi[0, 0, t, 0]) == want


def test_calibration_of_another_outlier_rule_is_used_with_a_warning(calibrated, tmp_path):
    """A file fitted under the earlier outlier rule (no ``outlier_rule`` in its extra) still
    serves, with a warning that names both rules; this kvbits' own files load silently, and a
    spec without outliers or with offline key rows (whose fit the rule does not change) is not
    warned about."""
    import warnings

    model, spec, cal, _ = calibrated
    assert cal.extra["outlier_rule"] == kvq.OUTLIER_RULE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvq.Calibration.load(cal.save(tmp_path / "new.safetensors")).check(model, spec)
    old = copy.deepcopy(cal)
    del old.extra["outlier_rule"]
    loaded = kvq.Calibration.load(old.save(tmp_path / "old.safetensors"))
    with pytest.warns(UserWarning, match=r"chosen by the 'mad' rule, not this kvbits' "
                                         r"'keys-abs-median'.*kvbits calibrate"):
        loaded.check(model, spec)
    for other in (spec.replace(outliers=0.0), spec.replace(key_scales="calibrated")):
        unruled = copy.deepcopy(loaded)  # no outliers, or key outliers by largest error
        unruled.spec = kvq.spec_fields(other)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            unruled.check(model, other)


def test_outliers_reduce_error():
    k, _ = data(seed=5)
    k = k + (torch.rand_like(k) < 0.01) * 8.0  # sparse spikes
    cb = kvq.uniform_codebooks(3, 3, 3)

    def err(n):
        c, s, z, oi, ov = kvq.quantize_keys(k, 3, 32, cb.k_codebook, cb.k_thresholds, n)
        return ((kvq.dequantize_keys(c, s, z, 3, 32, cb.k_codebook, oi, ov) - k) ** 2).mean()
    assert err(1) < 0.7 * err(0)


# ---------------------------------------------------------------------------------- calibration
def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    spec = resolve_spec("kvquant-3", codebook="head", qnorm=True)
    cal = kvq.calibrate(model, ids, spec, model_name="tiny", preset="kvquant-3", data="random",
                        window=128)
    path = cal.save(tmp_path_factory.mktemp("cal") / "tiny.safetensors")
    return model, spec, cal, path


def test_calibration_shapes_and_round_trip(calibrated):
    model, spec, cal, path = calibrated
    assert len(cal.layers) == 2
    layer = cal.layers[0]
    assert layer.k_codebook.shape == (2, 8) and layer.k_thresholds.shape == (2, 7)
    assert layer.v_codebook.shape == (2, 8) and layer.v_thresholds.shape == (2, 7)
    assert bool((layer.k_thresholds[:, 1:] >= layer.k_thresholds[:, :-1]).all())
    loaded = kvq.Calibration.load(path)
    assert (loaded.model, loaded.preset, loaded.data) == ("tiny", "kvquant-3", "random")
    assert loaded.date and loaded.fingerprint == kvq.model_fingerprint(model)
    for a, b in zip(cal.layers, loaded.layers):
        for name in ("k_codebook", "k_thresholds", "v_codebook", "v_thresholds"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    loaded.check(model, spec)  # no error


def test_failed_save_leaves_no_partial_file(calibrated, tmp_path, monkeypatch):
    """A save that fails at the final rename; the temporary file went with it only since a CLI
    audit found `.cal.tmp` left behind (a folder for the path, then; now refused before)."""
    _, _, cal, _ = calibrated

    def failing_replace(src, dst):
        raise PermissionError(f"cannot rename {src} to {dst}")
    monkeypatch.setattr("kvbits.files.os.replace", failing_replace)
    with pytest.raises(OSError):
        cal.save(tmp_path / "cal")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_calibration_save_keeps_the_umask_mode_and_devices(calibrated, tmp_path):
    """safetensors made calibration files 0600 (the automatic calibration cache unreadable to
    other users), and a save into a FIFO or /dev/null replaced it with a regular file."""
    import os
    import stat
    import threading

    _, _, cal, _ = calibrated
    mask = os.umask(0o022)
    try:
        path = cal.save(tmp_path / "c.safetensors")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        os.umask(mask)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    cal.save(fifo)
    reader.join(10)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and got
    (tmp_path / "from_fifo.safetensors").write_bytes(got[0])
    back = kvq.Calibration.load(tmp_path / "from_fifo.safetensors")
    assert all(torch.equal(a.k_codebook, b.k_codebook) for a, b in zip(cal.layers, back.layers))


def test_calibration_refuses_other_spec_and_model(calibrated):
    from kvbits.integrations.hf import KVBitsCache

    model, spec, cal, path = calibrated
    with pytest.raises(ValueError, match="key_bits"):
        KVBitsCache(model, spec.replace(key_bits=2, value_bits=2), calibration=str(path))
    with pytest.raises(ValueError, match="outliers"):
        cal.check(model, spec.replace(outliers=0.0))
    with pytest.raises(ValueError, match="calibration was made for model tiny"):
        KVBitsCache(tiny_llama(seed=1), spec, calibration=path)
    cache = KVBitsCache(model, spec, calibration=path)
    assert torch.equal(cache.layers[1].codebooks.v_codebook, cal.layers[1].v_codebook)
    # built from a config, the shape is still compared (it was not: session 47 QA)
    KVBitsCache(model.config, spec, calibration=path)
    other = copy.deepcopy(model.config)
    other.head_dim = 16
    with pytest.raises(ValueError, match=r"not for this model \(llama-L2-H2-D16\)"):
        KVBitsCache(other, spec, calibration=path)
    with pytest.raises(ValueError, match="needs codebooks"):
        KVBitsCache(model, spec)
    with pytest.raises(ValueError, match="not a kvbits kvquant calibration"):
        from safetensors.torch import save_file

        bad = path.with_name("bad.safetensors")
        save_file({"x": torch.zeros(1)}, str(bad))
        KVBitsCache(model, spec, calibration=bad)


def test_damaged_calibration_files_are_refused_by_name(calibrated, tmp_path):
    """Metadata that is not JSON or lacks its spec / fingerprint, and a table missing or of the
    wrong length: refused when loaded, naming the damage (raw JSONDecodeError / KeyError, or an
    AttributeError at the first forward, before; session 47 QA)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, _, _, path = calibrated
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = dict(f.metadata())

    def load(tensors=tensors, **edit):
        out = tmp_path / "edited.safetensors"
        doc = {k: v for k, v in {**meta, **edit}.items() if v is not None}
        save_file(tensors, str(out), metadata=doc)
        return kvq.Calibration.load(out)
    load()  # the unedited copy loads
    for edit, want in (({"spec": "{oops"}, "metadata is not JSON"),
                       ({"spec": None}, r"lacks \['spec'\]"),
                       ({"fingerprint": None}, r"lacks \['fingerprint'\]")):
        with pytest.raises(ValueError, match="damaged kvquant calibration: .*" + want):
            load(**edit)
    cut = tensors["layers.1.v_thresholds"][:, :-1].contiguous()  # one threshold short
    short = dict(tensors, **{"layers.1.v_thresholds": cut})
    for damaged in ({k: v for k, v in tensors.items() if k != "layers.0.k_codebook"}, short):
        with pytest.raises(ValueError, match="damaged kvquant calibration: layer .'s [kv]_"):
            load(damaged)
    # thresholds out of order (searchsorted coded against them silently) or a NaN / inf entry
    th = tensors["layers.1.k_thresholds"]
    cb = tensors["layers.0.v_codebook"]
    for name, bad in (("layers.1.k_thresholds", th.flip(-1).contiguous()),
                      ("layers.1.k_thresholds", th.clone().index_fill_(-1, torch.tensor([0]),
                                                                       float("nan"))),
                      ("layers.0.v_codebook", cb.clone().index_fill_(-1, torch.tensor([1]),
                                                                     float("inf")))):
        with pytest.raises(ValueError, match=f"layer {name[7]}'s {name[9]}_codebook .*"
                           "non-finite entry or thresholds out of ascending order"):
            load(dict(tensors, **{name: bad}))
    repeated = cb.clone()
    repeated[:, 1] = repeated[:, 0]  # repeated entries (k-means on few values gives them): fine
    load(dict(tensors, **{"layers.0.v_codebook": repeated}))
    # A QA audit: a codebook out of order (against ordered thresholds: codes took the wrong
    # entries silently), an 'extra' that is not an object (AttributeError in check), a 'probe'
    # that is not a list of numbers (TypeError in check), a stray tensor (IndexError)
    with pytest.raises(ValueError, match="layer 0's v_codebook .*out of ascending order"):
        load(dict(tensors, **{"layers.0.v_codebook": cb.flip(-1).contiguous()}))
    for edit, want in (({"extra": "[]"}, "'extra' '\\[\\]' is not a JSON object"),
                       ({"extra": "null"}, "'extra' 'null' is not a JSON object"),
                       ({"probe": '"abc"'}, "'probe' '\"abc\"' is not a list of numbers"),
                       ({"probe": "[1, null]"}, "'probe' .* is not a list of numbers")):
        with pytest.raises(ValueError, match="damaged kvquant calibration: its metadata's " + want):
            load(**edit)
    with pytest.raises(ValueError, match=r"damaged kvquant calibration: it holds tensors \['x'\]"):
        load(dict(tensors, x=torch.zeros(1)))


def test_calibration_of_another_head_or_layer_count_is_refused_by_file(calibrated, tmp_path):
    """A QA pass: a file whose fingerprint matches the model but whose codebooks are of another
    KV head count loaded, and was refused only at the first forward, inside the cache store,
    naming no file; one of another layer count named no file either."""
    import dataclasses

    from kvbits.integrations.hf import KVBitsCache

    model, spec, cal, _ = calibrated
    one_head = [kvq.LayerCodebooks(*(t[:1] for t in (layer.k_codebook, layer.k_thresholds,
                                                     layer.v_codebook, layer.v_thresholds)))
                for layer in cal.layers]
    path = dataclasses.replace(cal, layers=one_head).save(tmp_path / "one_head.safetensors")
    with pytest.raises(ValueError, match=r"calibration '.*one_head\.safetensors' holds codebooks "
                                         r"for 1/1 KV heads .* at layer 0, the model has 2 KV "
                                         "heads"):
        KVBitsCache(model, spec, calibration=path)
    deep = cal.layers + copy.deepcopy(cal.layers)
    path = dataclasses.replace(cal, layers=deep).save(tmp_path / "deep.safetensors")
    with pytest.raises(ValueError, match=r"calibration '.*deep\.safetensors' has 4 layers, the "
                                         r"model 2"):
        KVBitsCache(model, spec, calibration=path)
    with pytest.raises(ValueError, match=r"calibration \(preset kvquant-3\) holds codebooks for "
                                         r"1/1 KV heads"):
        KVBitsCache(model, spec, calibration=dataclasses.replace(cal, layers=one_head))


def test_calibration_without_its_probe_says_so(calibrated, tmp_path):
    """A QA pass: a file without its 'probe' metadata (its fingerprint the probe's, which only
    files with a probe carry) said "made for model tiny (F), not for this model (F)", the same
    fingerprint twice. It is damaged, and cannot be checked against the model: said so. An old
    file (a legacy fingerprint, no probe) of another model still compares legacy fingerprints."""
    import dataclasses

    from kvbits.integrations.hf import KVBitsCache

    model, spec, cal, _ = calibrated
    path = dataclasses.replace(cal, probe=None).save(tmp_path / "noprobe.safetensors")
    with pytest.raises(ValueError, match=r"calibration '.*noprobe\.safetensors' has no weight "
                                         r"probe .*: the file is damaged .*cannot be checked "
                                         r"against this model") as info:
        KVBitsCache(model, spec, calibration=path)
    assert str(info.value).count(cal.fingerprint) == 1
    legacy = dataclasses.replace(cal, probe=None, fingerprint=kvq._legacy_fingerprint(model))
    other = tiny_llama(seed=1)
    with pytest.raises(ValueError, match="calibration was made for model tiny") as info:
        legacy.check(other, spec)
    assert kvq._legacy_fingerprint(other) in str(info.value)
    legacy.check(model, spec)  # an old file of this model still loads


def test_calibration_follows_the_weights_not_their_dtype(calibrated):
    """`kvbits calibrate` runs in float32 on the CPU; the same model in float16 or bfloat16 (a
    GPU) is the same model: accepted. Other weights of the same shape are refused, also for
    models whose K projection is fused into one QKV weight (Phi-3's ``qkv_proj``), and files
    written before the weight probe still compare their exact fingerprint."""
    import copy
    import dataclasses

    from transformers import Phi3Config, Phi3ForCausalLM

    model, spec, cal, path = calibrated
    loaded = kvq.Calibration.load(path)
    assert loaded.probe is not None and len(loaded.probe) == kvq.PROBE_VALUES
    for dtype in (torch.float16, torch.bfloat16):
        half = copy.deepcopy(model).to(dtype)
        loaded.check(half, spec)  # no error
        assert kvq.model_fingerprint(half).rsplit("-", 1)[0] == cal.fingerprint.rsplit("-", 1)[0]
    with pytest.raises(ValueError, match="calibration was made for model tiny"):
        loaded.check(tiny_llama(seed=1).to(torch.bfloat16), spec)

    def phi3(seed):
        torch.manual_seed(seed)
        return Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=2, pad_token_id=0)).eval()
    a, b = phi3(0), phi3(1)
    assert "noweights" not in kvq.model_fingerprint(a)
    assert kvq.model_fingerprint(a) != kvq.model_fingerprint(b)
    assert not kvq.probes_match(kvq.weight_probe(a), kvq.weight_probe(b))
    legacy = dataclasses.replace(loaded, probe=None,
                                 fingerprint=kvq._legacy_fingerprint(model))
    legacy.check(model, spec)
    with pytest.raises(ValueError, match="calibration was made for model"):
        legacy.check(tiny_llama(seed=1), spec)


def test_calibration_of_a_softcapped_model():
    """Gemma2 caps its attention logits, which SDPA cannot: calibration records K/V through the
    model's own eager attention instead of failing, and the calibrated cache decodes close to
    the model (within the error of the same codebooks on post-RoPE keys)."""
    from kvbits.integrations.hf import KVBitsCache
    from kvbits.spec import resolve_spec

    model = tiny_gemma2(softcap=0.5)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(1))
    x = ids[:, :120]
    with torch.no_grad():
        full = model(input_ids=x).logits
    errs = {}
    for preset in ("kvquant-3", "kvquant-3-post"):
        spec = resolve_spec(preset).replace(residual_length=8)
        cache = KVBitsCache(model, spec, calibration=kvq.calibrate(model, ids, spec, window=64))
        with torch.no_grad():
            parts = [model(input_ids=x[:, :80], past_key_values=cache, use_cache=True).logits]
            parts += [model(input_ids=x[:, t:t + 1], past_key_values=cache,
                            use_cache=True).logits for t in range(80, 120)]
        errs[preset] = ((torch.cat(parts, 1) - full).abs().max() / full.abs().max()).item()
    assert errs["kvquant-3"] < 0.2 and errs["kvquant-3"] < 2 * errs["kvquant-3-post"], errs


def test_fisher_weights_change_the_codebook(calibrated):
    model, spec, cal, _ = calibrated
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    plain = kvq.calibrate(model, ids, spec.replace(fisher=False), window=128)
    assert not torch.allclose(plain.layers[0].k_codebook, cal.layers[0].k_codebook)


# ---------------------------------------------------------------------------------- spec and CLI
def test_kvquant_presets_and_validation():
    from kvbits.spec import PRESETS, QuantSpec

    s = PRESETS["kvquant-3"]
    assert (s.method, s.key_bits, s.value_bits, s.pre_rope, s.outliers) == ("kvquant", 3, 3,
                                                                           True, 0.01)
    assert s.n_outliers(64) == 1 and s.n_outliers(256) == 3 and s.calibrated
    assert PRESETS["kvquant-3-dense"].outliers == 0 and not PRESETS["kvquant-3-post"].pre_rope
    # One attention-sink token in FP16 by default (benchmarks/results/ppl_kvquant_sinks.md).
    assert {PRESETS[f"kvquant-{b}{v}"].sink_tokens for b in (2, 3, 4)
            for v in ("", "-dense", "-post")} == {1}
    with pytest.raises(ValueError, match="outliers"):
        QuantSpec(method="kvquant", outliers=0.5)
    with pytest.raises(ValueError, match="codebook"):
        QuantSpec(method="kvquant", codebook="token")
    with pytest.raises(ValueError, match="pre_rope"):
        QuantSpec(pre_rope=1)
    with pytest.raises(ValueError, match="'kvquant' only"):
        QuantSpec(method="kivi", outliers=0.01)
    # offline key scales: the same preset otherwise; a choice of two; kvquant only
    off = PRESETS["kvquant-3-offline"]
    assert off.key_scales == "calibrated" and off.replace(key_scales="group") == s
    assert "keys=calibrated" in off.describe() and PRESETS["kvquant-3"].key_scales == "group"
    with pytest.raises(ValueError, match="key_scales must be one of 'group', 'calibrated'"):
        QuantSpec(method="kvquant", key_scales="offline")
    with pytest.raises(ValueError, match="key_scales applies to method 'kvquant' only"):
        QuantSpec(key_scales="calibrated")


def test_cli_parses_kvquant_overrides_and_refuses_kivi_calibration():
    from kvbits.cli import CalibrateConfig, parse_presets, run_calibrate

    (v,) = parse_presets("kvquant-3:O=0.02,P=0,qnorm=1,codebook=head,fisher=false")
    s = v.spec
    assert (s.outliers, s.pre_rope, s.qnorm, s.codebook, s.fisher) == (0.02, False, True,
                                                                        "head", False)
    with pytest.raises(ValueError, match="kvquant"):
        run_calibrate(CalibrateConfig(variant=parse_presets("kivi-2")[0]))


@pytest.mark.parametrize("preset", ["kvquant-3", "kvquant-3-post", "kvquant-2"])
def test_elements_past_float16_range_saturate_without_nan(preset):
    """A BF16/FP32 model can hold a K or V element past float16's range: like the dense scales,
    the outlier correction saturates at +-65504 instead of becoming inf (NaN attention); the
    store, the reference and the kernel (interpreter on CPU) all stay finite."""
    import math

    from kvbits import ops
    from kvbits.cache.store import LayerStore

    g = torch.Generator().manual_seed(3)
    B, H, T, D = 1, 2, 65, 64  # one sink token and two groups of 32
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(2))
    k[0, 1, 40, 9] = -2e5
    v[0, 0, 5, 3] = 1e5
    spec = resolve_spec(preset, residual_length=0)
    st = LayerStore(spec, B, H, D, torch.bfloat16, "cpu",
                    inv_freq=inv if spec.pre_rope else None)
    st.append(k.bfloat16(), v.bfloat16(), flush=False)
    st.flush()
    assert torch.isfinite(st.k_out_val.float()).all() and torch.isfinite(st.v_out_val.float()).all()
    deq = kvq.dequantize_values(st.v_codes, st.v_scale, st.v_zero, spec.value_bits, 32, 32,
                                st.codebooks.v_codebook, st.v_out_idx, st.v_out_val)
    assert abs(float(deq[0, 0, 4, 3]) - ref_quant.FP16_MAX) < 64, "saturated, not lost"
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    out = ops.decode_attention(q, st.view(), scale=1 / math.sqrt(D), starts=st.starts)
    assert torch.isfinite(out.float()).all()


def test_outlier_correction_never_rounds_past_float16_range():
    """An FP16 value of 65504 kept as an outlier over a dense part whose top level is 48: the
    correction 65456 rounds to the float16 65472 and the element dequantized to 65520, inf in
    float16, so an FP16 attention output over it was inf. One float16 step back keeps it finite
    (session 49 QA, tests/cache/test_store_stateful.py)."""
    import math

    from kvbits import ops
    from kvbits.cache.store import LayerStore

    B, H, T, D = 1, 1, 32, 64
    v = torch.full((B, H, T, D), 16.0)
    v[..., 0], v[..., 1], v[..., 2] = ref_quant.FP16_MAX, 48.0, 0.0
    spec = resolve_spec("kvquant-2-post", residual_length=0, sink_tokens=0, outliers=1 / D)
    st = LayerStore(spec, B, H, D, torch.float16, "cpu")
    st.append(torch.zeros(B, H, T, D, dtype=torch.float16), v.half())
    assert st.body_len == T and st.v_out_idx[0, 0, :, 0].eq(0).all()  # channel 0: the outlier
    deq = kvq.dequantize_values(st.v_codes, st.v_scale, st.v_zero, spec.value_bits, 32, 32,
                                st.codebooks.v_codebook, st.v_out_idx, st.v_out_val)
    assert deq.abs().max() <= ref_quant.FP16_MAX and deq[0, 0, :, 0].min() > 65400
    q = torch.zeros(B, H, 1, D, dtype=torch.float16)  # equal scores: the mean of the values
    out = ops.decode_attention(q, st.view(), scale=1 / math.sqrt(D), starts=st.starts)
    assert torch.isfinite(out).all() and out[0, 0, 0, 0] > 65400


def test_calibration_uses_every_token():
    """Calibration windows cover the whole text (the tokens past the last whole window were
    dropped while the metadata recorded them); empty text is refused by name."""
    from kvbits.methods import calibration_windows

    assert calibration_windows(1100, 512) == [(0, 512), (512, 1024), (1024, 1100)]
    assert calibration_windows(1025, 512) == [(0, 512), (512, 1024)]  # 1 token: nothing to score
    assert calibration_windows(100, 512) == [(0, 100)]
    with pytest.raises(ValueError, match="at least 2 tokens of text, got 0"):
        calibration_windows(0, 512)


def test_calibration_errors_name_the_real_problem():
    """A window of 1 token said "at least 2 tokens of text, got 256" (the window was the
    problem); 11 tokens of text said "at least 32 tokens per window" (the total is)."""
    from kvbits.methods import calibration_windows

    with pytest.raises(ValueError, match=r"calibration window must be at least 2 tokens .*"
                                         r"got window=1"):
        calibration_windows(256, 1)
    spec = resolve_spec("kvquant-3")
    k = v = torch.randn(2, 11, 16)
    with pytest.raises(ValueError, match=r"at least 32 tokens of text in all .*got 11: give more "
                                         r"--tokens"):
        kvq.fit_layer(k, v, None, None, spec, window=512)


# --------------------------------------------------------- offline key scales (key_scales)
def test_offline_key_rows_and_quantization():
    """key_scales="calibrated": one FP16 scale / zero per (head, channel) from calibration
    quantiles; keys outside saturate at the codebook's ends and the outliers take the largest
    errors; a constant channel dequantizes to its value."""
    g = torch.Generator().manual_seed(5)
    H, D, bits = 2, 16, 3
    calib = torch.randn(H, 2000, D, generator=g) * 2 + 1
    calib[:, :, 3] = 0.75  # a constant channel
    scale, zero = kvq.offline_key_rows(calib, bits, q=0.01)
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == (H, D)
    assert float(scale[0, 3]) == 0 and float(zero[0, 3]) == 0.75
    lo = calib.sort(dim=1).values[:, 9]  # the 0.5% quantile of 2000 values: the 10th
    assert torch.allclose(zero.float(), lo, atol=1e-2)
    cb = kvq.uniform_codebooks(H, bits, bits).k_codebook
    k = torch.randn(1, H, 64, D, generator=g) * 2 + 1
    k[0, 0, 5, 7] = 40.0  # far past the offline range
    for n_out in (0, 1):
        words, s, z, oi, ov = kvq.quantize_keys(k, bits, 32, cb, kvq.thresholds_of(cb), n_out,
                                                rows=(scale, zero))
        assert s.shape == (1, H, 1, D) and torch.equal(s[0, :, 0], scale)
        x = kvq.dequantize_keys(words, s, z, bits, 32, cb, oi, ov, groups=2)
        top = zero.float() + scale.float() * (2**bits - 1)
        inside = (k[0] >= zero.float()[:, None]) & (k[0] <= top[:, None])
        step = scale.float()[:, None].expand_as(k[0])
        assert bool(((x[0] - k[0]).abs() <= step / 2 + 1e-3)[inside].all())
        if not n_out:  # (with one, channel 3's error is often the token's largest)
            assert torch.equal(x[0, :, :, 3], torch.full_like(x[0, :, :, 3], 0.75))
        # saturated: the last level, unless the token's outlier corrects it exactly
        want = 40.0 if n_out else float(top[0, 7])
        assert abs(float(x[0, 0, 5, 7]) - want) < 2e-2
        if n_out:
            assert int(oi[0, 0, 5, 0]) == 7


def test_offline_key_rows_pick_the_least_error_range_at_3_bits_and_more():
    """Without ``q``: at 2 bits the fixed OFFLINE_KEY_QUANTILE; at 3 and 4 bits, per channel,
    the candidate quantile range of least squared error of uniform quantization with saturation
    (never worse than the fixed one, narrower for a Gaussian channel); a constant channel
    gets scale 0, no NaN; the rule names the automatic calibration's cache key."""
    g = torch.Generator().manual_seed(7)
    H, T, D = 2, 3000, 8
    calib = torch.randn(H, T, D, generator=g)
    calib[:, :, 1] = torch.distributions.StudentT(1.5).sample((H, T))  # heavy tails
    calib[:, :, 2] = -0.5  # constant
    assert all(torch.equal(a, b) for a, b in zip(
        kvq.offline_key_rows(calib, 2), kvq.offline_key_rows(calib, 2, q=kvq.OFFLINE_KEY_QUANTILE),
        strict=True))

    def err(rows, bits):
        s, z = (t.float()[:, None, :] for t in rows)
        lv = (1 << bits) - 1
        codes = ((calib - z) / torch.where(s > 0, s, 1.0)).round().clamp(0, lv)
        return (calib - (z + codes * s)).square().mean(1)

    for bits in (3, 4):
        best, fixed = kvq.offline_key_rows(calib, bits), kvq.offline_key_rows(calib, bits, q=0.002)
        assert not any(bool(t.isnan().any()) for t in best)
        assert bool((err(best, bits) <= err(fixed, bits) * (1 + 1e-3) + 1e-6).all()), bits
        # Gaussian channels: the least-error clip is inside the 0.2% quantiles (~3.1 sigma)
        assert bool((best[0][:, 0] < fixed[0][:, 0]).all()), bits
        assert float(best[0][0, 2]) == 0 and float(best[1][0, 2]) == -0.5
    spec = resolve_spec("kvquant-3-offline")
    model = tiny_llama()
    assert kvq.calibration_path(model, spec, "t", 10) != kvq.calibration_path(
        model, spec.replace(key_scales="group"), "t", 10)


def test_offline_key_scales_calibrate_save_and_refuse(tmp_path):
    """calibrate() fits the rows (each window's first token left out) and the codebook on keys
    normalized by them; the file carries them; a group-scale file is refused for the offline
    spec and the other way; files written before the field existed still load."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvbits.integrations.hf import KVBitsCache

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    spec = resolve_spec("kvquant-3-offline")
    cal = kvq.calibrate(model, ids, spec, model_name="tiny", preset="kvquant-3-offline",
                        window=128)
    layer = cal.layers[0]
    assert layer.k_scale.shape == layer.k_zero.shape == (2, 32)
    assert layer.k_scale.dtype == torch.float16 and bool((layer.k_scale > 0).all())
    path = cal.save(tmp_path / "off.safetensors")
    loaded = kvq.Calibration.load(path)
    assert torch.equal(loaded.layers[1].k_zero, cal.layers[1].k_zero)
    cache = KVBitsCache(model, spec, calibration=path)
    assert torch.equal(cache.layers[0].codebooks.k_scale, layer.k_scale)
    with pytest.raises(ValueError, match="key_scales"):
        KVBitsCache(model, resolve_spec("kvquant-3"), calibration=path)
    with pytest.raises(ValueError, match="offline key scale and zero rows"):
        KVBitsCache(model, spec, calibration="uniform").update(
            torch.zeros(1, 2, 40, 32), torch.zeros(1, 2, 40, 32), 0)
    # a file from before key_scales existed: no such metadata field, read as "group"
    plain = kvq.calibrate(model, ids, resolve_spec("kvquant-3"), window=128)
    p2 = plain.save(tmp_path / "old.safetensors")
    with safe_open(str(p2), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in list(f.keys())}
    spec_meta = json.loads(meta["spec"])
    del spec_meta["key_scales"]
    meta["spec"] = json.dumps(spec_meta)
    save_file(tensors, str(p2), metadata=meta)
    kvq.Calibration.load(p2).check(model, resolve_spec("kvquant-3"))  # no error
    assert (kvq.calibration_path(model, resolve_spec("kvquant-3"), "t", 4)
            != kvq.calibration_path(model, spec, "t", 4))


def test_calibration_cache_of_a_text_file_follows_its_contents(tmp_path, monkeypatch):
    """`kvbits ppl --presets kvquant-3 --calib-text cal.txt` cached the codebooks under a key of
    the path alone: run again after cal.txt changed (or from another folder with another
    cal.txt) it reused the codebooks of the old text without a word."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    model, spec = tiny_llama(), resolve_spec("kvquant-3")
    (tmp_path / "cal.txt").write_text("The first calibration text.\n")
    first = kvq.calibration_path(model, spec, "cal.txt", 10)
    assert kvq.calibration_path(model, spec, "cal.txt", 10) == first
    (tmp_path / "cal.txt").write_text("Another text altogether.\n")
    assert kvq.calibration_path(model, spec, "cal.txt", 10) != first
    (tmp_path / "cal.txt").write_text("The first calibration text.\r\n")  # the same text read
    assert kvq.calibration_path(model, spec, "cal.txt", 10) == first


def test_bad_tables_and_outlier_counts_are_refused_by_name():
    """A codebook / thresholds of another width than ``2**bits`` (or another head count) and an
    outlier count outside ``[0, head_dim]``: refused naming the parameter. A 4-bit table at 3
    bits quantized silently (codes 8-15 lost their top bit in the packing), a 2-bit table at 3
    bits dequantized codes 4-7 from the next head's entries, and n_out > head_dim failed
    inside topk ("selected index k out of range")."""
    B, H, T, D, G, bits = 1, 2, 16, 8, 8, 3
    x = torch.randn(B, H, T, D)
    ok, small, wide = (kvq.uniform_codebooks(H, b, b) for b in (bits, 2, 4))
    for quant, args in ((kvq.quantize_keys, (x, bits, G)), (kvq.quantize_values, (x, bits, 4, G))):
        for cb in (small, wide):
            with pytest.raises(ValueError, match=r"codebook must be \[kv_heads, 8\]"):
                quant(*args, cb.k_codebook, ok.k_thresholds)
            with pytest.raises(ValueError, match=r"thresholds must be \[kv_heads, 7\]"):
                quant(*args, ok.k_codebook, cb.k_thresholds)
        with pytest.raises(ValueError, match=r"codebook must be \[kv_heads, 8\] = \[2, 8\]"):
            quant(*args, ok.k_codebook[:1], ok.k_thresholds[:1])
        for n_out in (-1, D + 1, 1.0, True):
            with pytest.raises(ValueError, match=r"n_out must be an int in \[0, head_dim=8\]"):
                quant(*args, ok.k_codebook, ok.k_thresholds, n_out)
        with pytest.raises(ValueError, match="group_size must be a positive int"):
            quant(*args[:-1], 0, ok.k_codebook, ok.k_thresholds)
        quant(*args, ok.k_codebook, ok.k_thresholds, D)  # every channel an outlier: fine
    kc, ks, kz, _, _ = kvq.quantize_keys(x, bits, G, ok.k_codebook, ok.k_thresholds)
    with pytest.raises(ValueError, match=r"dequantize_keys: codebook must be \[kv_heads, 8\]"):
        kvq.dequantize_keys(kc, ks, kz, bits, G, small.k_codebook)
    vc, vs, vz, _, _ = kvq.quantize_values(x, bits, 4, G, ok.v_codebook, ok.v_thresholds)
    with pytest.raises(ValueError, match=r"dequantize_values: codebook must be \[kv_heads, 8\]"):
        kvq.dequantize_values(vc, vs, vz, bits, 4, G, small.v_codebook)


def test_dequantize_refuses_scales_of_another_shape():
    """As the reference's: a keys' zero of one group broadcast over both groups silently, and
    value scales of another channel grouping (value_group 16 against 8) likewise."""
    x = torch.randn(1, 2, 64, 16)
    cb = kvq.uniform_codebooks(2, 3, 3)
    kc, ks, kz, ki, kv_ = kvq.quantize_keys(x, 3, 32, cb.k_codebook, cb.k_thresholds, 1)
    vc, vs, vz, vi, vv = kvq.quantize_values(x, 3, 8, 32, cb.v_codebook, cb.v_thresholds, 1)
    with pytest.raises(ValueError, match=r"dequantize_keys: zero must be \[1, 2, 2, 16\]"):
        kvq.dequantize_keys(kc, ks, kz[:, :, :1], 3, 32, cb.k_codebook, ki, kv_)
    with pytest.raises(ValueError, match=r"dequantize_values: scale must be \[1, 2, 64, 1\]"):
        kvq.dequantize_values(vc, vs, vz, 3, 16, 32, cb.v_codebook, vi, vv)
    with pytest.raises(ValueError, match="scale holds 40 tokens, not whole groups"):
        kvq.dequantize_values(vc, vs[:, :, :40], vz[:, :, :40], 3, 8, 32, cb.v_codebook)
    rows = ks[:, :, :1], kz[:, :, :1]  # offline rows: one [B, H, 1, D] row for every group
    assert kvq.dequantize_keys(kc, *rows, 3, 32, cb.k_codebook, groups=2).shape == x.shape


@pytest.mark.parametrize("ids, err, match", [
    ([[1, 2, 3] * 20], TypeError, "input_ids must be a torch.Tensor"),
    (torch.rand(1, 64), TypeError, "input_ids must be integer token ids"),
    (torch.randint(0, 128, (2, 64)), ValueError, r"shape \[1, T\] or \[T\]"),
    (torch.full((1, 64), 500), ValueError, r"input_ids must be in \[0, 128\)"),
])
def test_calibrate_refuses_bad_input_ids(ids, err, match):
    """input_ids that are not one text of valid ids are refused by name: a list or float ids
    failed inside the embedding, ids past the vocabulary were an IndexError there, and a batch of
    two was silently calibrated as one text run across the sequences' boundary."""
    with pytest.raises(err, match=match):
        kvq.calibrate(tiny_llama(), ids, resolve_spec("kvquant-3"))


def test_calibrate_and_check_refuse_what_is_not_a_spec_or_model(calibrated):
    """A preset name for ``spec`` was an AttributeError; Calibration.check with something that is
    neither a model nor a config (None, a name) passed silently."""
    model, spec, cal, _ = calibrated
    with pytest.raises(TypeError, match="spec must be a QuantSpec"):
        kvq.calibrate(model, torch.zeros(1, 64, dtype=torch.long), "kvquant-3")
    with pytest.raises(TypeError, match="spec must be a QuantSpec"):
        cal.check(model, "kvquant-3")
    for bad in (None, "tiny"):
        with pytest.raises(TypeError, match="model must be a transformers model or its config"):
            cal.check(bad, spec)
    cal.check(model, spec)
    cal.check(model.config, spec)


def test_auto_calibration_refuses_bad_tokens_and_text():
    """tokens that are not an integer >= 2 made a cache path first: a string then failed inside
    tokenize_text (a TypeError), 0 or 1 only after the text was loaded and tokenized; a text that
    is not a string was a TypeError in pathlib."""
    model, spec = tiny_llama(), resolve_spec("kvquant-3")
    for bad in ("4096", 0, 1, True, 2.5):
        with pytest.raises(ValueError, match="calibration tokens must be an integer >= 2"):
            kvq.auto_calibration(model, spec, tokens=bad)
    with pytest.raises(TypeError, match="calibration text must be a text name or a file path"):
        kvq.calibration_path(model, spec, 7, 4096)
    assert kvq.calibration_path(model, spec, "t", 10) == kvq.calibration_path(model, spec, "t", 10)


def test_calibrate_takes_int32_or_1d_ids_and_refuses_a_bad_window():
    """int32 ids failed in the Fisher loss ("expected target dtype to be Long"); a window that is
    a float or a string was a TypeError inside naming nothing (True was read as 1)."""
    model, spec = tiny_llama(), resolve_spec("kvquant-3", fisher=False)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    for bad in (8.0, "64", None, True):
        with pytest.raises(ValueError, match="calibrate: window must be an integer >= 2"):
            kvq.calibrate(model, ids, spec, window=bad)
    ref = kvq.calibrate(model, ids, resolve_spec("kvquant-3"), window=64)
    for other in (ids.int(), ids[0]):
        cal = kvq.calibrate(model, other, resolve_spec("kvquant-3"), window=64)
        assert torch.equal(cal.layers[0].k_codebook, ref.layers[0].k_codebook)


def test_calibration_save_and_load_refuse_a_folder(calibrated, tmp_path):
    """A folder for the path: save wrote the file and then failed renaming it onto the folder
    (IsADirectoryError), load said "No such device (os error 19)"."""
    _, _, cal, _ = calibrated
    with pytest.raises(IsADirectoryError, match=r"Calibration.save: path .* is a folder"):
        cal.save(tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="it is a folder"):
        kvq.Calibration.load(tmp_path)


def model_kv(model, ids):
    """Per layer the model's own (post-RoPE) K and V ``[H, T, D]`` of ``ids`` (full layers)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


@pytest.mark.parametrize("fisher", [False, True])
def test_softcapped_calibration_records_the_models_own_keys_and_values(fisher):
    """With Gemma2's logit cap the recorded K/V are the model's: the capture ran the model's own
    eager attention on the SDPA mask (none on the causal fast path, or a boolean one it adds to
    the scores), so every token saw the ones after it and the K/V of every layer past the first
    (and the Fisher weights) were another model's."""
    model = tiny_gemma2()
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    got = kvq.collect_kv(model, ids, window=48, fisher=fisher, pre_rope=False)
    for i, ((k_ref, v_ref), (k, v, *_)) in enumerate(zip(model_kv(model, ids), got)):
        torch.testing.assert_close(k_ref, k, msg=f"layer {i} keys")
        torch.testing.assert_close(v_ref, v, msg=f"layer {i} values")


@pytest.mark.parametrize("bad", ["one-head", "flat", "transposed", "single"])
def test_offline_rows_of_another_shape_are_refused_by_name(bad):
    """``rows`` must be the offline ``(scale, zero)`` pair of ``[kv_heads, head_dim]`` rows: one
    head's row failed in a reshape naming no argument, and a flat ``[H * D]`` or transposed
    ``[D, H]`` one was quantized with silently, reshaped as if it were ``[H, D]``."""
    H, D = 2, 8
    x = torch.randn(1, H, 32, D)
    cb = kvq.uniform_codebooks(H, 2, 2)
    s, z = kvq.offline_key_rows(x[0], 2)
    rows = {"one-head": (s[:1], z[:1]), "flat": (s.reshape(-1), z.reshape(-1)),
            "transposed": (s.T, z.T), "single": (s,)}[bad]
    with pytest.raises(ValueError, match=r"rows must be the offline \(scale, zero\) pair of "
                                         r"\[kv_heads, head_dim\] = \[2, 8\]"):
        kvq.quantize_keys(x, 2, 32, cb.k_codebook, cb.k_thresholds, 1, rows=rows)
    kvq.quantize_keys(x, 2, 32, cb.k_codebook, cb.k_thresholds, 1, rows=(s, z))  # fine


@pytest.mark.parametrize("side", ["keys", "values"])
def test_float64_codebooks_dequantize_with_outliers(side):
    """A float64 codebook (fitted outside kvbits, e.g. from numpy) quantizes, and its
    dequantization adds the outliers too: the float32 corrections were scattered into the float64
    dense values ("scatter(): Expected self.dtype to be equal to src.dtype")."""
    x = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(0))
    cb = kvq.uniform_codebooks(2, 3, 3)
    cb64, th64 = cb.k_codebook.double(), cb.k_thresholds.double()
    if side == "keys":
        c, s, z, oi, ov = kvq.quantize_keys(x, 3, 32, cb64, th64, 2)
        got = kvq.dequantize_keys(c, s, z, 3, 32, cb64, oi, ov)
        c, s, z, oi, ov = kvq.quantize_keys(x, 3, 32, cb.k_codebook, cb.k_thresholds, 2)
        want = kvq.dequantize_keys(c, s, z, 3, 32, cb.k_codebook, oi, ov)
    else:
        c, s, z, oi, ov = kvq.quantize_values(x, 3, 8, 32, cb64, th64, 2)
        got = kvq.dequantize_values(c, s, z, 3, 8, 32, cb64, oi, ov)
        c, s, z, oi, ov = kvq.quantize_values(x, 3, 8, 32, cb.v_codebook, cb.v_thresholds, 2)
        want = kvq.dequantize_values(c, s, z, 3, 8, 32, cb.v_codebook, oi, ov)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_offline_key_rows_top_code_stays_in_float16_range(bits):
    """Offline key rows of keys spanning float16's whole range (a BF16 / FP32 model): the top
    uniform code ``zero + (2**bits - 1) * scale`` stays at or below 65504, as the group min/max
    ones do (the scale had rounded up: 2 bits gave 65536, inf in a float16 dequantization)."""
    k = torch.tensor([-65504.0, 65504.0]).repeat(16).view(1, 32, 1).expand(2, 32, 8).contiguous()
    scale, zero = kvq.offline_key_rows(k, bits, q=0.0)
    top = zero.float() + scale.float() * ((1 << bits) - 1)
    assert (top <= 65504).all() and (top > 65000).all(), top.max()
    assert torch.isfinite(top.half()).all()  # (one float16 rounding, as the kernels have it)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_kmeans_refuses_weights_not_finite_or_negative(bad):
    """A NaN weight failed with "The expanded size of the tensor (4) must match the existing
    size (0)"; an inf one made the fit silently (almost) unweighted."""
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    w = torch.rand(50, generator=torch.Generator().manual_seed(1)) + 0.1
    w[3] = bad
    with pytest.raises(ValueError, match=r"kmeans_1d: w \(the weights\) must be finite and >= 0"):
        kvq.kmeans_1d(x, w, 4)


def test_calibrate_names_fisher_weights_overflowed_in_float16():
    """A float16 model whose logits overflow: the loss and its gradients, the Fisher weights,
    are not finite; calibrate named that and the fix, not k-means' "expanded size ... (0)"."""
    model = tiny_llama().half()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e6)  # logits past float16's 65504
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"calibrate: the Fisher weights .* of layer 0's keys "
                                         r"are not finite: .*float16.*calibrate in float32"):
        kvq.calibrate(model, ids, resolve_spec("kvquant-3"), window=128)


def test_offline_rows_and_table_widths_of_a_damaged_file_are_refused_by_name(tmp_path):
    """Offline key rows (k_scale / k_zero) NaN, inf, negative scales, missing or of another shape,
    and codebooks of another width than the file's own spec: refused when loaded, naming the file
    and the tensor (they loaded silently, or a width was refused later naming no file)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    cal = kvq.calibrate(model, ids, resolve_spec("kvquant-3-offline"), window=128)
    path = cal.save(tmp_path / "off.safetensors")
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = dict(f.metadata())

    def load(edit):
        out = tmp_path / "edited.safetensors"
        save_file({k: v for k, v in {**tensors, **edit}.items() if v is not None}, str(out),
                  metadata=meta)
        return kvq.Calibration.load(out)
    load({})  # the unedited copy loads
    s, z = tensors["layers.1.k_scale"], tensors["layers.1.k_zero"]
    for name, bad in (("k_scale", s.clone().index_fill_(-1, torch.tensor([2]), float("nan"))),
                      ("k_zero", z.clone().index_fill_(-1, torch.tensor([0]), float("inf"))),
                      ("k_scale", -s),
                      ("k_scale", s[:, :-1].contiguous()),
                      ("k_zero", z[:1].contiguous()),
                      ("k_zero", None)):
        with pytest.raises(ValueError, match=r"'.*edited\.safetensors' is a damaged kvquant "
                                             rf"calibration: layer 1's (.* )?{name}"):
            load({f"layers.1.{name}": bad})
    cb = tensors["layers.0.v_codebook"]  # 3 bits: 8 entries; 4 entries and 3 thresholds
    with pytest.raises(ValueError, match=r"damaged kvquant calibration: layer 0's v_codebook .* "
                                         r"value_bits=3"):
        load({"layers.0.v_codebook": cb[:, :4].contiguous(),
              "layers.0.v_thresholds": kvq.thresholds_of(cb[:, :4]).contiguous()})


@pytest.mark.parametrize("preset", ["kvquant-3", "kvquant-3-offline", "kvquant-2:codebook=head"])
def test_constant_and_sub_resolution_groups_do_not_shape_the_codebooks(preset):
    """Groups the FP16 scale cannot resolve (a constant channel: scale 0; a range within a few
    float16 steps of the zero) dequantize to their zero whatever the codebook, and normalize to
    rounding artifacts. Fitted on, they pulled the key codebooks of a repeated-token text onto
    0 and ~2**bits - 1, with entries far outside (SmolLM2 on ' the' x 256: layer 0 keys had 50x
    the error of the uniform codebook on other text; a QA audit). They are left out, and a
    layer left with nothing to fit takes the uniform codebook."""
    spec = resolve_spec(preset, fisher=False)
    g = torch.Generator().manual_seed(0)
    H, T, D = 2, 64, 32
    levels = (1 << spec.key_bits) - 1
    v = torch.randn(H, T, D, generator=g)
    # every key channel constant, or varying below float16's resolution at its magnitude
    k = 10 + torch.randn(H, 1, D, generator=g) + 1e-6 * torch.randn(H, T, D, generator=g)
    k[:, :, ::2] = k[:, :1, ::2]
    cb = kvq.fit_layer(k, v, None, None, spec, window=T)
    uniform = torch.arange(levels + 1, dtype=torch.float32).expand(H, -1)
    assert torch.equal(cb.k_codebook, uniform) and torch.equal(cb.k_thresholds,
                                                               kvq.thresholds_of(uniform))
    # half the channels real: the codebook is fitted on them alone, within the code range
    k[:, :, 1::4] = torch.randn(H, T, D // 4, generator=g)
    cb = kvq.fit_layer(k, v, None, None, spec, window=T)
    assert not torch.equal(cb.k_codebook, uniform)
    assert cb.k_codebook.min() > -0.5 and cb.k_codebook.max() < levels + 0.5, cb.k_codebook
    assert cb.v_codebook.isfinite().all()


def test_repeated_token_calibration_of_a_model_gives_usable_codebooks():
    """The same through calibrate: a text of one repeated token makes every pre-RoPE key
    channel of the first layer constant."""
    model = tiny_llama()
    cal = kvq.calibrate(model, torch.full((1, 64), 5), resolve_spec("kvquant-3"))
    uniform = torch.arange(8, dtype=torch.float32).expand(2, -1)
    assert torch.equal(cal.layers[0].k_codebook, uniform)
    for layer in cal.layers:
        for t in (layer.k_codebook, layer.v_codebook):
            assert t.isfinite().all() and t.min() > -0.5 and t.max() < 7.5, t
