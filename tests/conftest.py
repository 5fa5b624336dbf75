"""Shared test setup: deterministic seeds, a bounded hypothesis profile, a CPU-independent default NS dtype."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# Tests live in folders by capability (contract/, numerics/, checkpoints/, guarantees/, stacks/,
# cli/, codebase/, distributed/, deepspeed_engine/, gpu/, bench/); the helpers they share stay here
# (reference.py, helpers.py, spectra.py...) and are imported as plain modules. The folders have no
# __init__.py: pytest's default import mode puts each test's folder on sys.path, so a test module's
# name is unique across folders (pytest stops with "import file mismatch" otherwise), and no folder
# is named like a package the tests or their dependencies import (tests/ is on sys.path: where the
# package is missing, the folder would stand in for it, as tests/deepspeed did for deepspeed).
sys.path.insert(0, os.path.dirname(__file__))

# torch's own test utilities (imported by the torch.optim contract and mesh tests) load a hypothesis
# profile of their own when first imported ("dev": 10 random examples), which silently replaced
# ours for every module collected after them; import them first, so that ours is the one loaded.
with contextlib.suppress(ImportError):  # expecttest missing: nothing loads another profile either
    import torch.testing._internal.common_utils

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


@pytest.fixture(params=[False, True], ids=["fp32_default", "bf16_default"])
def fast_bf16(request: pytest.FixtureRequest) -> bool:
    """Run a test as on a CPU without, then with, fast bf16 (default Newton-Schulz dtype fp32, bf16)."""
    return bool(request.param)


@pytest.fixture(autouse=True)
def _default_ns_dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default compute dtype (``ns_dtype=None``, bench autocast) must not depend on the CPU the
    suite runs on: it is fp32, as on a CPU without fast bf16, unless the test asks for
    :func:`fast_bf16`. (The distributed ranks force it themselves, see distributed/harness.py.)"""
    fast = bool(request.getfixturevalue("fast_bf16")) if "fast_bf16" in request.fixturenames else False
    module = importlib.import_module("muonkit.functional.orthogonalize")  # the module, not the function
    monkeypatch.setattr(module, "_cpu_has_fast_bf16", lambda: fast)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo process group for the test (skipped where one already exists)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
