"""A stateful property test of a cache's lifecycle: a hypothesis ``RuleBasedStateMachine`` drives
a one-layer :class:`~kvbits.integrations.hf.KVBitsCache` (full attention, or a sliding window
that evicts) through random sequences of what generation does to it: prompts (left-padded, with
poison in the padding), chunked prefill (a padding longer than a chunk), decode steps,
speculative verification chunks and the crop of their rejected drafts, other crops, beam
reorders / batch expansion and selection, save + load, deepcopy, reset, and attention reads;
with ``step_graphs=True`` its one-token steps keep the lengths on the device (the bookkeeping of
the replayed CUDA-graph steps, run eagerly on the CPU) until something else touches it. Presets:
FP16, KIVI 2/3/4 bits and K4V2, uniform (per-token and per-channel), FP8 (calibrated and
dynamic), KVQuant (codebooks, outliers, pre-RoPE keys, offline key scales), Hadamard keys (whole
and calibrated subsets); G, R, S overridden (``"kivi-2:G=64,R=32,S=1"``); head_dim 64, 80, 96;
GQA; float16, bfloat16, float32. After every step it checks the cache against a simple model
of what it must hold:

* the model keeps the original K/V history and the counts of the tokens evicted, in the sink
  and in the packed body (the flush rule: whole groups of G once R + G tokens wait; a crop cuts
  quantized history only at a group boundary, and a crop right after a forward puts back what
  that forward flushed past its first row, DESIGN "Hugging Face integration"; a sliding layer
  drops whole groups no later query sees once they are a quarter of the live ones);
* the store must then hold *bit for bit* what a fresh store holds when the same history is
  quantized in one go, group by aligned group (history quantized exactly once, from the
  original values, whatever the chunking, crops, reorders, saves and evictions on the way):
  sink and residual the exact first / newest tokens, the body the codes of those groups;
* every attention output (the prompt step: full precision; later chunks: each row over the
  quantized / FP16 split it sees when generated one token at a time; reads of a random query)
  equals attention over the model's expectation of the stored values, is finite, and for the
  quantized presets stays near exact attention.

Failures this machine found (session 49): a crop into a sequence's left padding hid the tokens
that followed (test_hf.test_crop_into_left_padding_then_continue_like_dynamic_cache), and a
KVQuant outlier correction that rounded up dequantized 65504 to 65520, inf in float16
(test_kvquant.test_outlier_correction_never_rounds_past_float16_range). Session 52: dynamic FP8
scales that waited for a dropped sequence after a beam selection
(test_fp8.test_beam_selection_of_the_sequences_whose_scales_are_set).
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from kvbits import ops
from kvbits.cache.store import _BUFFERS, EVICT_RATIO, LayerStore
from kvbits.integrations.hf import KVBitsCache, kvbits_attention_forward
from kvbits.methods.kvquant import LayerCodebooks, thresholds_of
from kvbits.reference import quant as ref_quant
from kvbits.reference.attention import dequantize_layer

# Calibration inputs are made up per example, as cheaply as the persist tests make them: random
# sorted codebooks (and offline key rows), per-head FP8 scales, Hadamard channel subsets.
PRESETS = ["fp16", "kivi-2", "kivi-3", "kivi-4", "k4v2", "uniform-int4", "fp8", "fp8-dynamic",
           "kvquant-3", "kvquant-2-offline", "kivi-2-had", "kivi-2-hadc",
           "uniform-int2:key_axis=channel,value_axis=channel"]
MODES = ["randn", "randn", "randn", "const", "zeros", "wide", "edge"]
MAX_TOKENS = 400  # per sequence (time)


def _attend(q, keys, values, see, scale):
    """float32 attention of ``q [B, Hq, Lq, D]`` over ``keys, values [B, Hkv, T, D]`` with the
    bool mask ``see [B, Lq, T]`` (GQA: query head h reads KV head h // (Hq / Hkv)); a row that
    sees no token gives zeros (DESIGN: the kernels' and the reference's rule)."""
    B, Hq, Lq, D = q.shape
    Hkv = keys.shape[1]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, Lq, D)
    s = torch.einsum("bhgqd,bhtd->bhgqt", qg, keys.float()) * scale
    s = s.masked_fill(~see[:, None, None], -torch.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhgqt,bhtd->bhgqd", p, values.float()).reshape(B, Hq, Lq, D)


class CacheLifecycle(RuleBasedStateMachine):
    """One layer of a KVBitsCache against the model: ``hk, hv`` (the whole history, evicted
    tokens included), ``evicted``, ``sink``, ``body`` (tokens stored in each part), ``tracked``
    (tokens a crop puts back), ``starts`` (each sequence's first real token), ``pad_end``."""

    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvbits-stateful-"))
        self.saves = 0

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ setup
    @initialize(preset=st.sampled_from(PRESETS), G=st.sampled_from([32, 32, 64, 128]),
                R=st.sampled_from([0, 1, 8, 16, 40]), S=st.sampled_from([0, 0, 1, 3]),
                D=st.sampled_from([64, 64, 80, 96]), hkv=st.sampled_from([1, 2]),
                gqa=st.sampled_from([1, 2]), batch=st.integers(1, 3),
                dtype=st.sampled_from([torch.float16, torch.float16, torch.float32,
                                       torch.bfloat16]),
                window=st.sampled_from([None, None, None, 24, 48, 100]),
                step_graphs=st.sampled_from([False, False, True]), seed=st.integers(0, 2**16),
                recording=st.booleans())
    def setup(self, preset, G, R, S, D, hkv, gqa, batch, dtype, window, step_graphs, seed,
              recording):
        self.gen = torch.Generator().manual_seed(seed)
        self.B, self.Hkv, self.Hq, self.D, self.dtype = batch, hkv, hkv * gqa, D, dtype
        self.scale = 1.0 / math.sqrt(D)
        self.window = window
        torch.manual_seed(seed)
        shape = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 16,
                 "num_hidden_layers": 1, "num_attention_heads": self.Hq,
                 "num_key_value_heads": hkv, "head_dim": D}
        self.model = (LlamaForCausalLM(LlamaConfig(**shape)) if window is None else
                      MistralForCausalLM(MistralConfig(**shape, sliding_window=window)))
        self.model = self.model.to(dtype).eval()
        name, _, rest = preset.partition(":")
        # G, R and S as keywords: the FP16 preset takes them as harmless no-ops there (written
        # in its spec string, 'fp16:G=32,...', resolve_spec refuses them)
        text = f"{name}:{rest}" if rest else name
        # per-channel key magnitudes over 3 decades (KIVI's keys), fixed per example
        self.kmag = 10 ** (torch.rand(D, generator=self.gen) * 3 - 1)
        calibration = None
        if name == "fp8":  # per-head scales for an amax of ~4.5 sigma (and 2x headroom)
            calibration = [tuple(torch.full((hkv,), 4.5 * m * 2 / 448)
                                 * (0.5 + torch.rand(hkv, generator=self.gen))
                                 for m in (self.kmag.max().item(), 1.0))]
        elif name.endswith("hadc"):
            subsets = [list(range(8)), [3, 9], [], list(range(32))]
            calibration = [[subsets[(seed + h) % 4] for h in range(hkv)]]
        elif name.startswith("kvquant"):
            calibration = "uniform"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a group that does not divide head_dim 80 / 96
            self.cache = KVBitsCache(self.model, text, calibration=calibration,
                                     step_graphs=step_graphs, group_size=G,
                                     residual_length=R, sink_tokens=S)
        # step_graphs=True: one-token steps run with the lengths on the device (the CUDA-graph
        # bookkeeping; eagerly on the CPU) until anything else touches the layer
        self.step_graphs = step_graphs
        # transformers' notice before assisted decoding (a cache that cannot be cropped refuses
        # it): the prompt's forward then tracks its flushes for the crop of rejected drafts
        self.recording = recording and self.cache.is_croppable
        if self.recording:
            self.cache.activate_past_recording()
        layer = self.cache.layers[0]
        assert layer.sliding_window == window
        self.spec = layer.spec
        if self.spec.method == "kvquant":  # non-uniform tables (and offline key rows)
            def table(bits):
                steps = torch.rand(hkv, 1 << bits, generator=self.gen) + 0.2
                cb = torch.cumsum(steps, 1) - steps[:, :1]
                cb = cb / cb[:, -1:] * ((1 << bits) - 1)
                return cb, thresholds_of(cb)
            rows = {}
            if self.spec.key_scales == "calibrated":
                rows = {"k_scale": (torch.rand(hkv, D, generator=self.gen) * 0.3 + 0.05).half(),
                        "k_zero": (-torch.rand(hkv, D, generator=self.gen) * 2).half()}
            layer.codebooks = LayerCodebooks(*table(self.spec.key_bits),
                                             *table(self.spec.value_bits), **rows)
        self.module = torch.nn.Module()
        self.module.num_key_value_groups = gqa
        self.module.is_causal = True
        self.hk = torch.empty(batch, hkv, 0, D, dtype=dtype)
        self.hv = torch.empty(batch, hkv, 0, D, dtype=dtype)
        self._forget()

    def _forget(self):
        """The model of an empty cache (no store yet)."""
        self.hk, self.hv = self.hk[:, :, :0], self.hv[:, :, :0]
        self.has_store = False
        self.evicted = self.sink = self.body = self.tracked = 0
        # recording (activate_past_recording): a sliding layer keeps the tokens since the last
        # crop, which a crop can take back, as DynamicCache's sliding layers do; from here
        self.mark = 0
        self.starts = torch.zeros(self.B, dtype=torch.long)  # (in the history's positions)
        # the store's longest padding (a host bound: selecting sequences keeps it) and the end
        # of padding and own-sink positions (in the store)
        self.pad = self.pad_end = 0
        self.row_sinks = False  # a padded batch's sinks: each sequence's own first tokens
        self.fp8_amax = None  # fp8-dynamic: (k, v) amax [B, H, 1, 1] of the first flush
        self.fp8_set = None  # ... of each sequence's own tokens: whose are set (bool [B])
        # In a padded batch with sinks, the copies of each sequence's own sink tokens in the
        # body / residual are hidden, and kept out of every group's min/max, until the sink
        # goes with the first eviction: the groups flushed after it count them (past the
        # window: no query sees them). The flushed positions before that: up to this.
        self.hidden_upto = None
        self.wide = False  # the history has extreme values (the loose accuracy check is off)
        self.in_steps = False  # the layer is in the step graphs' mode (lengths on the device)

    # ------------------------------------------------------------------ model helpers
    @property
    def n(self) -> int:
        """Tokens seen (what get_seq_length reports), evicted ones included."""
        return self.hk.shape[2]

    @property
    def stored(self) -> int:
        return self.n - self.evicted

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    @property
    def store(self) -> LayerStore | None:
        return self.cache.layers[0].store

    @property
    def sink_full(self) -> int:
        """The sink's size once full (the sink goes with the first eviction, for good)."""
        return 0 if self.evicted else self.spec.sink_tokens

    def _draw(self, T, mode):
        shape = (self.B, self.Hkv, T, self.D)
        if mode == "const":  # constant groups: scale 0
            k = (torch.randn(self.B, self.Hkv, 1, self.D, generator=self.gen) * self.kmag)
            v = torch.randn(self.B, self.Hkv, 1, self.D, generator=self.gen)
            k, v = k.expand(shape), v.expand(shape)
        elif mode == "zeros":
            k, v = torch.zeros(shape), torch.zeros(shape)
        elif mode == "wide":  # near the ends of FP16's range (saturating scales)
            k = (torch.rand(shape, generator=self.gen) * 2 - 1) * 300
            v = (torch.rand(shape, generator=self.gen) * 2 - 1) * 6e4
            v[..., 0] = 65504.0
            v[..., 1] = -65504.0
            self.wide = True
        else:
            k = torch.randn(shape, generator=self.gen) * self.kmag
            v = torch.randn(shape, generator=self.gen)
            if mode == "edge":  # FP16's largest value over small integers (an outlier's
                # correction rounding up past it: the KVQuant bug of session 49)
                v = torch.randint(0, 49, shape, generator=self.gen).float()
                v[..., 0], v[..., 1], v[..., 2] = 65504.0, 48.0, 0.0
                self.wide = True
        return k.to(self.dtype).contiguous(), v.to(self.dtype).contiguous()

    def _query(self, T):
        return (torch.randn(self.B, self.Hq, T, self.D, generator=self.gen) * 0.5).to(self.dtype)

    def _flushed(self, body, upto):
        """Body length after flushing as generation does while the sequence holds its first
        ``upto`` tokens (whole groups while R + G wait)."""
        if not self.quantized:
            return 0
        R, G = self.spec.residual_length, self.spec.group_size
        waiting = upto - self.evicted - self.sink_full - body
        return body + G * max(0, (waiting - R) // G)

    def _first_flush(self, body0, body1, upto, groups=False):
        """fp8-dynamic: a sequence's scales are set by the first flush that quantizes a token
        of its own (the body going from ``body0`` to ``body1`` tokens), from the tokens held
        up to ``upto``, padding and copies of its own sink left out; a flush of nothing but
        its padding sets none (a prompt prefilled in chunks whose first chunk is all padding
        for it: it took scale 1 from an amax of 0, fixed). ``groups``: the flushes go one
        group at a time, as generation flushes them (a chunk's rows, a crop's refill), the
        j-th holding up to ``upto + j * G``."""
        if self.spec.method != "fp8" or self.spec.fp8_scale != "dynamic" or body1 <= body0:
            return
        G = self.spec.group_size
        flushes = [(body0 + j * G, body0 + (j + 1) * G, upto + j * G)
                   for j in range((body1 - body0) // G)] if groups else [(body0, body1, upto)]
        if self.fp8_set is None:  # (not set: an amax of 0, scale 1)
            self.fp8_set = torch.zeros(self.B, dtype=torch.bool)
            self.fp8_amax = tuple(torch.zeros(self.B, self.Hkv, 1, 1) for _ in "kv")
        lo = self.evicted + self.sink
        own = self.starts - self.evicted  # each sequence's first own token in the store
        gran = self.spec.fp8_granularity
        for b0, b1, up in flushes:
            new = (own >= b0) & (own < b1) & ~self.fp8_set
            if not bool(new.any()):
                continue
            keys, vals = self.hk[:, :, lo:up], self.hv[:, :, lo:up]
            valid = torch.arange(lo, up)[None, :] >= self.starts[:, None] + self.sink
            amax = (ref_quant.fp8_amax(keys, valid, gran), ref_quant.fp8_amax(vals, valid, gran))
            rows = new[:, None, None, None]
            self.fp8_amax = tuple(torch.where(rows, a, b) for a, b in zip(amax, self.fp8_amax))
            self.fp8_set = self.fp8_set | new

    @property
    def fp8_waiting(self) -> bool:
        """fp8-dynamic: a sequence's scales are not set yet (no token of its own flushed)."""
        return self.spec.method == "fp8" and self.spec.fp8_scale == "dynamic" and (
            self.fp8_set is None or not bool(self.fp8_set.all()))

    def _evict(self):
        """A sliding layer's eviction before an update (LayerStore.evict): the whole groups
        (FP16: tokens) no later query sees, with the sink, once they are a quarter of the live
        ones; not while a sequence still sees its own sink, nor while a padded sequence's sink
        copies still wait in the residual (quantized specs). Recording, it keeps what came
        after the last crop (KVBitsLayer._evict_unseen)."""
        upto = (min(self.n, self.mark) if self.recording else self.n) - self.evicted \
            - self.window + 1
        if self.sink and self.pad_end > upto:
            return
        if self.sink and self.quantized and self.pad_end > self.sink + self.body:
            return  # a padded sequence's sink copies wait in the residual until quantized
        if self.fp8_waiting and self.body:  # (its first own tokens set its scales)
            return
        res = self.stored - self.sink - self.body
        if not self.quantized:
            drop = min(max(0, upto - self.sink), res)
            if drop == 0 or EVICT_RATIO * drop < res - drop:
                return
        else:
            G = self.spec.group_size
            groups = self.body // G
            drop = min(max(0, (upto - self.sink) // G), groups)
            if drop == 0 or EVICT_RATIO * drop < groups - drop:
                return
            self.body -= drop * G
            drop *= G
        gone = self.sink + drop
        event("evicted")
        if not self.evicted:  # flushed from now on: the copies of the own sinks unhidden
            self.hidden_upto = gone + self.body
        self.evicted += gone
        self.sink = 0
        self.pad_end = max(0, self.pad_end - gone)

    def _device_lengths_ok(self) -> bool:
        """LayerStore.device_lengths_ok: a full sink (or none left), a sequence's own sink
        complete, FP8's dynamic scales set."""
        if self.sink < self.spec.sink_tokens and not self.evicted:
            return False
        if self.row_sinks and self.sink and self.stored < self.pad_end:
            return False
        return not self.fp8_waiting

    def _visible(self, rows_at):
        """Bool ``[B, len(rows_at), n]``: causal, past each sequence's padding, in the
        window."""
        t = torch.arange(self.n)[None, None, :]
        rows_at = torch.as_tensor(rows_at)[None, :, None]
        see = (t <= rows_at) & (t >= self.starts[:, None, None])
        return see if self.window is None else see & (t > rows_at - self.window)

    def _shadow(self, body=None) -> LayerStore:
        """A fresh store (no eviction) holding the model's history with the tokens the
        model's body holds (and those evicted past the sink) quantized in one go (R = 0
        flushes every whole group of them), the rest appended unflushed. After an eviction in
        a padded batch with sinks, it drops its sink as the eviction does (no group), before
        it quantizes the groups flushed since (see ``hidden_upto``)."""
        layer = self.cache.layers[0]
        body = self.body if body is None else body
        S0 = min(self.spec.sink_tokens, self.n)
        if self.evicted and self.quantized:  # groups gone from the front are whole groups
            body += self.evicted - S0
        spec = self.spec.replace(residual_length=0) if self.quantized else self.spec
        shadow = LayerStore(spec, self.B, self.Hkv, self.D, self.dtype, "cpu",
                            codebooks=layer.codebooks, inv_freq=layer.inv_freq,
                            fp8_scales=layer.fp8_scales,
                            hadamard_channels=layer.hadamard_channels)
        if self.fp8_amax is not None and self.spec.fp8_scale == "dynamic":
            # (a sequence whose scales are not set has no own token in the body: its codes
            # are 0, its scales 1, an amax of 0)
            shadow.k_scale = ref_quant.fp8_scale_from_amax(self.fp8_amax[0])
            shadow.v_scale = ref_quant.fp8_scale_from_amax(self.fp8_amax[1])
            shadow._fp8_ready = True
        if self.n:  # as at a prompt: appended, the padding set, then quantized
            shadow.append(self.hk, self.hv, flush=False)
            shadow.set_padding(self.starts)
            if self.hidden_upto is not None and self.row_sinks and self.quantized:
                shadow.flush(upto=min(self.hidden_upto, S0 + body))
                shadow.sink_len, shadow.evicted = 0, S0  # (the sink goes, no group with it)
                shadow.starts = shadow.starts - S0
                shadow._pad_end = max(0, shadow._pad_end - S0)
                shadow.flush(upto=body)
            else:
                shadow.flush(upto=S0 + body)
        assert shadow.body_len == body, "the model's body is not whole groups"
        return shadow

    def _stored_view(self, body=None):
        """float32 ``(K, V) [B, Hkv, n, D]`` the store should read, in its key space (Hadamard
        keys rotated), ``body`` tokens (default the model's) dequantized."""
        shadow = self._shadow(body)
        k, v = dequantize_layer(shadow.view(), torch.float32, starts=shadow.starts)
        if shadow.evicted:  # the sink it dropped: evicted, seen by no query
            k, v = (torch.cat([x.new_zeros(*x.shape[:2], shadow.evicted, x.shape[3]), x], 2)
                    for x in (k, v))
        return k, v

    def _expected_rows(self, q, n0, prefill, body0):
        """Expected output of the step's rows (positions n0 ..): the prompt step attends at
        full precision; later rows each over the split they see when generated alone."""
        T = q.shape[2]
        if prefill:
            return _attend(q, self.hk, self.hv, self._visible(n0 + torch.arange(T)), self.scale)
        qs = self.store.rotate_query(q)
        exact = self._stored_view(0)
        deq = self._stored_view() if self.body else exact
        # the quantized positions: from the sink (or the first evicted group) on
        lo = min(self.spec.sink_tokens, self.n) if self.evicted else self.sink
        outs = []
        for i in range(T):
            p = n0 + i
            hi = self.evicted + self.sink + self._flushed(body0, p + 1)
            keys, vals = exact
            if hi > lo:
                keys, vals = keys.clone(), vals.clone()
                keys[:, :, lo:hi] = deq[0][:, :, lo:hi]
                vals[:, :, lo:hi] = deq[1][:, :, lo:hi]
            outs.append(_attend(qs[:, :, i:i + 1], keys, vals, self._visible([p]), self.scale))
        return torch.cat(outs, 2)

    def _check_close(self, got, want, what, exact=None, low=False, rows=None):
        """``low``: the output came from attention in the store's dtype (the prompt step's
        SDPA), whose probabilities round to it. ``rows [B, Lq]``: the rows to check (not the
        padding's own)."""
        if rows is not None:
            keep = rows[:, None, :, None].expand_as(got)
            got, want = torch.where(keep, got, 0), torch.where(keep, want, 0)
            exact = None if exact is None else torch.where(keep, exact, 0)
        assert torch.isfinite(got).all(), f"{what}: non-finite attention output"
        got = got.float()
        tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[self.dtype]
        # the output's rounding, and float32 sums of values up to 65504 in another order
        # (scores of hundreds, from "wide" keys, differ by a float32 ulp: e^ulp - 1 ~ 1e-4)
        vmax = self.hv.float().abs().max().item() if self.n else 0.0
        eps = max(torch.finfo(self.dtype).eps if low else 0, 2e-4 if self.wide else 3e-5)
        bad = (got - want).abs() > tol * (1 + want.abs()) + eps * vmax
        assert not bad.any(), (
            f"{what}: attention differs from the model's expectation at {int(bad.sum())} of "
            f"{bad.numel()} elements, max |diff| {(got - want).abs().max().item():.3g} "
            f"({self.spec.describe()}, n={self.n}, body={self.body})")
        # Only no blow-up: on random K/V (and per-token keys over channels three decades
        # apart, the uniform preset's) few bits are not much better than noise; FP8 e4m3 has 3
        # mantissa bits. Not KVQuant's made-up tables (random codebooks fit no data).
        if exact is not None and self.quantized and not self.wide \
                and self.spec.method != "kvquant":
            bits = min(self.spec.key_bits, self.spec.value_bits)
            limit = 0.8 if self.spec.method == "fp8" else {2: 3.0, 3: 1.5, 4: 1.2, 8: 0.2}[bits]
            if self.spec.key_axis == "token":  # (what KIVI's per-channel keys are for)
                limit = 3.0
            # relative to the output, or to the values where it is near zero
            floor = 0.1 * self.hv.float().pow(2).mean().sqrt() * math.sqrt(exact.numel())
            err = ((got - exact).norm() / (exact.norm() + floor + 1e-6)).item()
            assert err < limit, f"{what}: {bits}-bit attention is {err:.2f} off exact (>{limit})"

    # ------------------------------------------------------------------ rules
    @rule(size=st.integers(1, 150), mode=st.sampled_from(MODES),
          pads=st.one_of(st.none(), st.lists(st.one_of(st.floats(0, 1), st.just(1.0)),
                                             min_size=4, max_size=4)))
    def prompt_or_chunk(self, size, mode, pads):
        """A prompt (each sequence left-padded by a fraction ``pads`` of it, poison values in
        the padding; 1: all of it, a prompt prefilled in chunks), or a chunk of one (chunked
        prefill, where a sequence's padding may go on), crossing group boundaries."""
        self._step(size, mode, pads)

    @rule(steps=st.integers(1, 12), mode=st.sampled_from(MODES))
    def decode(self, steps, mode):
        """Decode steps of one token each."""
        for _ in range(steps):
            self._step(1, mode)

    @precondition(lambda self: self.n > 0)
    @rule(drafts=st.integers(1, 6), accepted=st.integers(0, 6), mode=st.sampled_from(MODES))
    def verify_drafts(self, drafts, accepted, mode):
        """Speculative decoding: the last token and its drafts in one chunk, then the rejected
        drafts cropped (transformers' ``crop(-n)``)."""
        self._step(1 + drafts, mode)
        rejected = drafts - min(accepted, drafts)
        if rejected:
            self._crop(self.n - rejected, "drafts")

    def _step(self, size, mode, pads=None):
        """One forward of ``size`` tokens: update, then the kvbits attention of their rows."""
        size = min(size, MAX_TOKENS - self.n)  # keep the histories short (time)
        if size <= 0:
            return
        k, v = self._draw(size, mode)
        q = self._query(size)
        n0 = self.n
        prefill = self.stored == 0
        if size == 1 and not prefill and self.step_graphs and (
                self.in_steps or self._device_lengths_ok()):
            if not self.in_steps:
                event("entered the step graphs' mode")
            self.in_steps = True  # (a sliding layer evicts only when it leaves)
        else:
            self.in_steps = False
            if self.window is not None and not prefill:
                self._evict()  # before the update appends
        lead = torch.zeros(self.B, dtype=torch.long)  # the step's leading padding
        if pads is not None:  # (a sequence may be all padding: a prompt prefilled in chunks)
            lead = (torch.tensor(pads[:self.B]) * (size + 1)).long().clamp(max=size)
            # after the first chunk, only a sequence that holds nothing but padding may have
            # more (with a sink, only while nothing is quantized: else it is refused, by name,
            # test_hf.test_chunked_padding_after_a_sink_flush_is_refused)
            if not prefill:  # (the padding of a one-row step is not read: a decode step)
                lead = lead * (self.starts >= n0) * (size > 1)
                if self.spec.sink_tokens and (self.body or self.evicted):
                    lead = lead * 0
            if bool(lead.any()):
                event("prompt: padded" if prefill else "chunk: padding grew")
        if prefill:
            self.starts = lead
        elif bool(lead.any()):
            self.starts = self.starts + lead
        pad = torch.arange(size)[None, :] < lead[:, None]  # [B, T]
        if bool(pad.any()):  # finite, and finite when Hadamard-rotated: a model's K/V
            poison = torch.where(torch.arange(self.D) % 2 == 0, 4e3, -4e3)
            k = torch.where(pad[:, None, :, None], poison.to(k.dtype), k)
            v = torch.where(pad[:, None, :, None], -poison.to(v.dtype), v)
        mask = None  # transformers' mask where it matters: padding, or a window at the prompt
        self.hk = torch.cat([self.hk, k], 2)
        self.hv = torch.cat([self.hv, v], 2)
        if bool(pad.any()) or (prefill and self.window is not None):
            mask = self._visible(n0 + torch.arange(size))[:, None, :, self.evicted:]
        rk, rv = self.cache.update(k, v, 0)
        out, attn = kvbits_attention_forward(self.module, q, rk, rv, mask, scaling=self.scale)
        assert attn is None
        out = out.transpose(1, 2)
        assert out.shape == q.shape and out.dtype == q.dtype
        # the model
        self.has_store = True
        if prefill or bool(lead.any()):  # set_padding: the longest padding now
            self.pad = int((self.starts - self.evicted).max())
            self.row_sinks |= bool(self.pad and self.spec.sink_tokens)
        if not self.evicted:
            self.sink = min(self.spec.sink_tokens, self.n)
            self.pad_end = self.pad + self.sink if self.pad else 0
        body0 = self.body
        S, R, G = self.sink_full, self.spec.residual_length, self.spec.group_size
        self.body = self._flushed(body0, self.n)
        lim = (-(-R // G) + 1) * G  # LayerStore._undo_limit
        if prefill or size == 1:
            self._first_flush(body0, self.body, self.n)
            # the prompt's forward may verify drafts too: a crop puts back what it flushed
            croppable = self.quantized and R > 0
            self.tracked = min(self.body, lim) if prefill and croppable and self.recording \
                else 0
        else:
            self._first_flush(body0, self.body, self.evicted + S + body0 + R + G, groups=True)
            first_row = self._flushed(body0, n0 + 1)
            self.tracked = min(self.body - first_row, lim) if self.quantized else 0
        event("step: " + ("prompt" if prefill else "decode" if size == 1 else "chunk")
              + (", flushed" if self.body > body0 else "")
              + (", tracked for a crop" if self.tracked else ""))
        want = self._expected_rows(q, n0, prefill, body0)
        exact = None
        if not prefill:
            exact = _attend(q, self.hk, self.hv, self._visible(n0 + torch.arange(size)),
                            self.scale)
        self._check_close(out, want, f"step of {size} ({mode}) after {n0}", exact, low=prefill,
                          rows=~pad)

    @precondition(lambda self: self.n > 0)
    @rule(how=st.sampled_from(["residual", "boundary", "any", "padding", "too_many", "keep",
                               "zero"]),
          frac=st.floats(0, 1))
    def crop(self, how, frac):
        """``cache.crop(-m)`` (transformers' drop of rejected drafts), legacy keep-n, or an
        impossible cut."""
        n, G = self.n, self.spec.group_size
        first = self.evicted + self.sink  # the body's first position
        body_eff = self.body - self.tracked
        if how == "too_many":
            with pytest.raises(ValueError, match=f"cannot remove {n + 1} tokens"):
                self.cache.crop(-(n + 1))
            self.in_steps = False  # (the check left the mode)
            return
        if how == "zero":
            self.cache.crop(0)  # nothing: the mode stays
            self.mark = n  # (but a recording layer's crop point moves)
            return
        if how == "residual":
            keep = first + body_eff + int(frac * (n - first - body_eff))
        elif how == "boundary":
            keep = min(n, first + G * int(frac * (body_eff // G + 1)))
        elif how == "padding":  # into (or to the end of) the longest left padding
            keep = min(n, self.evicted + int(frac * (self.pad_end + 1)))
        else:
            keep = int(frac * n)
        if how == "keep" and keep == 0:
            return  # crop(0) is "nothing" in the legacy form too
        self._crop(keep, how)

    def _crop(self, keep, how):
        """Keep ``keep`` tokens (``crop(keep - n)``, or legacy ``crop(keep)``), as the model
        says: a cut that would leave the next token's window short, or inside a sequence's own
        sink, or inside a quantized group (after the groups a crop puts back) is refused with
        the reason, and changes nothing."""
        n, G, R = self.n, self.spec.group_size, self.spec.residual_length
        call = (lambda: self.cache.crop(keep)) if how == "keep" else \
            (lambda: self.cache.crop(keep - n))
        if how == "keep" or keep != n:  # a crop, even one that cuts nothing or is refused,
            self.in_steps = False  # leaves the mode (crop(0) does nothing at all)
        if keep >= n:
            call()
            self.mark = n
            return
        kept = keep - self.evicted  # in the store
        S = self.sink
        body_eff = self.body - self.tracked
        reasons = []
        if self.evicted and keep - self.window + 1 < self.evicted:
            reasons = [f"cannot keep {keep} tokens", f"the first {self.evicted} left"]
        elif self.row_sinks and S and kept < self.pad_end:
            reasons = [f"cut at {kept}", f"crop to >= {self.pad_end}"]
        elif self.quantized and S < kept < S + body_eff and (kept - S) % G:
            reasons = [f"cut at {kept}", f"groups of {G}", f"residual_length={R}"]
        event(f"crop {how}: " + ("refused" if reasons else "into the body"
                                 if kept < S + body_eff else "into the residual"))
        if reasons:
            with pytest.raises(ValueError) as err:
                call()
            for part in reasons:
                assert part in str(err.value), f"the refusal does not say {part!r}: {err.value}"
            return
        call()
        self.mark = keep
        if self.tracked:
            event("crop put back flushed groups")
        body = body_eff
        if kept < S + body:
            body = 0 if kept <= S else kept - S
            self.sink = min(S, kept)
        if self.hidden_upto is not None:  # groups flushed again: after the eviction
            self.hidden_upto = min(self.hidden_upto, self.evicted + self.sink + body)
        self.hk, self.hv = self.hk[:, :, :keep], self.hv[:, :, :keep]
        # a cut into a sequence's padding: what comes next is its own
        self.starts = self.starts.clamp(max=keep)
        self.pad, self.pad_end = min(self.pad, kept), min(self.pad_end, kept)
        if self.fp8_set is not None and not self.evicted:  # fp8-dynamic: a sequence left
            # with no own token in the body takes its scales again at its next first flush
            # (not after an eviction: every sequence had them then, and a body the window
            # emptied keeps them, as a run without the crop does)
            self.fp8_set = self.fp8_set & (self.starts - self.evicted < body)
            rows = self.fp8_set[:, None, None, None]
            self.fp8_amax = tuple(torch.where(rows, a, 0) for a in self.fp8_amax)
            if not bool(self.fp8_set.any()):
                self.fp8_amax = self.fp8_set = None
        if self.tracked:  # refilled one group at a time, as generation flushes them
            self.body = body0 = body
            while kept - self.sink - body >= R + G:
                body += G
            self._first_flush(body0, body, self.evicted + self.sink_full + body0 + R + G,
                              groups=True)
        self.body, self.tracked = body, 0

    @precondition(lambda self: self.has_store)
    @rule(data=st.data())
    def beams(self, data):
        """reorder_cache (beam indices, repeats allowed), batch_repeat_interleave or
        batch_select_indices: every buffer follows the index, like the history."""
        event("beams")
        what = data.draw(st.sampled_from(["reorder", "repeat", "select", "select_bool"]))
        B = self.B
        if what == "reorder":
            index = torch.tensor(data.draw(st.lists(st.integers(0, B - 1), min_size=1,
                                                    max_size=3)))
            self.cache.reorder_cache(index)
        elif what == "repeat":
            r = data.draw(st.integers(1, max(1, 3 // B)))
            index = torch.arange(B).repeat_interleave(r)
            self.cache.batch_repeat_interleave(r)
        else:
            keep = data.draw(st.lists(st.booleans(), min_size=B, max_size=B).filter(any))
            index = torch.tensor(keep).nonzero().flatten()
            self.cache.batch_select_indices(torch.tensor(keep) if what == "select_bool"
                                            else index)
        self.hk, self.hv = self.hk[index], self.hv[index]
        self.starts = self.starts[index]
        self.B = int(index.numel())
        if self.fp8_amax is not None:
            self.fp8_amax = tuple(a[index] for a in self.fp8_amax)
            self.fp8_set = self.fp8_set[index]
        self.tracked = 0  # an edit: what the last step flushed stays flushed
        self.in_steps = False

    @precondition(lambda self: self.n > 0)
    @rule()
    def save_and_load(self):
        """The cache saved to a file and loaded back holds the same bits."""
        event("save_and_load")
        self.saves += 1
        path = self.cache.save(self.tmp / f"cache{self.saves}.safetensors")
        self.in_steps = False  # (save leaves the step graphs' mode)
        if self.window is not None and self.stored:  # a sliding layer drops, before it is
            self._evict()  # saved, what its next update would (persist.save_cache)
        before = self.store
        loaded = KVBitsCache.load(path, self.model)
        after = loaded.layers[0].store
        assert (before is None) == (after is None)
        if before is not None:
            assert (before.evicted, before.starts.tolist()) == (after.evicted,
                                                                after.starts.tolist())
            _assert_same_bits(before, after, "saved and loaded")
        self.cache = loaded  # (the file keeps the FP16 copies of the last forward's flushes)
        self.recording = False  # a notice of transformers', not the cache's state
        self.step_graphs = self.in_steps = False  # (a loaded cache takes the default, auto)

    @precondition(lambda self: self.n > 0)
    @rule()
    def deepcopy(self):
        """``copy.deepcopy(cache)`` (transformers' prefix reuse) continues like the original."""
        event("deepcopy")
        self.cache = copy.deepcopy(self.cache)
        self.in_steps = False

    @precondition(lambda self: self.n > 0)
    @rule()
    def reset(self):
        event("reset")
        self.cache.reset()
        self._forget()

    @precondition(lambda self: self.n > 0)
    @rule(rows=st.integers(1, 4), window=st.one_of(st.none(), st.integers(1, 200)))
    def read(self, rows, window):
        """Attention of a random query (``rows`` rows at the last positions, causal, maybe a
        sliding window: at most the layer's) over the store as it is, through
        ``ops.decode_attention``."""
        event("read")
        if self.window is not None:
            window = min(window or self.window, self.window)
        store = self.store
        rows = min(rows, self.stored)
        if self.evicted:  # rows no earlier than what the evictions kept a whole window for
            rows = max(1, min(rows, self.n - self.evicted - window + 1))
        q = self._query(rows)
        qs = store.rotate_query(q)
        out = ops.decode_attention(qs, store.view(), scale=self.scale, starts=store.starts,
                                   lengths=store.seq_len, window=window)
        keys, vals = self._stored_view()
        pos = self.n - rows + torch.arange(rows)
        see = self._visible(pos)
        if window is not None:
            see &= torch.arange(self.n)[None, None, :] > pos[None, :, None] - window
        want = _attend(qs, keys, vals, see, self.scale)
        exact = _attend(q, self.hk, self.hv, see, self.scale)
        self._check_close(out, want, f"read of {rows} rows (window {window})", exact)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def lengths(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.get_seq_length() == self.n, (
            f"get_seq_length {self.cache.get_seq_length()}, the model holds {self.n}")
        store = self.store
        assert (store is None) == (not self.has_store)
        if store is None:
            return
        want = (self.evicted, self.sink, self.body, self.stored - self.sink - self.body)
        got = (store.evicted, store.sink_len, store.body_len, store.res_len)
        assert got == want, f"(evicted, sink, body, residual) {got}, the model says {want}"
        assert store.batch == self.B
        assert (store.lens_dev is not None) == self.in_steps, "in the step graphs' mode"
        if self.in_steps:  # the device lengths in step with the host's
            assert store.lens_dev.tolist() == [store.sink_len, store.body_len, store.res_len]
        # the host bound of hidden positions: exact where a crop or an eviction reads it (with
        # a sink), else at least the padding (an FP16 layer without a sink that evicted resets
        # it to the longest padding before the eviction: conservative, harmless)
        hidden = int((self.starts - self.evicted).max().clamp(min=0)) if self.B else 0
        assert store._pad_end == self.pad_end if self.sink else store._pad_end >= hidden, (
            f"_pad_end {store._pad_end}, the model says {self.pad_end} (padding to {hidden})")
        if self.quantized:
            R, G = self.spec.residual_length, self.spec.group_size
            assert store.res_len < R + G, "a residual of R + G tokens or more was not flushed"

    @invariant()
    def same_bits_as_one_go(self):
        """The store holds what quantizing the history in one go (aligned groups) holds."""
        if not hasattr(self, "cache") or self.store is None:
            return
        store = self.store
        assert torch.equal(store.starts.long(), self.starts - self.evicted), "starts"
        for name, t in _used(store).items():
            if t.is_floating_point():
                assert torch.isfinite(t.float()).all(), f"{name} holds NaN or inf"
        # the residual: the newest tokens, exactly (in the store's key space)
        r, S = store.res_len, store.sink_len
        assert torch.equal(store.res_v[:, :, :r], self.hv[:, :, self.n - r:]), "residual values"
        plain_keys = store.hadamard is None and store.key_order is None
        if plain_keys:
            assert torch.equal(store.res_k[:, :, :r], self.hk[:, :, self.n - r:]), "residual keys"
        # sequence b's sink: its own first tokens (positions starts[b] + j), those it has
        at = self.starts[:, None] + torch.arange(S)  # [B, S]
        has = (at < self.n)[:, None, :, None]
        at = at.clamp(max=max(self.n - 1, 0))[:, None, :, None].expand(-1, self.Hkv, -1, self.D)
        for buf, hist, what in ((store.sink_v, self.hv, "values"),
                                (store.sink_k, self.hk, "keys"))[:2 if plain_keys else 1]:
            want = torch.gather(hist, 2, at) if S else hist[:, :, :0]
            assert bool(((buf[:, :, :S] == want) | ~has).all()), f"sink {what}"
        # everything, against the one-go store (past what this one evicted)
        shadow = self._shadow()
        G = self.spec.group_size
        S0 = min(self.spec.sink_tokens, self.n)
        gone = self.evicted - S0 if self.evicted else 0
        want = _used(shadow, groups=gone // G if self.quantized else 0,
                     tokens=0 if self.quantized else gone, sink=not self.evicted)
        got = _used(store)
        want.pop("starts"), got.pop("starts")  # (checked above: they shift with evictions)
        if store.fp8 and not store.body_len:  # an empty FP8 body's scales are not set yet
            for u in (want, got):
                u.pop("k_scale", None), u.pop("v_scale", None)
        _assert_same(want, got, "the store against the history quantized in one go")


def _used(store: LayerStore, groups: int = 0, tokens: int = 0, sink: bool = True) -> dict:
    """The used rows of every buffer (what ``state()`` saves; the sink cut to its tokens, a
    padded sequence's sink slots whose tokens have not come yet zeroed: they hold any value),
    past the first ``groups`` quantized groups and ``tokens`` residual tokens (those a sliding
    layer evicted), without the sink if not ``sink``."""
    per_group = store._rows_per_group()
    out = {"starts": store.starts}
    for name in _BUFFERS:  # (as state() saves them; it refuses a store in the device mode)
        t = getattr(store, name)
        if t is None:
            continue
        if name in per_group:
            t = t[:, :, :store.body_len // store.spec.group_size * per_group[name]]
        elif name in ("res_k", "res_v"):
            t = t[:, :, :store.res_len]
        if name in ("sink_k", "sink_v"):
            t = t[:, :, :store.sink_len if sink else 0]
            if store._row_sinks:
                at = store.starts.long()[:, None] + torch.arange(t.shape[2])
                t = torch.where((at < store.seq_len)[:, None, :, None], t, 0)
        elif name in per_group:
            t = t[:, :, groups * per_group[name]:]
        elif name in ("res_k", "res_v"):
            t = t[:, :, tokens:]
        out[name] = t
    return out


def _assert_same(ua: dict, ub: dict, what: str) -> None:
    ua = {k: v for k, v in ua.items() if v.numel()}
    ub = {k: v for k, v in ub.items() if v.numel()}
    assert ua.keys() == ub.keys(), f"{what}: buffers {sorted(ua)} vs {sorted(ub)}"
    for name in ua:
        x, y = ua[name], ub[name]
        assert x.shape == y.shape and x.dtype == y.dtype, (
            f"{what}: {name} {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        if x.is_floating_point() and x.element_size() == 1:  # float8: compare the bytes
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        same = x == y
        if x.is_floating_point():
            same |= torch.isnan(x) & torch.isnan(y)
        if not bool(same.all()):
            where = (~same).nonzero()
            raise AssertionError(f"{what}: {name} differs at {where.shape[0]} places, first "
                                 f"{tuple(where[0].tolist())}")


def _assert_same_bits(a: LayerStore, b: LayerStore, what: str) -> None:
    got = (a.sink_len, a.body_len, a.res_len), (b.sink_len, b.body_len, b.res_len)
    assert got[0] == got[1], f"{what}: lengths {got[0]} vs {got[1]}"
    _assert_same(_used(a), _used(b), what)


def _run(monkeypatch, max_examples, steps):
    monkeypatch.setenv("KVBITS_KERNELS", "reference")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_state_machine_as_test(CacheLifecycle, settings=settings(
            max_examples=max_examples, stateful_step_count=steps, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        torch.set_num_threads(before)


@pytest.mark.filterwarnings("ignore:group_size .* does not divide head_dim")
def test_cache_lifecycle(monkeypatch):
    """~15 s on two CPU cores; the machine ran ~100,000 rules (max_examples 400-500,
    stateful_step_count 40) when it was written."""
    _run(monkeypatch, max_examples=60, steps=30)
