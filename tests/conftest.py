"""Shared pytest fixtures (keep small: one fixture per real model)."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in its interpreter. The flag must be set before anything
# (transformers included) imports triton, or kernels get compiled for a GPU that is not there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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
