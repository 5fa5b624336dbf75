"""The N-D device-mesh suite: HSDP, FSDP2 + TP, TP, EP, pipeline stages, checkpoints across meshes,
every rank's box of real DTensors (scenario_dtensor_placement), and split Newton-Schulz (scenario_split).

Launches (each one process group, many checks): W=4 runs the 2x2 layouts and saves the
checkpoints, W=1 resumes those that end on one device, W=8 runs the 2x2x2 layouts (``slow``:
eight ranks on a small CI machine, still run in CI). ``MUONKIT_MESH_NAIVE=1`` runs every check
with the test-only :class:`naive_mesh.NaiveMeshStrategy` (the exactly-once checks must then fail).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import checks_of
from launcher import failure_report, launch

pytestmark = pytest.mark.distributed

MODULES = [
    "scenario_mesh",
    "scenario_mesh_checkpoint",
    "scenario_dtensor_placement",  # real DTensors read as boxes
    "scenario_split",  # one job's Newton-Schulz over a group of ranks (W=4 and 8)
]
WORLD_SIZES = [4, 1, 8]  # 4 first: it writes the checkpoints W=1 loads
TIMEOUT = {1: 240.0, 4: 600.0, 8: 900.0}
CASES = [
    pytest.param(w, name, id=f"W{w}-{name}", marks=[pytest.mark.slow] if w == 8 else [])
    for w in WORLD_SIZES
    for m in MODULES
    for name in checks_of(m, w)
]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"root": tmp_path_factory.mktemp("mesh"), "results": {}}


def _results(launches: dict, world_size: int) -> dict:
    if world_size not in launches["results"]:
        if world_size == 1:
            _results(launches, 4)
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
