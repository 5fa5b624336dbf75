"""The one executor: move pieces to owners, orthogonalize once, send each rank its regions back.

:class:`PlannedStrategy` is the base of every communicating strategy (DDP, FSDP2, ZeRO, DTensor
meshes). A subclass only says where things live, as :class:`~muonkit.distributed.pieces.Job` s
(:meth:`PlannedStrategy.jobs`); the collectives, the non-finite flag, the settings check, the
wire dtype, the lr shape scale and the statistics live here, once.

For each exchange group of a :class:`~muonkit.distributed.planner.Plan` (default: the jobs of
one set of matrix shapes and one update dtype):

1. one ``all_to_all_single`` brings every piece an owner lacks to it (skipped when owners hold
   everything, as under DDP). All groups' gathers start at once;
2. the owner assembles each whole (a view, no copy, when it holds the whole) and orthogonalizes
   its jobs, same-shape matrices batched (``muon_directions``, counted in ``stats``): first those
   it already holds, while the gathers travel;
3. one ``all_to_all_single`` sends each receiver its region of the result, in the wire dtype
   (the Newton-Schulz compute dtype when it is narrower than the update: lossless, since the
   result was computed in it), while the next group is orthogonalized.

Split jobs (:attr:`~muonkit.distributed.planner.Plan.splits`, a job's Newton-Schulz run by a
group of ranks) go beside these stages (:mod:`muonkit.distributed.split_run`): their pieces leave
first, their members orthogonalize while the gathers travel, and their results return last.

The directions are unscaled: the optimizer multiplies every rank's local direction by the lr
shape scale when the step commits (:func:`muonkit.stages.local_scale`), as on one device. A
narrow wire's values cast up exactly on arrival, so each direction equals
:class:`SingleDeviceStrategy`'s bit for bit wherever batched products do not depend on the batch.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Cuts, Strategy, StrategyStats, local_part
from muonkit.distributed.collectives import Collectives, Pending, group_of
from muonkit.distributed.guard import CollectiveGuard
from muonkit.distributed.pieces import Box, Job, Piece, Region, Span
from muonkit.distributed.planner import Plan, job_cost, make_plan, wire_dtype
from muonkit.distributed.schedule import Exchange, Grid, GroupSchedule, rank_schedule
from muonkit.distributed.split_plan import SplitCost, SplitPolicy
from muonkit.distributed.split_run import SplitRun
from muonkit.distributed.split_schedule import schedule as split_schedule
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions
from muonkit.functional.orthogonalize import default_compute_dtype

__all__ = ["PlannedStrategy", "group_keys"]

_PLAN_CACHE = 64  # plans kept per strategy (one per distinct call: chunk, partition, config)


class PlannedStrategy(Strategy):
    """A strategy whose layout reader describes jobs; planning and communication are shared."""

    name = "planned"

    def __init__(self, process_group: Any, *, comm: Callable[[StrategyStats], Collectives] | None = None) -> None:
        """``comm``: makes the collectives from the stats instead (the plan simulator's stand-in)."""
        super().__init__()
        self.comm = comm(self.stats) if comm is not None else Collectives(group_of(process_group), self.stats)
        self._plans: dict[Hashable, Plan] = {}
        self._plans_by_placement: dict[Hashable, Plan] = {}
        self.split_policy = SplitPolicy()
        """When a job's Newton-Schulz runs over a group of ranks (:mod:`muonkit.distributed.split_plan`):
        by default only where it pays. Set it before the first step, e.g. on a strategy given to the
        optimizer with ``strategy=`` (``SplitPolicy(threshold=math.inf)``: never)."""

    @abstractmethod
    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        """Where every job of these params lives: pieces in group ranks, ``Job.tensor`` an index into
        ``params``. Raise (the same on every rank) on layouts the reader does not support."""

    @functools.cached_property
    def guard(self) -> CollectiveGuard:
        """Over :attr:`comm`: the agreement and verdicts in its collectives, its failure channel."""
        return CollectiveGuard(self.comm, strategy=self.name)

    def placement_key(self, params: list[Tensor], updates: list[Tensor]) -> Hashable | None:
        """A cheap key that fixes :meth:`jobs` for a given ``config``: what each param's jobs depend on
        (shapes, placements, update dtypes), so that a steady-state step finds its plan without
        building and hashing its jobs. ``None`` (default): jobs are built every call."""
        del params, updates
        return None

    def directions(
        self,
        params: list[Tensor],
        updates: list[Tensor],
        config: MuonConfig,
        *,
        states: list[list[Tensor]] | None = None,
    ) -> list[Tensor]:
        self.run(self._plan_for(params, updates, config), updates, updates, config, states=states)
        return updates  # scratch (see Strategy): every read of it happens before its region is written

    def _plan_for(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> Plan:
        placement = self.placement_key(params, updates)
        if placement is None:
            return self.plan_of(self.jobs(params, updates, config), updates, config)
        key = (placement, config.layout, config.steps, config.ns_method, config.ns_dtype, self.split_policy)
        plan = self._plans_by_placement.get(key)
        if plan is None:
            if len(self._plans_by_placement) >= _PLAN_CACHE:
                self._plans_by_placement.clear()
            plan = self._plans_by_placement[key] = self.plan_of(self.jobs(params, updates, config), updates, config)
        return plan

    def plan_of(
        self, jobs: Sequence[Job], updates: Sequence[Tensor], config: MuonConfig, *, one_group: bool = False
    ) -> Plan:
        """The (cached) plan of ``jobs``: groups by matrix shapes and update dtype, or one group."""
        dtypes = [u.dtype for u in updates]
        keys = None if one_group else group_keys(jobs, dtypes)
        cache_key = (
            tuple(jobs),
            None if keys is None else tuple(keys),
            config.steps,
            config.ns_method,
            config.ns_dtype,
            self.split_policy,
        )
        plan = self._plans.get(cache_key)
        if plan is None:
            if len(self._plans) >= _PLAN_CACHE:
                self._plans.clear()
            costs = [job_cost(job, config) for job in jobs]
            plan = make_plan(
                jobs, costs=costs, world_size=self.comm.world_size, keys=keys, split=self._split_cost(updates, config)
            )
            self._plans[cache_key] = plan
        return plan

    def run(
        self,
        plan: Plan,
        updates: Sequence[Tensor],
        out: Sequence[Tensor],
        config: MuonConfig,
        *,
        states: Sequence[Sequence[Tensor]] | None = None,
    ) -> None:
        """Write into ``out`` (local tensors like ``updates``) this rank's regions of every job's direction.

        ``out`` may be ``updates`` itself: a job's regions are read (sent, or viewed by its owner)
        before they are written, and jobs do not share regions. ``states``: each tensor's
        ``"rows"`` states of the group's update rule, whole on every rank; overwritten with the new
        ones (see :class:`RowStates`). What this rank sends, receives and writes comes from its
        :func:`~muonkit.distributed.schedule.rank_schedule`, computed at the plan's first run.
        """
        moments = None if states is None else RowStates(config, states, lambda: _describe(plan), plan.memo)
        split = self._start_splits(plan, updates, config)
        exchanges = plan.memo.get(("schedule", self.comm.rank, self.comm.world_size))  # made at the first run
        if exchanges is None:
            exchanges = rank_schedule(plan, self.comm.rank, self.comm.world_size)
        likes = [updates[plan.jobs[group[0]].tensor] for group in plan.groups]
        gathers = [self._gather(plan, part, updates, like) for part, like in zip(exchanges, likes, strict=True)]
        if split is not None:
            split.iterate(moments)
        returns = []
        for k, part in enumerate(exchanges):
            like = likes[k]
            wire = self._wire_dtype(config, like)
            options = config.ns_options
            ready = part.ready
            results = dict(
                zip(ready, self._orthogonalize(plan, ready, updates, (part, []), options, config, moments), strict=True)
            )
            received = self._wait(gathers[k], part)
            gathers[k] = None  # free the received pieces now, not at the end of the step
            rest = [j for j in part.mine if j not in results]
            computed = self._orthogonalize(plan, rest, updates, (part, received), options, config, moments)
            results.update(zip(rest, computed, strict=True))
            returns.append((part, *self._send_back(plan, part, results, wire, like)))
            mine = _parts(results, part.local, part.local_results, part.local_grids)
            self._write_all(plan, part.local, part.local_cuts, mine, out)
        for part, pending, arrived in returns:
            if pending is not None:
                pending.wait()
            if part.back is not None:
                self._write_all(plan, part.back.receive, part.back.mine, arrived, out)
        if split is not None:
            split.finish(out)
        if moments is not None:
            moments.share(self.comm.all_reduce)

    @functools.cached_property
    def _wires(self) -> dict[Hashable, torch.dtype]:
        return {}

    def _wire_dtype(self, config: MuonConfig, like: Tensor) -> torch.dtype:
        """:func:`~muonkit.distributed.planner.wire_dtype`, worked out once per what it depends on."""
        key = (config.rule.changes_directions, config.ns_dtype, like.dtype, like.device)
        wire = self._wires.get(key)
        if wire is None:
            wire = self._wires[key] = wire_dtype(config, like)
        return wire

    # -- split jobs (muonkit.distributed.split_run) ---------------------------------------------

    def _split_cost(self, updates: Sequence[Tensor], config: MuonConfig) -> SplitCost:
        """The split cost model with the compute dtype this rank's iteration runs in."""
        dtype = config.ns_dtype
        if dtype is None and updates:
            dtype = default_compute_dtype(updates[0].device)
        return SplitCost(steps=config.steps, method=config.ns_method, dtype=dtype, policy=self.split_policy)

    def _start_splits(self, plan: Plan, updates: Sequence[Tensor], config: MuonConfig) -> SplitRun | None:
        """Start the plan's split jobs (their pieces travel to the members); None without any."""
        if not plan.splits:
            return None
        key = ("split schedule", self.comm.rank)
        if key not in plan.memo:  # the same every step: once per plan
            plan.memo[key] = split_schedule(plan, self.comm.rank)
        run = SplitRun(self.comm, self.compute, plan, plan.memo[key], updates, config, self._all_to_all_lists)
        run.start()
        return run

    # -- the two exchanges ---------------------------------------------------------------------

    def _gather(
        self, plan: Plan, part: GroupSchedule, updates: Sequence[Tensor], like: Tensor
    ) -> tuple[Pending, Tensor] | None:
        """Start sending my source pieces of others' jobs to their owners (one all_to_all)."""
        exchange = part.gather
        if exchange is None:
            return None
        outgoing = exchange.mine.views(updates)
        if outgoing is None:  # a local tensor stored out of its flat order: piece by piece
            outgoing = [local_part(updates[plan.jobs[j].tensor], piece).reshape(-1) for j, piece in exchange.send]
        return self._all_to_all(outgoing, exchange, like=like, dtype=like.dtype)

    def _wait(self, gather: tuple[Pending, Tensor] | None, part: GroupSchedule) -> list[Tensor]:
        """The received source pieces of my jobs, in the order of ``part.gather.receive``."""
        if gather is None or part.gather is None:
            return []
        pending, buffer = gather
        pending.wait()
        return list(torch.split(buffer, part.gather.sizes)) if part.gather.sizes else []

    def _send_back(
        self, plan: Plan, part: GroupSchedule, results: dict[int, Tensor], wire: torch.dtype, like: Tensor
    ) -> tuple[Pending | None, list[Tensor]]:
        """Start sending each receiver its regions of my results (one all_to_all); the pieces I will
        receive, in the order of ``part.back.receive``."""
        exchange = part.back
        if exchange is None:
            return None, []
        cast = {j: results[j].to(wire) for j in dict.fromkeys(j for j, _ in exchange.send)}  # once per result
        outgoing = None
        if exchange.results is not None:  # ranges (several for a piece: concatenated by the send buffer)
            outgoing = exchange.results.views({j: _as(t, exchange.grids.get(j)) for j, t in cast.items()})
        if outgoing is None:
            outgoing = [piece.region.read(cast[j]) for j, piece in exchange.send]
        pending, buffer = self._all_to_all(outgoing, exchange, like=like, dtype=wire)
        return pending, list(torch.split(buffer, exchange.sizes)) if exchange.sizes else []

    def _all_to_all_lists(
        self, outgoing: list[list[Tensor]], incoming: list[int], *, like: Tensor, dtype: torch.dtype
    ) -> tuple[Pending, Tensor]:
        """One ``all_to_all_single`` of per-rank lists of flat tensors (``incoming``: elements from each rank)."""
        flat = [t for ts in outgoing for t in ts]
        send = torch.cat(flat) if flat else like.new_empty(0, dtype=dtype)
        received = like.new_empty(sum(incoming), dtype=dtype)
        splits = [sum(t.numel() for t in ts) for ts in outgoing]
        pending = self.comm.all_to_all_single(received, send, output_splits=incoming, input_splits=splits)
        return pending, received

    def _all_to_all(
        self, outgoing: list[Tensor], exchange: Exchange, *, like: Tensor, dtype: torch.dtype
    ) -> tuple[Pending, Tensor]:
        send = torch.cat(outgoing) if outgoing else like.new_empty(0, dtype=dtype)
        received = like.new_empty(sum(exchange.output_splits), dtype=dtype)
        pending = self.comm.all_to_all_single(
            received, send, output_splits=exchange.output_splits, input_splits=exchange.input_splits
        )
        return pending, received

    # -- on the owner and on arrival -----------------------------------------------------------

    def _orthogonalize(
        self,
        plan: Plan,
        jobs: Sequence[int],
        updates: Sequence[Tensor],
        received: tuple[GroupSchedule, list[Tensor]],
        options: NSOptions,
        config: MuonConfig,
        moments: RowStates | None,
    ) -> list[Tensor]:
        """Directions of my ``jobs`` (whole, in the update dtype), batched by matrix shape; the new
        ``"rows"`` states of them go into ``moments``. ``received``: the group's schedule and the
        pieces its gather brought (empty before it arrived)."""
        if not jobs:
            return []
        wholes = [self._whole(plan, j, updates, received) for j in jobs]
        layouts = [plan.jobs[j].layout for j in jobs]
        olds = None if moments is None else [moments.old(j) for j in jobs]
        directions, news = self.compute(wholes, layouts, config, options=options, states=olds)
        if moments is not None:
            for j, new in zip(jobs, news, strict=True):
                moments.computed(j, new)
        return directions

    def _whole(
        self, plan: Plan, j: int, updates: Sequence[Tensor], received: tuple[GroupSchedule, list[Tensor]]
    ) -> Tensor:
        part, arrived = received
        job, assembly = plan.jobs[j], part.assembly[j]
        local = updates[job.tensor]
        sources = assembly.sources
        if len(sources) == 1 and sources[0][1] < 0 and _in_order(sources[0][0].region, job):
            return local_part(local, sources[0][0]).reshape(job.shape)  # held whole here: a view, no copy
        data = [local_part(local, piece).reshape(-1) if slot < 0 else arrived[slot] for piece, slot in sources]
        if assembly.tiles is not None:  # flat ranges of the whole: one concatenation
            parts = [data[i] if n == data[i].numel() else data[i][a : a + n] for i, a, n in assembly.tiles]
            return torch.cat(parts).view(job.shape)
        if assembly.grid is not None:  # blocks of a grid: concatenated, then laid out (one more copy)
            grid, order = assembly.grid
            return grid.whole(torch.cat([data[i] for i in order]), job.shape)
        whole = local.new_empty(job.shape)
        for (piece, _), flat in zip(sources, data, strict=True):
            piece.region.write(whole, flat)
        return whole

    def _write_all(
        self,
        plan: Plan,
        pieces: Sequence[tuple[int, Piece]],
        cuts: Cuts,
        data: Sequence[Tensor],
        out: Sequence[Tensor],
    ) -> None:
        """Put each ``data`` (flat, storage order) into my region ``pieces[i]`` of ``out``: one batched copy."""
        views = cuts.views(out)
        if views is None:  # a local tensor stored out of its flat order: piece by piece
            for (j, piece), flat in zip(pieces, data, strict=True):
                view = local_part(out[plan.jobs[j].tensor], piece)
                view.copy_(flat.view(view.shape))
            return
        if views:
            torch._foreach_copy_(views, list(data))


def _parts(
    results: dict[int, Tensor], pieces: Sequence[tuple[int, Piece]], cuts: Cuts | None, grids: dict[int, Grid]
) -> list[Tensor]:
    """``piece.region.read(results[j])`` of each piece: views of one split per result where they are
    flat ranges of it or blocks of a grid (``cuts``)."""
    if cuts is not None:
        jobs = dict.fromkeys(j for j, _ in pieces)
        views = cuts.pieces({j: _as(results[j], grids.get(j)) for j in jobs} if grids else results)
        if views is not None:
            return views
    return [piece.region.read(results[j]) for j, piece in pieces]


def _as(result: Tensor, grid: Grid | None) -> Tensor:
    """A result as its pieces are cut from it: itself, or its grid's blocks one after another."""
    return result if grid is None else grid.blocks(result)


def _describe(plan: Plan) -> tuple[list[tuple[int, tuple[int, ...], MatrixLayout]], list[int]]:
    """Each job of ``plan`` as ``(tensor, shape, layout)``, and the jobs an owner or a split computes."""
    owned = [j for j, owner in enumerate(plan.owners) if owner >= 0] + [s.job for s in plan.splits]
    return [(job.tensor, job.shape, job.layout) for job in plan.jobs], owned


def _in_order(region: Region, job: Job) -> bool:
    """Whether ``region`` is the whole job in the whole's own order (its local storage is the whole)."""
    return region == Box.full(job.shape) or region == Span(0, job.numel)


def group_keys(jobs: Sequence[Job], dtypes: Sequence[torch.dtype]) -> list[Hashable]:
    """Each job's exchange group key: jobs of the same set of matrix shapes (one batched call
    each) and update dtype (``dtypes[job.tensor]``) are exchanged together."""
    shapes: dict[tuple[tuple[int, ...], MatrixLayout], tuple[tuple[int, int], ...]] = {}
    keys: list[Hashable] = []
    for job in jobs:
        kind = (job.shape, job.layout)
        if kind not in shapes:
            shapes[kind] = tuple(sorted({(b.rows, b.cols) for b in job.layout.blocks(job.shape)}))
        keys.append((shapes[kind], dtypes[job.tensor]))
    return keys


class RowStates:
    """A rule's ``"rows"`` states during one run of the executor: old ones in, new ones out, on every rank.

    Each rank keeps every tensor's states whole (one value per matrix row: tiny). The jobs of a
    tensor come in the order of its rows (each expert, and in it each ``split_sizes`` block), so
    job ``j`` owns the next ``spec.length(job)`` values of its tensor's vectors. The owner of a
    job computes its new values from the whole direction; every rank writes those it computed
    into zero vectors and one ``all_reduce(SUM)`` of all of them gives every rank every new value
    exactly (each value has one non-zero contributor). Values of no job with an owner (empty
    matrices) keep the old ones, as on one device.

    ``describe()``: ``(jobs, owned)``, each job of the plan as ``(tensor, shape, layout)`` in plan
    order and the jobs someone computes, called once per plan: ``memo`` is the plan's memo (the
    spans are the same every step).
    """

    def __init__(
        self,
        config: MuonConfig,
        states: Sequence[Sequence[Tensor]],
        describe: Callable[[], tuple[list[tuple[int, tuple[int, ...], MatrixLayout]], list[int]]],
        memo: dict[Any, Any],
    ) -> None:
        self.states = states
        specs = config.rule.rows_states
        key = ("rows spans", specs)
        if key not in memo:
            jobs, owned = describe()
            spans: list[list[tuple[int, int, int]]] = []  # per job, per spec: (tensor, start, stop)
            ends = [[0] * len(specs) for _ in states]
            for tensor, shape, layout in jobs:
                mine = []
                for s, spec in enumerate(specs):
                    count = spec.length(shape, layout)
                    mine.append((tensor, ends[tensor][s], ends[tensor][s] + count))
                    ends[tensor][s] += count
                spans.append(mine)
            memo[key] = (spans, owned)
        self.spans, self.owned = memo[key]
        self.sums = [[torch.zeros_like(v) for v in vs] for vs in states]

    def old(self, j: int) -> list[Tensor]:
        """Job ``j``'s part of each state."""
        return [self.states[t][s][start:stop] for s, (t, start, stop) in enumerate(self.spans[j])]

    def computed(self, j: int, new: Sequence[Tensor]) -> None:
        for s, ((t, start, stop), value) in enumerate(zip(self.spans[j], new, strict=True)):
            self.sums[t][s][start:stop] = value

    def computed_part(self, j: int, offset: int, new: Sequence[Tensor]) -> None:
        """New values of a split job's rows from ``offset`` on (each member's rows)."""
        for s, ((t, start, _), value) in enumerate(zip(self.spans[j], new, strict=True)):
            self.sums[t][s][start + offset : start + offset + value.numel()] = value

    def share(self, all_reduce: Any) -> None:
        """The one all-reduce (``all_reduce(flat, op=...)``); then ``states`` hold the new values."""
        sums = [v for vs in self.sums for v in vs]
        if not sums:
            return
        flat = torch.cat([s.reshape(-1) for s in sums])
        all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        parts = iter(torch.split(flat, [s.numel() for s in sums]))
        shared = [[next(parts) for _ in vs] for vs in self.sums]
        for j in self.owned:
            for s, (t, start, stop) in enumerate(self.spans[j]):
                self.states[t][s][start:stop] = shared[t][s][start:stop]
