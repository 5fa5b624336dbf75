"""Running a plan's split jobs (:class:`~muonkit.distributed.split_plan.Split`) on this rank.

:class:`~muonkit.distributed.executor.PlannedStrategy` runs them beside its owned jobs, in three
stages every rank enters in the same order:

1. :meth:`SplitRun.start`: one ``all_to_all_single`` (per update dtype) brings each member the
   parts of its shard it lacks (skipped when members hold their shards, as under DDP, or FSDP2
   when the shards sit on the holders' row blocks), started before the owned jobs' gathers;
2. :meth:`SplitRun.iterate`: each member orthogonalizes its shard
   (:func:`~muonkit.functional.sharded.orthogonalize_shard`), summing the small Gram products
   (and gathering ``P``'s row blocks) among the job's members alone, by point-to-point messages
   in a ring (:meth:`~muonkit.distributed.collectives.Collectives.ring_all_reduce`): no process
   group per set of members, which torch can make neither cheaply (every rank of the job joins a
   barrier) nor by the members alone once their group histories differ. Every member runs the
   jobs in plan order, so no two members wait on each other in opposite orders. Ranks in no
   group go straight on to their owned jobs, while the gathers travel;
3. :meth:`SplitRun.finish`, after the owned jobs: one ``all_to_all_single`` (per wire dtype)
   sends each rank its regions of the shards' results, then they are written (scaled on arrival
   where the wire is narrower than the update, as for owned jobs).

Which pieces go where is computed once per plan (:func:`schedule`, cached by the strategy) and
costs each rank O(its own pieces and shards) per step.

Limits: the shards run eagerly (``ns_compile`` applies to owned jobs only); a member waiting in
a ring on a member that failed inside the step is released when that process exits or at the
group's timeout, not by the failure channel (a gloo receive waited in slices closes its
connection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import StrategyStats
from muonkit.distributed.collectives import Collectives, Pending
from muonkit.distributed.pieces import Box, Job, Piece, Region, Span, local_part
from muonkit.distributed.planner import Plan, wire_dtype
from muonkit.distributed.split_plan import Split, clip
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.sharded import normuon_normalize_shard, orthogonalize_shard, p_rows, shard_flops

__all__ = ["SplitRun", "schedule"]


class Moments(Protocol):
    """NorMuon's row moments during a run (the executor's ``_RowMoments``)."""

    def old(self, j: int) -> Tensor: ...

    def computed_part(self, j: int, start: int, new: Tensor) -> None: ...


class Exchange(Protocol):
    """The executor's ``all_to_all_single`` of per-rank lists of flat tensors (``PlannedStrategy._all_to_all``)."""

    def __call__(
        self, outgoing: list[list[Tensor]], incoming: list[int], *, like: Tensor, dtype: torch.dtype
    ) -> tuple[Pending, Tensor]: ...


Part = tuple[Piece, Region]
"""A piece and its part inside one shard (a region of the whole job)."""


@dataclass
class _Member:
    """What this rank does as member ``k`` of a split job."""

    k: int
    shard: Box
    own: list[Part]
    """Parts of my shard I hold (read from my own pieces)."""
    incoming: list[tuple[int, Part]]
    """Parts of my shard sent to me: ``(source rank, (source piece, part))``, in sending order."""
    view: Piece | None
    """A piece of mine whose region contains the shard as a slice (no assembly), or None."""
    outgoing: list[tuple[int, Part]]
    """Parts of my shard's result for other ranks: ``(rank, (their receiver piece, part))``."""
    writes: list[Part]
    """Parts of my shard's result I receive myself."""


@dataclass
class _Schedule:
    """This rank's share of a plan's splits: per split, its member role (or None) and transfers."""

    members: list[_Member | None]
    sends: list[list[tuple[int, Part]]]
    """Per split: the parts of my source pieces I send: ``(member rank, (my piece, part))``."""
    receives: list[list[tuple[int, Part]]]
    """Per split: the parts of results sent to me: ``(member rank, (my receiver piece, part))``."""


def schedule(plan: Plan, rank: int) -> _Schedule:
    """What ``rank`` sends, receives and computes for ``plan.splits`` (pure; cache it per plan)."""
    members, sends, receives = [], [], []
    for split in plan.splits:
        job = plan.jobs[split.job]
        members.append(_member(job, split, rank))
        holding = {(p.rank, p.region) for p in job.held}
        sends.append(
            [
                (split.ranks[k], (piece, part))
                for piece in split.sources
                if piece.rank == rank
                for k, part in _parts(job, split, piece.region)
                if (split.ranks[k], piece.region) not in holding
            ]
        )
        receives.append(
            [
                (split.ranks[k], (piece, part))
                for piece in job.receivers
                if piece.rank == rank
                for k, part in _parts(job, split, piece.region)
                if split.ranks[k] != rank
            ]
        )
    return _Schedule(members, sends, receives)


def _member(job: Job, split: Split, rank: int) -> _Member | None:
    if rank not in split.ranks:
        return None
    k = split.ranks.index(rank)
    shard = split.shard(k, job.shape)
    lo, hi = split.bounds[k], split.bounds[k + 1]
    mine = [p for p in job.held if p.rank == rank]
    held = {p.region for p in mine}
    own, incoming = [], []
    for piece in split.sources:  # one per distinct region: mine if I hold it, else its source's
        part = clip(piece.region, split.dim, lo, hi, job.shape)
        if part is None:
            continue
        if piece.region in held:
            own.append((next(p for p in mine if p.region == piece.region), part))
        else:
            incoming.append((piece.rank, (piece, part)))
    view = next((p for p in mine if _slice_of(p.region, shard, split.dim, job.shape) is not None), None)
    outgoing, writes = [], []
    for piece in job.receivers:
        part = clip(piece.region, split.dim, lo, hi, job.shape)
        if part is None:
            continue
        if piece.rank == rank:
            writes.append((piece, part))
        else:
            outgoing.append((piece.rank, (piece, part)))
    return _Member(k, shard, own, incoming, view, outgoing, writes)


def _parts(job: Job, split: Split, region: Region) -> list[tuple[int, Region]]:
    out = []
    for k in range(len(split.ranks)):
        part = clip(region, split.dim, split.bounds[k], split.bounds[k + 1], job.shape)
        if part is not None:
            out.append((k, part))
    return out


def _slice_of(region: Region, shard: Box, dim: int, shape: Sequence[int]) -> slice | None:
    """Where ``shard`` lies in ``region``'s local storage along ``dim`` when it is one slice of it
    (the region whole along the other dim, one run containing the shard), else None."""
    ((lo, hi),) = shard.runs[dim]
    if isinstance(region, Span):  # dim 0: a span of whole rows
        cols = shape[1]
        if region.start <= lo * cols and hi * cols <= region.stop:
            return slice(lo * cols - region.start, hi * cols - region.start)
        return None
    if region.runs[1 - dim] != ((0, shape[1 - dim]),) or len(region.runs[dim]) != 1:
        return None
    a, b = region.runs[dim][0]
    return slice(lo - a, hi - a) if a <= lo and hi <= b else None


def within(outer: Region, inner: Region) -> Region:
    """``inner`` (a part of ``outer``, in the whole's coordinates) in ``outer``'s local storage coordinates."""
    if isinstance(outer, Span):
        assert isinstance(inner, Span)
        return Span(inner.start - outer.start, inner.stop - outer.start)
    assert isinstance(inner, Box)
    runs = []
    for outer_runs, inner_runs in zip(outer.runs, inner.runs, strict=True):
        local, offsets = 0, []
        for a, b in outer_runs:
            offsets.append((a, b, local))
            local += b - a
        runs.append(tuple(_local_run(run, offsets) for run in inner_runs))
    return Box(tuple(runs))


def _local_run(run: tuple[int, int], offsets: list[tuple[int, int, int]]) -> tuple[int, int]:
    start, stop = run
    for a, b, local in offsets:
        if a <= start and stop <= b:
            return local + start - a, local + stop - a
    raise AssertionError(f"run {run} is not inside one run of {offsets}")


def shifted(part: Region, shard: Box, dim: int, shape: Sequence[int]) -> Region:
    """``part`` (inside ``shard``, whole coordinates) in the shard's own coordinates."""
    ((lo, _),) = shard.runs[dim]
    if isinstance(part, Span):
        return Span(part.start - lo * shape[1], part.stop - lo * shape[1])
    runs = list(part.runs)
    runs[dim] = tuple((a - lo, b - lo) for a, b in runs[dim])
    return Box(tuple(runs))


def _view(local: Tensor, piece: Piece) -> Tensor:
    """``piece``'s region of a rank's local tensor, shaped as the region's storage (flat for a span)."""
    part = local_part(local, piece)
    region = piece.region
    return part.reshape(-1) if isinstance(region, Span) else part.view(region.shape)


def _read(local: Tensor, piece: Piece, part: Region) -> Tensor:
    """The flat data of ``part`` (inside ``piece``'s region) from a rank's local tensor."""
    return within(piece.region, part).read(_view(local, piece))


class _Writes:
    """Copies into the updates, applied at once: ``torch._foreach_copy_`` (converting to the
    update's dtype), then ``torch._foreach_mul_`` per scale (the data is never written: it may be a
    view of a result still to be sent)."""

    def __init__(self) -> None:
        self.destinations: list[Tensor] = []
        self.sources: list[Tensor] = []
        self.scaled: dict[float, list[Tensor]] = {}

    def add(self, copies: list[tuple[Tensor, Tensor]], scale: float) -> None:
        for destination, source in copies:
            self.destinations.append(destination)
            self.sources.append(source)
            if scale != 1.0:
                self.scaled.setdefault(scale, []).append(destination)

    def apply(self) -> None:
        if self.destinations:
            torch._foreach_copy_(self.destinations, self.sources)
        for scale, views in self.scaled.items():
            torch._foreach_mul_(views, scale)


class SplitRun:
    """The split jobs of one :meth:`PlannedStrategy.run` on this rank (see the module docstring)."""

    def __init__(
        self,
        comm: Collectives,
        stats: StrategyStats,
        plan: Plan,
        plan_schedule: _Schedule,
        updates: Sequence[Tensor],
        config: MuonConfig,
        exchange: Exchange,
    ) -> None:
        self.comm, self.stats, self.plan, self.schedule = comm, stats, plan, plan_schedule
        self.exchange = exchange
        self.updates, self.config = updates, config
        self.gathers: list[tuple[Pending, Tensor, list[tuple[int, int, Part]]]] = []
        self.results: dict[int, Tensor] = {}  # split index -> my shard's direction (storage shape)
        self.on_owner: dict[int, bool] = {}

    # -- stage 1 -------------------------------------------------------------------------------

    def start(self) -> None:
        """Send members the parts of their shards they lack (one all_to_all per update dtype)."""
        if not any(s.gathers for s in self.plan.splits):
            return
        for dtype in self._dtypes(lambda i: self.updates[self._job(i).tensor].dtype):
            chosen = [i for i in range(len(self.plan.splits)) if self.updates[self._job(i).tensor].dtype == dtype]
            outgoing: list[list[Tensor]] = [[] for _ in range(self.comm.world_size)]
            for i in chosen:
                local = self.updates[self._job(i).tensor]
                for rank, (piece, part) in self.schedule.sends[i]:
                    outgoing[rank].append(_read(local, piece, part))
            expected = [
                (rank, i, item)
                for i in chosen
                if (member := self.schedule.members[i]) is not None
                for rank, item in member.incoming
            ]
            incoming = [0] * self.comm.world_size
            for rank, _, (_, part) in expected:
                incoming[rank] += part.numel
            like = self.updates[self._job(chosen[0]).tensor]
            pending, buffer = self.exchange(outgoing, incoming, like=like, dtype=dtype)
            self.gathers.append((pending, buffer, sorted(expected, key=lambda e: e[0])))

    # -- stage 2 -------------------------------------------------------------------------------

    def iterate(self, moments: Moments | None) -> None:
        """Orthogonalize my shards, in plan order (blocking collectives over each job's members)."""
        received = self._received()
        for i, split in enumerate(self.plan.splits):
            member = self.schedule.members[i]
            if member is not None:
                self.results[i] = self._direction(i, split, member, received, moments)

    def _received(self) -> dict[tuple[int, Piece], Tensor]:
        """The received parts of my shards, by (split, source piece)."""
        out: dict[tuple[int, Piece], Tensor] = {}
        for pending, buffer, expected in self.gathers:
            pending.wait()
            offset = 0  # the buffer holds each source rank's parts in turn, each in sending order
            for _, i, (piece, part) in expected:
                out[(i, piece)] = buffer[offset : offset + part.numel]
                offset += part.numel
        self.gathers = []
        return out

    def _shard(self, i: int, split: Split, member: _Member, received: dict[tuple[int, Piece], Tensor]) -> Tensor:
        job = self.plan.jobs[split.job]
        local = self.updates[job.tensor]
        if member.view is not None:
            where = _slice_of(member.view.region, member.shard, split.dim, job.shape)
            assert where is not None
            view = _view(local, member.view)
            if isinstance(member.view.region, Span):
                return view[where].view(member.shard.shape)
            return view.narrow(split.dim, where.start, where.stop - where.start)
        shard = local.new_empty(member.shard.shape)
        copies = [  # one batched copy of every part
            pair
            for piece, part in member.own
            for pair in shifted(part, member.shard, split.dim, job.shape).copies(shard, _read(local, piece, part))
        ]
        copies += [
            pair
            for _, (piece, part) in member.incoming
            for pair in shifted(part, member.shard, split.dim, job.shape).copies(shard, received[(i, piece)])
        ]
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
        return shard

    def _direction(
        self,
        i: int,
        split: Split,
        member: _Member,
        received: dict[tuple[int, Piece], Tensor],
        moments: Moments | None,
    ) -> Tensor:
        """My shard of the job's direction (storage orientation, update dtype; scaled where the wire
        is as wide as the update, as on one device)."""
        job, config = self.plan.jobs[split.job], self.config
        like = self.updates[job.tensor]
        self.on_owner[i] = wire_dtype(config, like) == like.dtype
        (block,) = job.layout.blocks(job.shape)
        scale = lr_scale(config.adjust_lr, block.rows, block.cols) if self.on_owner[i] else 1.0

        def reduce(t: Tensor) -> Tensor:
            flat = t.reshape(-1)
            self.comm.ring_all_reduce(flat, split.ranks)
            return flat.view(t.shape)

        def gather(block: Tensor) -> Tensor:  # in rank order: the members' sorted order
            out = block.new_empty(len(split.ranks) * block.numel())
            self.comm.ring_all_gather(out, block.reshape(-1), split.ranks)
            return out.view(len(split.ranks), *block.shape).movedim(0, 1).reshape(block.size(0), -1, block.size(-1))

        options = config.ns_options
        shard = self._shard(i, split, member, received)
        n, m = job.shape[split.dim], job.shape[1 - split.dim]
        position = sorted(split.ranks).index(self.comm.rank)
        direction = orthogonalize_shard(
            shard, dim=split.dim, size=n, reduce=reduce, coefficients=options.coefficients, steps=options.steps,
            eps=options.eps, dtype=options.dtype, method=options.method, member=(position, len(split.ranks)),
            gather=gather if split.by_rows else None, scale=1.0 if config.normuon else scale,
        )  # fmt: skip
        if config.normuon:
            assert moments is not None
            direction = self._normuon(split, member, direction, moments, reduce).mul_(scale)
        width = split.bounds[member.k + 1] - split.bounds[member.k]
        rows = len(p_rows(m, len(split.ranks), position)) if split.by_rows else None
        self.stats.flops += shard_flops(
            m, width, n, config.steps, method=config.ns_method, dtype=config.ns_dtype, rows=rows
        )
        self.stats.matrices += int(member.k == 0)  # one matrix, counted once
        return direction

    def _normuon(
        self, split: Split, member: _Member, o: Tensor, moments: Moments, reduce: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """NorMuon's normalization of my shard: matrix rows are storage rows (``matrix``) or columns
        (``transposed``); the shard holds whole rows when it is cut along them."""
        job = self.plan.jobs[split.job]
        row_dim = 1 if job.layout.resolved(2) == "transposed" else 0
        rows_cut = split.dim != row_dim
        matrix = o.mT if row_dim == 1 else o
        v = moments.old(split.job)
        start = 0 if rows_cut else split.bounds[member.k]
        v = v if rows_cut else v[start : start + matrix.size(0)]
        cols = job.shape[1 - row_dim]
        normalized, new = normuon_normalize_shard(
            matrix[None], v[None], rows_cut=rows_cut, cols=cols, reduce=reduce, beta2=self.config.beta2,
            eps=self.config.eps,
        )  # fmt: skip
        if not rows_cut or member.k == 0:  # each new value from one member
            moments.computed_part(split.job, start, new[0])
        return normalized[0].mT if row_dim == 1 else normalized[0]

    # -- stage 3 -------------------------------------------------------------------------------

    def finish(self, out: Sequence[Tensor]) -> None:
        """Send each rank its parts of my shards' results, receive mine, write them into ``out``
        (batched: one copy of every part, then one multiply per scale, as owned jobs' writes)."""
        writes = _Writes()
        for i, split in enumerate(self.plan.splits):
            member = self.schedule.members[i]
            if member is None:
                continue
            job = self.plan.jobs[split.job]
            for piece, part in member.writes:
                data = shifted(part, member.shard, split.dim, job.shape).read(self.results[i])
                self._write(i, piece, part, data, out, writes)
        if any(s.returns for s in self.plan.splits):
            self._returns(out, writes)
        writes.apply()
        self.results = {}

    def _returns(self, out: Sequence[Tensor], writes: _Writes) -> None:
        """Send each receiver its parts of my shards' results; receive mine (to ``writes``)."""
        like_of = {i: self.updates[self._job(i).tensor] for i in range(len(self.plan.splits))}
        for wire in self._dtypes(lambda i: wire_dtype(self.config, like_of[i])):
            chosen = [i for i in range(len(self.plan.splits)) if wire_dtype(self.config, like_of[i]) == wire]
            outgoing: list[list[Tensor]] = [[] for _ in range(self.comm.world_size)]
            for i in chosen:
                member = self.schedule.members[i]
                if member is None:
                    continue
                job = self.plan.jobs[self.plan.splits[i].job]
                for rank, (_, part) in member.outgoing:
                    region = shifted(part, member.shard, self.plan.splits[i].dim, job.shape)
                    outgoing[rank].append(region.read(self.results[i]).to(wire))
            expected = sorted(
                ((rank, i, item) for i in chosen for rank, item in self.schedule.receives[i]), key=lambda e: e[0]
            )
            incoming = [0] * self.comm.world_size
            for rank, _, (_, part) in expected:
                incoming[rank] += part.numel
            pending, buffer = self.exchange(outgoing, incoming, like=like_of[chosen[0]], dtype=wire)
            pending.wait()
            offset = 0
            for _, i, (piece, part) in expected:
                self._write(i, piece, part, buffer[offset : offset + part.numel], out, writes)
                offset += part.numel

    def _write(self, i: int, piece: Piece, part: Region, data: Tensor, out: Sequence[Tensor], writes: _Writes) -> None:
        """Put flat ``data`` (``part`` of the job, storage order) into my receiver ``piece`` of ``out``,
        scaled unless the member did (a ``view.mul_`` after the copy, as owned jobs do), in ``writes``."""
        job = self.plan.jobs[self.plan.splits[i].job]
        view = _view(out[job.tensor], piece)
        copies = within(piece.region, part).copies(view, data)
        scale = 1.0
        if not self._scaled(i):
            (block,) = job.layout.blocks(job.shape)
            scale = lr_scale(self.config.adjust_lr, block.rows, block.cols)
        writes.add(copies, scale)

    def _scaled(self, i: int) -> bool:
        if i in self.on_owner:
            return self.on_owner[i]
        like = self.updates[self._job(i).tensor]
        return wire_dtype(self.config, like) == like.dtype

    def _job(self, i: int) -> Job:
        return self.plan.jobs[self.plan.splits[i].job]

    def _dtypes(self, dtype_of: Callable[[int], torch.dtype]) -> list[torch.dtype]:
        """The distinct dtypes of the splits, in a fixed order (the same on every rank)."""
        return sorted({dtype_of(i) for i in range(len(self.plan.splits))}, key=str)
