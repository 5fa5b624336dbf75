"""Shared test setup: deterministic seeds and a bounded hypothesis profile."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# tests/reference.py is imported as a plain module by the tests next to it.
sys.path.insert(0, os.path.dirname(__file__))

# Bounded and derandomized: the same examples on every CI run, no wall-clock deadline (the CPU
# is shared, timings are noisy). HYPOTHESIS_PROFILE=deep runs more examples locally.
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("deep", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The tests use small tensors, where a second intra-op thread only adds synchronization; on a
# busy 2-core machine OpenMP's barriers made them ~10x slower. No test measures speed.
torch.set_num_threads(int(os.environ.get("MUONKIT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state, whatever ran before it."""
    torch.manual_seed(0)
