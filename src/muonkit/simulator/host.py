"""The host work of one optimizer step on one simulated rank: the executor itself, collectives stubbed.

:func:`host_step` gives a :class:`~muonkit.distributed.executor.PlannedStrategy` the rank's local
tensors on the ``meta`` device (shapes only: no memory, no arithmetic) and a stand-in for the
collectives that returns at once, replaces Newton-Schulz by an empty result, and runs
:meth:`~muonkit.distributed.executor.PlannedStrategy.run` on each of the stage's plans: what is
left is the Python and dispatch work of a step (schedules, views, concatenations, copies), the
part that grows with the ranks. The meta device's own ``cat`` is a Python reference (about 20 us
per input, some 20 times a real device's dispatch); during the measurement a shape-only one
stands in for it (:func:`_fast_meta_cat`), so that a concatenation of many pieces costs about
what it costs on a device. The first step also computes the rank's schedules
(:func:`~muonkit.distributed.schedule.rank_schedule`), once per plan; the steady steps after it
are what every later step costs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Compute, StrategyStats
from muonkit.distributed.collectives import Collectives, Pending
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.pieces import Job
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions
from muonkit.functional.update_rule import Reduce

__all__ = ["host_step"]


def host_step(stage: Any, rank: int, *, repeats: int = 5) -> dict[str, float]:
    """CPU seconds (this thread's: other processes' load does not count) of ``rank``'s first and
    steady steps over every group of ``stage`` (a :class:`~muonkit.simulator.simulate.StagePlan`):
    ``first_step_s`` and ``step_s`` (median of ``repeats``)."""
    strategy = _Simulated(rank, stage.world_size)
    calls = [(group.plan, _locals(group, rank), group.config) for group in stage.groups]
    times = []
    with _fast_meta_cat():
        for _ in range(repeats + 1):
            strategy.timed.stand_in = 0.0
            start = time.thread_time()
            for plan, updates, config in calls:
                strategy.run(plan, updates, updates, config)
            times.append(time.thread_time() - start - strategy.timed.stand_in)
    return {"first_step_s": times[0], "step_s": statistics.median(times[1:]) if repeats else times[0]}


@contextlib.contextmanager
def _fast_meta_cat() -> Iterator[None]:
    """``torch.cat`` of meta tensors by shape arithmetic alone, for the duration."""

    def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
        first = tensors[0]
        dim = dim % first.ndim
        shape = list(first.shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        return first.new_empty(shape)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        library = torch.library.Library("aten", "IMPL")
        library.impl("cat", cat, "Meta")
    try:
        yield
    finally:
        library._destroy()


def _locals(group: Any, rank: int) -> list[Tensor]:
    """The rank's local update of each param of a group: its box's shape (the whole under DDP), on meta."""
    out = []
    for matrix, holders in zip(group.matrices, group.holders, strict=True):
        shape = matrix.shape if holders is None else dict(holders)[rank].shape
        out.append(torch.empty(shape, device="meta"))
    return out


class _Stub(Collectives):
    """Collectives that return at once (counting what they would send)."""

    def __init__(self, rank: int, world_size: int, stats: StrategyStats) -> None:  # no process group
        self.rank, self.world_size, self.stats = rank, world_size, stats

    def all_to_all_single(
        self, output: Tensor, input: Tensor, *, output_splits: list[int], input_splits: list[int]
    ) -> Pending:
        self._count((sum(input_splits) - input_splits[self.rank]) * input.element_size())
        return Pending(_Done(), output, input)

    def _count(self, nbytes: float) -> int:
        """Counted as Collectives counts it, with no failure channel to tell."""
        self.stats.collectives += 1
        self.stats.bytes_sent += round(nbytes)
        return 0

    def _exchange(self, ring: list[int], me: int, send: Tensor, recv: Tensor) -> None:
        return None  # a ring's messages (counted by ring_all_reduce and ring_all_gather as they start)


class _Done:
    def wait(self) -> None:
        return None


class _StandIn(Compute):
    """The math of one simulated rank, on meta tensors, timed into ``stand_in`` (left out of the host
    work): a whole matrix's directions are an empty result; a split job's Newton-Schulz (its
    iteration on a shard, the sums and gathers among its members) and update rule run, since their
    arithmetic on meta tensors is the Python of dispatching it, not host work."""

    def __init__(self, stats: StrategyStats) -> None:
        super().__init__(stats)
        self.stand_in = 0.0
        """Seconds spent standing in for Newton-Schulz (left out of the host work)."""

    def __call__(
        self,
        wholes: Sequence[Tensor],
        layouts: Sequence[MatrixLayout],
        config: MuonConfig,
        *,
        options: NSOptions | None = None,
        states: Sequence[Sequence[Tensor]] | None = None,
    ) -> tuple[list[Tensor], list[list[Tensor]]]:
        start = time.thread_time()
        directions = [w.new_empty(w.shape) for w in wholes]
        self.stand_in += time.thread_time() - start
        return directions, []

    def shard(self, shard: Tensor, **options: Any) -> Tensor:
        start = time.thread_time()
        try:
            return super().shard(shard, **options)
        finally:
            self.stand_in += time.thread_time() - start

    def after_shard(
        self, config: MuonConfig, o: Tensor, olds: Sequence[Tensor], *, rows_cut: bool, cols: int, reduce: Reduce
    ) -> tuple[Tensor, list[Tensor]]:
        start = time.thread_time()
        try:
            return super().after_shard(config, o, olds, rows_cut=rows_cut, cols=cols, reduce=reduce)
        finally:
            self.stand_in += time.thread_time() - start


class _Simulated(PlannedStrategy):
    """The executor on one simulated rank: Newton-Schulz replaced by an empty result."""

    name = "simulated"

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(None, comm=lambda stats: _Stub(rank, world_size, stats))
        self.timed = _StandIn(self.stats)
        self.compute = self.timed

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        raise NotImplementedError("the simulator hands the executor its plans")
