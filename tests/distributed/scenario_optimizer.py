"""HybridMuon under DDP (replicated) and FSDP2 (DTensor) against one device, on injected gradients.

Every rank is given the same global gradient (as DDP's all-reduce or FSDP2's reduce-scatter
would leave it), so the distributed optimizer and the single-device one see identical inputs.
Each rank does the same elementwise fp32 arithmetic on its slice as the single device does on
the whole tensor, each matrix is orthogonalized from the same fp32 input, results travel in the
dtype they were computed in, and the shape scale is applied after the transfer as on one device.
The only difference is which matrices share a batched matmul call, which a matmul kernel may
round differently: states must be bit-identical, Muon params within the tolerance of
:mod:`common`, and DDP ranks bit-identical to each other. (On the CPUs we ran, x86 AVX2 and
AVX512, the params come out bit-identical too.) The comparisons run under both default
Newton-Schulz dtypes, fp32 and bf16, whatever the CPU supports.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from common import (
    NORMUON_ZOO,
    ZOO,
    ParamSpec,
    all_sum,
    build,
    differences,
    differences_to,
    dim0_sizes,
    full,
    matrix_count,
    mesh,
    rank_differences,
    set_grads,
    shard,
    snapshot,
    train_beside_single,
)
from harness import Context, check
from torch import nn

import muonkit
from muonkit.distributed import DTensorStrategy, ReplicatedStrategy, SingleDeviceStrategy, select_strategy

STEPS = 4
INF_STEP = 2  # a non-finite gradient on one rank: every rank must skip the step (on the CPU, where the
# verdict is read at once, before orthogonalizing anything; a GPU computes and masks every commit)


def _run(layout: str, ctx: Context, zoo: list[ParamSpec]) -> tuple[list[str], list[int]]:
    params, opt = build(layout, zoo)
    ref_params, ref_opt = build("single", zoo)
    counted = []
    for step in range(STEPS):
        set_grads(params, zoo, step)
        set_grads(ref_params, zoo, step)
        if step == INF_STEP:
            _poison(params[5], ctx)
            _poison(ref_params[5], ctx, everywhere=True)
        before = opt.strategy.stats.matrices
        opt.step()
        ref_opt.step()
        counted.append(all_sum(opt.strategy.stats.matrices - before))
    assert opt.skipped_steps == ref_opt.skipped_steps == 1, (opt.skipped_steps, ref_opt.skipped_steps)
    problems = differences(params, opt, ref_params, ref_opt, zoo)
    return problems + (rank_differences(params) if layout == "ddp" else []), counted


def _poison(p: nn.Parameter, ctx: Context, *, everywhere: bool = False) -> None:
    """inf in the last row: only the last rank's copy (DDP) or the rank holding that row (FSDP2)."""
    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    if (
        everywhere
        or (ctx.rank == ctx.world_size - 1 and not hasattr(p.grad, "to_local"))
        or (hasattr(p.grad, "to_local") and grad.size(0) > 0 and sum_rows_before(p, ctx) + grad.size(0) == p.shape[0])
    ):
        grad[-1, 0] = float("inf")


def sum_rows_before(p: nn.Parameter, ctx: Context) -> int:
    return sum(dim0_sizes(p.shape[0], ctx.world_size)[: ctx.rank])


@check(2, 4, both_ns_defaults=True)
def ddp_matches_single_device(ctx: Context) -> None:
    problems, counted = _run("ddp", ctx, ZOO)
    assert not problems, "\n".join(problems)
    expected = [0 if s == INF_STEP else matrix_count(ZOO, s) for s in range(STEPS)]  # skipped before any work
    assert counted == expected, f"matrices orthogonalized per step over all ranks {counted}, expected {expected}"


@check(2, 4, both_ns_defaults=True)
def fsdp2_matches_single_device(ctx: Context) -> None:
    problems, counted = _run("fsdp", ctx, ZOO)
    assert not problems, "\n".join(problems)
    expected = [0 if s == INF_STEP else matrix_count(ZOO, s) for s in range(STEPS)]  # skipped before any work
    assert counted == expected, f"matrices orthogonalized per step over all ranks {counted}, expected {expected}"


@check(2, both_ns_defaults=True)
def normuon_and_cautious_wd_match_single_device(ctx: Context) -> None:
    """NorMuon and cautious weight decay under DDP, FSDP2 ``Shard(0)`` (rows split across ranks) and
    ``Shard(1)`` (every row cut across ranks): params, momentum and the row moments (replicated on
    every rank) equal one device's, each matrix orthogonalized and normalized once."""
    problems = []
    for layout in ("ddp", "fsdp", "columns"):
        params, opt = build(layout, NORMUON_ZOO)
        ref_params, ref_opt = build("single", NORMUON_ZOO)
        if layout == "columns":  # not vacuous: a rank holds half of every row
            assert tuple(params[0].to_local().shape) == (16, 8), params[0].to_local().shape
        for step in range(STEPS):
            set_grads(params, NORMUON_ZOO, step)
            set_grads(ref_params, NORMUON_ZOO, step)
            opt.step()
            ref_opt.step()
        problems += [f"{layout}: {d}" for d in differences(params, opt, ref_params, ref_opt, NORMUON_ZOO)]
        problems += rank_differences(params) if layout == "ddp" else []
        done, expected = all_sum(opt.strategy.stats.matrices), ref_opt.strategy.stats.matrices
        problems += (
            [] if done == expected else [f"{layout}: {done} orthogonalizations over all ranks, one device {expected}"]
        )
    assert not problems, "\n".join(problems)


def _poison_directions(opt: muonkit.HybridMuon) -> None:
    """The next step's first non-empty local direction gets an inf (this rank only)."""
    original = opt.strategy.directions

    def directions(params: list[torch.Tensor], updates: list[torch.Tensor], config: Any) -> list[torch.Tensor]:
        out = original(params, updates, config)
        hit = next((d for d in out if d.numel() > 0), None)
        if hit is not None:
            hit.view(-1)[0] = float("inf")
            opt.strategy.directions = original  # type: ignore[method-assign]
        return out

    opt.strategy.directions = directions  # type: ignore[method-assign]


CUSTOM = [(3.4, -4.7, 2.0)]  # near Keller's, not a preset's schedule: directions held until the verdict


@check(2, 4)
def a_non_finite_update_on_one_rank_skips_everywhere_in_one_agreement(ctx: Context) -> None:
    """A custom schedule, only the last rank sees it: every rank skips (all bit-identical), at a
    normal step's collectives."""
    for layout in ("ddp", "fsdp"):
        params, opt = build(layout, ZOO)
        for group in opt.param_groups:
            if group["algorithm"] == "muon":
                group["ns_coefficients"] = CUSTOM
        collectives = []
        for step in range(STEPS):
            set_grads(params, ZOO, step)
            if step == INF_STEP:
                before = [{k: v.clone() for k, v in entry.items()} for entry in snapshot(params, opt)]
                if ctx.rank == ctx.world_size - 1:
                    _poison_directions(opt)
            count = opt.strategy.stats.collectives
            opt.step()
            collectives.append(opt.strategy.stats.collectives - count)
            if step == INF_STEP:
                problems = differences_to(snapshot(params, opt), before)
                assert not problems, f"{layout}: " + "\n".join(problems)
        assert opt.skipped_steps == 1, (layout, opt.skipped_steps)
        assert collectives[INF_STEP] == collectives[0], f"{layout}: collectives per step {collectives}"


@check(2, 4)
def a_non_finite_update_from_finite_gradients_streamed_raises_on_every_rank(ctx: Context) -> None:
    """A preset's schedule (each chunk applied as it comes): a non-finite direction on the last
    rank only, which finite gradients cannot give but a bug could, is not applied there and
    every rank raises the same error instead of hanging in the next step's collectives."""
    for layout in ("ddp", "fsdp"):
        params, opt = build(layout, ZOO)
        set_grads(params, ZOO, 0)
        opt.step()
        set_grads(params, ZOO, 1)
        if ctx.rank == ctx.world_size - 1:
            _poison_directions(opt)
        with pytest.raises(RuntimeError, match="A Muon direction was non-finite although every gradient was finite"):
            opt.step()
        set_grads(params, ZOO, 2)
        opt.step()  # the ranks are still in step: the same collectives follow
        assert all(torch.isfinite(full(p.detach())).all() for p in params), layout


@check(2, 4)
def work_is_spread_and_counted(ctx: Context) -> None:
    for layout in ("ddp", "fsdp"):
        params, opt = build(layout, ZOO)
        set_grads(params, ZOO, 0)
        opt.step()
        stats = opt.strategy.stats
        assert stats.matrices > 0, f"{layout}: rank {ctx.rank} orthogonalized nothing though there are many matrices"
        assert stats.bytes_sent > 0 and stats.collectives > 0, f"{layout}: {stats}"
        total = all_sum(stats.flops)
        assert stats.flops <= 0.75 * total, f"{layout}: rank {ctx.rank} did {stats.flops} of {total} FLOPs"


@check(2, 4, both_ns_defaults=True)
def a_rank_that_owns_no_matrix(ctx: Context) -> None:
    zoo = [ParamSpec("muon", (2, 8)), ParamSpec("adamw", (2,)), ParamSpec("adamw", (6, 3))]
    for layout in ("ddp", "fsdp"):
        params, opt, problems = train_beside_single(layout, zoo, 3)
        problems += rank_differences(params) if layout == "ddp" else []
        assert not problems, f"{layout}: " + "\n".join(problems)
        owners = all_sum(int(opt.strategy.stats.matrices > 0))
        assert owners == 1, f"{layout}: {owners} ranks orthogonalized the single matrix"
        assert all_sum(opt.strategy.stats.matrices) == 3, f"{layout}: one matrix, three steps"


@check(2, 4)
def ranks_disagreeing_on_grads_raise_everywhere(ctx: Context) -> None:
    for layout in ("ddp", "fsdp"):
        params, opt = build(layout, ZOO)
        set_grads(params, ZOO, 0)
        if ctx.rank == 0:
            params[3].grad = None
        try:
            opt.step()
        except RuntimeError as e:
            assert "Ranks disagree on which params have gradients at positions [3]" in str(e), str(e)
        else:
            raise AssertionError(f"{layout}: no error on rank {ctx.rank}")


@check(2)
def strategy_selection(ctx: Context) -> None:
    plain = [nn.Parameter(torch.randn(4, 4))]
    try:
        select_strategy(plain)
    except ValueError as e:
        assert "process_group=torch.distributed.group.WORLD" in str(e) and "SingleDeviceStrategy()" in str(e), str(e)
    else:
        raise AssertionError("plain params at world size 2 without process_group must be refused")
    assert isinstance(select_strategy(plain, process_group=dist.group.WORLD), ReplicatedStrategy)
    device_mesh = mesh()
    assert isinstance(select_strategy(plain, process_group=device_mesh), ReplicatedStrategy)
    sharded = [nn.Parameter(shard(torch.randn(4, 4), device_mesh))]
    assert isinstance(select_strategy(sharded), DTensorStrategy)
    try:
        select_strategy(sharded + plain)
    except ValueError as e:
        assert "1 DTensor params (FSDP2) and 1 plain tensors" in str(e), str(e)
    else:
        raise AssertionError("mixed DTensor and plain params must be refused")
    opt = muonkit.HybridMuon(plain, strategy=SingleDeviceStrategy())  # the explicit opt-out
    assert isinstance(opt.strategy, SingleDeviceStrategy)


@check(2)
def strategy_is_chosen_from_the_params_at_the_first_step(ctx: Context) -> None:
    """Not at construction: an engine may swap the params (accelerate's FSDP2 ``prepare`` puts
    DTensors in the param groups) between the two; ``load_state_dict`` before the first step (as
    accelerate's optimizer wrapper does) must not choose either."""
    device_mesh = mesh()

    def swapped(process_group: Any = None) -> tuple[muonkit.HybridMuon, list[Any]]:
        plain = [nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
        opt = muonkit.HybridMuon(plain, process_group=process_group)  # no error at world size 2
        opt.load_state_dict(opt.state_dict())
        sharded = [nn.Parameter(shard(p.detach(), device_mesh)) for p in plain]
        opt.param_groups[0]["params"] = sharded
        for p in sharded:
            p.grad = shard(torch.ones(4, 4), device_mesh)
        return opt, sharded

    for process_group in (None, dist.group.WORLD):  # make_optimizer passes WORLD under torchrun by itself
        opt, _ = swapped(process_group)
        opt.step()
        assert isinstance(opt.strategy, DTensorStrategy), type(opt.strategy)
        assert all_sum(opt.strategy.stats.matrices) == 2, opt.strategy.stats

    # another group over the same ranks as the DTensors' mesh is used as it is
    opt, _ = swapped(dist.new_group(list(range(ctx.world_size))))
    opt.step()
    assert all_sum(opt.strategy.stats.matrices) == 2, opt.strategy.stats

    # a group over other ranks than the DTensors' mesh is refused at the first step, before anything changes
    singles = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank creates every group
    opt, sharded = swapped(singles[ctx.rank])
    before = [p.detach().full_tensor() for p in sharded]
    try:
        opt.step()
    except ValueError as e:
        assert "process_group= spans ranks" in str(e), str(e)
    else:
        raise AssertionError("a process_group over other ranks than the DTensors' mesh must be refused")
    assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, sharded, strict=True))
    assert not opt.state

    # plain params at world size 2 without a group: opt.strategy read before the first step (maybe on
    # one rank only) cannot compare the ranks' params and says what to pass; the first step compares
    # them (the same here) and takes them for DDP replicas (tests/distributed/scenario_choice.py)
    opt = muonkit.HybridMuon([nn.Parameter(torch.ones(4, 4))])
    opt.param_groups[0]["params"][0].grad = torch.ones(4, 4)
    try:
        opt.strategy  # noqa: B018 - the read chooses
    except ValueError as e:
        assert "process_group=torch.distributed.group.WORLD" in str(e) and "SingleDeviceStrategy()" in str(e), str(e)
        assert "built before torch.distributed" not in str(e), str(e)  # it was initialized at construction
        assert "first step() chooses ReplicatedStrategy by itself" in str(e), str(e)
    else:
        raise AssertionError("opt.strategy of plain params at world size 2 without process_group must be refused")
    opt.step()
    assert isinstance(opt.strategy, ReplicatedStrategy) and opt.strategy.verify_grads, opt.strategy

    # an explicit strategy wins over the params' layout, and set_strategy replaces the choice
    opt, _ = swapped()
    explicit = ReplicatedStrategy(dist.group.WORLD)
    opt.set_strategy(explicit)
    assert opt.strategy is explicit
