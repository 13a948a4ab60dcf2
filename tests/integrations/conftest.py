"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): their ops are small, and with 2 threads a CPU
    shared with other jobs spends most of its time in OpenMP barriers (10x slower measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
