"""The CUDA tests (``make gpu-check``). Every test here is marked ``cuda`` and skipped, at no cost,
where ``torch.cuda.is_available()`` is False.

``MUONKIT_GPU_TESTS_ON_CPU=1`` runs them on the CPU instead, at their small sizes (what
``python -m muonkit_bench.gpu_check --dry-run-cpu`` does, so the suite cannot rot on machines
without a GPU); the checks that need CUDA itself (fp16 matrix products, CUDA graphs, NCCL,
DeepSpeed on a GPU) skip there with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ON_CPU = "MUONKIT_GPU_TESTS_ON_CPU"
NO_CUDA = "needs CUDA: torch.cuda.is_available() is False (run `make gpu-check` on a machine with a GPU)"
HERE = Path(__file__).resolve().parent


def gpu_test_device() -> str | None:
    """``"cuda"`` where there is a GPU, ``"cpu"`` for the CPU dry run, else None (skip)."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get(ON_CPU) == "1" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device = gpu_test_device()
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cuda)
            if device is None:
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture
def device() -> str:
    """The device the test runs on: ``"cuda"``, or ``"cpu"`` in the dry run."""
    found = gpu_test_device()
    if found is None:  # collection already skipped it; here for a test selected by other means
        pytest.skip(NO_CUDA)
    return found


@pytest.fixture
def cuda(device: str) -> str:
    """For checks that need CUDA itself: skipped in the CPU dry run."""
    if device != "cuda":
        pytest.skip("needs CUDA itself (not run in the CPU dry run)")
    return device
