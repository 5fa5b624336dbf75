"""Single-process tests of the one planner (owners, sources, groups) and of region assembly.

No ranks are launched: plans are pure functions of the jobs, so every rank's view is computed here.
"""

from __future__ import annotations

import math

import pytest
import torch
from common import dim0_sizes

from muonkit.config import MuonConfig, group_config
from muonkit.distributed.base import local_part
from muonkit.distributed.pieces import At, Box, Expert, Job, Piece, Span
from muonkit.distributed.planner import choose_owners, choose_sources, job_cost, make_plan, scale_of
from muonkit.distributed.replicated import whole_jobs
from muonkit.distributed.zero import partition_jobs
from muonkit.distributed.zero_partition import contiguous_partition, per_param_partition
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.matrices import MatrixLayout

MATRIX = MatrixLayout()


def _config(layout: str = "auto", split_sizes: tuple[int, ...] | None = None) -> MuonConfig:
    group = {
        "algorithm": "muon", "lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_coefficients": "polar_express",
        "ns_steps": None, "eps": 1e-7, "weight_decay": 0.0, "adjust_lr": "keller", "layout": layout,
        "split_sizes": split_sizes, "ns_dtype": None, "ns_method": "gram",
    }  # fmt: skip
    config = group_config(group)
    assert isinstance(config, MuonConfig)
    return config


def _gpt_shapes(layers: int, d: int) -> list[tuple[int, ...]]:
    return [s for _ in range(layers) for s in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]]


def _row_jobs(shapes: list[tuple[int, ...]], world_size: int) -> list[Job]:
    """FSDP2 Shard(0): rank r holds a block of rows of every tensor."""
    jobs = []
    for i, shape in enumerate(shapes):
        sizes = dim0_sizes(shape[0], world_size)
        starts = [sum(sizes[:r]) for r in range(world_size)]
        rest = tuple(((0, d),) for d in shape[1:])
        held = tuple(Piece(r, Box((((starts[r], starts[r] + n),), *rest))) for r, n in enumerate(sizes) if n)
        jobs.append(Job(i, shape, MATRIX, held))
    return jobs


def _expert_jobs(experts: int, shape: tuple[int, int], world_size: int, first: int) -> list[Job]:
    """EP / FSDP2 experts: expert k whole on the rank that holds its row of the stack."""
    sizes = dim0_sizes(experts, world_size)
    return [
        Job(first, shape, MATRIX, (Piece(r, Box.full(shape), Expert(k)),))
        for r, n in enumerate(sizes)
        for k in range(n)
    ]


def _loads(jobs: list[Job], costs: list[float], owners: list[int], world_size: int) -> list[float]:
    loads = [0.0] * world_size
    for cost, owner in zip(costs, owners, strict=True):
        loads[owner] += cost
    return loads


def _layouts(world_size: int) -> dict[str, list[Job]]:
    config = _config()
    replicated = [
        j
        for i, s in enumerate([*_gpt_shapes(3, 48), (8, 40, 24)])
        for j in whole_jobs(i, s, config.layout, range(world_size))
    ]
    return {
        "ddp": replicated,
        "fsdp": _row_jobs([*_gpt_shapes(3, 48), (5, 48), (2, 48)], world_size),
        "experts": [*_expert_jobs(16, (40, 24), world_size, 0), *_row_jobs(_gpt_shapes(2, 40), world_size)],
    }


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "experts"])
def test_newton_schulz_load_is_within_the_bound(layout: str, world_size: int) -> None:
    """Per rank at most 1.15/W of the total plus one largest job (the planner proves 1.1/W + largest)."""
    jobs = _layouts(world_size)[layout]
    costs = [job_cost(j, _config()) for j in jobs]
    owners = choose_owners(jobs, costs, world_size)
    loads = _loads(jobs, costs, owners, world_size)
    total, largest = sum(costs), max(costs)
    assert math.isclose(sum(loads), total)
    assert max(loads) <= 1.15 * total / world_size + largest, (layout, loads)
    assert choose_owners(list(jobs), list(costs), world_size) == owners  # deterministic


def test_owners_prefer_whole_holders_then_part_holders() -> None:
    full = Box.full((4, 4))
    only_one = Job(0, (4, 4), MATRIX, (Piece(2, full),))
    assert choose_owners([only_one], [5.0], 3) == [2]  # whole on one rank only: it stays there
    replicated = Job(1, (4, 4), MATRIX, (Piece(1, full), Piece(2, full)))
    assert choose_owners([replicated], [5.0], 3) == [1]  # the least loaded whole holder, not rank 0
    rows = [Box((((0, 1),), ((0, 4),))), Box((((1, 4),), ((0, 4),)))]
    split = Job(2, (4, 4), MATRIX, (Piece(0, rows[0]), Piece(2, rows[1])))
    assert choose_owners([split], [5.0], 3) == [2]  # among holders, the one holding most
    # Rank 2 is busy (its own whole job): the split job goes to holder 0; with both holders far above
    # the least-loaded rank (beyond the tolerance), to the idle rank 1.
    assert choose_owners([only_one, split], [5.0, 1.0], 3) == [2, 0]
    busy0 = Job(3, (4, 4), MATRIX, (Piece(0, full),))
    assert choose_owners([only_one, busy0, split], [5.0, 5.0, 1.0], 3) == [2, 0, 1]


def test_zero_size_jobs_have_no_owner_sources_or_group() -> None:
    shapes = [(0, 8), (3, 4), (8, 0), (5, 2)]
    for layout in (
        contiguous_partition(
            names=list("abcd"), shapes=shapes, offsets=[0, 0, 12, 12], partition_size=11, world_size=2
        ),
        per_param_partition(names=list("abcd"), shapes=shapes, world_size=2),
    ):
        jobs = partition_jobs(layout, MATRIX)
        plan = make_plan(jobs, costs=[job_cost(j, _config()) for j in jobs], world_size=2)
        assert plan.owners[0] == plan.owners[2] == -1, plan.owners
        assert plan.sources[0] == plan.sources[2] == ()
        assert all(j not in (0, 2) for group in plan.groups for j in group)
        assert all(0 not in plan.computed(r) and 2 not in plan.computed(r) for r in range(2))


def test_zero_whole_params_stay_and_straddling_ones_go_to_a_holder() -> None:
    shapes = [(5, 7), (3, 4), (6, 9), (40, 3), (4, 4), (2, 3)]
    numels = [math.prod(s) for s in shapes]
    layout = contiguous_partition(
        names=list("abcdef"),
        shapes=shapes,
        offsets=[sum(numels[:i]) for i in range(len(shapes))],
        partition_size=math.ceil((sum(numels) + 3) / 4),
        world_size=4,
    )
    jobs = partition_jobs(layout, MATRIX)
    plan = make_plan(jobs, costs=[job_cost(j, _config()) for j in jobs], world_size=4)
    for param, owner in zip(layout.params, plan.owners, strict=True):
        assert owner in param.holders, (param.name, owner, param.holders)
        if len(param.pieces) == 1:
            assert owner == param.pieces[0].rank


def test_replicated_copies_are_sent_once() -> None:
    rows = [Box((((0, 2),), ((0, 3),))), Box((((2, 4),), ((0, 3),)))]
    # HSDP-like: rows 0-1 on ranks 0 and 2, rows 2-3 on ranks 1 and 3.
    job = Job(0, (4, 3), MATRIX, (Piece(0, rows[0]), Piece(1, rows[1]), Piece(2, rows[0]), Piece(3, rows[1])))
    sent = [0] * 4
    assert choose_sources(job, 2, sent) == (Piece(2, rows[0]), Piece(1, rows[1]))  # the owner's own copy
    assert sent == [0, 6, 0, 0]
    assert choose_sources(job, 2, sent) == (Piece(2, rows[0]), Piece(3, rows[1]))  # balanced: rank 3 this time
    plan = make_plan([job, job], costs=[1.0, 1.0], world_size=4)
    for j in range(2):
        regions = [p.region for p in plan.sources[j]]
        assert sorted(regions, key=str) == sorted(set(regions), key=str) and len(regions) == 2


def test_ddp_needs_no_gather_but_a_return() -> None:
    jobs = whole_jobs(0, (6, 4), MATRIX, range(3)) + whole_jobs(1, (2, 6, 4), MatrixLayout("experts"), range(3))
    plan = make_plan(jobs, costs=[job_cost(j, _config()) for j in jobs], world_size=3, keys=[0, 0, 0])
    assert plan.groups == ((0, 1, 2),)
    assert not plan.gathers(plan.groups[0]) and plan.returns(plan.groups[0])
    assert sorted(plan.owners) == [0, 1, 2]


@pytest.mark.parametrize(("kind", "shape"), [("matrix", (9, 4)), ("experts", (2, 9, 4)), ("flatten", (9, 2, 2))])
def test_replicated_split_blocks_are_jobs_of_their_own(kind: str, shape: tuple[int, ...]) -> None:
    """DDP balances matrices: a fused QKV tensor's blocks go to three ranks, each read in place."""
    layout = MatrixLayout(kind, (2, 3, 4))  # type: ignore[arg-type]
    jobs = whole_jobs(0, shape, layout, range(3))
    update = torch.randn(shape)
    assert len(jobs) == len(layout.blocks(shape)) * layout.base_shape(shape)[0]
    by_matrix = sorted((m for batch in layout.to_matrices(update) for m in batch.unbind(0)), key=lambda m: m.data_ptr())
    for job, block in zip(jobs, by_matrix, strict=True):
        assert torch.equal(local_part(update, job.held[0]).view(job.shape), block)
    owners = choose_owners(jobs[:3], [job_cost(j, _config()) for j in jobs[:3]], 3)
    assert sorted(owners) == [0, 1, 2]


def test_groups_run_largest_first_and_single_rank_jobs_need_no_exchange() -> None:
    small, big = (
        Job(0, (2, 2), MATRIX, (Piece(0, Box.full((2, 2))),)),
        Job(1, (8, 8), MATRIX, (Piece(1, Box.full((8, 8))),)),
    )
    plan = make_plan([small, big], costs=[1.0, 9.0], world_size=2, keys=["s", "b"])
    assert plan.groups == ((1,), (0,))
    assert not any(plan.gathers(g) or plan.returns(g) for g in plan.groups)


def test_regions_must_cover_the_job() -> None:
    half = Box((((0, 2),), ((0, 4),)))
    with pytest.raises(ValueError, match="cover 8 of its 16 elements"):
        make_plan([Job(0, (4, 4), MATRIX, (Piece(0, half), Piece(1, half)))], costs=[1.0], world_size=2)
    with pytest.raises(ValueError, match="names rank 2; the group has 2"):
        make_plan([Job(0, (4, 4), MATRIX, (Piece(2, Box.full((4, 4))),))], costs=[1.0], world_size=2)


def _pieces_and_locals(whole: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
    """Every kind of region, each with a local tensor that stores it the way its reader does."""
    out = []
    rows = Box((((1, 4),), ((0, 5),)))
    out.append((Piece(0, rows), whole[1:4].clone()))
    strided = Box((((0, 2), (4, 6)), ((1, 3),)))  # _StridedShard-like rows x a column block
    out.append((Piece(0, strided), torch.cat([whole[0:2, 1:3], whole[4:6, 1:3]])))
    flat = torch.cat([torch.zeros(3), whole.reshape(-1)[7:19], torch.zeros(2)])
    out.append((Piece(0, Span(7, 19), At(3)), flat))
    stack = torch.stack([torch.zeros_like(whole), whole])
    out.append((Piece(0, Box.full(whole.shape), Expert(1)), stack))
    return out


def test_regions_read_what_local_part_holds_and_write_it_back() -> None:
    whole = torch.arange(30.0).view(6, 5)
    for piece, local in _pieces_and_locals(whole):
        held = local_part(local, piece).reshape(-1)
        assert torch.equal(piece.region.read(whole), held), piece
        rebuilt = torch.full_like(whole, -1.0)
        piece.region.write(rebuilt, held)
        mask = torch.full_like(whole, -1.0)
        piece.region.write(mask, piece.region.read(whole))
        assert torch.equal(rebuilt, mask) and (rebuilt >= 0).sum() == piece.region.numel


def test_row_pieces_assemble_the_whole() -> None:
    whole = torch.randn(7, 3)
    job = _row_jobs([(7, 3)], 4)[0]
    rebuilt = torch.empty_like(whole)
    for piece in job.held:
        piece.region.write(rebuilt, piece.region.read(whole))
    assert torch.equal(rebuilt, whole)


CASES = [
    ("matrix", (12, 6), None),
    ("matrix", (12, 6), (4, 8)),
    ("transposed", (6, 12), (4, 8)),
    ("flatten", (12, 2, 3), (5, 7)),
]


@pytest.mark.parametrize(("kind", "shape", "split"), CASES)
@pytest.mark.parametrize("adjust_lr", ["keller", "spectral", "match_adamw"])
def test_scale_of_a_region_matches_scaling_whole_blocks(
    kind: str, shape: tuple, split: tuple | None, adjust_lr: str
) -> None:
    layout = MatrixLayout(kind, split)  # type: ignore[arg-type]
    blocks = layout.blocks(shape)
    whole = layout.from_matrices(
        [
            torch.full((b.count, b.rows, b.cols), lr_scale(adjust_lr, b.rows, b.cols), dtype=torch.float64)
            for b in blocks
        ],
        shape,
    )
    job = Job(0, shape, layout, (Piece(0, Box.full(shape)),))
    rest = tuple(((0, d),) for d in shape[1:])
    for region in [Box.full(shape), Box((((1, shape[0] - 1),), *rest)), Span(5, 40)]:
        scale = scale_of(job, region, adjust_lr, like=torch.empty(0, dtype=torch.float64))
        got = torch.ones(region.numel, dtype=torch.float64) * scale
        assert torch.equal(got, region.read(whole))
        assert isinstance(scale, float) == (split is None)
