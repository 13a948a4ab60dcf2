"""Shared pytest fixtures (keep small: one fixture per real model, the sm_90 compile runner, and
the Gluon body's call recorder)."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in its interpreter. The flag must be set before anything
# (transformers included) imports triton, or kernels get compiled for a GPU that is not there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(config, items):
    """``KVBITS_TEST_SHARD=i/n`` keeps every n-th collected test from the i-th (0-based), so that
    n processes share one GPU run (``benchmarks/probes/run_gpu_suite_sharded.sh``); compiling
    dominates those tests, and it runs on the host's cores in parallel."""
    shard = os.environ.get("KVBITS_TEST_SHARD")
    if not shard:
        return
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"KVBITS_TEST_SHARD must be 'i/n' (0 <= i < n), got {shard!r}")
    if not 0 <= i < n:
        raise pytest.UsageError(f"KVBITS_TEST_SHARD must be 'i/n' (0 <= i < n), got {shard!r}")
    keep = items[i::n]
    config.hook.pytest_deselected(items=[t for t in items if t not in set(keep)])
    items[:] = keep


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M in float32, eval mode (skips if unavailable).

    Session-scoped and shared: a test that changes the model (e.g. its attention
    implementation) must put it back.
    """
    from kvbits.data import load_model

    try:
        model, tokenizer = load_model("smollm2", dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 (no network and no cached copy)
        pytest.skip(f"SmolLM2 is not available: {exc}")
    return model, tokenizer


@pytest.fixture
def compile_sm90():
    """``run(child_source, configs) -> list``: run a script that compiles kernels for sm_90 (it
    gets ``json.dumps(configs)`` as argv[1] and prints one JSON list last) in child processes
    outside Triton's interpreter mode, which this process may be in; the configs are dealt to
    one child per CPU (at most 4), which run at once: compiling is single-threaded and these
    tests are the suite's longest. Skips where the Triton build has no ptxas."""
    import json
    import subprocess
    import sys

    def run(child: str, configs) -> list:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        n = max(1, min(len(configs), os.cpu_count() or 1, 4))
        procs = [subprocess.Popen([sys.executable, "-c", child, json.dumps(configs[i::n])],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(n)]
        parts = []
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            if proc.returncode and "ptxas" in err.lower() and "not found" in err.lower():
                pytest.skip("this Triton build has no ptxas")
            assert proc.returncode == 0, err[-3000:]
            parts.append(json.loads(out.strip().splitlines()[-1]))
        return [parts[i % n][i // n] for i in range(len(configs))]
    return run



@pytest.fixture
def gluon_calls(monkeypatch):
    """Let the Gluon body kernel serve every layer it is eligible for (the size limits that send
    small steps, and plain KIVI layers with many blocks of query columns, to the Triton kernel as
    the faster one are lifted) and record its calls: returns a list that gets one
    ``(q, kv, keywords)`` per call of ``decode_gluon.attend_body``."""
    from kvbits.kernels import decode_gluon

    for name in ("MIN_BODY_TOKENS", "MIN_BODY_TOKENS_PLANES", "MIN_BODY_TOKENS_WIDE"):
        monkeypatch.setattr(decode_gluon, name, 1)
    monkeypatch.setattr(decode_gluon, "MAX_PLAIN_BLOCKS", 1 << 10)
    calls, real = [], decode_gluon.attend_body
    monkeypatch.setattr(decode_gluon, "attend_body",
                        lambda q, kv, *a, **k: calls.append((q, kv, k)) or real(q, kv, *a, **k))
    return calls


@pytest.fixture
def interrupted_writes(monkeypatch):
    """``cut(n)``: from then on ``Path.write_text`` writes only the first ``n`` characters and
    raises KeyboardInterrupt (Ctrl-C mid-write); ``cut.undo()`` puts it back. For the tests
    that a file written so is never left cut under its name."""
    from pathlib import Path
    real = Path.write_text

    def cut(n: int) -> None:
        def write(self, text, *args, **kwargs):
            real(self, text[:n], *args, **kwargs)
            raise KeyboardInterrupt
        monkeypatch.setattr(Path, "write_text", write)
    cut.undo = monkeypatch.undo
    return cut
