"""A rank that raises inside ``step()`` makes every rank raise within seconds, not at the group's timeout.

The last rank raises (an injected ``RuntimeError`` standing for an out-of-memory error or a bug)
at one point of a step: before the agreement, before the exchanges, in Newton-Schulz, after the
exchanges, or after the step's last collective. Every other rank must raise
:class:`~muonkit.distributed.collectives.RankFailedError` naming it within ``BOUND`` seconds of
entering ``step()``, say truthfully whether the step had changed its params or states, and
every rank must refuse the next step. Where every rank raises alike (the same error before the
first collective, a non-finite verdict with ``nonfinite="raise"``), the group stays in step and
the next step runs.

Layouts: ``ddp`` (ReplicatedStrategy), ``fsdp`` (DTensorStrategy on a 1-D mesh, Shard(0)) and
``zero`` (a ZeroStrategy bound to a hand-made flat partition, as DeepSpeed ZeRO-1/2 hands it).
Each case runs on a fresh process group with a short timeout (``GROUP_TIMEOUT``): the ranks
that waited for the failed one abandoned a collective, so that group is spent, and code that
lets them wait shows as that group's timeout (a gloo error after ``GROUP_TIMEOUT`` s), not as a
30-minute hang.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from common import ParamSpec, group_dicts, initial, set_grads, shard, zero_partition
from harness import Context, check
from torch import Tensor, nn

import muonkit
from muonkit.distributed import collectives
from muonkit.distributed.collectives import RankFailedError

GROUP_TIMEOUT = datetime.timedelta(seconds=10)
BOUND = 5.0  # seconds from entering step() to raising, on every rank (measured: 11-46 ms)
SPECS = [
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon", (16, 16)),
    ParamSpec("muon", (8, 24)),
    ParamSpec("muon", (7, 5)),  # rows that do not divide by 2 or 4
    ParamSpec("muon", (3, 6, 4)),  # experts
    ParamSpec("adamw", (7,)),
    ParamSpec("adamw", (10, 4)),
]
ZERO_SHAPES = [(6, 5), (4, 4), (8, 3), (3, 4)]
INJECTED = "injected failure inside step()"


class Case:
    """One process group, params and optimizer for one failure."""

    def __init__(self, layout: str, ctx: Context, **kwargs: Any) -> None:
        self.layout = layout
        self.group = dist.new_group(timeout=GROUP_TIMEOUT)
        self.step_index = 0
        if layout == "zero":
            self.params, self.opt = zero_partition(
                ZERO_SHAPES, rank=ctx.rank, world_size=ctx.world_size, process_group=self.group, **kwargs
            )
        else:
            self.params, self.opt = _build(layout, self.group, **kwargs)

    def grads(self) -> None:
        if self.layout == "zero":
            g = torch.Generator().manual_seed(self.step_index)
            self.params[0].grad = torch.randn(self.params[0].shape, generator=g)
        else:
            set_grads(self.params, SPECS, self.step_index)
        self.step_index += 1

    def step(self, *, new_grads: bool = True) -> tuple[BaseException | None, float]:
        """One step (with new gradients): what it raised (None: nothing) and how long it took."""
        if new_grads:
            self.grads()
        start = time.monotonic()
        try:
            self.opt.step()
        except Exception as e:
            return e, time.monotonic() - start
        return None, time.monotonic() - start

    def local_values(self) -> list[Tensor]:
        """This rank's params and states, as stored here (no communication)."""
        out = [_local(p).clone() for p in self.params]
        for p in self.params:
            out += [_local(v).clone() for _, v in sorted(self.opt.state.get(p, {}).items()) if isinstance(v, Tensor)]
        return out


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.detach()


def _build(layout: str, group: Any, **kwargs: Any) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    if layout == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh

        device_mesh = DeviceMesh.from_group(group, "cpu")
        params = [nn.Parameter(shard(initial(i, s), device_mesh)) for i, s in enumerate(SPECS)]
        # named too: DTensors on a mesh equal to an earlier one (the same ranks) may report that mesh's group
    else:
        params = [nn.Parameter(initial(i, s)) for i, s in enumerate(SPECS)]
    return params, muonkit.HybridMuon(group_dicts(params, SPECS), process_group=group, **kwargs)


def _raiser(*_: Any, **__: Any) -> Any:
    raise RuntimeError(INJECTED)


def _after(original: Callable[..., Any]) -> Callable[..., Any]:
    def run_then_raise(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        raise RuntimeError(INJECTED)

    return run_then_raise


# Where the last rank raises: (the optimizer, its strategy or its guard, the method replaced for one step, by what)
POINTS: dict[str, tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "before the agreement": ("guard", "align_grads", lambda _: _raiser),
    "before the exchanges": ("strategy", "directions", lambda _: _raiser),
    "in Newton-Schulz": ("strategy", "compute", lambda _: _raiser),
    "after the exchanges": ("guard", "outcome", lambda _: _raiser),  # before the final verdict
    "after the last collective": ("guard", "outcome", _after),
}


@contextmanager
def _failing(opt: muonkit.HybridMuon, point: str, *, here: bool) -> Iterator[None]:
    """Inside: ``opt`` raises at ``point`` (if ``here``)."""
    where, name, replace = POINTS[point]
    owner: Any = {"strategy": opt.strategy, "guard": opt.strategy.guard}.get(where, opt)
    if here:
        setattr(owner, name, replace(getattr(owner, name)))
    try:
        yield
    finally:
        vars(owner).pop(name, None)


def _one_rank_fails(layout: str, point: str, ctx: Context) -> list[str]:
    """What is wrong on this rank when the last rank raises at ``point``."""
    failing = ctx.world_size - 1
    case = Case(layout, ctx)
    first, _ = case.step()
    assert first is None, f"{layout}: the first step raised {first!r}"
    before = case.local_values()
    with _failing(case.opt, point, here=ctx.rank == failing):
        error, took = case.step()
    changed = any(not torch.equal(a, b) for a, b in zip(before, case.local_values(), strict=True))
    problems = []
    if point == "after the last collective" and ctx.rank != failing:
        # the step completed here; the next one waits for the failed rank, which refuses it
        if error is not None:
            problems.append(f"the step raised {error!r} although every collective completed")
        error, took = case.step()
    if ctx.rank == failing:
        notes = " ".join(getattr(error, "__notes__", []))
        if not (isinstance(error, RuntimeError) and str(error) == INJECTED):
            problems.append(f"the failing rank raised {error!r}, not the injected error")
        elif "the ranks waiting for it were told" not in notes or ("partly applied" in notes) != changed:
            problems.append(f"the failing rank's note {notes!r} (its state changed: {changed})")
    elif not isinstance(error, RankFailedError):
        problems.append(f"raised {type(error).__name__}: {error} after {took:.1f} s, not RankFailedError")
    else:
        if error.rank != failing or INJECTED not in error.error or INJECTED not in str(error):
            problems.append(f"RankFailedError names rank {error.rank} and {error.error!r}")
        if point != "after the last collective" and error.applied_here != changed:
            problems.append(f"says applied here: {error.applied_here}, the state changed: {changed}: {error}")
    if took > BOUND:
        problems.append(f"raised after {took:.1f} s (bound {BOUND} s)")
    dist.barrier()  # on the default group, which is in step: code that let ranks wait is in step again here
    refused, took = case.step()  # every rank refuses: the group is out of step
    if not (isinstance(refused, RuntimeError) and "cannot step on this process group any more" in str(refused)):
        problems.append(f"the next step raised {refused!r}, not a refusal")
    elif took > BOUND:
        problems.append(f"the refusal took {took:.1f} s")
    dist.barrier()
    return [f"{layout}, {point}, rank {ctx.rank}: {p}" for p in problems]


def _every_rank_fails_alike(layout: str, ctx: Context) -> list[str]:
    """The same error on every rank before the first collective, then a non-finite gradient on the
    last rank under ``nonfinite="raise"``: every rank raises, and the group stays in step."""
    case = Case(layout, ctx, nonfinite="raise")
    problems = []
    first, _ = case.step()
    assert first is None, f"{layout}: the first step raised {first!r}"
    with _failing(case.opt, "before the agreement", here=True):
        error, took = case.step()
    if not (isinstance(error, RuntimeError) and str(error) == INJECTED and took < BOUND):
        problems.append(f"every rank failing alike: raised {error!r} after {took:.1f} s")
    notes = " ".join(getattr(error, "__notes__", []))
    if "the process group is in step" not in notes:
        problems.append(f"every rank failing alike: note {notes!r}")
    case.grads()
    if ctx.rank == ctx.world_size - 1:
        _local(case.params[0].grad).view(-1)[0] = math.inf  # type: ignore[arg-type]
    error, _ = case.step(new_grads=False)
    if not isinstance(error, FloatingPointError):
        problems.append(f"a non-finite gradient with nonfinite='raise' raised {error!r}")
    error, _ = case.step()
    if error is not None:
        problems.append(f"the step after errors every rank raised alike raised {error!r}")
    return [f"{layout}, rank {ctx.rank}: {p}" for p in problems]


def _check_layout(layout: str, ctx: Context) -> None:
    problems = [p for point in POINTS for p in _one_rank_fails(layout, point, ctx)]
    problems += _every_rank_fails_alike(layout, ctx)
    assert not problems, "\n".join(problems)


@check(2, 4)
def ddp_a_rank_that_raises_inside_step_releases_every_rank(ctx: Context) -> None:
    _check_layout("ddp", ctx)


@check(2, 4)
def fsdp2_a_rank_that_raises_inside_step_releases_every_rank(ctx: Context) -> None:
    _check_layout("fsdp", ctx)


@check(2, 4)
def zero_a_rank_that_raises_inside_step_releases_every_rank(ctx: Context) -> None:
    _check_layout("zero", ctx)


@check(2)
def the_host_agreement_beside_an_nccl_group_is_released_too(ctx: Context) -> None:
    """As beside an NCCL-only group: the agreement goes through a gloo side group (with the default
    timeout, 60 s here); a rank that raises before it still releases the others within the bound."""
    original = collectives.reduces_cpu
    collectives.reduces_cpu = lambda group: False
    try:
        problems = _one_rank_fails("ddp", "before the agreement", ctx)
    finally:
        collectives.reduces_cpu = original
    assert not problems, "\n".join(problems)
