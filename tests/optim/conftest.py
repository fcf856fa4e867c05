"""Fixtures for the optimizer tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run torch ops on one thread: on a busy 2-core CI machine OpenMP spin-waits make the small tensors here
    up to 50x slower. The fused-kernel tests pass ``threads=2`` explicitly, so the OpenMP path stays covered."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
