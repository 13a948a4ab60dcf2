"""Result files of the evaluation commands (``kvbits ppl``, ``needle``, ``bench``): written as a
run goes, so that a run stopped early keeps what it measured, and marked incomplete until its
last write, so that such a file is not taken for a whole run."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["incomplete_note", "write_text_atomic"]


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it, renamed over ``path`` once
    whole: a run stopped mid-write (Ctrl-C) leaves the previous file or the new one, never a cut
    one. Makes the folder. A path that exists as something other than a file (``/dev/null``) is
    written to directly. Returns the path."""
    path = Path(path)
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: written to, not replaced
        path.write_text(text, encoding="utf-8")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (a failed or interrupted write)
    return path


def incomplete_note(done: int, total: int | None, what: str) -> str:
    """The Markdown line that heads a result file of a run not (yet) finished: ``done`` of
    ``total`` ``what`` (e.g. presets) measured."""
    of = f" of {total}" if total is not None else ""
    return (f"**Incomplete: {done}{of} {what} so far** (the run is still going, or was stopped "
            "or failed before the rest; `\"complete\": false` in the JSON).")
