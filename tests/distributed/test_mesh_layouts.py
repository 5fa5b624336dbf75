"""The DTensor layout reader on real N-D meshes: one launch of 4 and one of 8 gloo ranks (marked slow)."""

from __future__ import annotations

import pytest
from harness import checks_of
from launcher import failure_report, launch

pytestmark = pytest.mark.distributed

MODULES = ["scenario_dtensor_layout"]
CASES = [
    pytest.param(w, name, id=f"W{w}-{name}", marks=[pytest.mark.slow] if w == 8 else [])
    for w in (4, 8)
    for m in MODULES
    for name in checks_of(m, w)
]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"root": tmp_path_factory.mktemp("meshes"), "results": {}}


def _results(launches: dict, world_size: int) -> dict:
    if world_size not in launches["results"]:
        root = launches["root"]
        launches["results"][world_size] = launch(
            MODULES, world_size=world_size, out_dir=root / f"w{world_size}", shared=root / "shared", timeout=600.0
        )
    return launches["results"][world_size]


@pytest.mark.parametrize(("world_size", "name"), CASES)
def test_check(launches: dict, world_size: int, name: str) -> None:
    report = failure_report(_results(launches, world_size), name, world_size)
    if report is not None:
        pytest.fail(f"{name} at world size {world_size}:\n{report}", pytrace=False)
