"""DeepSpeed entered without muonkit's entry points: the error names the fix (1 rank, ds_checks_errors)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ds_launch import launch, report
from ds_worker import names

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is not installed (pip install 'muonkit[deepspeed]')")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    shared = tmp_path_factory.mktemp("ds_errors")
    return launch("ds_checks_errors", world_size=1, out_dir=shared / "out", shared=shared)


@pytest.mark.parametrize("name", names("ds_checks_errors"))
def test_error_names_the_fix(results: dict, name: str) -> None:
    problem = report(results, name, 1)
    assert problem is None, problem
