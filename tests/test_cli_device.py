"""``--device`` and ``--dtype`` of kvbits ppl, calibrate, tune and needle (the first three always
ran the model on the CPU in float32, needle in float32 on either device): refused values, the defaults, half precision on the CPU, and where the run's
device and dtype are recorded; generate's --device (auto besides, through the same check). A tiny
random Llama stands in for the model (no download)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_cli import run  # (tests/ is on sys.path, as for tiny_decoders)

import kvbits.data
from kvbits import cli
from kvbits.cli import main

CUDA = torch.cuda.is_available()
COMMANDS = ("ppl", "calibrate", "tune", "needle", "demo")


def tiny_llama():
    """A random 2-layer Llama (seed 0, 64-token vocabulary, GQA 2, head_dim 32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    """``kvbits.data.load_model`` gives the tiny Llama (in the dtype and on the device asked
    for) and ``tokenize_text`` fixed random ids; returns ``(loads, text)``: the
    ``(dtype, device)`` of each load, and a text file for ``--text``."""
    loads = []

    def load_model(name, dtype=torch.float32, device="cpu", log=None):
        loads.append((dtype, str(device)))
        return tiny_llama().to(device=device, dtype=dtype), None

    def tokenize_text(tok, text, n=None):
        ids = torch.randint(0, 64, (1, 640), generator=torch.Generator().manual_seed(1))
        return ids if n is None else ids[:, :n]

    monkeypatch.setattr(kvbits.data, "load_model", load_model)
    monkeypatch.setattr(kvbits.data, "tokenize_text", tokenize_text)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("Some text to score.\n")
    return loads, str(text)


@pytest.fixture
def no_load(monkeypatch):
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))


PPL = ("--tokens", "320", "--chunk", "64", "--window", "256", "--presets", "fp16,kivi-2:R=4",
       "--no-progress")


def ppl_run(capsys, tmp_path, text, *extra, name="r"):
    js, md = tmp_path / f"{name}.json", tmp_path / f"{name}.md"
    code, _, err = run(capsys, "ppl", "--model", "tiny", "--text", text, *PPL, "--json",
                       str(js), "--md", str(md), *extra)
    assert code == 0, err
    return json.loads(js.read_text()), md.read_text(), err


# --------------------------------------------------------------------------- refused values
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "CUDA", "cuda:", ""])
def test_bad_device_is_refused_naming_the_option(capsys, no_load, command, device):
    code, _, err = run(capsys, command, "--device", device)
    assert code == 2 and re.search(r"argument --device: must be cpu, cuda or cuda:N, got "
                                   + re.escape(repr(device)), err), err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_digit_that_is_not_ascii_is_refused(capsys, no_load, command):
    """"²".isdigit() is True: the parser lets cuda:² through; check_device refuses it."""
    code, _, err = run(capsys, command, "--device", "cuda:\u00b2")
    assert code == 2 and "--device: must be cpu, cuda or cuda:N, got 'cuda:\u00b2'" in err, err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused_before_the_model_loads(capsys, monkeypatch, no_load,
                                                              command, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, command, "--device", device)
    assert code == 2 and f"kvbits {command}: error: --device {device}: torch sees no CUDA " \
                         "device" in err and "use --device cpu" in err, err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_gpu_index_past_the_last_is_refused(capsys, monkeypatch, no_load, command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run(capsys, command, "--device", "cuda:1")
    assert code == 2 and "--device cuda:1: torch sees 1 CUDA device (cuda:0); give cpu, cuda " \
                         "or cuda:N with N < 1" in err, err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"torch sees 2 CUDA devices \(cuda:0 to cuda:1\)"):
        cli.check_device("cuda:2")
    assert cli.check_device("cuda:1") == "cuda:1"


def test_hf_quantized_rows_are_refused_on_cuda(capsys, monkeypatch, no_load):
    """transformers' QuantizedCache on a CUDA model: optimum-quanto builds its CUDA extension
    with nvcc at the first dequantization, which had not finished after 140 s on an H200 (a tiny
    model); refused before the model loads, naming both options."""
    from kvbits.cli import PplConfig, parse_hf_variants, parse_presets, run_ppl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run(capsys, "ppl", "--presets", "kivi-2", "--hf-quantized",
                       "quanto:int4,quanto:int2:axis_key=-1", "--device", "cuda")
    assert code == 2 and "--hf-quantized quanto:int4,quanto:int2:axis_key=-1 with --device " \
                         "cuda: transformers' QuantizedCache rows run on the CPU only" in err \
        and "give --device cpu, or leave out --hf-quantized" in err, err
    variants = parse_presets("fp16") + parse_hf_variants("hqq:int4")
    with pytest.raises(ValueError, match="--hf-quantized hqq:int4 with --device cuda:0: "):
        run_ppl(PplConfig("tiny", "t", variants, device="cuda:0"), "kvbits ppl")


def test_the_configs_check_the_device_and_dtype_too(monkeypatch, no_load):
    """run_ppl, run_calibrate and run_tune (the API under the commands) check before loading."""
    from kvbits.cli import (
        CalibrateConfig,
        PplConfig,
        TuneConfig,
        parse_preset,
        parse_presets,
        run_calibrate,
        run_ppl,
        run_tune,
    )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfgs = [lambda **k: run_ppl(PplConfig("tiny", "t", parse_presets("fp16"), **k), "kvbits ppl"),
            lambda **k: run_calibrate(CalibrateConfig("tiny", "t", parse_preset("kvquant-3"),
                                                      **k)),
            lambda **k: run_tune(TuneConfig("tiny", "t", 3.0, parse_preset("kivi-3"), **k))]
    for go in cfgs:
        with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
            go(device="cuda")
        with pytest.raises(ValueError, match=r"--device: must be cpu, cuda or cuda:N, got 'gpu'"):
            go(device="gpu")
        with pytest.raises(ValueError, match=r"--dtype: must be one of auto, float32, float16, "
                                             r"bfloat16, got 'half'"):
            go(dtype="half")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("dtype", ["half", "fp16", "float64", "auto16"])
def test_bad_dtype_is_refused_by_the_parser(capsys, no_load, command, dtype):
    code, _, err = run(capsys, command, "--dtype", dtype)
    choices = ", ".join(f"'?{c}'?" for c in ("auto", "float32", "float16", "bfloat16"))
    assert code == 2 and re.search(rf"argument --dtype: invalid choice: '{dtype}' \(choose from "
                                   rf"{choices}\)", err), err  # (Python 3.12 quotes them)


def test_auto_dtype():
    f32, f16 = torch.float32, torch.float16
    assert cli.resolve_dtype("auto", "cpu", "ppl") is f32
    assert cli.resolve_dtype("auto", "cuda", "ppl") is f16
    assert cli.resolve_dtype("auto", "cuda:1", "ppl") is f16
    assert cli.resolve_dtype("auto", "cuda", "needle") is f16  # (it was float32: the slow path)
    assert cli.resolve_dtype("auto", "cpu", "needle") is f32
    assert cli.resolve_dtype("auto", "cuda", "demo") is f16
    assert cli.resolve_dtype("auto", "cpu", "demo") is f32
    for command in ("calibrate", "tune"):  # Fisher weights, KLs at 4 bits: float32 on a GPU too
        assert cli.resolve_dtype("auto", "cuda", command) is f32
        assert cli.resolve_dtype("auto", "cpu", command) is f32
    assert cli.resolve_dtype("bfloat16", "cpu", "ppl") is torch.bfloat16


# -------------------------------------------------------------------------------------- ppl
def test_ppl_cpu_float32_is_the_default_run(capsys, tmp_path, fake_model):
    loads, text = fake_model
    default, md, _ = ppl_run(capsys, tmp_path, text, name="default")
    given, _, _ = ppl_run(capsys, tmp_path, text, "--device", "cpu", "--dtype", "float32",
                          name="given")
    assert loads == [(torch.float32, "cpu")] * 2
    assert default["device"] == given["device"] == "cpu" and "gpu" not in default
    assert default["dtype"] == given["dtype"] == "float32"
    for a, b in zip(default["results"], given["results"], strict=True):
        assert a["label"] == b["label"] and a["ppl"] == b["ppl"]
    assert re.search(r"float32 on \d+ CPU threads? \(", md), md


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ppl_in_half_precision_on_the_cpu(capsys, tmp_path, fake_model, dtype):
    loads, text = fake_model
    ref, _, _ = ppl_run(capsys, tmp_path, text, name="f32")
    half, md, err = ppl_run(capsys, tmp_path, text, "--dtype", dtype, name=dtype)
    assert loads == [(torch.float32, "cpu"), (getattr(torch, dtype), "cpu")]
    assert half["dtype"] == dtype and half["device"] == "cpu"
    assert f"{dtype} on " in md and f"({dtype} on cpu)" in err
    for a, b in zip(ref["results"], half["results"], strict=True):
        assert abs(b["ppl"] / a["ppl"] - 1) < 0.01, (a["label"], a["ppl"], b["ppl"])


def test_ppl_hf_quantized_rows_in_half_precision_on_the_cpu(capsys, tmp_path, fake_model):
    pytest.importorskip("optimum.quanto")
    _, text = fake_model
    hf = ("--hf-quantized", "quanto:int4:G=32,R=4")
    ref, _, _ = ppl_run(capsys, tmp_path, text, *hf, name="f32")
    half, _, _ = ppl_run(capsys, tmp_path, text, *hf, "--dtype", "float16", name="f16")
    assert [r["label"] for r in half["results"]] == ["fp16", "kivi-2:R=4",
                                                     "HF quanto:int4:G=32,R=4"]
    for a, b in zip(ref["results"], half["results"], strict=True):
        assert abs(b["ppl"] / a["ppl"] - 1) < 0.01, (a["label"], a["ppl"], b["ppl"])


def test_ppl_json_records_the_window_used(capsys, tmp_path, fake_model):
    """Without --window the JSON said "window": null; it is the model's default window (the
    tiny Llama's max_position_embeddings, 2048), as each result row says."""
    _, text = fake_model
    js = tmp_path / "w.json"
    code, _, err = run(capsys, "ppl", "--model", "tiny", "--text", text, "--tokens", "320",
                       "--chunk", "64", "--presets", "fp16", "--no-progress", "--json", str(js))
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["window"] == 2048 == doc["results"][0]["window"]


# -------------------------------------------------------------------------------- calibrate
# (the default --window, 512: another one is refused without -o, see test_cli.py)
CAL = ("--model", "tiny", "--preset", "kvquant-3:R=4", "--tokens", "256")


def test_calibrate_records_device_and_dtype(capsys, tmp_path, fake_model):
    """The file's ``extra`` says what the model ran in; without -o the file lands at the path
    ``kvbits ppl`` looks for, keyed by the dtype (float32: the path from before the key)."""
    from kvbits.methods import kvquant as kvq
    from kvbits.spec import resolve_spec

    loads, text = fake_model
    spec = resolve_spec("kvquant-3").replace(residual_length=4)
    code, out, err = run(capsys, "calibrate", *CAL, "--text", text)
    assert code == 0, err
    f32 = kvq.Calibration.load(out.strip())
    assert out.strip() == str(kvq.calibration_path(tiny_llama(), spec, text, 256))
    assert {"device": "cpu", "dtype": "float32"}.items() <= f32.extra.items()
    assert "gpu" not in f32.extra and "Fisher" not in err
    code, out, err = run(capsys, "calibrate", *CAL, "--text", text, "--dtype", "float16",
                         "--device", "cpu")
    assert code == 0, err
    assert loads == [(torch.float32, "cpu"), (torch.float16, "cpu")]
    f16 = kvq.Calibration.load(out.strip())
    assert {"device": "cpu", "dtype": "float16", "tokens": 256, "window": 512}.items() \
        <= f16.extra.items()
    assert out.strip() == str(kvq.calibration_path(tiny_llama().half(), spec, text, 256))
    assert out.strip() != str(kvq.calibration_path(tiny_llama(), spec, text, 256))
    assert "note: --dtype float16: the Fisher weights are squared gradients" in err
    path = tmp_path / "k3.safetensors"
    code, _, err = run(capsys, "calibrate", *CAL, "--text", text, "--dtype", "bfloat16", "-o",
                       str(path))
    assert code == 0, err
    assert kvq.Calibration.load(path).extra["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------- tune
TUNE = ("--model", "tiny", "--avg-bits", "3", "--tokens", "256", "--window", "128")


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_tune_spec_file_records_device_and_dtype(capsys, tmp_path, fake_model, dtype):
    from kvbits.spec import QuantSpec

    loads, text = fake_model
    path = tmp_path / "t.json"
    given = () if dtype is None else ("--dtype", dtype)
    code, _, err = run(capsys, "tune", *TUNE, "--text", text, "-o", str(path), *given)
    assert code == 0, err
    info = json.loads(path.read_text())["info"]
    want = dtype or "float32"
    assert loads == [(getattr(torch, want), "cpu")]
    assert info["device"] == "cpu" and info["dtype"] == want and "gpu" not in info
    assert ("note: --dtype float16: a layer's KL at 4 bits" in err) == (dtype is not None)
    assert QuantSpec.load(path).layer_bits  # the file still reads back


# -------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_ppl_calibrate_and_tune_on_cuda(capsys, tmp_path, fake_model):
    """On CUDA ppl runs in float16 by default (kvbits presets through the fused kernels),
    calibrate and tune in float32; each records the GPU."""
    from kvbits.methods import kvquant as kvq

    loads, text = fake_model
    ref, _, _ = ppl_run(capsys, tmp_path, text, name="cpu")
    got, md, _ = ppl_run(capsys, tmp_path, text, "--device", "cuda", name="cuda")
    assert loads[-1] == (torch.float16, "cuda")
    assert got["device"] == "cuda:0" and got["dtype"] == "float16" and got["gpu"]
    assert f"float16 on {got['gpu']} (cuda:0)." in md
    for a, b in zip(ref["results"], got["results"], strict=True):
        assert abs(b["ppl"] / a["ppl"] - 1) < 0.01, (a["label"], a["ppl"], b["ppl"])
    code, out, err = run(capsys, "calibrate", *CAL, "--text", text, "--device", "cuda:0")
    assert code == 0, err
    assert loads[-1] == (torch.float32, "cuda:0")
    extra = kvq.Calibration.load(out.strip()).extra
    assert extra["device"] == "cuda:0" and extra["dtype"] == "float32" and extra["gpu"]
    path = tmp_path / "t.json"
    code, _, err = run(capsys, "tune", *TUNE, "--text", text, "-o", str(path), "--device", "cuda")
    assert code == 0, err
    info = json.loads(path.read_text())["info"]
    assert info["device"] == "cuda:0" and info["dtype"] == "float32" and info["gpu"]


# ----------------------------------------------------------------------------------- needle
class _Loaded(Exception):
    pass


@pytest.fixture
def first_load(monkeypatch):
    """``first_load(argv)`` runs ``main(argv)`` up to the model's load (stopped there) and
    returns the ``(dtype, device)`` of each load asked for."""
    def go(argv):
        loads = []

        def load_model(name, dtype=None, device=None, log=None):
            loads.append((dtype, str(device)))
            raise _Loaded

        monkeypatch.setattr(kvbits.data, "load_model", load_model)
        with pytest.raises(_Loaded):
            main(argv)
        return loads
    return go


@pytest.mark.parametrize("command", ["needle", "demo"])
@pytest.mark.parametrize(("extra", "dtype"), [((), torch.float32),
                                              (("--dtype", "bfloat16"), torch.bfloat16)])
def test_needle_and_demo_load_the_model_in_the_dtype_asked_for(first_load, command, extra,
                                                               dtype):
    """needle loaded float32 whatever the device (on CUDA the decode kernels then took their
    float32 path, not the half-precision one a model runs in); demo ran on the CPU only."""
    assert first_load([command, "--model", "tiny", *extra]) == [(dtype, "cpu")]


# --------------------------------------------------------------------------------- generate
GENERATE = ("generate", "--model", "tiny", "--prompt", "x")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "CUDA", "cuda:", "", "AUTO",
                                    "cuda:\u00b2"])
def test_generate_refuses_a_bad_device_naming_the_allowed_values(capsys, no_load, device):
    """generate kept its own check (argparse choices auto, cpu, cuda: "invalid choice"); it now
    takes check_device's syntax, auto besides."""
    code, _, err = run(capsys, *GENERATE, "--device", device)
    assert code == 2 and "kvbits generate: error: argument --device: must be auto, cpu, cuda or " \
                         f"cuda:N, got {device!r}" in err, err


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_generate_refuses_cuda_without_a_gpu_as_the_others_do(capsys, monkeypatch, no_load,
                                                              device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, *GENERATE, "--device", device)
    assert code == 2 and f"kvbits generate: error: --device {device}: torch sees no CUDA " \
                         "device" in err and "use --device cpu" in err, err


def test_generate_refuses_a_gpu_index_past_the_last(capsys, monkeypatch, no_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = run(capsys, *GENERATE, "--device", "cuda:1")
    assert code == 2 and "--device cuda:1: torch sees 1 CUDA device (cuda:0); give cpu, cuda " \
                         "or cuda:N with N < 1" in err, err
    with pytest.raises(ValueError, match="must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        cli.check_device("gpu", auto=True)
    with pytest.raises(ValueError, match="must be cpu, cuda or cuda:N, got 'auto'"):
        cli.check_device("auto")  # (auto is generate's alone)


@pytest.mark.parametrize(("device", "gpus", "extra", "want"), [
    ("auto", 0, (), (torch.float32, "cpu")),
    ("auto", 1, (), (torch.float16, "cuda")),
    ("cpu", 1, (), (torch.float32, "cpu")),
    ("cuda", 1, (), (torch.float16, "cuda")),
    ("cuda:1", 2, (), (torch.float16, "cuda:1")),
    ("cuda:1", 2, ("--fuse",), (torch.float16, "cuda:1")),  # the graph loop's default: CUDA
])
def test_generate_loads_the_model_on_the_device_asked_for(monkeypatch, first_load, device, gpus,
                                                          extra, want):
    """auto is the GPU (FP16) when torch sees one, else the CPU (FP32), as before; cuda:N, which
    generate refused, loads there (--fuse too: the graph loop is the default on any GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert first_load([*GENERATE, "--device", device, *extra]) == [want]
