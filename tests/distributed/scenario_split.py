"""Split Newton-Schulz (one job over a group of ranks) against one device, at 4 and 8 ranks.

The planner splits a job only where it pays (thousands of ranks, large matrices); here a policy
forces it on every splittable matrix of the zoo (``threshold=0``, ``parts=W``: as many shards as
ranks, fewer where the long side is shorter), so every path runs on small matrices: row and
column cuts, shards that do not divide evenly, the replicated and chained forms, the Gram
iteration (fp32), transposed layouts, experts and ``split_sizes`` blocks (each its own job),
a bf16 param, NorMuon with rows whole and rows cut, FSDP2 ``Shard(0)`` and ``Shard(1)`` and DDP.

Compared with the single-device optimizer as every distributed layout is (:mod:`common`): states
bit for bit, Muon params within ``MUON_REL_TOL`` of the distance travelled (the sums of partial
Gram products round differently from one product; measured far below it), DDP ranks bit-identical
to each other, each matrix counted once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from common import NORMUON_ZOO, ZOO, ParamSpec, all_sum, build, differences, matrix_count, rank_differences, set_grads
from harness import Context, check
from scenario_planner import HandMade, _config

import muonkit
from muonkit.distributed import select_strategy
from muonkit.distributed.base import StrategyStats
from muonkit.distributed.collectives import Collectives
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.pieces import Box, Job, Piece
from muonkit.distributed.planner import Plan
from muonkit.distributed.split_plan import SplitPolicy
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_directions

STEPS = 2
# The zoo's kinds of matrices, one of each: every point-to-point round of every split job costs a
# few milliseconds on a loaded CI machine (the full ZOO at W=8: ~10 minutes).
SPLIT_ZOO = [ZOO[i] for i in (0, 3, 4, 5, 7, 8, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20)]
SPLIT_NORMUON_ZOO = [NORMUON_ZOO[i] for i in (0, 2, 3, 5, 8, 9, 10, 12)]


def _forced(opt: muonkit.HybridMuon, params: list[Any], layout: str, world_size: int, by_rows: bool) -> PlannedStrategy:
    """The optimizer's own strategy for ``layout``, forced to split every splittable job into W shards:
    with free collectives (``P`` by rows) or at the default costs (``P`` replicated: at these sizes
    the gathers' latency outweighs the FLOPs they save)."""
    group = dist.group.WORLD if layout == "ddp" else None
    strategy = select_strategy(params, process_group=group)
    assert isinstance(strategy, PlannedStrategy)
    free = {"flops_per_byte": 0.0, "flops_per_collective": 0.0} if by_rows else {}
    strategy.split_policy = SplitPolicy(threshold=0, parts=world_size, **free)
    opt.set_strategy(strategy)
    return strategy


def _plans(strategy: PlannedStrategy) -> list[Plan]:
    return [*strategy._plans.values(), *strategy._plans_by_placement.values()]


def _train(layout: str, zoo: list[ParamSpec], ctx: Context, *, by_rows: bool) -> list[str]:
    params, opt = build(layout, zoo)
    strategy = _forced(opt, params, layout, ctx.world_size, by_rows)
    ref_params, ref_opt = build("single", zoo)
    counted = []
    for step in range(STEPS):
        set_grads(params, zoo, step)
        set_grads(ref_params, zoo, step)
        before = strategy.stats.matrices
        opt.step()
        ref_opt.step()
        counted.append(all_sum(strategy.stats.matrices - before))
    problems = differences(params, opt, ref_params, ref_opt, zoo)
    problems += rank_differences(params) if layout == "ddp" else []
    expected = [matrix_count(zoo, s) for s in range(STEPS)]
    problems += [] if counted == expected else [f"matrices per step {counted}, expected {expected}"]
    splits = [s for plan in _plans(strategy) for s in plan.splits]
    problems += [] if len(splits) >= 10 else [f"only {len(splits)} split jobs: the check would prove little"]
    forms = {s.by_rows for s in splits}
    problems += [] if by_rows in forms else [f"no split job with by_rows={by_rows}"]
    return [f"{layout}: {p}" for p in problems]


@check(4, 8, both_ns_defaults=True)
def split_jobs_match_single_device(ctx: Context) -> None:
    problems = _train("fsdp", SPLIT_ZOO, ctx, by_rows=True) + _train("ddp", SPLIT_ZOO, ctx, by_rows=False)
    assert not problems, "\n".join(problems)


@check(4, 8)
def split_normuon_matches_single_device(ctx: Context) -> None:
    """Rows whole (a tall matrix cut along its rows) and rows cut (wide, cut along the columns)."""
    problems = _train("fsdp", SPLIT_NORMUON_ZOO, ctx, by_rows=False)
    problems += _train("columns", SPLIT_NORMUON_ZOO, ctx, by_rows=True)
    assert not problems, "\n".join(problems)


@check(4, 8)
def shards_on_their_row_blocks_move_nothing(ctx: Context) -> None:
    """A tall matrix in FSDP2 row blocks, split into as many shards as ranks: each member holds its
    shard, so the only bytes sent are the sums (a norm, then one Gram matrix's upper triangle in
    float32 per step) and the result goes nowhere; the direction matches one device's."""
    w, rows, cols = ctx.world_size, 8 * ctx.world_size, 6
    jobs = [
        Job(
            0,
            (rows, cols),
            MatrixLayout(),
            tuple(Piece(r, Box((((8 * r, 8 * r + 8),), ((0, cols),)))) for r in range(w)),
        )
    ]
    whole = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    strategy = HandMade(jobs)
    strategy.split_policy = SplitPolicy(threshold=0, parts=w)
    config = dataclasses.replace(_config(), ns_dtype=torch.float32, ns_method="newton_schulz")
    mine = whole[8 * ctx.rank : 8 * ctx.rank + 8].clone()
    got = strategy.directions([torch.empty(0)], [mine], config)[0]
    want = muon_directions([whole], [MatrixLayout()], config.ns_options)[0][8 * ctx.rank : 8 * ctx.rank + 8]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    (split,) = strategy.plan_of(jobs, [mine], config).splits
    assert split.ranks == tuple(range(w)) and not split.gathers and not split.returns, split
    ring = 2 * (w - 1) / w
    expected = round(ring * 8) + config.steps * round(ring * (cols * (cols + 1) // 2) * 4)
    assert strategy.stats.bytes_sent == expected, (strategy.stats.bytes_sent, expected)
    assert strategy.stats.collectives == 1 + config.steps, strategy.stats.collectives
    assert all_sum(strategy.stats.matrices) == 1


@check(4, 8)
def ring_sums_and_gathers_among_members_alone(ctx: Context) -> None:
    """The members' point-to-point sums and gathers, on overlapping sets of ranks that other ranks
    never join (no process group is made), with chunks left empty where a tensor has fewer
    elements than members: every member gets the same bits, the sum of every member's values."""
    comm = Collectives(dist.group.WORLD, StrategyStats())
    w = ctx.world_size
    sets = [tuple(range(w)), (0, 2, w - 1), (1, w - 1), tuple(range(1, w, 2)), (w - 2, 0)]
    for members in sets:
        for numel in (1, 2, 7, 33):
            values = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * r + numel)) for r in range(w)]
            summed = torch.full((numel,), math.nan)
            if ctx.rank in members:
                summed = values[ctx.rank].clone()
                comm.ring_all_reduce(summed, members)
                torch.testing.assert_close(summed, sum(values[r] for r in members), rtol=0, atol=1e-5)
                gathered = torch.empty(len(members) * numel)
                comm.ring_all_gather(gathered, values[ctx.rank], members)
                assert torch.equal(gathered, torch.cat([values[r] for r in sorted(members)])), (members, numel)
            every = [torch.empty(numel) for _ in range(w)]
            dist.all_gather(every, summed)  # every rank, after the members' own exchanges
            assert all(torch.equal(every[r], every[members[0]]) for r in members), (members, numel)
