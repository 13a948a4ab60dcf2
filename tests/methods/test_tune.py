"""kvbits tune: sensitivities through the cache quantizer, exact allocation, spec file via CLI."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvbits.cli import parse_presets
from kvbits.methods.tune import _table, allocate, layer_sensitivity, tune
from kvbits.spec import PRESETS, resolve_spec


def test_allocate_is_exact_and_meets_budget():
    costs = [_table(1.0, 0.1), _table(0.01, 0.001), _table(0.5, 0.01)]
    assert allocate(costs, 9) == [4, 2, 3]
    assert allocate(costs, 6) == [2, 2, 2]
    assert allocate(costs, 12) == [4, 4, 4]
    assert sum(allocate(costs, 10)) <= 10
    with pytest.raises(ValueError, match="avg bits too low"):
        allocate(costs, 5)
    # 3 bits = geometric mean of 2 and 4; 8 bits extrapolated
    assert _table(1.0, 0.01) == pytest.approx([1.0, 0.1, 0.01, 1e-6])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: OpenMP barriers dominate on a shared CPU
    yield LlamaForCausalLM(cfg).eval()
    torch.set_num_threads(before)


def test_tune_tiny_model(model, tmp_path):
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    sens = layer_sensitivity(model, ids, PRESETS["kivi-3"], (2, 4), window=64)
    assert sens["k"].shape == (3, 2) and (sens["k"] >= -1e-6).all()
    assert (sens["k"][:, 0] >= sens["k"][:, 1]).all()  # 2 bits hurt more than 4
    assert model.config._attn_implementation != "kvbits_tune"  # restored
    r = tune(model, ids, PRESETS["kivi-3"], 3.0, window=64)
    assert r.avg_bits <= 3.0 and len(r.spec.layer_bits) == 3
    path = tmp_path / "t.json"
    r.spec.save(path, sensitivity=r.sensitivity)
    (v,) = parse_presets(str(path))
    assert v.spec == r.spec == resolve_spec(str(path))
    # made for 3 layers: a deeper model is refused too (its extra layers silently kept the base
    # bits, 2.4 average bits for a 2.0 tune on 5 layers; found by a QA audit), a shallower one
    # always was
    assert r.spec.model_layers == 3 and r.spec.average_bits(3) == r.avg_bits
    for depth in (2, 5):
        with pytest.raises(ValueError, match=rf"chosen for a model with 3 layers .* has {depth}"):
            r.spec.average_bits(depth)
    assert r.spec.for_layer(0, 3).model_layers == 0  # a layer's own spec names no depth
    with pytest.raises(ValueError, match="the base spec is method 'fp8'; tune allocates the bits "
                       "of method 'kivi' or 'uniform'"):
        tune(model, ids, PRESETS["fp8-dynamic"], 3.0)


def test_tune_with_calibrated_hadamard_base(model):
    """A kivi-N-hadc base: every trial rotates the calibrated channel subsets, and the tuned spec
    keeps the rotation; without the subsets it is refused with the calibration hint."""
    from kvbits.methods.hadamard import calibrate_hadamard
    from kvbits.methods.tune import _fake_quantize

    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    base = PRESETS["kivi-3-hadc"]
    chans = calibrate_hadamard(model, ids, base, window=64)
    assert any(len(c) for layer in chans for c in layer)  # something is rotated
    r = tune(model, ids, base, 3.0, window=64, calibration=chans)
    assert r.spec.hadamard_calibrated and len(r.spec.layer_bits) == 3 and r.avg_bits <= 3.0
    # the rotation changes what the quantizer sees (so the sensitivities are the rotated ones)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(1, 1, 64, 32, generator=g) * 3 for _ in range(2))
    k[..., 5] += 40  # an outlier channel, the case the rotation exists for
    layer = next(i for i, layer in enumerate(chans) if len(layer[0]))
    spec = base.replace(key_bits=2, value_bits=2)
    plain, _ = _fake_quantize(k, v, spec.replace(hadamard=False, hadamard_calibrated=False), "k")
    rotated, _ = _fake_quantize(k, v, spec, "k", chans[layer])
    assert not torch.allclose(plain, rotated)
    assert (rotated - k).norm() < k.norm()  # back in the model's space, not still rotated
    with pytest.raises(ValueError, match="calibration"):
        tune(model, ids, base, 3.0, window=64, calibration=None)


def test_allocate_spends_the_budget_on_ties():
    """A tensor whose 4-bit KL measured no lower than its 2-bit one (noise, or a layer where
    quantization does not matter) has equal costs at every width; the allocation gave it 2 bits
    and left the budget unspent: --avg-bits 4 wrote a spec averaging 2 bits here, 3 below."""
    flat = _table(0.5, 0.5)
    assert sum(allocate([flat] * 4, 16)) == 16
    assert sum(allocate([_table(0.0, 0.0)] * 3, 12)) == 12
    assert allocate([_table(1.0, 0.1), flat], 16) == [8, 8]
    # strictly better widths still win the budget first
    assert allocate([_table(1.0, 0.1), flat], 10) == [8, 2]


@pytest.mark.parametrize("tokens, window, match", [
    (64, 16, r"window=16 .* group_size 32"),  # every window shorter than a group
    (20, 512, r"20 tokens .* group_size 32"),  # the whole text shorter than a group
    (1, 512, r"1 tokens .* group_size 32"),  # (a ZeroDivisionError)
    (64, 0, r"window=0"),  # (range() arg 3 must not be zero)
])
def test_tune_refuses_windows_that_quantize_nothing(model, tokens, window, match):
    """The cache quantizes whole groups of G tokens: a shorter window kept every token in FP16,
    so every sensitivity was 0 and tune wrote a spec of arbitrary bits without a word."""
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=match):
        tune(model, ids, PRESETS["kivi-3"], 3.0, window=window)
    with pytest.raises(ValueError, match=match):
        layer_sensitivity(model, ids, PRESETS["kivi-3"], window=window)


def test_tune_with_pre_rope_base(model):
    """A pre-RoPE base (kivi-3:P=1, uniform:P=1) failed after the full-precision pass: the
    trials' stores had no RoPE frequencies. They take the model's, and the quantized keys come
    back turned, in the model's space."""
    from kvbits.methods.tune import _fake_quantize
    from kvbits.reference.rope import model_inv_freqs, rotate

    base = resolve_spec("kivi-3:P=1")
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    r = tune(model, ids, base, 3.0, window=64)
    assert r.spec.pre_rope and len(r.spec.layer_bits) == 3 and r.avg_bits <= 3.0
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(1, 1, 64, 32, generator=g) for _ in range(2))
    inv = model_inv_freqs(model)[0]
    k = rotate(k * torch.linspace(0.5, 4, 32), torch.arange(64)[None], inv)  # post-RoPE
    got, _ = _fake_quantize(k, v, base.replace(key_bits=8, value_bits=8), "k", inv_freq=inv)
    assert (got - k).abs().max() < 0.05 * k.abs().max()


def test_allocate_matches_brute_force():
    """Against every allocation of up to 4 tensors (integer costs: exact sums): the least total
    cost within the budget, and of the allocations that reach it the one spending the most."""
    import itertools

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvbits.methods.tune import CHOICES

    costs_st = st.lists(st.lists(st.integers(0, 6), min_size=4, max_size=4), min_size=1,
                        max_size=4)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(costs_st, st.integers(0, 32))
    def check(costs, extra):
        budget = 2 * len(costs) + extra
        got = allocate([[float(c) for c in row] for row in costs], budget)
        best = min((sum(row[CHOICES.index(b)] for row, b in zip(costs, combo)), -sum(combo))
                   for combo in itertools.product(CHOICES, repeat=len(costs))
                   if sum(combo) <= budget)
        assert (sum(row[CHOICES.index(b)] for row, b in zip(costs, got)), -sum(got)) == best

    check()


def test_tune_keeps_the_base_fp16_layers(model, tmp_path):
    """A base with skip_layers (a spec file) was refused; its FP16 layers are now kept, not
    measured, and count 16 bits in the average budget, so the tuned layers share the rest."""
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    base = resolve_spec("kivi-3", skip_layers=(-1,))
    sens = layer_sensitivity(model, ids, base, (2, 4), window=64)
    assert (sens["k"][2] == 0).all() and (sens["k"][:2, 0] > 0).all()  # layer 2 not run
    r = tune(model, ids, base, 8.0, window=64)  # 16 + 2 x 4 layers' tensors at 8 bits fit
    assert r.spec.skip_layers == (-1,) and [e[0] for e in r.spec.layer_bits] == [0, 1]
    assert r.spec.for_layer(2, 3).method == "fp16" and r.sensitivity["k"][2] is None
    assert r.avg_bits == r.spec.average_bits(3) <= 8.0
    assert r.avg_bits == (16 * 2 + 2 * 2 * 4) / 6  # budget 48: 32 to FP16, 16 over 4 tensors
    path = tmp_path / "skip.json"
    r.spec.save(path, sensitivity=r.sensitivity)
    assert resolve_spec(str(path)) == r.spec
    with pytest.raises(ValueError, match=r"avg_bits=6.0 over 3 layers cannot be met with 1 of "
                                         r"them kept in FP16"):
        tune(model, ids, base, 6.0, window=64)
    with pytest.raises(ValueError, match="cannot be met with 3 of them kept in FP16"):
        tune(model, ids, resolve_spec("kivi-3", skip_layers=(0, 1, 2)), 8.0, window=64)


def test_tune_takes_the_averages_a_base_with_fp16_layers_can_reach(model):
    """FP16 layers count 16 bits, so with one of three kept in FP16 the averages reachable are
    (32 + 4 * [2..8]) / 6 = [6.67, 10.67]: avg_bits above 8 was refused ("must be in [2, 8]")
    while the message for one below the range said "raise avg_bits"; a base with one FP16
    layer of two (reachable: [9, 12]) could not be tuned at all (a QA audit)."""
    from kvbits.methods.tune import check_tune_args

    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    base = resolve_spec("kivi-3", skip_layers=(-1,))
    check_tune_args(base, 10.0, "--base", "--avg-bits")
    r = tune(model, ids, base, 32 / 3, window=64)  # the most: every tuned tensor at 8 bits
    assert [e[1:] for e in r.spec.layer_bits] == [(8, 8), (8, 8)]
    assert r.avg_bits == pytest.approx(32 / 3)
    with pytest.raises(ValueError, match=r"above the most they can average, 10.6667 .*give "
                                         r"avg_bits in \[6.66667, 10.6667\]"):
        tune(model, ids, base, 11.0, window=64)
    with pytest.raises(ValueError, match=r"give avg_bits in \[6.66667, 10.6667\]"):
        tune(model, ids, base, 6.0, window=64)
    with pytest.raises(ValueError, match=r"--avg-bits must be in \[2, 16\] .*FP16 layers at 16"):
        check_tune_args(base, 16.5, "--base", "--avg-bits")
    with pytest.raises(ValueError, match=r"--avg-bits must be in \[2, 8\]"):  # no FP16 layer
        check_tune_args(resolve_spec("kivi-3"), 8.5, "--base", "--avg-bits")


def test_sensitivity_of_a_softcapped_model():
    """Gemma2 caps its attention logits, which SDPA refuses ("`sdpa` attention does not support
    `softcap`"): the trials run the capped attention, the unquantized pass gives the model's own
    logits, and the sensitivities are measured."""
    from tiny_decoders import tiny_gemma2

    from kvbits.methods import tune as tune_mod

    model = tiny_gemma2()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        tune_mod._register()
        model.set_attn_implementation(tune_mod._ATTN)
        try:
            got = model(ids, use_cache=False).logits
        finally:
            model.set_attn_implementation("eager")
    torch.testing.assert_close(got, want)
    sens = layer_sensitivity(model, ids, PRESETS["kivi-2"], (2, 4), window=64)
    for kind in ("k", "v"):
        assert sens[kind].shape == (2, 2) and sens[kind].isfinite().all()
        assert (sens[kind] >= -1e-6).all()


def test_sensitivity_is_finite_with_logits_at_minus_inf(model):
    """Logits at -inf (a masked vocabulary entry) have p == 0 in both distributions: their KL
    terms are 0, not 0 * (-inf - -inf) = NaN, which allocate then took as a cost."""
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    masked = torch.arange(100, 128)
    hook = model.lm_head.register_forward_hook(
        lambda module, args, out: out.index_fill(-1, masked, float("-inf")))
    try:
        sens = layer_sensitivity(model, ids, PRESETS["kivi-3"], (2, 4), window=64)
    finally:
        hook.remove()
    for kind in ("k", "v"):
        assert torch.isfinite(sens[kind]).all(), sens[kind]
        assert (sens[kind] >= -1e-6).all() and (sens[kind][:, 0] > 0).all()


def test_tune_output_replaces_the_old_spec_file_only_when_whole(model, tmp_path, monkeypatch,
                                                                interrupted_writes):
    """``kvbits tune -o FILE`` wrote the spec file in place: stopped part way (Ctrl-C, a full
    disk), it left a cut file, which every later --presets FILE refused, over the spec a
    previous tune had written there. The old file now stays until the new one is whole."""
    import json

    from kvbits import cli

    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(cli, "_load", lambda *a, **k: (model, None, ids))
    out = tmp_path / "t.json"
    cfg = cli.TuneConfig(model="tiny", avg_bits=3.0, base=parse_presets("kivi-3")[0], tokens=64,
                         window=64, output=str(out))
    cli.run_tune(cfg)
    before = out.read_text()
    interrupted_writes(40)
    with pytest.raises(KeyboardInterrupt):
        cli.run_tune(cli.TuneConfig(**{**cfg.__dict__, "avg_bits": 2.5}))
    interrupted_writes.undo()
    assert out.read_text() == before and json.loads(before)["info"]["avg_bits"] <= 3.0
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary left
    assert resolve_spec(str(out)).model_layers == 3
