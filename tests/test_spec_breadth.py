"""QuantSpec fields of the breadth methods: every bad value names its field and what is allowed."""

from __future__ import annotations

import pytest

from kvbits.spec import PRESETS, QuantSpec, resolve_spec


def test_presets():
    u = PRESETS["uniform"]
    assert (u.method, u.key_bits, u.group_size, u.residual_length, u.key_axis, u.value_axis) == (
        "uniform", 4, 64, 128, "token", "token")  # transformers' QuantizedCache defaults
    assert PRESETS["uniform-int2"].key_bits == 2 and PRESETS["uniform-int8"].value_bits == 8
    assert PRESETS["kivi-3-had"].hadamard and PRESETS["kivi-3-had"].key_bits == 3
    assert PRESETS["fp8"].calibrated and not PRESETS["fp8-dynamic"].calibrated
    assert "hadamard" in PRESETS["kivi-2-had"].describe()
    c = PRESETS["kivi-2-hadc"]
    assert c.hadamard and c.hadamard_calibrated and c.key_bits == 2 and not c.calibrated
    assert c.describe().endswith("hadamard-calibrated")
    assert QuantSpec.from_dict(c.to_dict()) == c
    assert "K:token V:token" in u.describe()


def test_hf_names():
    s = resolve_spec("uniform", nbits=8, axis_key=-1, axis_value=-1, q_group_size=128,
                     residual_length=64)
    assert (s.key_bits, s.value_bits, s.key_axis, s.value_axis, s.group_size,
            s.residual_length) == (8, 8, "channel", "channel", 128, 64)
    assert resolve_spec("uniform", nbits=2, key_bits=4).key_bits == 4  # explicit field wins


@pytest.mark.parametrize("fields, match", [
    ({"method": "uniform", "key_axis": "row"}, r"key_axis must be one of 'channel', 'token'"),
    ({"method": "kivi", "key_axis": "token"}, r"need method 'uniform'"),
    ({"method": "fp8", "key_bits": 4, "value_bits": 4}, r"must be 8 for method 'fp8'"),
    ({"method": "fp8", "key_bits": 8, "value_bits": 8, "fp8_scale": "static"},
     r"fp8_scale must be one of 'dynamic', 'calibrated'"),
    ({"method": "kivi", "fp8_granularity": "tensor"}, r"apply to method 'fp8' only"),
    # only kvquant's calibration reads it: 'kivi-2:fisher=0' was kept and did nothing
    ({"method": "uniform", "fisher": False}, r"fisher applies to method 'kvquant' only"),
    ({"method": "kvquant", "hadamard": True}, r"hadamard applies to methods"),
    ({"hadamard": True, "pre_rope": True}, r"cannot be combined with pre_rope"),
    # FP8 layers kept the store's unrotated keys and neither path turned them back (0.89 off)
    ({"method": "fp8", "key_bits": 8, "value_bits": 8, "pre_rope": True},
     r"pre_rope applies to methods 'kivi', 'uniform', 'kvquant'"),
    ({"method": "fp16", "pre_rope": True},  # (accepted and ignored before session 53)
     r"pre_rope applies to methods 'kivi', 'uniform', 'kvquant'.*method is 'fp16'"),
    ({"hadamard": 1}, r"hadamard must be True or False"),
    ({"hadamard_calibrated": True}, r"hadamard_calibrated needs hadamard=True"),
    ({"method": "fp8", "key_bits": 8, "value_bits": 8, "hadamard": True,
      "hadamard_calibrated": True}, r"hadamard_calibrated needs hadamard=True and method"),
    ({"layer_bits": ((0, 5, 2),)}, r"layer_bits: key_bits of layer 0 must be one of 2, 3, 4, 8"),
    ({"layer_bits": ((0, 4),)}, r"integer triples"),
    ({"layer_bits": [(0, 4, 4)]}, r"must be tuples"),
    ({"skip_layers": ("first",)}, r"skip_layers entries must be layer indices"),
    ({"method": "fp8", "key_bits": 8, "value_bits": 8, "skip_layers": (0,)},
     r"apply to methods 'kivi', 'uniform'"),
])
def test_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        QuantSpec(**fields)


def test_for_layer_and_average_bits():
    s = resolve_spec("kivi-2", layer_bits=((0, 8, 8), (-1, 4, 2)), skip_layers=(1,))
    assert s.for_layer(0, 4).key_bits == 8 and s.for_layer(3, 4).key_bits == 4
    assert s.for_layer(1, 4).method == "fp16" and s.for_layer(2, 4).key_bits == 2
    assert s.for_layer(2, 4).layer_bits == ()
    assert s.average_bits(4) == (16 + 32 + 4 + 6) / 8
    with pytest.raises(ValueError, match="layer -5 is out of range"):
        resolve_spec("kivi-2", skip_layers=(-5,)).for_layer(0, 4)
    # a layer named twice (the last entry silently won): refused, -1 and 3 the same layer
    for kw in ({"layer_bits": ((0, 8, 8), (-4, 2, 2))}, {"layer_bits": ((3, 8, 8),),
                                                         "skip_layers": (-1,)}):
        with pytest.raises(ValueError, match="is named twice"):
            resolve_spec("kivi-2", **kw).for_layer(0, 4)
    # the same setting twice is harmless: k4v2-edge8 on a one-layer model (first = last layer)
    edge = resolve_spec("k4v2-edge8")
    assert (edge.for_layer(0, 1).key_bits, edge.for_layer(0, 1).value_bits) == (8, 8)
    assert edge.average_bits(1) == 8
    assert resolve_spec("kivi-2", skip_layers=(0, -1)).for_layer(0, 1).method == "fp16"


def test_unknown_preset_mentions_spec_files():
    with pytest.raises(ValueError, match=r"spec file"):
        resolve_spec("kivi-5")
    with pytest.raises(ValueError, match="unknown QuantSpec field"):
        QuantSpec.from_dict({"bits": 3})


def test_cli_overrides():
    from kvbits.cli import parse_presets

    (u, h, f) = parse_presets("uniform-int2:axis_key=-1,q_group_size=32,kivi-2-had:hadamard=0,"
                              "fp8-dynamic:fp8_granularity=tensor")
    assert (u.spec.key_axis, u.spec.group_size, u.spec.key_bits) == ("channel", 32, 2)
    assert not h.spec.hadamard and f.spec.fp8_granularity == "tensor"
