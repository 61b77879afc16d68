"""Shared test settings."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# The tests' models are tiny and two cores are shared by trainers, daemons and their
# decode threads: OpenMP workers only oversubscribe them. Subprocesses inherit this.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
