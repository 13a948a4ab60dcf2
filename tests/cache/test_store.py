"""Tests for kvbits.cache.store.LayerStore: sink | packed body | residual bookkeeping.

Every quantized comparison here is exact (torch.equal): the store must call the quantizer on the
original tokens, whole groups at a time, so its codes, scales and zeros are *bit-identical* to
quantizing the same tokens in one go with the reference. Any re-quantization of dequantized data
(the Hugging Face QuantizedCache flaw) changes the scales and fails these tests.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbits.cache.store import LayerStore
from kvbits.formats.layout import body_bytes_per_token
from kvbits.formats.packing import packed_length
from kvbits.reference.attention import dequantize_layer
from kvbits.reference.quant import quantize_keys, quantize_values
from kvbits.spec import QuantSpec, resolve_spec

B, H, D = 2, 2, 64


@pytest.fixture(autouse=True)
def _reference_quantizer(monkeypatch):
    # The store's contract is checked against the PyTorch reference quantizer, bit for bit.
    monkeypatch.setenv("KVBITS_KERNELS", "reference")


def _kv(T, *, b=B, h=H, d=D, seed=0, dtype=torch.float16):
    """Random K/V [b, h, T, d] with per-channel key magnitudes over 3 decades (KIVI keys)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, T, d, generator=g) * 10 ** (torch.rand(d, generator=g) * 3 - 1)
    v = torch.randn(b, h, T, d, generator=g)
    return k.to(dtype), v.to(dtype)


def _store(spec, *, b=B, h=H, d=D, dtype=torch.float16):
    return LayerStore(spec, b, h, d, dtype, "cpu")


def _append_by_token(store, k, v):
    for t in range(k.shape[2]):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])


def _expected_lengths(n, S, R, G):
    sink = min(n, S)
    body = G * max(0, (n - S - R) // G)
    return sink, body, n - sink - body


def _used(store):
    """The used part of every buffer, for exact comparisons between stores."""
    ng = store.body_len // store.spec.group_size
    return {
        "sink_k": store.sink_k[:, :, :store.sink_len], "sink_v": store.sink_v[:, :, :store.sink_len],
        "k_codes": store.k_codes[:, :, :ng * store.k_words],
        "k_scale": store.k_scale[:, :, :ng], "k_zero": store.k_zero[:, :, :ng],
        "v_codes": store.v_codes[:, :, :ng * store.v_words],
        "v_scale": store.v_scale[:, :, :store.body_len],
        "v_zero": store.v_zero[:, :, :store.body_len],
        "res_k": store.res_k[:, :, :store.res_len], "res_v": store.res_v[:, :, :store.res_len],
    }


def _assert_same_state(a, b, what):
    assert (a.sink_len, a.body_len, a.res_len) == (b.sink_len, b.body_len, b.res_len), (
        f"{what}: lengths (sink, body, res) {(a.sink_len, a.body_len, a.res_len)} != "
        f"{(b.sink_len, b.body_len, b.res_len)}")
    ua, ub = _used(a), _used(b)
    for name in ua:
        assert torch.equal(ua[name], ub[name]), f"{what}: buffer {name} differs"


def _assert_matches_one_shot(store, k, v, what, valid=None, starts=None):
    """The store holds exactly sink = k[:S], body = quantize(k[S:S+body]) in one call,
    residual = the rest, unchanged. With left padding ``starts``, sequence b's sink is its own
    first S tokens k[b, :, starts[b]:starts[b]+S] instead, and ``valid`` must hide them too."""
    s = store.spec
    S, nb, nr = store.sink_len, store.body_len, store.res_len
    assert S + nb + nr == k.shape[2], f"{what}: {S}+{nb}+{nr} tokens held, {k.shape[2]} appended"
    if starts is None:
        sink_k, sink_v = k[:, :, :S], v[:, :, :S]
    else:
        sink_k = torch.stack([k[b, :, p:p + S] for b, p in enumerate(starts.tolist())])
        sink_v = torch.stack([v[b, :, p:p + S] for b, p in enumerate(starts.tolist())])
    assert torch.equal(store.sink_k[:, :, :S], sink_k), f"{what}: sink keys differ"
    assert torch.equal(store.sink_v[:, :, :S], sink_v), f"{what}: sink values differ"
    assert torch.equal(store.res_k[:, :, :nr], k[:, :, S + nb:]), f"{what}: residual keys differ"
    assert torch.equal(store.res_v[:, :, :nr], v[:, :, S + nb:]), f"{what}: residual values differ"
    if not nb:
        return
    body_valid = None if valid is None else valid[:, S:S + nb]
    want_k = quantize_keys(k[:, :, S:S + nb], s.key_bits, s.group_size, body_valid)
    want_v = quantize_values(v[:, :, S:S + nb], s.value_bits, store.value_group, s.group_size,
                             body_valid)
    used = _used(store)
    for name, got, want in zip(("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"),
                               (used["k_codes"], used["k_scale"], used["k_zero"],
                                used["v_codes"], used["v_scale"], used["v_zero"]),
                               (*want_k, *want_v)):
        if not torch.equal(got, want):
            diff = (got != want).nonzero()
            raise AssertionError(
                f"{what}: {name} differs from quantizing the original tokens in one go at "
                f"{diff.shape[0]} places, first {tuple(diff[0].tolist())} (token index along "
                f"dim 2); the history was re-quantized or flushed in the wrong groups")


# ----------------------------------------------------------------------------- flush
FLUSH_CASES = [  # (S, R, G, n)
    (0, 0, 32, 97), (0, 16, 32, 130), (4, 16, 32, 150), (0, 128, 32, 300),
    (3, 5, 64, 200), (0, 0, 128, 300), (4, 0, 64, 140), (7, 1, 32, 111),
]


@pytest.mark.parametrize("S,R,G,n", FLUSH_CASES, ids=[f"S{c[0]}-R{c[1]}-G{c[2]}" for c in FLUSH_CASES])
def test_flush_boundaries_token_by_token(S, R, G, n):
    spec = QuantSpec(group_size=G, residual_length=R, sink_tokens=S)
    store = _store(spec)
    k, v = _kv(n, seed=S + R + G)
    prev_body = 0
    for t in range(n):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        want = _expected_lengths(t + 1, S, R, G)
        got = (store.sink_len, store.body_len, store.res_len)
        assert got == want, f"after {t + 1} tokens (S={S} R={R} G={G}): (sink, body, res) = " \
                            f"{got}, expected {want}"
        assert store.body_len - prev_body in (0, G), "keys must flush one whole group at a time"
        assert store.res_len <= R + G - 1 or not spec.quantized
        prev_body = store.body_len
    assert store.body_len > 0, "the case never flushed: it tests nothing"
    _assert_matches_one_shot(store, k, v, f"S={S} R={R} G={G} token by token")


@settings(max_examples=25, deadline=None)
@given(S=st.integers(0, 6), R=st.sampled_from([0, 1, 16, 33]), G=st.sampled_from([32, 64]),
       chunks=st.lists(st.integers(1, 70), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_any_chunking_same_state(S, R, G, chunks, seed):
    spec = QuantSpec(key_bits=4, value_bits=2, group_size=G, residual_length=R, sink_tokens=S)
    n = sum(chunks)
    k, v = _kv(n, seed=seed)
    chunked, one = _store(spec), _store(spec)
    at = 0
    for c in chunks:
        chunked.append(k[:, :, at:at + c], v[:, :, at:at + c])
        at += c
        want = _expected_lengths(at, S, R, G)
        assert (chunked.sink_len, chunked.body_len, chunked.res_len) == want, (chunks, at)
    one.append(k, v)
    _assert_same_state(chunked, one, f"chunks {chunks} vs one append")
    _assert_matches_one_shot(chunked, k, v, f"chunks {chunks}")


@settings(max_examples=25, deadline=None)
@given(preset=st.sampled_from(["kivi-2", "kivi-3", "k4v2", "uniform-int4", "kivi-8"]),
       S=st.integers(0, 4), R=st.sampled_from([0, 5, 16]), G=st.sampled_from([32, 64]),
       before=st.integers(1, 200), after=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       seed=st.integers(0, 99))
def test_saved_state_continues_like_the_store(preset, S, R, G, before, after, seed):
    """``state()`` -> ``load_state()`` into a new store: the same state, and the same state again
    after further appends (flushes included); saved buffers hold only their used rows."""
    spec = resolve_spec(preset, group_size=G, residual_length=R, sink_tokens=S)
    k, v = _kv(before + sum(after), seed=seed)
    a = _store(spec)
    a.append(k[:, :, :before], v[:, :, :before])
    tensors, scalars = a.state()
    assert all(t.shape[2] <= getattr(a, n).shape[2] for n, t in tensors.items() if n != "starts")
    assert "res_k" not in tensors or tensors["res_k"].shape[2] == a.res_len
    b = _store(spec)
    b.load_state({n: t.clone() for n, t in tensors.items()}, scalars)
    assert all(getattr(b, n).shape[2] % 16 == 0 for n in tensors
               if n not in ("starts", "sink_k", "sink_v"))  # capacities in 16-row blocks
    at = before
    for c in after:
        _assert_same_state(a, b, f"{preset} after {at} tokens")
        for st_ in (a, b):
            st_.append(k[:, :, at:at + c], v[:, :, at:at + c])
        at += c
    _assert_same_state(a, b, f"{preset} after {at} tokens")


@pytest.mark.parametrize("preset", ["kivi-2", "uniform-int4", "k4v2"])
@pytest.mark.parametrize("cut", [20, 50])
def test_saved_between_a_verification_step_and_its_crop(preset, cut):
    """A store saved after a verification step (``track_flushes``, then drafts that flushed a
    group) and loaded: the crop of rejected drafts puts that group back as the saved store's
    does. Until session 50 the file lost the FP16 copies: a cut inside the group was refused
    and a cut past it left the group quantized."""
    spec = resolve_spec(preset, group_size=32, residual_length=16, sink_tokens=0)
    k, v = _kv(90)
    a = _store(spec)
    a.append(k[:, :, :40], v[:, :, :40])
    a.append(k[:, :, 40:], v[:, :, 40:], flush=False)  # the prompt's last token and 49 drafts
    a.track_flushes()
    a.flush()
    assert a.body_len == 64
    tensors, scalars = a.state()
    b = _store(spec)
    b.load_state({n: t.clone() for n, t in tensors.items()}, scalars)
    for s in (a, b):
        s.crop(cut)
    _assert_same_state(a, b, f"{preset} cut at {cut}")
    assert (a.body_len, a.res_len) == (32 * ((cut - 16) // 32), cut - 32 * ((cut - 16) // 32))
    fresh = _store(spec)  # as if the rejected drafts had never come
    fresh.append(k[:, :, :cut], v[:, :, :cut])
    _assert_same_state(b, fresh, f"{preset} cut at {cut} against a store without the drafts")


def test_a_saved_undo_of_the_wrong_shape_is_refused():
    spec = resolve_spec("kivi-2", group_size=32, residual_length=16)
    k, v = _kv(90)
    a = _store(spec)
    a.append(k, v, flush=False)
    a.track_flushes()
    a.flush()
    tensors, scalars = a.state()
    tensors["undo_k"] = tensors["undo_k"][:, :, :31]
    with pytest.raises(ValueError, match="undo_k / undo_v .* whole groups of 32"):
        _store(spec).load_state(tensors, scalars)


@pytest.mark.parametrize("preset", ["kivi-2", "kivi-3", "kivi-4", "kivi-8", "k4v2", "k8v4"])
def test_prompt_in_one_append_equals_token_by_token(preset):
    spec = resolve_spec(preset, residual_length=20, sink_tokens=3)
    k, v = _kv(173, seed=1)
    one, tok = _store(spec), _store(spec)
    one.append(k, v)
    _append_by_token(tok, k, v)
    _assert_same_state(one, tok, preset)
    _assert_matches_one_shot(one, k, v, preset)


def test_sink_filled_first():
    spec = QuantSpec(residual_length=0, sink_tokens=5)
    store = _store(spec)
    k, v = _kv(40)
    store.append(k[:, :, :3], v[:, :, :3])
    assert (store.sink_len, store.body_len, store.res_len) == (3, 0, 0)
    store.append(k[:, :, 3:9], v[:, :, 3:9])  # 2 more fill the sink, 4 go to the residual
    assert (store.sink_len, store.body_len, store.res_len) == (5, 0, 4)
    store.append(k[:, :, 9:40], v[:, :, 9:40])  # 35 after the sink: one group of 32 flushes
    assert (store.sink_len, store.body_len, store.res_len) == (5, 32, 3)
    _assert_matches_one_shot(store, k, v, "sink first")


def test_sink_keeps_fp16_exactly_beyond_quantization():
    spec = QuantSpec(residual_length=0, sink_tokens=4)
    store = _store(spec)
    k, v = _kv(68)
    store.append(k, v)
    keys, values = dequantize_layer(store.view(), dtype=torch.float16)
    assert torch.equal(keys[:, :, :4], k[:, :, :4]) and torch.equal(values[:, :, :4], v[:, :, :4])


def test_fp16_spec_never_quantizes():
    store = _store(resolve_spec("fp16"))
    k, v = _kv(300)
    store.append(k[:, :, :200], v[:, :, :200])
    _append_by_token(store, k[:, :, 200:], v[:, :, 200:])
    assert (store.sink_len, store.body_len, store.res_len) == (0, 0, 300)
    assert torch.equal(store.res_k[:, :, :300], k) and torch.equal(store.res_v[:, :, :300], v)


def test_input_dtype_cast_to_store_dtype():
    store = _store(QuantSpec(residual_length=8))
    k, v = _kv(50, dtype=torch.float32)
    store.append(k, v)
    assert store.res_k.dtype == torch.float16
    _assert_matches_one_shot(store, k.half(), v.half(), "fp32 into an fp16 store")


def test_view_is_the_storage():
    store = _store(QuantSpec(key_bits=4, value_bits=8, group_size=64, residual_length=10,
                             sink_tokens=2))
    k, v = _kv(150)
    store.append(k, v)
    kv = store.view()
    assert (kv.sink_len, kv.body_len, kv.res_len) == (2, 128, 20)
    assert (kv.key_bits, kv.value_bits, kv.group_size, kv.value_group) == (4, 8, 64, 64)
    assert kv.k_codes.data_ptr() == store.k_codes.data_ptr(), "view copied the codes"
    assert (kv.batch, kv.kv_heads, kv.head_dim, kv.total_len) == (B, H, D, 150)


# ----------------------------------------------------------------------------- reorder
def test_reorder_selects_along_batch():
    spec = QuantSpec(residual_length=16, sink_tokens=2)
    store = _store(spec, b=3)
    k, v = _kv(100, b=3, seed=4)
    store.append(k, v, flush=False)
    store.set_padding(torch.tensor([0, 3, 1]))
    store.flush()
    before = {n: t.clone() for n, t in _used(store).items()}
    dense_before = store._dense_body()  # the CPU path's dequantized body (beam search reorders
    # every step: rebuilding it dequantized all history each time)
    index = torch.tensor([2, 0, 0, 1])  # beams may repeat and change the batch size
    store.reorder(index)
    assert store.batch == 4
    for name, t in _used(store).items():
        assert torch.equal(t, before[name][index]), f"{name} does not follow the beam index"
    assert store.starts.tolist() == [1, 0, 0, 3]
    assert dense_before is not None and store._dense is not None, "the dense body was rebuilt"
    kept = store._dense
    store._dense = None  # the reference path's dense body followed the index, exactly
    assert all(torch.equal(a, b) for a, b in zip(kept, store._dense_body()))
    # Appending keeps working with the new batch, and equals a store built from reordered input.
    k2, v2 = _kv(40, b=4, seed=5)
    store.append(k2, v2)
    fresh = _store(spec, b=4)
    fresh.append(torch.cat([k[index], k2], 2), torch.cat([v[index], v2], 2), flush=False)
    fresh.set_padding(torch.tensor([1, 0, 0, 3]))
    fresh.flush()
    _assert_same_state(store, fresh, "reorder then append")


def test_reorder_index_is_checked():
    """A float index was truncated (0.9 -> row 0) and a row out of range failed inside
    ``index_select`` (a device-side assert on CUDA): both are refused by name, the store
    unchanged; a list of rows works."""
    store = _store(QuantSpec(residual_length=8), b=2)
    store.append(*_kv(40, b=2))
    before = {n: t.clone() for n, t in _used(store).items()}
    for bad, why in ((torch.tensor([0.9, 1.2]), "1-D integer tensor"),
                     (torch.tensor([[1, 0]]), "1-D integer tensor"),
                     (torch.tensor([True, False]), "1-D integer tensor"),
                     (torch.tensor([0, 2]), r"rows in \[0, 2\).*got rows 0\.\.2"),
                     (torch.tensor([-1, 0]), r"got rows -1\.\.0")):
        with pytest.raises(ValueError, match=rf"reorder: .*{why}"):
            store.reorder(bad)
    assert store.batch == 2
    assert all(torch.equal(t, before[n]) for n, t in _used(store).items())
    store.reorder([1, 0])
    assert torch.equal(store.res_k[:, :, :store.res_len], before["res_k"][[1, 0]])


def test_one_beam_index_is_read_back_once(monkeypatch):
    """transformers hands the same beam index to every layer of a step: its range is read back
    to the host (a GPU sync) once, not once per layer; an index changed in place is read again."""
    stores = [_store(QuantSpec(residual_length=8), b=2) for _ in range(4)]
    for store in stores:
        store.append(*_kv(40, b=2))
    reads = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: reads.append(1) or aminmax(t))
    index = torch.tensor([1, 0])
    for store in stores:
        store.reorder(index)
    assert len(reads) == 1
    index[0] = 2  # in place: row 2 of a batch of 2
    with pytest.raises(ValueError, match=r"got rows 0\.\.2"):
        stores[0].reorder(index)
    assert len(reads) == 2


# ----------------------------------------------------------------------------- crop
def test_crop_into_residual_then_append_equals_fresh():
    spec = QuantSpec(residual_length=16, sink_tokens=2)
    k, v = _kv(160, seed=6)
    store = _store(spec)
    store.append(k[:, :, :140], v[:, :, :140])  # body 96, residual 42 (2 + 96 + 42)
    assert (store.sink_len, store.body_len, store.res_len) == (2, 96, 42)
    store.crop(120)
    assert (store.sink_len, store.body_len, store.res_len) == (2, 96, 22)
    store.append(k[:, :, 140:], v[:, :, 140:])
    fresh = _store(spec)
    fresh.append(torch.cat([k[:, :, :120], k[:, :, 140:]], 2),
                 torch.cat([v[:, :, :120], v[:, :, 140:]], 2))
    _assert_same_state(store, fresh, "crop into residual then append")


def test_crop_negative_removes_from_end():
    store = _store(QuantSpec(residual_length=16))
    store.append(*_kv(100))
    store.crop(-5)
    assert store.seq_len == 95 and store.body_len == 64


def test_crop_past_start_empties():
    store = _store(QuantSpec(residual_length=0, sink_tokens=4))
    store.append(*_kv(100))
    store.crop(-1000)
    assert (store.sink_len, store.body_len, store.res_len) == (0, 0, 0), (
        f"crop(-1000) left lengths {(store.sink_len, store.body_len, store.res_len)}")


def test_crop_at_group_boundary_inside_body():
    spec = QuantSpec(residual_length=8, sink_tokens=3)
    store = _store(spec)
    k, v = _kv(150, seed=7)
    store.append(k, v)  # sink 3, body 128, residual 19
    full_k, full_v = dequantize_layer(store.view())
    store.crop(3 + 64)
    assert (store.sink_len, store.body_len, store.res_len) == (3, 64, 0)
    kk, vv = dequantize_layer(store.view())
    assert torch.equal(kk, full_k[:, :, :67]) and torch.equal(vv, full_v[:, :, :67])
    store.append(k[:, :, 67:], v[:, :, 67:])  # the dropped tokens come back, re-quantized once
    fresh_k, _fresh_v = dequantize_layer(store.view())
    assert store.seq_len == 150
    assert torch.equal(fresh_k[:, :, :67], full_k[:, :, :67])


def test_crop_into_sink_and_noop():
    store = _store(QuantSpec(residual_length=0, sink_tokens=5))
    k, v = _kv(70)
    store.append(k, v)
    store.crop(200)
    assert store.seq_len == 70, "crop beyond the end must be a no-op"
    store.crop(2)
    assert (store.sink_len, store.body_len, store.res_len) == (2, 0, 0)
    store.append(k[:, :, 2:], v[:, :, 2:])
    fresh = _store(QuantSpec(residual_length=0, sink_tokens=5))
    fresh.append(k, v)
    _assert_same_state(store, fresh, "crop into sink then append")


@pytest.mark.parametrize("cut", [3 + 1, 3 + 31, 3 + 33, 3 + 127])
def test_crop_inside_body_off_boundary_raises(cut):
    store = _store(QuantSpec(residual_length=8, sink_tokens=3))
    store.append(*_kv(150))
    before = (store.sink_len, store.body_len, store.res_len)
    with pytest.raises(ValueError) as err:
        store.crop(cut)
    msg = str(err.value)
    for part in (str(cut), "group", "32", "131"):  # the cut, the rule, G, the residual start
        assert part in msg, f"crop error does not mention {part!r}: {msg}"
    assert (store.sink_len, store.body_len, store.res_len) == before, "failed crop changed state"


# ----------------------------------------------------------------------------- padding
@pytest.mark.parametrize("poison", [6e4, -6e4, float("inf")])
def test_padding_kept_out_of_minmax(poison):
    S, R, G = 2, 4, 32
    spec = QuantSpec(key_bits=4, value_bits=4, group_size=G, residual_length=R, sink_tokens=S)
    T = 2 + 3 * G + 7
    k, v = _kv(T, b=3, seed=8)
    starts = torch.tensor([0, 11, 2 + G + 5])  # seq 2: the whole first body group is padding
    valid = torch.arange(T)[None, :] >= starts[:, None]
    pad = ~valid[:, None, :, None].expand_as(k)
    kp, vp = k.clone(), v.clone()
    kp[pad], vp[pad] = poison, poison
    store = _store(spec, b=3)
    store.set_padding(starts)
    store.append(kp[:, :, :50], vp[:, :, :50])
    _append_by_token(store, kp[:, :, 50:], vp[:, :, 50:])
    assert store.body_len == 3 * G
    used = _used(store)
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        assert torch.isfinite(used[name]).all(), f"padding reached {name}"
    # Identical to quantizing with the padding (and each sequence's own sink tokens, kept in
    # FP16) excluded, whatever the padding holds.
    hidden = torch.arange(T)[None, :] >= starts[:, None] + S
    _assert_matches_one_shot(store, kp, vp, f"padding poison={poison}", valid=hidden,
                             starts=starts)
    clean = _store(spec, b=3)
    clean.set_padding(starts)
    clean.append(k, v)
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        assert torch.equal(used[name], _used(clean)[name]), f"padding values changed {name}"
    assert (used["k_scale"][2, :, 0] == 0).all(), "fully padded key group must have scale 0"


def test_padded_sinks_settle_close_and_guard_edits():
    """A left-padded batch's sink holds each sequence's own first tokens, S slots as an
    unpadded sequence has, even while the shortest sequence has fewer real tokens: its later
    slots take its tokens as they come (a sink of the shortest's count, closed by the first
    flush, quantized the longer sequences' tokens that their sinks hold alone). Edits that
    would split a sequence's sink are refused."""
    S, R, G = 3, 0, 32
    spec = QuantSpec(key_bits=4, value_bits=4, group_size=G, residual_length=R, sink_tokens=S)
    k, v = _kv(100, b=2, seed=9)
    store = _store(spec, b=2)
    store.set_padding(torch.tensor([0, 39]))
    store.append(k[:, :, :40], v[:, :, :40], flush=False)  # sequence 1 holds one real token
    assert store.sink_len == 3 and torch.equal(store.sink_k[1, :, 0], k[1, :, 39])
    assert torch.equal(store.sink_k[0, :, :3], k[0, :, :3])
    store.append(k[:, :, 40:41], v[:, :, 40:41], flush=False)  # ... now two
    assert store.sink_len == 3 and torch.equal(store.sink_k[1, :, :2], k[1, :, 39:41])
    assert store.res_len == 38 and torch.equal(store.res_k[:, :, :38], k[:, :, 3:41])
    store.flush()  # the first flush: sequence 0's first three tokens stay FP16
    assert (store.sink_len, store.body_len, store.res_len) == (3, 32, 6)
    store.append(k[:, :, 41:], v[:, :, 41:])
    assert store.sink_len == 3 and torch.equal(store.sink_k[1, :, :3], k[1, :, 39:42])
    assert torch.equal(store.sink_k[0, :, :3], k[0, :, :3])
    # The reference puts the sinks back at their positions: FP16 there, bit for bit.
    keys, _ = dequantize_layer(store.view(), torch.float16, starts=store.starts)
    assert torch.equal(keys[1, :, 39:42], k[1, :, 39:42])
    assert torch.equal(keys[0, :, :3], k[0, :, :3])
    with pytest.raises(ValueError, match="own sink"):
        store.crop(41)  # sequence 1's sink reaches position 41
    with pytest.raises(ValueError, match="already holds quantized tokens"):
        store.set_padding(torch.tensor([0, 4]))
    assert store.evict(41) == 0, "the sink went while a sequence could still see it"


# ----------------------------------------------------------------------------- nbytes
NBYTES_CASES = [("kivi-2", 32, 128, 0, 16), ("kivi-3", 64, 96, 4, 0), ("k4v2", 128, 80, 0, 5),
                ("kivi-8", 32, 64, 2, 128), ("k8v4", 64, 256, 0, 33), ("fp16", 32, 128, 0, 0)]


@pytest.mark.parametrize("preset,G,d,S,R", NBYTES_CASES, ids=[c[0] for c in NBYTES_CASES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_nbytes_exact(preset, G, d, S, R, dtype):
    spec = resolve_spec(preset, group_size=G, residual_length=R, sink_tokens=S)
    store = _store(spec, b=3, h=2, d=d, dtype=dtype)
    k, v = _kv(2 * G + S + R + 13, b=3, h=2, d=d)
    store.append(k, v)
    # Count the bytes of the used part of each tensor by hand.
    want = sum(t.numel() * t.element_size() for t in _used(store).values())
    got = store.nbytes()
    assert got == want, f"{preset} G={G} D={d}: nbytes {got} != {want} counted by hand"
    if spec.quantized:
        Gv = spec.value_group(d)
        per_token = (packed_length(G, spec.key_bits) * 4 * d / G + 4 * d / G
                     + packed_length(G, spec.value_bits) * 4 * d / G + 4 * d / Gv)
        fp = (store.sink_len + store.res_len) * 2 * d * torch.tensor([], dtype=dtype).element_size()
        assert got == 3 * 2 * (fp + store.body_len * per_token)


def test_kivi2_body_costs_96_bytes_per_token():
    # K: 2 bits * 128 / 8 = 32 code bytes + FP16 scale and zero per channel per 32 tokens
    # (2 * 2 * 128 / 32 = 16); V: 32 code bytes + FP16 scale and zero per 32 channels (16).
    assert body_bytes_per_token(128, 2, 2, 32, 32) == 96
    spec = resolve_spec("kivi-2", residual_length=0)
    store = _store(spec, b=1, h=1, d=128)
    store.append(*_kv(64, b=1, h=1, d=128))
    assert (store.body_len, store.res_len) == (64, 0)
    assert store.nbytes() == 64 * 96
    store.append(*_kv(1, b=1, h=1, d=128, seed=3))  # one FP16 token: K and V, 2 * 128 * 2 bytes
    assert store.nbytes() == 64 * 96 + 512


# ----------------------------------------------------------------------------- input checks
@pytest.mark.parametrize("which", ["key_states", "value_states"])
@pytest.mark.parametrize("shape", [(B + 1, H, 4, D), (B, H + 1, 4, D), (B, H, 4, D + 1),
                                   (B, H, D), (1, B, H, 4, D)])
def test_bad_input_shape_names_the_tensor(which, shape):
    store = _store(QuantSpec())
    good = torch.zeros(B, H, 4, D, dtype=torch.float16)
    bad = torch.zeros(shape, dtype=torch.float16)
    k, v = (bad, good) if which == "key_states" else (good, bad)
    with pytest.raises(ValueError) as err:
        store.append(k, v)
    msg = str(err.value)
    assert which in msg and str(tuple(shape)) in msg, msg
    assert store.seq_len == 0


def test_token_count_mismatch():
    store = _store(QuantSpec())
    with pytest.raises(ValueError, match="key_states has 4 tokens but value_states 5"):
        store.append(torch.zeros(B, H, 4, D), torch.zeros(B, H, 5, D))


@pytest.mark.parametrize("d", [80, 96])
def test_three_bit_any_head_dim(d):
    # 3-bit codes are packed along tokens (32 per column), so any head_dim works.
    spec = QuantSpec(key_bits=3, value_bits=3, residual_length=0)
    store = _store(spec, d=d)
    k, v = _kv(70, d=d)
    store.append(k, v)
    assert store.body_len == 64
    _assert_matches_one_shot(store, k, v, f"3-bit D={d}")


def test_allocation_stays_close_to_the_tokens_held():
    # A prompt lands in the residual first; once its groups move to the body the residual must
    # not keep prompt-sized FP16 capacity, and decode-time growth must not double the body.
    spec = resolve_spec("kivi-2")
    store = LayerStore(spec, 2, 2, 64, torch.float16, "cpu")
    x = torch.randn(2, 2, 4000, 64, dtype=torch.float16)
    store.append(x, x)
    R, G = spec.residual_length, spec.group_size
    assert store.res_k.shape[2] <= 2 * (R + G)
    for _ in range(300):  # decode steps: several flushes grow the body
        t = torch.randn(2, 2, 1, 64, dtype=torch.float16)
        store.append(t, t)
    body_words = store.body_len // G * packed_length(G, 2)
    assert store.k_codes.shape[2] <= 1.25 * body_words + 16
    assert store.res_k.shape[2] <= 2 * (R + G)


def test_evict_drops_whole_invisible_groups_and_shifts_padding():
    """LayerStore.evict: whole groups before ``upto`` (and the sink before them) go once they
    are at least a quarter of those that stay; what stays is the tail of the same buffers, left padding shifts with it
    (negative past the padding), the sink never refills; device lengths keep everything."""
    from kvbits.cache.store import LayerStore
    from kvbits.spec import resolve_spec

    spec = resolve_spec("kivi-2", group_size=32, residual_length=8, sink_tokens=2)
    g = torch.Generator().manual_seed(0)
    st = LayerStore(spec, 2, 2, 64, torch.float32, "cpu")
    st.set_padding(torch.tensor([0, 5]))
    kv = [torch.randn(2, 2, 170, 64, generator=g) for _ in range(2)]
    st.append(kv[0], kv[1])  # sink 2, body 160 (5 groups), residual 8
    assert (st.sink_len, st.body_len, st.res_len) == (2, 160, 8)
    before = st.view_raw()
    assert st.evict(2 + 31) == 0  # no whole group before it
    st.body_len = 4 * 160  # (as if) 20 groups: one dead group is less than 1/4 of 19 live ones
    assert st.evict(2 + 32) == 0
    st.body_len = 160
    assert st.evict(2 + 32) == 2 + 32  # 1 group goes (and the sink), 4 stay: 1 >= 4 / 4
    assert (st.sink_len, st.body_len, st.res_len, st.evicted) == (0, 128, 8, 34)
    assert st.total_len == 170 and st.seq_len == 136
    after = st.view_raw()
    kc, vs = after.k_codes[:, :, :4 * st.k_words], after.v_scale[:, :, :128]
    torch.testing.assert_close(kc, before.k_codes[:, :, st.k_words:5 * st.k_words])
    torch.testing.assert_close(vs, before.v_scale[:, :, 32:160])
    assert all(getattr(st, n).shape[2] % 16 == 0 for n in ("k_codes", "k_scale", "v_codes"))
    assert st.starts.tolist() == [-34, -29]  # the sequences began that far before
    st.append(kv[0][:, :, :3], kv[1][:, :, :3])
    assert st.sink_len == 0 and st.res_len == 11  # the closed sink does not refill
    st.begin_device_lengths(400)
    assert st.evict(10**6) == 0  # lengths on the device: buffers stay put


def test_all_hold_real_tokens_follows_padding_through_eviction():
    """LayerStore.all_hold_real_tokens: the host-side answer the decode step reads instead of
    the mask. A left padding longer than what a sliding layer keeps stored must not keep the
    answer False once eviction has shifted it away (step graphs would stay off for good); a
    store restored from a file answers from the padding as set (a bound, never a wrong True)."""
    from kvbits.cache.store import LayerStore
    from kvbits.spec import resolve_spec

    spec = resolve_spec("kivi-2", group_size=32, residual_length=8)
    g = torch.Generator().manual_seed(1)
    st = LayerStore(spec, 2, 1, 32, torch.float32, "cpu")
    kv = [torch.randn(2, 1, 200, 32, generator=g) for _ in range(2)]
    st.append(kv[0], kv[1], flush=False)
    st.set_padding(torch.tensor([0, 150]))
    st.flush()
    assert st.all_hold_real_tokens() and not st.all_hold_real_tokens(ahead=50)
    gone = st.evict(160)
    assert gone == 160 and st.seq_len == 40 and st.starts.tolist() == [-160, -10]
    assert st.all_hold_real_tokens() and st.all_hold_real_tokens(ahead=49)
    assert not st.all_hold_real_tokens(ahead=50)  # exactly max(starts): -10 < 40 - 50 fails
    fresh = LayerStore(spec, 2, 1, 32, torch.float32, "cpu")
    fresh.load_state(*st.state())
    assert not fresh.all_hold_real_tokens()  # 150 as set: a bound above the 40 stored
    cut = LayerStore(spec, 2, 1, 32, torch.float32, "cpu")
    cut.append(kv[0][:, :, :20], kv[1][:, :, :20], flush=False)
    cut.set_padding(torch.tensor([0, 20]))  # sequence 1 is all padding so far
    assert not cut.all_hold_real_tokens()
    cut.append(kv[0][:, :, :1], kv[1][:, :, :1])
    assert cut.all_hold_real_tokens()


def test_eviction_waits_for_sink_copies_in_the_residual():
    """A padded sequence's sink tokens have copies at their positions in the body/residual,
    hidden below ``starts + sink_len`` (out of the min/max of their group when quantized). An
    eviction drops the sink and moves ``starts`` by what went, so copies still waiting in the
    residual came out of hiding: the next flush counted them in their group's min/max, and an
    attention-sink key (a large outlier channel) coarsened the group's other keys, some of
    them inside the sliding window (here a window of 8, R = 4: positions 63..65 when the group
    is flushed at 70): errors of the whole range, 6x half a step of their own. The eviction
    now waits until the copies are quantized (hidden)."""
    S, G, R, W = 2, 32, 4, 8
    spec = QuantSpec(key_bits=2, value_bits=2, group_size=G, residual_length=R, sink_tokens=S)
    k, v = _kv(70, b=2, seed=3, dtype=torch.float32)
    k[1, :, 40:42, 0] = 1000.0  # sequence 1's sink tokens (positions 40, 41): an outlier key
    store = _store(spec, b=2, dtype=torch.float32)
    store.append(k[:, :, :50], v[:, :, :50], flush=False)
    store.set_padding(torch.tensor([0, 40]))
    store.flush()  # sink 2, body 2..33 (one group), residual 34..49 holds the copies 40, 41
    assert (store.sink_len, store.body_len, store.res_len) == (2, 32, 16)
    store.evict(50 - W + 1)  # what a sliding layer asks before its next token
    store.append(k[:, :, 50:70], v[:, :, 50:70])  # flushes the group of positions 34..65
    keys, _ = dequantize_layer(store.view(), torch.float32, starts=store.starts)
    own = torch.arange(42, 66)  # the group's tokens of sequence 1 but its sink's copies
    x = k[1, :, own, 0]
    err = (keys[1, :, own - store.evicted, 0] - x).abs().amax(1)
    step = (x.amax(1) - x.amin(1)) / 3  # 2 bits: the group's own range in 3 steps
    assert (err <= step / 2 * 1.001 + 1e-4).all(), (err, step)
    assert store.evict(70 - W + 1) == 2 + 32  # the copies are quantized: it goes ahead
    assert store.sink_len == 0


def test_dequantize_layer_refuses_negative_starts_with_a_sink():
    """A sink token sits at position ``starts[b] + j``: with a negative start (a sliding
    layer's store after eviction) that is before position 0, where a position-ordered tensor
    has no slot. With one start negative and one positive dequantize_layer raised an index
    error inside place_sinks; with all starts <= 0 it returned the stored order, the sink at
    positions 0.. . It now says so (the store drops its sink when it evicts, so it never holds
    both; the reference attention reads the stored order, stored_order_mask)."""
    spec = QuantSpec(key_bits=4, value_bits=4, group_size=32, residual_length=8, sink_tokens=4)
    store = _store(spec, b=2)
    store.append(*_kv(80, b=2))
    for starts in ([-3, 2], [-3, 0], [-1, -2]):
        with pytest.raises(ValueError, match=r"dequantize_layer: starts .* negative .*sink_len=4"):
            dequantize_layer(store.view(), starts=torch.tensor(starts))
    k, _ = dequantize_layer(store.view(), starts=torch.tensor([0, 2]))  # non-negative: placed
    assert k.shape[2] == 80
    no_sink = _store(spec.replace(sink_tokens=0), b=2)
    no_sink.append(*_kv(80, b=2))
    k, _ = dequantize_layer(no_sink.view(), starts=torch.tensor([-3, 2]))  # nothing to place
    assert k.shape[2] == 80


def test_value_group_that_does_not_divide_head_dim_is_announced():
    """group_size 64 at head_dim 96 (Phi-3): values are grouped by gcd = 32 channels, and the
    store says so once instead of silently."""
    import warnings

    spec = resolve_spec("uniform-int4")  # q_group_size 64
    with pytest.warns(UserWarning, match="groups of 32 channels"):
        st = LayerStore(spec, 1, 2, 96, torch.float32, "cpu")
    assert st.value_group == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LayerStore(spec, 1, 2, 128, torch.float32, "cpu")  # divides: nothing to say
        LayerStore(resolve_spec("fp16"), 1, 2, 16, torch.float32, "cpu")  # nothing grouped


def test_wrong_shapes_name_the_expected_one():
    """A wrong input shape names the expected one; a batch that is a multiple of the cache's
    (beams over a cache that already holds the prompt) also names the way out."""
    store = _store(QuantSpec(), b=2)
    store.append(*_kv(5, b=2))
    with pytest.raises(ValueError, match=r"key_states must be \[batch=2, kv_heads=.*got \(4, "
                                         r".*batch_repeat_interleave\(2\)"):
        store.append(*_kv(1, b=4))
    with pytest.raises(ValueError, match=r"head_dim=.*got \(2, .*\)$"):
        store.append(*_kv(1, b=2, d=D // 2))
    with pytest.raises(ValueError, match=r"got \(3, .*\) \(this layer holds 5 tokens of 2 "
                                         r"sequences.*cache.reset\(\) or a new cache"):
        store.append(*_kv(1, b=3))  # (a cache reused for another batch)
    k, v = _kv(3, b=2)
    with pytest.raises(ValueError, match="key_states has 3 tokens but value_states 2"):
        store.append(k, v[:, :, :2])


def test_edits_refused_while_lengths_live_on_the_device():
    """A captured decode loop keeps the true lengths in ``lens_dev``: a crop, a reorder, a host
    append or new padding left it stale (the attention still saw the cropped tokens)."""
    store = _store(QuantSpec(residual_length=8), b=2)
    store.append(*_kv(40, b=2))
    store.begin_device_lengths(64)
    for op, call in (("crop", lambda: store.crop(20)),
                     ("reorder", lambda: store.reorder(torch.tensor([1, 0]))),
                     ("append", lambda: store.append(*_kv(1, b=2))),
                     ("set_padding", lambda: store.set_padding(torch.tensor([0, 1])))):
        with pytest.raises(ValueError, match=rf"{op}: this layer keeps its lengths on the device"):
            call()
    store.end_device_lengths()
    store.crop(36)
    assert store.seq_len == 36


def test_crop_takes_integers_only():
    store = _store(QuantSpec(residual_length=8))
    store.append(*_kv(40))
    for bad in (20.5, None, "20", True):
        with pytest.raises(ValueError, match="crop: length must be an integer"):
            store.crop(bad)
    store.crop(torch.tensor(39))  # a 0-d integer tensor is an index
    assert store.seq_len == 39 and isinstance(store.res_len, int)
    with pytest.raises(ValueError, match=r"starts must hold one position per sequence \(2\)"):
        store.set_padding(torch.tensor([0, 1, 2]))


def test_reserve_and_append_refuse_what_they_cannot_store():
    """``reserve`` with a negative size reserved nothing, silently, and a float size failed
    inside ``new_empty``; integer, boolean and complex K/V were cast to the store's dtype
    (complex losing its imaginary part). All are refused by name; nothing changes."""
    store = _store(QuantSpec(residual_length=8))
    store.append(*_kv(40))
    caps = (store.k_codes.shape[2], store.res_k.shape[2])
    for args, name in (((-5,), "tokens"), ((100.5,), "tokens"), ((100, -1), "residual"),
                       ((True,), "tokens")):
        with pytest.raises(ValueError, match=f"reserve: {name} must be an integer >= 0"):
            store.reserve(*args)
    assert (store.k_codes.shape[2], store.res_k.shape[2]) == caps
    store.reserve(200, 64)
    assert store.k_codes.shape[2] >= 7 * store.k_words and store.res_k.shape[2] >= 64
    k, v = _kv(3)
    for dtype in (torch.int32, torch.bool, torch.complex64):
        with pytest.raises(ValueError, match=f"key_states must be a floating-point tensor, "
                                             f"got {dtype}"):
            store.append(k.to(dtype), v)
        with pytest.raises(ValueError, match="value_states must be a floating-point"):
            store.append(k, v.to(dtype))
    assert store.seq_len == 40
    store.append(k.double(), v.float())  # any floating dtype is the store's
    assert store.seq_len == 43 and store.res_k.dtype == torch.float16


def test_padding_and_eviction_take_integers():
    """``set_padding`` truncated float starts silently (3.9 -> 3 tokens of padding), took a
    boolean mask as counts, and with a sink failed on a negative start inside ``gather``;
    ``evict`` failed inside ``narrow`` on a float. Refused by name, nothing changed; negative
    starts stay valid down to ``-evicted`` (eviction shifts them there)."""
    store = _store(QuantSpec(residual_length=8, sink_tokens=2))
    store.append(*_kv(80), flush=False)
    for bad, why in ((torch.tensor([0.7, 3.9]), "must be integers .*got torch.float32"),
                     (torch.tensor([True, False]), "must be integers .*got torch.bool"),
                     (torch.tensor([-3, 2]), "must be >= 0 .*got -3")):
        with pytest.raises(ValueError, match=f"set_padding: starts {why}"):
            store.set_padding(bad)
    assert store.starts.tolist() == [0, 0] and (store.sink_len, store.res_len) == (2, 78)
    store.set_padding([0, 3])
    store.flush()
    for bad in (33.5, None):
        with pytest.raises(ValueError, match="evict: upto must be an integer"):
            store.evict(bad)
    assert store.evict(40) == 34 and store.starts.tolist() == [-34, -31]
    store.set_padding(torch.tensor([-34, -31]))  # as eviction left them (no sink any more)
    with pytest.raises(ValueError, match="must be >= -34"):
        store.set_padding(torch.tensor([-35, 0]))


def test_store_shape_and_dtype_are_checked():
    """An integer store cast every appended token to integers, silently; a float head_dim or a
    negative batch failed inside torch. Refused by name."""
    spec = QuantSpec(residual_length=8)
    for args, why in (((-1, H, D, torch.float16), "batch must be an integer >= 1, got -1"),
                      ((B, 0, D, torch.float16), "kv_heads must be an integer >= 1, got 0"),
                      ((B, H, 32.0, torch.float16), "head_dim must be an integer >= 1, got 32.0"),
                      ((B, H, D, torch.int32), "dtype must be the model's floating-point")):
        with pytest.raises(ValueError, match=f"LayerStore: {why}"):
            LayerStore(spec, *args, "cpu")


def test_fp8_dynamic_scales_reset_when_crop_empties_the_body():
    """A dynamic scale belongs to the tokens that set it: after a crop to 0 the next tokens set
    it again (it kept the old one, so 50x larger tokens saturated)."""
    from kvbits.spec import resolve_spec

    spec = resolve_spec("fp8-dynamic", residual_length=0)
    k, v = _kv(64, dtype=torch.float32)
    a, fresh = _store(spec, dtype=torch.float32), _store(spec, dtype=torch.float32)
    a.append(k, v)
    a.crop(0)
    a.append(50 * k, 50 * v)
    fresh.append(50 * k, 50 * v)
    assert torch.equal(a.k_scale, fresh.k_scale) and torch.equal(a.v_scale, fresh.v_scale)


# ------------------------------------------------- KVQuant with offline key scales (fixed rows)
def _offline_store(spec, seed=0):
    from kvbits.methods import kvquant as kvq

    cb = kvq.uniform_codebooks(H, spec.key_bits, spec.value_bits)
    calib, _ = _kv(300, b=1, seed=seed + 7)  # calibration keys: another draw
    cb.k_scale, cb.k_zero = kvq.offline_key_rows(calib[0].float(), spec.key_bits)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    return LayerStore(spec, B, H, D, torch.float16, "cpu", codebooks=cb, inv_freq=inv)


@settings(max_examples=10, deadline=None)
@given(bits=st.sampled_from([2, 3, 4]), S=st.integers(0, 2), R=st.sampled_from([0, 16]),
       before=st.integers(1, 150), after=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       seed=st.integers(0, 99))
def test_offline_key_scales_store(bits, S, R, before, after, seed):
    """key_scales="calibrated": the key scale / zero stay one fixed [B, H, 1, D] row (never
    grown, saved whole), the memory count drops the per-group pair, chunked appends equal
    token-by-token ones, and a saved state continues like the store."""
    spec = resolve_spec(f"kvquant-{bits}-offline", residual_length=R, sink_tokens=S)
    k, v = _kv(before + sum(after), seed=seed)
    a, b = _offline_store(spec, seed), _offline_store(spec, seed)
    rows = a.k_scale.clone(), a.k_zero.clone()
    a.append(k[:, :, :before], v[:, :, :before])
    _append_by_token(b, k[:, :, :before], v[:, :, :before])
    _assert_same_state(a, b, "chunked vs by token")
    tensors, scalars = a.state()
    c = _offline_store(spec, seed)
    c.load_state({n: t.clone() for n, t in tensors.items()}, scalars)
    at = before
    for n in after:
        for st_ in (a, c):
            st_.append(k[:, :, at:at + n], v[:, :, at:at + n])
        at += n
    _assert_same_state(a, c, "saved and continued")
    for st_ in (a, c):
        assert st_.k_scale.shape == (B, H, 1, D)
        assert torch.equal(st_.k_scale, rows[0]) and torch.equal(st_.k_zero, rows[1])
    grouped = LayerStore(spec.replace(key_scales="group"), B, H, D, torch.float16, "cpu",
                         inv_freq=a.inv_freq)
    grouped.append(k[:, :, :at], v[:, :, :at])
    if a.body_len:
        saved = B * H * a.body_len * 2 * 2 * D // spec.group_size - B * H * 2 * 2 * D
        assert grouped.nbytes(2) - a.nbytes(2) == saved
        assert a.view().key_scales_fixed and not grouped.view().key_scales_fixed
    # the reference reads the same keys from the view as dequantizing with the rows directly
    keys, _ = dequantize_layer(a.view(), dtype=torch.float32)
    assert torch.isfinite(keys).all() and keys.shape[2] == at


@pytest.mark.parametrize("bits", [2, 3])
def test_offline_key_scales_with_device_lengths(bits):
    """The captured decode path (lengths on the device, flush_dev) with offline key scales
    writes what the host path writes and leaves the fixed row alone (flush_dev once tested
    a buffer's membership in a tuple of tensors, which compares them elementwise)."""
    spec = resolve_spec(f"kvquant-{bits}-offline", residual_length=16, sink_tokens=1)
    host, dev = _offline_store(spec), _offline_store(spec)
    k, v = _kv(200, seed=4)
    for st_ in (host, dev):
        st_.append(k[:, :, :100], v[:, :, :100])
    rows = dev.k_scale.clone()
    dev.begin_device_lengths(200)
    for t in range(100, 170):
        host.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        dev.append_dev(k[:, :, t:t + 1], v[:, :, t:t + 1])
        if dev.res_len == spec.residual_length + spec.group_size:
            dev.flush_dev()
    dev.end_device_lengths()
    assert dev.body_len == host.body_len > 96
    _assert_same_state(host, dev, "device lengths vs host")
    assert torch.equal(dev.k_scale, rows)
