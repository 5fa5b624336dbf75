"""The distributed suite: a few launches of 1, 2 and 4 gloo ranks, each running many checks.

Launches (each one process group, many checks): W=2 runs every scenario and saves the
checkpoints; W=4 and W=1 reload them and repeat the equivalence checks that matter at their
size. Each check shows up here as its own test, so a failure names the check and the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import PENDING, checks_of, run_pending
from launcher import failure_report, launch

pytestmark = pytest.mark.distributed

MODULES = [
    "scenario_optimizer",
    "scenario_training",
    "scenario_checkpoint",
    "scenario_resume",
    "scenario_hf",
    "scenario_agreement",
    "scenario_planner",
    "scenario_qk_clip",
    "scenario_regions",
    "scenario_failure",
    "scenario_choice",
]
WORLD_SIZES = [2, 4, 1]  # 2 first: it writes the checkpoints the others load
CASES = [(w, name) for w in WORLD_SIZES for m in MODULES for name in checks_of(m, w)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"root": tmp_path_factory.mktemp("dist"), "results": {}}


def _results(launches: dict, world_size: int) -> dict:
    if world_size not in launches["results"]:
        if world_size != 2:
            _results(launches, 2)
        root: Path = launches["root"]
        launches["results"][world_size] = launch(
            MODULES, world_size=world_size, out_dir=root / f"w{world_size}", shared=root / "shared"
        )
    return launches["results"][world_size]


@pytest.mark.parametrize(("world_size", "name"), CASES, ids=[f"W{w}-{n}" for w, n in CASES])
def test_check(launches: dict, world_size: int, name: str) -> None:
    pending = PENDING.get(name.split("[")[0])
    if pending is not None and not run_pending():
        pytest.skip(f"pending: {pending} (MUONKIT_RUN_PENDING=1 runs it)")
    report = failure_report(_results(launches, world_size), name, world_size)
    if report is not None:
        pytest.fail(f"{name} at world size {world_size}:\n{report}", pytrace=False)
