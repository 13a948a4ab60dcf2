"""Shared pytest fixtures (keep small: one fixture per real model, and the sm_90 compile runner)."""

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
    gets ``json.dumps(configs)`` as argv[1] and prints one JSON list last) in a child process
    outside Triton's interpreter mode, which this process may be in. Skips where the Triton
    build has no ptxas."""
    import json
    import subprocess
    import sys

    def run(child: str, configs) -> list:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        res = subprocess.run([sys.executable, "-c", child, json.dumps(configs)], check=False,
                             env=env, capture_output=True, text=True, timeout=600)
        if res.returncode and "ptxas" in res.stderr.lower() and "not found" in res.stderr.lower():
            pytest.skip("this Triton build has no ptxas")
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])
    return run

