"""ZeroStrategy on hand-made ZeRO layouts at 4 ranks (no DeepSpeed needed): see ds_checks_strategy."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ds_launch import launch, report
from ds_worker import names

from muonkit.distributed.zero_partition import contiguous_partition, per_param_partition

WORLD = 4
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ds_strategy")
    return launch("ds_checks_strategy", world_size=WORLD, out_dir=root / "out", shared=root / "shared", timeout=240)


@pytest.mark.parametrize("name", names("ds_checks_strategy"))
def test_strategy(results: dict, name: str) -> None:
    problem = report(results, name, WORLD)
    assert problem is None, problem


def test_contiguous_layout_pieces() -> None:
    layout = contiguous_partition(
        names=["a", "b"], shapes=[(2, 2), (2, 3)], offsets=[0, 4], partition_size=5, world_size=2
    )
    assert [(p.rank, p.local_offset, p.param_offset, p.length) for p in layout.params[1].pieces] == [
        (0, 4, 0, 1),
        (1, 0, 1, 5),
    ]


def test_per_param_layout_pieces() -> None:
    layout = per_param_partition(names=["a", "b"], shapes=[(2, 3), (1, 2)], world_size=4)
    assert layout.numel == 2 + 1
    assert [(p.rank, p.local_offset, p.param_offset, p.length) for p in layout.params[0].pieces] == [
        (0, 0, 0, 2),
        (1, 0, 2, 2),
        (2, 0, 4, 2),
    ]
    assert [p.rank for p in layout.params[1].pieces] == [0, 1]


def test_layout_rejects_gaps() -> None:
    from muonkit.distributed.zero_partition import FlatParam, FlatPartition, Piece

    with pytest.raises(ValueError, match="cover"):
        FlatPartition((FlatParam("a", (2, 2), (Piece(0, 0, 0, 3),)),), 4, 1)
