"""Tests for kvbits.spec: presets, field validation (every bad value names its field and the
allowed values) and resolve_spec."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvbits import PRESETS, QuantSpec, resolve_spec
from kvbits.spec import BITS, GROUP_SIZES, METHODS

# preset name -> (method, key_bits, value_bits): the names users type must keep their meaning.
EXPECTED_PRESETS = {
    "fp16": ("fp16", None, None),
    "kivi-2": ("kivi", 2, 2),
    "kivi-3": ("kivi", 3, 3),
    "kivi-4": ("kivi", 4, 4),
    "kivi-8": ("kivi", 8, 8),
    "k4v2": ("kivi", 4, 2),
    "k8v4": ("kivi", 8, 4),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_exists_with_its_bits(name):
    method, kb, vb = EXPECTED_PRESETS[name]
    assert name in PRESETS, f"preset {name!r} missing; presets are {sorted(PRESETS)}"
    spec = PRESETS[name]
    assert isinstance(spec, QuantSpec)
    assert spec.method == method, f"{name}: method {spec.method!r}, expected {method!r}"
    if method == "fp16":
        assert not spec.quantized, f"{name} must not quantize"
        assert spec.describe() == "fp16"
    else:
        assert spec.quantized
        assert (spec.key_bits, spec.value_bits) == (kb, vb), (
            f"{name}: K{spec.key_bits}V{spec.value_bits}, expected K{kb}V{vb}")
        assert f"K{kb}V{vb}" in spec.describe(), spec.describe()


def test_kivi_defaults_match_the_paper():
    # KIVI: group 32, residual 128, no sink.
    spec = PRESETS["kivi-2"]
    assert (spec.group_size, spec.residual_length, spec.sink_tokens) == (32, 128, 0), spec


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["kivi-2"].key_bits = 4  # type: ignore[misc]


def _allowed_pattern(allowed) -> str:
    return ".*".join(re.escape(repr(a)) for a in allowed)


# (field, bad value, allowed values that the message must list)
CHOICE_CASES = [
    ("method", "KIVI", METHODS),
    ("method", "int4", METHODS),
    ("method", None, METHODS),
    ("key_bits", 1, BITS),
    ("key_bits", 5, BITS),
    ("key_bits", 16, BITS),
    ("key_bits", 0, BITS),
    ("key_bits", -2, BITS),
    ("key_bits", True, BITS),
    ("key_bits", "2", BITS),
    ("value_bits", 6, BITS),
    ("value_bits", 1, BITS),
    ("value_bits", True, BITS),
    ("group_size", 16, GROUP_SIZES),
    ("group_size", 48, GROUP_SIZES),
    ("group_size", 256, GROUP_SIZES),
    ("group_size", 0, GROUP_SIZES),
    ("group_size", "32", GROUP_SIZES),
]


@pytest.mark.parametrize("field,value,allowed", CHOICE_CASES,
                         ids=[f"{f}={v!r}" for f, v, _ in CHOICE_CASES])
def test_invalid_choice_names_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError) as err:
        QuantSpec(**{field: value})
    msg = str(err.value)
    assert field in msg, f"message does not name the field {field!r}: {msg}"
    assert re.search(_allowed_pattern(allowed), msg), (
        f"message does not list the allowed values {allowed}: {msg}")
    assert repr(value) in msg, f"message does not show the bad value {value!r}: {msg}"


# Integral floats compare equal to the allowed ints (2.0 in (2, 3, 4, 8) is True), so a check by
# membership alone lets them through; they then reach the kernels as a float constexpr.
FLOAT_CASES = [("key_bits", 2.0, BITS), ("value_bits", 4.0, BITS),
               ("group_size", 32.0, GROUP_SIZES)]


@pytest.mark.parametrize("field,value,allowed", FLOAT_CASES,
                         ids=[f"{f}={v!r}" for f, v, _ in FLOAT_CASES])
def test_integral_float_choice_is_rejected(field, value, allowed):
    with pytest.raises(ValueError, match=field):
        QuantSpec(**{field: value})


COUNT_CASES = [(f, v) for f in ("residual_length", "sink_tokens")
               for v in (-1, -128, True, False, 1.0, 16.5, "4", None, 2**20, 2**40)]


@pytest.mark.parametrize("field,value", COUNT_CASES, ids=[f"{f}={v!r}" for f, v in COUNT_CASES])
def test_invalid_count_names_field_and_rule(field, value):
    with pytest.raises(ValueError) as err:
        QuantSpec(**{field: value})
    msg = str(err.value)
    assert field in msg, f"message does not name the field {field!r}: {msg}"
    assert "integer in [0, 2**20)" in msg, f"message does not say what is allowed: {msg}"
    assert repr(value) in msg, f"message does not show the bad value {value!r}: {msg}"


@pytest.mark.parametrize("field,value", [
    ("residual_length", 0), ("residual_length", 1), ("residual_length", 4096),
    ("sink_tokens", 0), ("sink_tokens", 4), ("sink_tokens", 97)])
def test_valid_counts_accepted(field, value):
    assert getattr(QuantSpec(**{field: value}), field) == value


@pytest.mark.parametrize("kb", BITS)
@pytest.mark.parametrize("vb", BITS)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_every_valid_combination_accepted(kb, vb, g):
    spec = QuantSpec(key_bits=kb, value_bits=vb, group_size=g)
    assert (spec.key_bits, spec.value_bits, spec.group_size) == (kb, vb, g)


# whole groups when gcd(G, D) >= min(G, D, 32); else G channels (or all of D) and a shorter
# last group: (32, 80) is 32 + 32 + 16, not five groups of 16; (32, 100) 32 x 3 + 4, not 25 of 4
@pytest.mark.parametrize("g,d,want,groups", [
    (32, 128, 32, 4), (128, 128, 128, 1), (128, 64, 64, 1), (128, 96, 32, 3), (64, 256, 64, 4),
    (64, 96, 32, 3), (128, 192, 64, 3), (32, 80, 32, 3), (64, 80, 64, 2),
    (128, 80, 80, 1), (32, 100, 32, 4), (64, 100, 64, 2), (32, 40, 32, 2), (64, 24, 24, 1)])
def test_value_group(g, d, want, groups):
    spec = QuantSpec(group_size=g)
    assert spec.value_group(d) == want and spec.value_groups(d) == groups


def test_replace_revalidates():
    spec = QuantSpec()
    assert spec.replace(key_bits=4).key_bits == 4
    assert spec.key_bits == 2, "replace must not modify the original"
    with pytest.raises(ValueError, match="key_bits"):
        spec.replace(key_bits=5)
    with pytest.raises(ValueError, match=r"unknown field\(s\) resid; fields: method, key_bits"):
        spec.replace(resid=3)  # was a bare TypeError


def test_resolve_spec_by_name_and_overrides():
    assert resolve_spec("kivi-4") is PRESETS["kivi-4"]
    spec = resolve_spec("kivi-4", residual_length=0, sink_tokens=4, group_size=128)
    assert (spec.key_bits, spec.value_bits) == (4, 4)
    assert (spec.residual_length, spec.sink_tokens, spec.group_size) == (0, 4, 128), spec
    assert PRESETS["kivi-4"].residual_length == 128, "override leaked into the preset"


def test_resolve_spec_from_a_spec_string():
    """``PRESET:FIELD=VALUE,...`` as the CLI takes it (and the README's preset table names
    them), short names included; keyword overrides win over the string's."""
    spec = resolve_spec("kivi-3:S=1,G=64")
    assert spec == PRESETS["kivi-3"].replace(sink_tokens=1, group_size=64)
    assert resolve_spec("kivi-2:bits=4,R=0", residual_length=32) == PRESETS["kivi-2"].replace(
        key_bits=4, value_bits=4, residual_length=32)
    assert resolve_spec("kvquant-3:pre_rope=0,outliers=0.02").outliers == 0.02
    with pytest.raises(ValueError, match=r"group_size must be one of 32, 64, 128; got 7"):
        resolve_spec("kivi-2:G=7")
    with pytest.raises(ValueError, match=r"bad override 'X=1' in 'kivi-2:X=1'.*group_size"):
        resolve_spec("kivi-2:X=1")
    with pytest.raises(ValueError, match=r"group_size in 'kivi-2:G=big' must be an integer"):
        resolve_spec("kivi-2:G=big")
    with pytest.raises(ValueError, match="unknown preset 'kivi-5:G=64'"):
        resolve_spec("kivi-5:G=64")


def test_spec_string_numbers_are_plain_decimals():
    """A QA pass: ``O=-0`` was kept as -0.0 (label "out=-0", and another calibration cache key
    than ``O=0``), and int() took ``G=6_4`` and ``G=+64`` as 64. Numbers are plain decimals now,
    a '-' left for the field's own range check (transformers' axis_key=-1 takes one)."""
    import math

    from kvbits.methods.kvquant import spec_fields
    from kvbits.spec import parse_overrides

    neg, zero = resolve_spec("kvquant-3:O=-0"), resolve_spec("kvquant-3:O=0")
    assert math.copysign(1.0, neg.outliers) == 1.0 and "out=0 " in neg.describe()
    assert json.dumps(spec_fields(neg)) == json.dumps(spec_fields(zero))
    assert resolve_spec("kvquant-3:O=.01").outliers == resolve_spec("kvquant-3:O=1e-2").outliers
    for text, field, values in (("kivi-2:G=6_4", "group_size", r"one of 32, 64, 128"),
                                ("kivi-2:G=+64", "group_size", r"one of 32, 64, 128"),
                                ("kivi-2:bits=\u0663", "bits", r"one of 2, 3, 4, 8"),
                                ("kivi-2:R= 1_0", "residual_length", r"in \[0, 2\*\*20\)"),
                                ("kvquant-3:O=+0.01", "outliers", r"a fraction in \[0, 0.25\]"),
                                ("kvquant-3:O=nan", "outliers", r"a fraction in \[0, 0.25\]")):
        with pytest.raises(ValueError, match=rf"{field} in '.*' must be an? (integer|number) in "
                                             rf"plain decimal.*\({values}"):
            resolve_spec(text)
    with pytest.raises(ValueError, match=r"residual_length must be an integer in \[0, 2\*\*20"):
        resolve_spec("kivi-2:R=-1")  # a sign still reaches the range check
    assert parse_overrides("x", "axis_key=-1")["axis_key"] == -1


def test_resolve_spec_none_override_means_keep():
    # CLI flags left unset arrive as None and must not override the preset.
    spec = resolve_spec("k4v2", residual_length=None, group_size=None)
    assert spec == PRESETS["k4v2"]


def test_resolve_spec_refuses_overrides_of_a_spec_that_quantizes_nothing():
    # "fp16:K=2" once resolved to plain fp16: the user asked for 2-bit keys and got none.
    for spec, kw, got in (("fp16:K=2", {}, "key_bits"),
                          ("fp16:R=3", {}, "residual_length"),  # (typed, then ignored)
                          ("fp16:G=64,S=2", {"residual_length": 4}, "group_size, sink_tokens"),
                          ("fp16", {"nbits": 2, "residual_length": 4}, "key_bits, value_bits"),
                          (PRESETS["fp16"], {"hadamard": True}, "hadamard")):
        with pytest.raises(ValueError, match=r"(preset|spec) 'fp16' quantizes nothing and takes "
                                             rf"no overrides of how to quantize \(got {got}\)"):
            resolve_spec(spec, **kw)
    assert resolve_spec("fp16", residual_length=None) is PRESETS["fp16"]  # unset CLI flags
    # the knobs a loop over presets passes to all, the FP16 baseline too, stay harmless
    assert not resolve_spec("fp16", group_size=64, residual_length=8, sink_tokens=4).quantized


def test_resolve_spec_from_spec():
    base = QuantSpec(key_bits=8, value_bits=4, group_size=64)
    assert resolve_spec(base) is base
    assert resolve_spec(base, value_bits=2).value_bits == 2


def test_resolve_spec_override_is_validated():
    with pytest.raises(ValueError, match="value_bits"):
        resolve_spec("kivi-2", value_bits=7)
    with pytest.raises(ValueError, match="residual_length"):
        resolve_spec("kivi-2", residual_length=-1)


@pytest.mark.parametrize("name", ["kivi2", "KIVI-2", "kivi-5", "", "int4"])
def test_resolve_spec_unknown_preset_lists_presets(name):
    with pytest.raises(ValueError) as err:
        resolve_spec(name)
    msg = str(err.value)
    assert repr(name) in msg, f"message does not show the bad name: {msg}"
    for preset in PRESETS:
        assert preset in msg, f"message does not list preset {preset!r}: {msg}"


@pytest.mark.parametrize("bad", [None, 2, ("kivi-2",)])
def test_resolve_spec_rejects_non_name(bad):
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_spec(bad)


@pytest.mark.parametrize("name", ["foo", "S", "nbit", "group"])
def test_resolve_spec_unknown_override_names_the_fields(name):
    # Was a bare TypeError from QuantSpec.__init__ ("unexpected keyword argument").
    with pytest.raises(ValueError, match=rf"unknown QuantSpec override\(s\) {name};.*key_bits.*"
                                         r"residual_length.*nbits"):
        resolve_spec("kivi-2", **{name: 1})


@pytest.mark.parametrize("doc,match", [
    ([1, 2], "from a dict of its fields"),
    ({"layer_bits": 3}, r"layer_bits must be a list of \[layer, key_bits, value_bits\] triples"),
    ({"layer_bits": [3]}, r"layer_bits must be a list of \[layer, key_bits, value_bits\] triples"),
    ({"skip_layers": 0}, "skip_layers must be a list of layer indices"),
])
def test_spec_file_with_malformed_fields(tmp_path, doc, match):
    # Were TypeErrors from dict() / tuple() deep in from_dict.
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kvbits_spec": 1, "spec": doc}))
    with pytest.raises(ValueError, match=match):
        resolve_spec(str(path))


@pytest.mark.parametrize("text,field", [
    ("kivi-2:G=64,G=128", "group_size"),
    ("kivi-2:residual_length=64,R=32", "residual_length"),
    ("uniform:G=64,q_group_size=128", "group_size"),
    ("kivi-2:bits=4,nbits=2", "bits"),
    ("uniform:axis_key=-1,key_axis=token", "key_axis"),
    ("kivi-2:S=1,S=1", "sink_tokens"),
])
def test_spec_string_refuses_a_field_set_twice(text, field):
    # The last value won (or, for transformers' names, the first), the other silently dropped.
    with pytest.raises(ValueError, match=rf"{re.escape(repr(text))} sets {field} twice"):
        resolve_spec(text)


@pytest.mark.parametrize("text", ["kivi-2:", "uniform-int4: "])
def test_spec_string_with_a_colon_and_nothing_after_is_refused(text):
    """Session 50 QA: 'kivi-2:' ran as kivi-2 under the label 'kivi-2:' in tables and files."""
    from kvbits.cli import parse_presets

    with pytest.raises(ValueError, match="ends in ':' with no overrides after it"):
        resolve_spec(text)
    with pytest.raises(ValueError, match=r"--presets: .* ends in ':'"):
        parse_presets(f"fp16,{text}")


@pytest.mark.parametrize("text", ["kivi-2:,", "kvquant-3: , ,"])
def test_spec_string_with_only_commas_after_the_colon_is_refused(text):
    """A QA audit: 'kivi-2:,' ran as kivi-2 under that label, as 'kivi-2:' did before."""
    with pytest.raises(ValueError, match="has no overrides after its ':', only commas"):
        resolve_spec(text)


def test_spec_string_bits_may_be_refined_by_one_width():
    # bits / nbits set both widths; K or V then changes one: not a conflict.
    assert (resolve_spec("kivi-2:bits=4,K=8").key_bits, resolve_spec("kivi-2:bits=4,K=8")
            .value_bits) == (8, 4)
    assert resolve_spec("uniform:nbits=4,K=2").key_bits == 2


def test_bits_as_a_keyword_as_in_a_spec_string():
    # KVBitsCache(model, "kivi-2", bits=4) was refused ("unknown override bits") while
    # "kivi-2:bits=4" and nbits=4 were taken.
    assert resolve_spec("kivi-2", bits=4) == resolve_spec("kivi-2:bits=4")
    assert resolve_spec("kivi-2", bits=4, value_bits=2).describe() == "kivi K4V2 G=32 R=128 S=0"
    with pytest.raises(ValueError, match="nbits and bits .* disagree: nbits=2, bits=4"):
        resolve_spec("kivi-2", bits=4, nbits=2)
    # an unhashable width (a list, as transformers' per-layer habits might suggest) raised
    # TypeError: unhashable type, naming nothing
    for kw in ({"nbits": [4]}, {"bits": {}}, {"nbits": [4], "bits": [4]}):
        with pytest.raises(ValueError, match=r"key_bits must be one of 2, 3, 4, 8"):
            resolve_spec("uniform", **kw)


def test_transformers_name_and_field_that_disagree_are_refused():
    # KVBitsCache(model, "uniform", q_group_size=64, group_size=32) quietly used 32.
    with pytest.raises(ValueError, match=r"q_group_size \(transformers' name of group_size\) "
                                         r"and group_size disagree.*give one of them"):
        resolve_spec("uniform", q_group_size=64, group_size=32)
    with pytest.raises(ValueError, match="axis_key .*and key_axis disagree"):
        resolve_spec("uniform", axis_key=-1, key_axis="token")
    assert resolve_spec("uniform", q_group_size=64, group_size=64).group_size == 64
    # keywords still win over the string, whichever name either uses
    assert resolve_spec("uniform:q_group_size=128", group_size=32).group_size == 32
    assert resolve_spec("uniform:G=128", q_group_size=32).group_size == 32
    assert resolve_spec("uniform:axis_key=-1", key_axis="token").key_axis == "token"


def _tuned_file(tmp_path, layer_bits, skip_layers=(), model_layers=4):
    spec = PRESETS["kivi-3"].replace(layer_bits=tuple(layer_bits), skip_layers=tuple(skip_layers),
                                     model_layers=model_layers)
    path = tmp_path / "tuned.json"
    spec.save(path)
    return str(path)


def test_bits_override_of_a_spec_that_sets_every_layer_is_refused(tmp_path):
    # "smollm2-avg3.json:bits=4" resolved, described itself as K4V4 and changed no layer.
    every = _tuned_file(tmp_path, [(i, 3, 2) for i in range(3)], skip_layers=(-1,))
    for text, kw in ((every + ":bits=4", {}), (every, {"value_bits": 4}),
                     (every + ":K=8", {})):
        with pytest.raises(ValueError, match=r"sets the bits of each of its 4 layers .*would "
                                             "change no layer"):
            resolve_spec(text, **kw)
    assert resolve_spec(every + ":G=64").group_size == 64  # other fields still apply
    assert resolve_spec(every + ":K=3").key_bits == 3  # the file's own value: a no-op anyway
    # a layer the spec leaves to the base bits, or a spec for any depth: the override applies
    some = _tuned_file(tmp_path, [(0, 8, 8), (1, 2, 2)])
    assert resolve_spec(some + ":bits=4").for_layer(3, 4).key_bits == 4
    assert resolve_spec("k4v2-edge8:K=2").for_layer(1, 30).key_bits == 2


@pytest.mark.parametrize("name", ["smollm2-avg3.json", "smollm2-avg3-hadc.json"])
def test_committed_spec_files_name_their_depth(name):
    # They predated model_layers: ":bits=4" and a 32-layer model were taken silently.
    path = str(Path(__file__).parents[1] / "benchmarks" / "results" / "specs" / name)
    assert resolve_spec(path).model_layers == 30
    with pytest.raises(ValueError, match="would change no layer"):
        resolve_spec(path + ":bits=4")
    with pytest.raises(ValueError, match="model with 30 layers"):
        resolve_spec(path).for_layer(0, 32)


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_spec_file_of_another_format_version_is_refused(tmp_path, version):
    # Any "kvbits_spec" was read as format 1.
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"kvbits_spec": version, "spec": PRESETS["kivi-2"].to_dict()}))
    with pytest.raises(ValueError, match=r"has format kvbits_spec=.*this kvbits reads format 1"):
        resolve_spec(str(path))
    path.write_text(json.dumps({"spec": PRESETS["kivi-2"].to_dict()}))  # no marker: as before
    assert resolve_spec(str(path)) == PRESETS["kivi-2"]


def test_spec_file_errors_name_the_file_and_duplicate_keys_are_refused(tmp_path):
    """A field's error named no file (a spec file among several --presets: which one?), a file
    that is not UTF-8 was the codec's bare UnicodeDecodeError, and a key given twice kept its
    last value silently (a hand-edited "key_bits": 2, ..., "key_bits": 4 ran at 4 bits). An
    editor's UTF-8 byte-order mark is read."""
    path = tmp_path / "s.json"
    name = re.escape(repr(str(path)))
    path.write_text('{"kvbits_spec": 1, "spec": {"key_bits": 5}}')
    with pytest.raises(ValueError, match=f"spec file {name}: QuantSpec.key_bits must be one of"):
        resolve_spec(str(path))
    path.write_bytes(b'{"kvbits_spec": 1, "info": "caf\xe9", "spec": {}}')  # Latin-1
    with pytest.raises(ValueError, match=f"cannot read spec file {name}: 'utf-8' codec"):
        QuantSpec.load(path)
    for text, key in (('{"spec": {"key_bits": 2, "value_bits": 2, "key_bits": 4}}', "key_bits"),
                      ('{"spec": {"key_bits": 2}, "spec": {"key_bits": 4}}', "spec")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"cannot read spec file {name}: '{key}' given twice"):
            QuantSpec.load(path)
    path.write_bytes(b'\xef\xbb\xbf{"kvbits_spec": 1, "spec": {"key_bits": 4}}')
    assert QuantSpec.load(path) == QuantSpec(key_bits=4)


def test_spec_save_is_atomic_and_writes_into_what_is_not_a_regular_file(tmp_path, monkeypatch,
                                                                        interrupted_writes):
    """QuantSpec.save (and so ``kvbits tune -o``) wrote the file in place: a write stopped part
    way (Ctrl-C, a full disk) left a cut file, which the next run refused, over the good spec
    saved there before. It now goes through a temporary file renamed over the name; a FIFO (as
    /dev/null) is written into, not replaced; a symbolic link is written through; a folder or
    info that is not JSON is refused by name."""
    import os
    import stat

    path = tmp_path / "s.json"
    PRESETS["kivi-2"].save(path, note="good")
    interrupted_writes(20)
    with pytest.raises(KeyboardInterrupt):
        PRESETS["kivi-4"].save(path)
    interrupted_writes.undo()
    assert QuantSpec.load(path) == PRESETS["kivi-2"]
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary left
    link = tmp_path / "link.json"
    link.symlink_to(path)
    PRESETS["kivi-4"].save(link)
    assert link.is_symlink() and QuantSpec.load(path) == PRESETS["kivi-4"]
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # (the writer's open does not wait)
        try:
            PRESETS["kivi-3"].save(fifo)
            assert stat.S_ISFIFO(os.stat(fifo).st_mode)
            assert json.loads(os.read(fd, 1 << 16))["spec"] == PRESETS["kivi-3"].to_dict()
        finally:
            os.close(fd)
    with pytest.raises(ValueError, match="QuantSpec.save: path .* is a folder"):
        PRESETS["kivi-2"].save(tmp_path)
    with pytest.raises(TypeError, match="info keywords must be JSON-able"):
        PRESETS["kivi-2"].save(tmp_path / "t.json", note=object())
    assert not (tmp_path / "t.json").exists()
