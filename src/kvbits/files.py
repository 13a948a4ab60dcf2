"""Files kvbits writes (caches, calibrations, spec files, result tables), written so that a run
stopped mid-write (Ctrl-C, a full disk) never leaves a cut file under the name, which a later
run would refuse or, worse, trust, over the good one saved there before."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["write_file_atomic", "write_text_atomic"]


def write_file_atomic(path, write, data) -> Path:
    """``write(target)`` a file for ``path`` through a temporary file beside it (named for this
    process), renamed over ``path`` once whole. A symbolic link is written through (its target
    replaced, the link kept), and a path that exists as something other than a regular file
    (``/dev/null``, a FIFO) gets the bytes ``data()`` written into it: renamed over, or given to
    safetensors' ``save_file`` (which replaces what it writes to), it became a regular file (as
    root, /dev/null itself). A new file gets the mode the umask gives (safetensors makes its
    files 0600: a cache saved for another user's process could not be read there), one that
    replaces another keeps that file's mode. Makes the folder. Returns ``path``."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.exists() and not target.is_file():
        with open(target, "wb") as f:
            f.write(data())
        return path
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, stat.S_IMODE(target.stat().st_mode) if target.exists() else
                 0o666 & ~_umask())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # (a failed or interrupted write)
    return path


def write_text_atomic(path, text: str) -> Path:
    """:func:`write_file_atomic` for UTF-8 ``text``. Returns the path."""
    return write_file_atomic(path, lambda target: Path(target).write_text(text, encoding="utf-8"),
                             lambda: text.encode("utf-8"))


def _umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
