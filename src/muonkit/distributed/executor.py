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

The lr shape scale is applied as on one device, where ``orthogonalize`` casts its result up to
the update dtype and multiplies by the scale there: when the wire is narrower, every receiver
casts its region up and multiplies (a per-element scale read from a whole-shaped map when
``split_sizes`` blocks differ, cached); otherwise the owner scales in ``muon_directions`` itself
and sends the scaled values. Either way each direction equals :class:`SingleDeviceStrategy`'s
bit for bit wherever batched products do not depend on the batch.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.agreement import Setting
from muonkit.distributed.base import Strategy
from muonkit.distributed.collectives import Collectives, Pending, group_of
from muonkit.distributed.pieces import Box, Job, Piece, Region, Span, local_part
from muonkit.distributed.planner import Plan, job_cost, make_plan, scale_of, wire_dtype
from muonkit.distributed.split_plan import SplitCost, SplitPolicy
from muonkit.distributed.split_run import SplitRun, schedule
from muonkit.functional.muon import NSOptions
from muonkit.functional.orthogonalize import default_compute_dtype

__all__ = ["PlannedStrategy"]

_PLAN_CACHE = 64  # plans kept per strategy (one per distinct call: chunk, partition, config)


class PlannedStrategy(Strategy):
    """A strategy whose layout reader describes jobs; planning and communication are shared."""

    name = "planned"

    def __init__(self, process_group: Any) -> None:
        super().__init__()
        self.comm = Collectives(group_of(process_group), self.stats)
        self._plans: dict[Hashable, Plan] = {}
        self._plans_by_layout: dict[Hashable, Plan] = {}
        self._scales: dict[Hashable, Tensor] = {}
        self.split_policy = SplitPolicy()
        """When a job's Newton-Schulz runs over a group of ranks (:mod:`muonkit.distributed.split_plan`):
        by default only where it pays. Set it before the first step, e.g. on a strategy given to the
        optimizer with ``strategy=`` (``SplitPolicy(threshold=math.inf)``: never)."""
        self._split_schedules: dict[int, tuple[Plan, Any]] = {}

    @abstractmethod
    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        """Where every job of these params lives: pieces in group ranks, ``Job.tensor`` an index into
        ``params``. Raise (the same on every rank) on layouts the reader does not support."""

    def all_true(self, flags: Tensor) -> list[bool]:
        return self.comm.all_ranks_true(flags)

    def reduce_flags(self, flags: Tensor) -> Tensor:
        return self.comm.reduce_flags(flags)

    def values_error(self) -> Exception:
        return self.comm.values_error()

    def check_participation(self, has_grad: Sequence[bool], settings: Callable[[], Sequence[Setting]] = list) -> None:
        self.comm.check_agreement([*settings(), Setting("strategy", self.name)], has_grad)

    def end_step(self) -> None:
        self.comm.end_step()

    def step_failed(self, error: BaseException, *, applied: bool) -> None:
        self.comm.step_failed(error, applied=applied)

    def host_tensors(self) -> list[Tensor]:
        return list(self.comm.host_buffers)

    def layout_key(self, params: list[Tensor], updates: list[Tensor]) -> Hashable | None:
        """A cheap key that fixes :meth:`jobs` for a given ``config``: what each param's jobs depend on
        (shapes, placements, update dtypes), so that a steady-state step finds its plan without
        building and hashing its jobs. ``None`` (default): jobs are built every call."""
        del params, updates
        return None

    def directions(
        self, params: list[Tensor], updates: list[Tensor], config: MuonConfig, *, rows: list[Tensor] | None = None
    ) -> list[Tensor]:
        self.run(self._plan_for(params, updates, config), updates, updates, config, rows=rows)
        return updates  # scratch (see Strategy): every read of it happens before its region is written

    def _plan_for(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> Plan:
        layout = self.layout_key(params, updates)
        if layout is None:
            return self.plan_of(self.jobs(params, updates, config), updates, config)
        key = (layout, config.layout, config.steps, config.ns_method, config.ns_dtype, self.split_policy)
        plan = self._plans_by_layout.get(key)
        if plan is None:
            if len(self._plans_by_layout) >= _PLAN_CACHE:
                self._plans_by_layout.clear()
            plan = self._plans_by_layout[key] = self.plan_of(self.jobs(params, updates, config), updates, config)
        return plan

    def plan_of(
        self, jobs: Sequence[Job], updates: Sequence[Tensor], config: MuonConfig, *, one_group: bool = False
    ) -> Plan:
        """The (cached) plan of ``jobs``: groups by matrix shapes and update dtype, or one group."""
        keys = None if one_group else [_group_key(job, updates[job.tensor].dtype) for job in jobs]
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
        rows: Sequence[Tensor] | None = None,
    ) -> None:
        """Write into ``out`` (local tensors like ``updates``) this rank's regions of every job's direction.

        ``out`` may be ``updates`` itself: a job's regions are read (sent, or viewed by its owner)
        before they are written, and jobs do not share regions. ``rows`` (NorMuon): each
        tensor's row moments, whole on every rank; overwritten with the new ones (see
        :class:`_RowMoments`).
        """
        moments = _RowMoments(plan, rows) if rows is not None else None
        split = self._start_splits(plan, updates, config)
        gathers = [self._gather(plan, group, updates) for group in plan.groups]
        if split is not None:
            split.iterate(moments)
        returns = []
        for k, group in enumerate(plan.groups):
            like = updates[plan.jobs[group[0]].tensor]
            wire = wire_dtype(config, like)
            on_owner = wire == like.dtype  # nothing to cast up on arrival: the owner scales, as one device does
            options = config.ns_options if on_owner else dataclasses.replace(config.ns_options, adjust_lr=None)
            mine = [j for j in group if plan.owners[j] == self.comm.rank]
            ready = [j for j in mine if all(p.rank == self.comm.rank for p in plan.sources[j])]
            results = dict(
                zip(ready, self._orthogonalize(plan, ready, updates, {}, options, config, moments), strict=True)
            )
            received = self._wait(gathers[k], plan, group)
            gathers[k] = None  # free the received pieces now, not at the end of the step
            rest = [j for j in mine if j not in results]
            computed = self._orthogonalize(plan, rest, updates, received, options, config, moments)
            results.update(zip(rest, computed, strict=True))
            returns.append((on_owner, *self._send_back(plan, group, results, wire, like)))
            for j, direction in results.items():
                for piece in plan.jobs[j].receivers:
                    if piece.rank == self.comm.rank:
                        self._write(plan.jobs[j], piece, piece.region.read(direction), out, config, scaled=on_owner)
        for on_owner, pending, pieces in returns:
            if pending is not None:
                pending.wait()
            for (j, piece), data in pieces:
                self._write(plan.jobs[j], piece, data, out, config, scaled=on_owner)
        if split is not None:
            split.finish(out)
        if moments is not None:
            moments.share(self.comm)

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
        cached = self._split_schedules.get(id(plan))
        if cached is None or cached[0] is not plan:
            if len(self._split_schedules) >= _PLAN_CACHE:
                self._split_schedules.clear()
            cached = self._split_schedules[id(plan)] = (plan, schedule(plan, self.comm.rank))
        run = SplitRun(self.comm, self.stats, plan, cached[1], updates, config, self._all_to_all)
        run.start()
        return run

    # -- the two exchanges ---------------------------------------------------------------------

    def _gather(self, plan: Plan, group: Sequence[int], updates: Sequence[Tensor]) -> tuple[Pending, Tensor] | None:
        """Start sending my source pieces of others' jobs to their owners (one all_to_all)."""
        if not plan.gathers(group):
            return None
        me, world = self.comm.rank, self.comm.world_size
        outgoing: list[list[Tensor]] = [[] for _ in range(world)]
        for j in group:
            for piece in plan.sources[j]:
                if piece.rank == me and plan.owners[j] != me:
                    outgoing[plan.owners[j]].append(local_part(updates[plan.jobs[j].tensor], piece).reshape(-1))
        like = updates[plan.jobs[group[0]].tensor]
        incoming = [sum(p.region.numel for _, p in self._sources_from(plan, group, r)) for r in range(world)]
        return self._all_to_all(outgoing, incoming, like=like, dtype=like.dtype)

    def _wait(
        self, gather: tuple[Pending, Tensor] | None, plan: Plan, group: Sequence[int]
    ) -> dict[tuple[int, Piece], Tensor]:
        """The received source pieces of my jobs, by (job, piece)."""
        if gather is None:
            return {}
        pending, buffer = gather
        pending.wait()
        out: dict[tuple[int, Piece], Tensor] = {}
        offset = 0
        for r in range(self.comm.world_size):
            for j, piece in self._sources_from(plan, group, r):
                out[(j, piece)] = buffer[offset : offset + piece.region.numel]
                offset += piece.region.numel
        return out

    def _sources_from(self, plan: Plan, group: Sequence[int], rank: int) -> list[tuple[int, Piece]]:
        """The source pieces ``rank`` sends me for the jobs I own in ``group``, in sending order."""
        if rank == self.comm.rank:
            return []
        return [(j, p) for j in group if plan.owners[j] == self.comm.rank for p in plan.sources[j] if p.rank == rank]

    def _send_back(
        self, plan: Plan, group: Sequence[int], results: dict[int, Tensor], wire: torch.dtype, like: Tensor
    ) -> tuple[Pending | None, list[tuple[tuple[int, Piece], Tensor]]]:
        """Start sending each receiver its regions of my results (one all_to_all)."""
        if not plan.returns(group):
            return None, []
        me, world = self.comm.rank, self.comm.world_size
        outgoing: list[list[Tensor]] = [[] for _ in range(world)]
        for j in group:
            if plan.owners[j] == me:
                for piece in plan.jobs[j].receivers:
                    if piece.rank != me:
                        outgoing[piece.rank].append(piece.region.read(results[j]).to(wire))
        expected: list[list[tuple[int, Piece]]] = [[] for _ in range(world)]
        for j in group:
            if plan.owners[j] != me:
                expected[plan.owners[j]] += [(j, p) for p in plan.jobs[j].receivers if p.rank == me]
        incoming = [sum(p.region.numel for _, p in e) for e in expected]
        pending, buffer = self._all_to_all(outgoing, incoming, like=like, dtype=wire)
        pieces, offset = [], 0
        for e in expected:
            for j, piece in e:
                pieces.append(((j, piece), buffer[offset : offset + piece.region.numel]))
                offset += piece.region.numel
        return pending, pieces

    def _all_to_all(
        self, outgoing: list[list[Tensor]], incoming: list[int], *, like: Tensor, dtype: torch.dtype
    ) -> tuple[Pending, Tensor]:
        flat = [t for ts in outgoing for t in ts]
        send = torch.cat(flat) if flat else like.new_empty(0, dtype=dtype)
        received = like.new_empty(sum(incoming), dtype=dtype)
        pending = self.comm.all_to_all_single(
            received,
            send,
            output_splits=incoming,
            input_splits=[sum(t.numel() for t in ts) for ts in outgoing],
        )
        return pending, received

    # -- on the owner and on arrival -----------------------------------------------------------

    def _orthogonalize(
        self,
        plan: Plan,
        jobs: list[int],
        updates: Sequence[Tensor],
        received: dict[tuple[int, Piece], Tensor],
        options: NSOptions,
        config: MuonConfig,
        moments: _RowMoments | None,
    ) -> list[Tensor]:
        """Directions of my ``jobs`` (whole, in the update dtype), batched by matrix shape; NorMuon's
        new row moments of them go into ``moments``."""
        if not jobs:
            return []
        wholes = [self._whole(plan, j, updates, received) for j in jobs]
        layouts = [plan.jobs[j].layout for j in jobs]
        rows = None if moments is None else [moments.old(j) for j in jobs]
        directions, new_rows = self.compute(wholes, layouts, config, options=options, rows=rows)
        if moments is not None:
            for j, new in zip(jobs, new_rows, strict=True):
                moments.computed(j, new)
        return directions

    def _whole(
        self, plan: Plan, j: int, updates: Sequence[Tensor], received: dict[tuple[int, Piece], Tensor]
    ) -> Tensor:
        job, sources = plan.jobs[j], plan.sources[j]
        local = updates[job.tensor]
        if len(sources) == 1 and sources[0].rank == self.comm.rank and _in_order(sources[0].region, job):
            return local_part(local, sources[0]).reshape(job.shape)  # held whole here: a view, no copy
        whole = local.new_empty(job.shape)
        for piece in sources:
            data = local_part(local, piece).reshape(-1) if piece.rank == self.comm.rank else received[(j, piece)]
            piece.region.write(whole, data)
        return whole

    def _write(
        self, job: Job, piece: Piece, data: Tensor, out: Sequence[Tensor], config: MuonConfig, *, scaled: bool
    ) -> None:
        """Put ``data`` (flat, storage order) into my region ``piece`` of ``out``; scale it unless the owner did."""
        view = local_part(out[job.tensor], piece)
        view.copy_(data.view(view.shape))
        if not scaled:
            view.mul_(self._scale(job, piece, config.adjust_lr, view))

    def _scale(self, job: Job, piece: Piece, adjust_lr: str | None, view: Tensor) -> float | Tensor:
        key = (job.shape, job.layout, piece.region, adjust_lr, view.dtype, view.device)
        cached = self._scales.get(key)
        if cached is not None:
            return cached
        scale = scale_of(job, piece.region, adjust_lr, like=view)
        if isinstance(scale, Tensor):  # split blocks of different scales: cache the region's map
            scale = self._scales[key] = scale.view(view.shape)
        return scale


class _RowMoments:
    """NorMuon's row moments during one :meth:`PlannedStrategy.run`: old ones in, new ones out, on every rank.

    Each rank keeps every tensor's moments whole (one value per matrix row: tiny). The jobs of a
    tensor come in the order of its rows (each expert, and in it each ``split_sizes`` block:
    :func:`~muonkit.functional.normuon.normuon_rows`), so job ``j`` owns the next
    ``rows(job)`` values of its tensor's vector. The owner of a job computes its new moments
    from the whole direction; every rank writes those it computed into a zero vector and one
    ``all_reduce(SUM)`` of all of them gives every rank every new value exactly (each value
    has one non-zero contributor). Values of no job with an owner (empty matrices) keep the
    old ones, as on one device.
    """

    def __init__(self, plan: Plan, rows: Sequence[Tensor]) -> None:
        self.rows = rows
        self.spans: list[tuple[int, int, int]] = []  # per job: (tensor, start, stop)
        ends = [0] * len(rows)
        for job in plan.jobs:
            count = sum(b.count * b.rows for b in job.layout.blocks(job.shape))
            self.spans.append((job.tensor, ends[job.tensor], ends[job.tensor] + count))
            ends[job.tensor] += count
        self.owned = [j for j, owner in enumerate(plan.owners) if owner >= 0] + [s.job for s in plan.splits]
        self.sums = [torch.zeros_like(v) for v in rows]

    def old(self, j: int) -> Tensor:
        t, start, stop = self.spans[j]
        return self.rows[t][start:stop]

    def computed(self, j: int, new: Tensor) -> None:
        t, start, stop = self.spans[j]
        self.sums[t][start:stop] = new

    def computed_part(self, j: int, offset: int, new: Tensor) -> None:
        """New moments of a split job's rows from ``offset`` on (each member's rows)."""
        t, start, _ = self.spans[j]
        self.sums[t][start + offset : start + offset + new.numel()] = new

    def share(self, comm: Collectives) -> None:
        """The one all-reduce; then ``rows`` hold the new moments."""
        if not self.rows:
            return
        flat = torch.cat([s.reshape(-1) for s in self.sums])
        comm.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        sums = torch.split(flat, [s.numel() for s in self.sums])
        for j in self.owned:
            t, start, stop = self.spans[j]
            self.rows[t][start:stop] = sums[t][start:stop]


def _in_order(region: Region, job: Job) -> bool:
    """Whether ``region`` is the whole job in the whole's own order (its local storage is the whole)."""
    return region == Box.full(job.shape) or region == Span(0, job.numel)


def _group_key(job: Job, dtype: torch.dtype) -> Hashable:
    """Jobs exchanged together: the same set of matrix shapes (one batched call each) and dtype."""
    return tuple(sorted({(b.rows, b.cols) for b in job.layout.blocks(job.shape)})), dtype
