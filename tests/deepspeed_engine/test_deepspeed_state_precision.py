"""DeepSpeed ZeRO-1/2/3 with 8-bit and bf16 optimizer state (``state_dtype``): 2-rank checks, then 1-rank loads.

See ds_checks_state_precision (against one device with the same state_dtype; checkpoints resume
bit for bit, also after ``muonkit convert-deepspeed`` to the same world size) and
ds_checks_state_precision_load (the 2-rank checkpoints converted to 1 rank: 8-bit states recoded
in the new partition's blocks, bf16 exact).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ds_launch import launch, report
from ds_worker import names

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is not installed (pip install 'muonkit[deepspeed]')")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ds_precision_shared")


@pytest.fixture(scope="module")
def train_results(shared: Path) -> dict:
    return launch("ds_checks_state_precision", world_size=2, out_dir=shared.parent / "ds_precision", shared=shared)


@pytest.fixture(scope="module")
def load_results(shared: Path, train_results: dict) -> dict:
    del train_results  # the checkpoints it saved are the input
    return launch(
        "ds_checks_state_precision_load", world_size=1, out_dir=shared.parent / "ds_precision_load", shared=shared
    )


@pytest.mark.parametrize("name", names("ds_checks_state_precision"))
def test_train(train_results: dict, name: str) -> None:
    problem = report(train_results, name, 2)
    assert problem is None, problem


@pytest.mark.parametrize("name", names("ds_checks_state_precision_load"))
def test_load(load_results: dict, name: str) -> None:
    problem = report(load_results, name, 1)
    assert problem is None, problem
