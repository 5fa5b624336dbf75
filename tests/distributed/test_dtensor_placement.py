"""The DTensor placement reader without ranks: boxes per mesh coordinate, jobs, what raises.

Real DTensors (``distribute_tensor``, ``fully_shard``, ``parallelize_module``) at 4 and 8 ranks
are checked in ``tests/distributed/scenario_dtensor_placement.py``. Here the boxes are checked
against torch's own shape arithmetic (``_compute_local_shape_and_global_offset``, a separate
code path from the split that :func:`dim_runs` runs) and against an invariant every layout
keeps: each element is held by exactly as many ranks as the mesh dims that do not shard it hold.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from muonkit.distributed.base import local_part
from muonkit.distributed.dtensor_placement import check_placements, dim_runs, mesh_boxes, rank_boxes, tensor_jobs
from muonkit.distributed.pieces import At, Box, Expert
from muonkit.functional.matrices import MatrixLayout

MESHES = [(4,), (2, 2), (3, 2), (2, 2, 2)]
SHAPES = [(0, 5), (1, 1), (3, 2), (5, 7), (8, 4), (10, 6), (13, 9)]
OPTIONS = [Replicate(), Shard(0), Shard(1)] + [
    _StridedShard(d, split_factor=f) for d, f in [(0, 2), (1, 2), (0, 3), (1, 4)]
]


def _combos(mesh_shape: tuple[int, ...]) -> list[tuple[object, ...]]:
    return list(itertools.product(OPTIONS, repeat=len(mesh_shape)))


class _Sizes:
    """What torch's shard-order decoder reads of a device mesh: its sizes."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def size(self, dim: int) -> int:
        return self.shape[dim]


def decodable(placements: tuple[object, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether torch finds an order of the shardings (else it cannot gather such a DTensor either)."""
    decode = DTensorSpec._maybe_convert_StridedShard_to_shard_order
    return decode(placements, _Sizes(mesh_shape)) is not None  # type: ignore[arg-type]


def _replication(mesh_shape: tuple[int, ...], placements: tuple[object, ...]) -> int:
    return math.prod(n for n, p in zip(mesh_shape, placements, strict=True) if isinstance(p, Replicate))


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_boxes_agree_with_torch_shape_arithmetic_and_cover_each_element_once_per_replica(
    mesh_shape: tuple[int, ...],
) -> None:
    checked = rejected = 0
    for shape, placements in itertools.product(SHAPES, _combos(mesh_shape)):
        if not decodable(placements, mesh_shape):
            with pytest.raises(ValueError, match="give no order in which the mesh dims shard dim"):
                mesh_boxes(shape, placements, mesh_shape)
            rejected += 1
            continue
        boxes = mesh_boxes(shape, placements, mesh_shape)
        hits = torch.zeros(shape, dtype=torch.int64)
        for coordinate, box in boxes.items():
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
            assert box.shape == tuple(local), (shape, placements, coordinate)
            for runs, start, size in zip(box.runs, offset, local, strict=True):
                assert (runs[0][0] if runs else size) == (start if runs else 0), (shape, placements, coordinate)
            index = torch.arange(math.prod(shape)).view(shape)
            hits.view(-1)[box.read(index)] += 1
        assert torch.all(hits == _replication(mesh_shape, placements)), (shape, placements)
        checked += 1
    assert checked + rejected == len(SHAPES) * len(OPTIONS) ** len(mesh_shape)
    assert checked > 0 and rejected > 0


def test_fsdp_over_tensor_parallel_rows_are_strided() -> None:
    # torch's own example (placement_types._StridedShard): 8 rows, dp x tp = 2 x 2.
    boxes = mesh_boxes((8, 8), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2))
    rows = {c: b.runs[0] for c, b in boxes.items()}
    assert rows == {(0, 0): ((0, 2),), (0, 1): ((4, 6),), (1, 0): ((2, 4),), (1, 1): ((6, 8),)}
    # uneven: TP cuts 10 rows 5 + 5, FSDP each 3 + 2; dp rank 0 holds two runs before the TP cut
    assert dim_runs(10, ((_StridedShard(0, split_factor=2), 2, 0),)) == ((0, 3), (5, 8))
    assert dim_runs(3, ((Shard(0), 4, 3),)) == ()


def test_rank_boxes_follow_the_group_rank_of_each_coordinate() -> None:
    ranks = torch.tensor([[3, 1], [0, 2]])  # any mapping of coordinates to group ranks
    held = rank_boxes((4, 6), (Shard(0), Shard(1)), ranks)
    assert [r for r, _ in held] == [0, 1, 2, 3]
    assert dict(held)[3] == Box((((0, 2),), ((0, 3),)))  # coordinate (0, 0)
    assert dict(held)[2] == Box((((2, 4),), ((3, 6),)))  # coordinate (1, 1)


def _reassemble(job_shape: tuple[int, ...], pieces: list, locals_: dict[int, torch.Tensor]) -> torch.Tensor:
    whole = torch.full(job_shape, -1)
    for piece in pieces:
        piece.region.write(whole, local_part(locals_[piece.rank], piece).reshape(-1))
    return whole


def test_tensor_jobs_reassemble_every_layout_from_any_holder() -> None:
    ranks = torch.arange(4).view(2, 2)
    cases = [
        ((10, 6), MatrixLayout(), (_StridedShard(0, split_factor=2), Shard(0))),
        ((6, 10), MatrixLayout("transposed", (4, 6)), (Shard(1), Replicate())),  # blocks are columns: one job
        ((4, 2, 3, 3), MatrixLayout(), (Replicate(), Shard(2))),  # conv, flattened
    ]
    for shape, layout, placements in cases:
        whole = torch.arange(math.prod(shape)).view(shape)
        held = rank_boxes(shape, placements, ranks)
        locals_ = {r: box.read(whole).view(box.shape) for r, box in held}
        (job,) = tensor_jobs(7, shape, layout, held)
        assert job.tensor == 7 and job.shape == shape and job.layout == layout
        assert sorted({p.rank for p in job.held}) == [r for r, box in held if box.numel]
        assert torch.equal(_reassemble(shape, list(job.held), locals_), whole)


@pytest.mark.parametrize(
    ("shape", "placements"),
    [
        ((12, 6), (Shard(0), Shard(1))),
        ((12, 6), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP2 + TP rows: K is cut in two runs
        ((12, 6), (Replicate(), Shard(0))),
        ((12, 2, 3), (Shard(0), Shard(2))),  # flattened to (12, 6)
    ],
    ids=str,
)
def test_split_blocks_are_jobs_of_their_own_wherever_the_rows_are_cut(shape: tuple, placements: tuple) -> None:
    whole = torch.arange(math.prod(shape)).view(shape)
    held = rank_boxes(shape, placements, torch.arange(4).view(2, 2))
    locals_ = {r: box.read(whole).view(box.shape) for r, box in held}
    kind = "matrix" if len(shape) == 2 else "flatten"
    jobs = tensor_jobs(0, shape, MatrixLayout(kind, (3, 4, 5)), held)
    assert [j.shape[0] for j in jobs] == [3, 4, 5] and all(j.layout == MatrixLayout(kind) for j in jobs)
    for job, (a, b) in zip(jobs, [(0, 3), (3, 7), (7, 12)], strict=True):
        assert all(isinstance(p.where, At) for p in job.held)
        assert torch.equal(_reassemble(job.shape, list(job.held), locals_), whole[a:b])


@pytest.mark.parametrize(
    ("placements", "ranges"),
    [
        ((Replicate(), Shard(1)), [(0, 8), (8, 16)]),  # TP row-wise over 2: two heads per rank
        ((Shard(1), Shard(1)), [(0, 4), (4, 8), (8, 12), (12, 16)]),  # a head per rank
        ((Shard(0), Shard(1)), [(0, 8), (8, 16)]),  # FSDP2 rows on "dp", TP columns: rows cut any way
        ((Shard(1), Replicate()), [(0, 8), (8, 16)]),  # replicated copies: one job, two holders
    ],
    ids=str,
)
def test_per_head_columns_held_whole_are_jobs_of_their_own(placements: tuple, ranges: list) -> None:
    """A per-head output projection under tensor parallelism: each rank's column range is whole heads,
    so each range is its own job, whose pieces are its holders' whole local tensors."""
    shape, layout = (6, 16), MatrixLayout("matrix", (4,) * 4, "cols")
    whole = torch.arange(math.prod(shape)).view(shape)
    held = rank_boxes(shape, placements, torch.arange(4).view(2, 2))
    locals_ = {r: box.read(whole).view(box.shape) for r, box in held}
    jobs = tensor_jobs(0, shape, layout, held)
    assert [j.shape for j in jobs] == [(6, b - a) for a, b in ranges]
    for job, (a, b) in zip(jobs, ranges, strict=True):
        assert job.layout == MatrixLayout("matrix", (4,) * ((b - a) // 4), "cols")
        assert all(p.where is None for p in job.held)
        assert torch.equal(_reassemble(job.shape, list(job.held), locals_), whole[:, a:b])


@pytest.mark.parametrize("placements", [(Replicate(), Replicate()), (Shard(0), Replicate())], ids=str)
def test_per_head_columns_cut_inside_a_head_or_held_whole_are_one_job(placements: tuple) -> None:
    shape = (6, 12)
    held = rank_boxes(shape, (Replicate(), Shard(1)), torch.arange(4).view(2, 2))  # columns 0-5, 6-11
    (job,) = tensor_jobs(0, shape, MatrixLayout("matrix", (4, 4, 4), "cols"), held)  # 6 cuts the second head
    assert job.shape == shape
    held = rank_boxes(shape, placements, torch.arange(4).view(2, 2))
    (job,) = tensor_jobs(0, shape, MatrixLayout("matrix", (4, 4, 4), "cols"), held)
    assert job.shape == shape


@pytest.mark.parametrize(
    "placements",
    [(Shard(0), Replicate()), (Shard(0), Shard(1)), (_StridedShard(1, split_factor=2), Shard(1)), (Shard(2), Shard(0))],
    ids=str,
)
def test_expert_stacks_give_one_job_per_expert_and_block_with_the_holders_of_that_expert(placements: tuple) -> None:
    shape = (3, 5, 4)  # 3 experts on 2 ep ranks: one rank holds 2, the other 1
    whole = torch.arange(60).view(shape)
    held = rank_boxes(shape, placements, torch.arange(4).view(2, 2))
    locals_ = {r: box.read(whole).view(box.shape) for r, box in held}
    jobs = tensor_jobs(0, shape, MatrixLayout(), held)
    assert len(jobs) == 3
    for e, job in enumerate(jobs):
        assert job.shape == (5, 4) and job.layout == MatrixLayout("matrix")
        assert all(isinstance(p.where, Expert) for p in job.held)
        assert torch.equal(_reassemble((5, 4), list(job.held), locals_), whole[e])
    jobs = tensor_jobs(0, shape, MatrixLayout(split_sizes=(2, 3)), held)
    assert [j.shape for j in jobs] == [(2, 4), (3, 4)] * 3
    for k, job in enumerate(jobs):
        e, (a, b) = k // 2, [(0, 2), (2, 5)][k % 2]
        assert torch.equal(_reassemble(job.shape, list(job.held), locals_), whole[e, a:b])


def test_nested_expert_dims_index_the_local_stack() -> None:
    shape = (2, 3, 2, 2)
    whole = torch.arange(24).view(shape)
    held = rank_boxes(shape, (Shard(1),), torch.arange(2))  # rank 0: experts (i, 0..1), rank 1: (i, 2)
    locals_ = {r: box.read(whole).view(box.shape) for r, box in held}
    jobs = tensor_jobs(0, shape, MatrixLayout("experts"), held)
    assert len(jobs) == 6
    for e, job in enumerate(jobs):
        assert torch.equal(_reassemble((2, 2), list(job.held), locals_), whole.view(6, 2, 2)[e])


def test_zero_size_params_have_no_jobs_and_empty_pieces_are_left_out() -> None:
    assert tensor_jobs(0, (0, 5), MatrixLayout(), rank_boxes((0, 5), (Shard(0),), torch.arange(4))) == []
    (job,) = tensor_jobs(0, (3, 5), MatrixLayout(), rank_boxes((3, 5), (Shard(0),), torch.arange(4)))
    assert [p.rank for p in job.held] == [0, 1, 2]  # rank 3 holds no row
    experts = tensor_jobs(0, (2, 3, 5), MatrixLayout(), rank_boxes((2, 3, 5), (Shard(0),), torch.arange(4)))
    assert [[p.rank for p in job.held] for job in experts] == [[0], [1]]


def test_replicated_holders_are_all_listed() -> None:
    (job,) = tensor_jobs(
        0, (4, 4), MatrixLayout(), rank_boxes((4, 4), (Replicate(), Shard(0)), torch.arange(4).view(2, 2))
    )
    assert [(p.rank, p.region) for p in job.held] == [
        (0, Box((((0, 2),), ((0, 4),)))),
        (1, Box((((2, 4),), ((0, 4),)))),
        (2, Box((((0, 2),), ((0, 4),)))),
        (3, Box((((2, 4),), ((0, 4),)))),
    ]


@pytest.mark.parametrize(
    ("placements", "message"),
    [
        ((Shard(0), Partial()), r"Unsupported DTensor placement Partial\(sum\) on mesh dim 1 .* a Partial param holds"),
        (
            (Shard(2),),
            r"Invalid DTensor placement Shard\(dim=2\) on mesh dim 0: a param of shape \(4, 4\) .* has no dim 2",
        ),
    ],
)
def test_unreadable_placements_raise_naming_them_and_what_is_supported(placements: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_placements((4, 4), placements, (2,) * len(placements))
    with pytest.raises(ValueError, match=r"Shard\(d\), _StridedShard|has no dim"):
        mesh_boxes((4, 4), placements, (2,) * len(placements))


def test_an_explicit_shard_order_other_than_mesh_order_raises() -> None:
    from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

    placements = (Shard(0), Shard(0))
    check_placements((8, 4), placements, (2, 2), shard_order=(ShardOrderEntry(0, (0, 1)),))  # the default: fine
    with pytest.raises(ValueError, match=r"Unsupported DTensor shard order .* mesh dim order"):
        check_placements((8, 4), placements, (2, 2), shard_order=(ShardOrderEntry(0, (1, 0)),))
