"""Result files of the evaluation commands (``kvbits ppl``, ``needle``, ``bench``): written as a
run goes, so that a run stopped early keeps what it measured, and marked incomplete until its
last write, so that such a file is not taken for a whole run."""

from __future__ import annotations

__all__ = ["incomplete_note"]


def incomplete_note(done: int, total: int | None, what: str) -> str:
    """The Markdown line that heads a result file of a run not (yet) finished: ``done`` of
    ``total`` ``what`` (e.g. presets) measured."""
    of = f" of {total}" if total is not None else ""
    return (f"**Incomplete: {done}{of} {what} so far** (the run is still going, or was stopped "
            "or failed before the rest; `\"complete\": false` in the JSON).")
