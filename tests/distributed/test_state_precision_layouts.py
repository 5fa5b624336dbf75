"""Low-precision optimizer state (``state_dtype="8bit"`` / ``"bf16"``) on every layout: launches of 2, 4, 1 and 8 gloo ranks.

``scenario_state_precision`` compares DDP, FSDP2 (dim 0 and dim 1), HSDP, TP, FSDP2 + TP and EP
with the same state_dtype on one device; ``scenario_state_precision_checkpoint`` saves DCP
checkpoints at 2 ranks and loads them at 4 and 1 (other layouts, other world sizes, other state
precisions). W=2 first: it writes the checkpoints. W=8 (2x2x2 meshes, 8-way FSDP2) is ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import checks_of
from launcher import failure_report, launch

pytestmark = pytest.mark.distributed

MODULES = ["scenario_state_precision", "scenario_state_precision_checkpoint"]
WORLD_SIZES = [2, 4, 1, 8]
TIMEOUT = {1: 240.0, 2: 300.0, 4: 600.0, 8: 900.0}
CASES = [
    pytest.param(w, name, id=f"W{w}-{name}", marks=[pytest.mark.slow] if w == 8 else [])
    for w in WORLD_SIZES
    for m in MODULES
    for name in checks_of(m, w)
]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"root": tmp_path_factory.mktemp("state_precision"), "results": {}}


def _results(launches: dict, world_size: int) -> dict:
    if world_size not in launches["results"]:
        if world_size in (4, 1):
            _results(launches, 2)
        root: Path = launches["root"]
        launches["results"][world_size] = launch(
            MODULES,
            world_size=world_size,
            out_dir=root / f"w{world_size}",
            shared=root / "shared",
            timeout=TIMEOUT[world_size],
        )
    return launches["results"][world_size]


@pytest.mark.parametrize(("world_size", "name"), CASES)
def test_check(launches: dict, world_size: int, name: str) -> None:
    report = failure_report(_results(launches, world_size), name, world_size)
    if report is not None:
        pytest.fail(f"{name} at world size {world_size}:\n{report}", pytrace=False)
