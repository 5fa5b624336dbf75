"""The linear job builder and planner give exactly the jobs and plans of the reference (main 3a3594f).

:mod:`planner_reference` keeps the quadratic versions verbatim. Here both build and plan the same
layouts and everything must be equal: every job's pieces (rank, region, where, in order), owners,
sources (which holder of each region, in order) and exchange groups. Layouts: random jobs (tuples
and compact :class:`~muonkit.distributed.pieces.Pieces`, replicas, empty pieces, cost ties, any
tolerance), every DTensor placement combination the layout tests read, ZeRO partitions, and the
simulator's reference models on small meshes and at 256 ranks.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import planner_reference as ref
from muonkit.distributed.dtensor_placement import dim_runs, mesh_boxes, rank_boxes, tensor_jobs
from muonkit.distributed.executor import group_keys
from muonkit.distributed.pieces import At, Box, Expert, Holders, Job, Piece, Pieces, Span
from muonkit.distributed.planner import choose_owners, job_cost, make_plan
from muonkit.distributed.replicated import whole_jobs
from muonkit.distributed.zero import partition_jobs
from muonkit.distributed.zero_partition import contiguous_partition, per_param_partition
from muonkit.functional.matrices import MatrixLayout
from muonkit.simulator.meshes import parse_mesh
from muonkit.simulator.models import KIMI_K2, LLAMA_70B, shapes_of
from muonkit.simulator.simulate import muon_config

MATRIX = MatrixLayout()


def assert_same_jobs(new: list[Job], old: list[Job]) -> None:
    assert len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        assert (a.tensor, a.shape, a.layout) == (b.tensor, b.shape, b.layout)
        assert tuple(a.held) == tuple(b.held), (a, b)
        assert tuple(a.needed) == tuple(b.needed)


def assert_same_plan(jobs: list[Job], costs: list[float], world_size: int, **options: object) -> None:
    new = make_plan(jobs, costs=costs, world_size=world_size, **options)  # type: ignore[arg-type]
    old = ref.make_plan(jobs, costs=costs, world_size=world_size, **options)  # type: ignore[arg-type]
    assert new.owners == old.owners
    assert [tuple(s) for s in new.sources] == [tuple(s) for s in old.sources]
    assert new.groups == old.groups


def _random_job(rng: random.Random, tensor: int, world: int) -> Job:
    rows, cols = rng.randint(1, 9), rng.randint(1, 5)
    shape = (rows, cols)
    kind = rng.choice(["one", "copies", "rows", "spans", "empty"])
    ranks = list(range(world))
    if kind == "one":
        pieces = [Piece(rng.choice(ranks), Box.full(shape))]
    elif kind == "copies":
        pieces = [
            Piece(r, Box.full(shape), Expert(rng.randint(0, 2))) for r in rng.sample(ranks, rng.randint(1, world))
        ]
    elif kind in ("rows", "spans"):
        cuts = sorted(rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 3)))) if rows > 1 else []
        bounds = list(zip([0, *cuts], [*cuts, rows], strict=True))
        pieces = []
        for a, b in bounds:
            region = Box((((a, b),), ((0, cols),))) if kind == "rows" else Span(a * cols, b * cols)
            for r in rng.sample(ranks, rng.randint(1, min(3, world))):
                pieces.append(Piece(r, region, At(rng.randint(0, 4)) if kind == "spans" else None))
        rng.shuffle(pieces)
    else:  # a zero-size job, or one with an empty piece beside its rows
        if rng.random() < 0.5:
            return Job(tensor, (0, cols), MATRIX, ())
        pieces = [Piece(rng.choice(ranks), Box(((), ((0, cols),)))), Piece(rng.choice(ranks), Box.full(shape))]
    if rng.random() < 0.5 and len({p.where for p in pieces}) == 1:  # the compact form of the same pieces
        holders = Holders(tuple(p.rank for p in pieces), tuple(p.region for p in pieces))
        return Job(tensor, shape, MATRIX, Pieces(holders, pieces[0].where))
    return Job(tensor, shape, MATRIX, tuple(pieces))


@pytest.mark.parametrize("seed", range(40))
def test_random_jobs_get_the_reference_plan(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(8):
        world = rng.choice([1, 2, 3, 4, 5, 8, 16])
        jobs = [_random_job(rng, t, world) for t in range(rng.randint(1, 25))]
        costs = [float(rng.choice([0, 1, 1, 2, 3, 8, 8, 40])) * bool(job.numel) for job in jobs]
        tolerance = rng.choice([0.1, 0.1, 0.0, 0.5, 2.0, -0.1])
        keys = [rng.choice("ab") for _ in jobs] if rng.random() < 0.5 else None
        assert_same_plan(jobs, costs, world, keys=keys, tolerance=tolerance)
        assert choose_owners(jobs, costs, world, tolerance=tolerance) == ref.choose_owners(
            jobs, costs, world, tolerance=tolerance
        )


MESHES = [(4,), (2, 2), (3, 2), (2, 2, 2)]
SHAPES = [(1, 1), (3, 2), (5, 7), (8, 4), (13, 9)]
EXPERTS = [(3, 5, 4), (4, 6, 2), (1, 3, 3)]
OPTIONS = [Replicate(), Shard(0), Shard(1)] + [_StridedShard(d, split_factor=f) for d, f in [(0, 2), (1, 2), (0, 3)]]


def _decodable(shape: tuple[int, ...], placements: tuple[object, ...], mesh: tuple[int, ...]) -> bool:
    try:
        mesh_boxes(shape, placements, mesh)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_dtensor_boxes_jobs_and_plans_equal_the_reference(mesh: tuple[int, ...]) -> None:
    ranks = torch.arange(math.prod(mesh)).flip(0).view(mesh)  # group ranks in another order than coordinates
    checked = 0
    for shape, placements in itertools.product(SHAPES + EXPERTS, itertools.product(OPTIONS, repeat=len(mesh))):
        if any(getattr(p, "dim", 0) >= len(shape) for p in placements) or not _decodable(shape, placements, mesh):
            continue
        assert mesh_boxes(shape, placements, mesh) == ref.mesh_boxes(shape, placements, mesh)  # type: ignore[arg-type]
        held = rank_boxes(shape, placements, ranks)  # type: ignore[arg-type]
        assert list(held) == ref.rank_boxes(shape, placements, ranks)  # type: ignore[arg-type]
        layouts = [MatrixLayout()] + ([MatrixLayout(split_sizes=(1, shape[-2] - 1))] if shape[-2] > 1 else [])
        for layout in layouts:
            jobs = tensor_jobs(0, shape, layout, held)
            assert_same_jobs(jobs, ref.tensor_jobs(0, shape, layout, list(held)))
            config = muon_config(layout.kind, layout.split_sizes)
            assert_same_plan(jobs, [job_cost(j, config) for j in jobs], math.prod(mesh))
        checked += 1
    assert checked >= 20


def test_dim_runs_equal_the_reference_for_every_coordinate() -> None:
    for size, parts in itertools.product([0, 1, 5, 13, 64], [(4,), (3, 2), (2, 2, 2)]):
        placements = [Shard(0), _StridedShard(0, split_factor=2)]
        for kinds in itertools.product(placements, repeat=len(parts)):
            for coordinate in itertools.product(*(range(n) for n in parts)):
                splits = tuple((p, n, c) for p, n, c in zip(kinds, parts, coordinate, strict=True))
                assert dim_runs(size, splits) == ref.dim_runs(size, splits)  # type: ignore[arg-type]


def test_replicated_jobs_equal_the_reference() -> None:
    cases = [
        ((6, 4), MatrixLayout()),
        ((4, 6), MatrixLayout("transposed", (2, 4))),
        ((3, 6, 4), MatrixLayout("experts")),
        ((2, 9, 4), MatrixLayout("experts", (2, 3, 4))),
        ((9, 2, 2), MatrixLayout("flatten", (4, 5))),
    ]
    for world in (1, 3, 8):
        jobs, old = [], []
        for t, (shape, layout) in enumerate(cases):
            jobs += whole_jobs(t, shape, layout, range(world))
            old += ref.whole_jobs(t, shape, layout, range(world))
        assert_same_jobs(jobs, old)
        assert_same_plan(
            jobs, [job_cost(j, muon_config()) for j in jobs], world, keys=group_keys(jobs, [torch.float32] * 5)
        )


def test_zero_partitions_get_the_reference_plan() -> None:
    shapes = [(5, 7), (3, 4), (6, 9), (40, 3), (4, 4), (2, 3), (0, 3), (16, 16)]
    numels = [math.prod(s) for s in shapes]
    offsets = [sum(numels[:i]) for i in range(len(shapes))]
    for world in (2, 3, 4, 8):
        for layout in (
            contiguous_partition(
                names=[str(i) for i in range(len(shapes))], shapes=shapes, offsets=offsets,
                partition_size=math.ceil(sum(numels) / world), world_size=world,
            ),
            per_param_partition(names=[str(i) for i in range(len(shapes))], shapes=shapes, world_size=world),
        ):  # fmt: skip
            jobs = partition_jobs(layout, MATRIX)
            assert_same_plan(jobs, [job_cost(j, muon_config()) for j in jobs], world)


def _small(config: dict, **changes: int) -> dict:
    return {**config, **changes}


SIMULATED = [
    (_small(LLAMA_70B, num_hidden_layers=1, hidden_size=256, intermediate_size=640, num_attention_heads=8,
            num_key_value_heads=2), ["fsdp=8", "hsdp=2x4", "tp=2,fsdp=4", "tp=2,hsdp=2x2", "ddp=4", "fsdp=256",
                                     "hsdp=8x8", "tp=4,fsdp=16"]),
    (_small(KIMI_K2, num_hidden_layers=3, hidden_size=128, intermediate_size=320, moe_intermediate_size=64,
            n_routed_experts=12, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16), ["ep=4,fsdp=2", "ep=2,fsdp=2", "ep=4,fsdp=4", "tp=2,fsdp=4",
                                                 "hsdp=2x4", "pp=2,fsdp=4", "ep=16,fsdp=16"]),
]  # fmt: skip
"""Reduced Llama-70B-like and Kimi-K2-like models on the meshes the simulator reads, up to 256 ranks."""


@pytest.mark.parametrize(("config", "mesh"), [(c, m) for c, meshes in SIMULATED for m in meshes])
def test_simulated_layouts_equal_the_reference(config: dict, mesh: str) -> None:
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.experts.gate_up_proj": "colwise", "layers.*.mlp.experts.down_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}  # fmt: skip
    model, spec = shapes_of("small", config, plan), parse_mesh(mesh)
    groups: dict[str, list] = {}
    for matrix in model.matrices:
        groups.setdefault(matrix.layout, []).append(matrix)
    for layout, matrices in groups.items():
        config_ = muon_config(layout)
        jobs, old = [], []
        for i, matrix in enumerate(matrices):
            placed = spec.placement(matrix, model.experts)
            if placed is None:
                jobs += whole_jobs(i, matrix.shape, config_.layout, range(spec.stage_ranks))
                old += ref.whole_jobs(i, matrix.shape, config_.layout, range(spec.stage_ranks))
                continue
            jobs += tensor_jobs(i, matrix.shape, config_.layout, rank_boxes(matrix.shape, *placed))
            old += ref.tensor_jobs(i, matrix.shape, config_.layout, ref.rank_boxes(matrix.shape, *placed))
        assert_same_jobs(jobs, old)
        keys = group_keys(jobs, [torch.float32] * len(matrices))
        assert_same_plan(jobs, [job_cost(j, config_) for j in jobs], spec.stage_ranks, keys=keys)
