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
   sends each rank its regions of the shards' results, then they are written (unscaled, as for
   owned jobs: the lr shape scale is the commit's).

Which pieces go where is computed once per plan (:func:`~muonkit.distributed.split_schedule.schedule`,
cached by the strategy) and costs each rank O(its own pieces and shards) per step.

Limits: the shards run eagerly (``ns_compile`` applies to owned jobs only); a member waiting in
a ring on a member that failed inside the step is released when that process exits or at the
group's timeout, not by the failure channel (a gloo receive waited in slices closes its
connection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Compute, Cuts, local_part
from muonkit.distributed.collectives import Collectives, Pending
from muonkit.distributed.pieces import Job, Piece, Region, Span
from muonkit.distributed.planner import Plan, wire_dtype
from muonkit.distributed.split_plan import Split
from muonkit.distributed.split_schedule import Member, Part, SplitSchedule, shifted, slice_of, within
from muonkit.functional.sharded import p_rows, shard_flops

__all__ = ["SplitRun"]


class Moments(Protocol):
    """The update rule's ``"rows"`` states during a run (:class:`~muonkit.distributed.base.RowStates`)."""

    def old(self, j: int) -> list[Tensor]: ...

    def computed_part(self, j: int, offset: int, new: Sequence[Tensor]) -> None: ...


class Exchange(Protocol):
    """The executor's ``all_to_all_single`` of per-rank lists of flat tensors (``PlannedStrategy._all_to_all``)."""

    def __call__(
        self, outgoing: list[list[Tensor]], incoming: list[int], *, like: Tensor, dtype: torch.dtype
    ) -> tuple[Pending, Tensor]: ...


def _view(local: Tensor, piece: Piece) -> Tensor:
    """``piece``'s region of a rank's local tensor, shaped as the region's storage (flat for a span)."""
    part = local_part(local, piece)
    region = piece.region
    return part.reshape(-1) if isinstance(region, Span) else part.view(region.shape)


def _read(local: Tensor, piece: Piece, part: Region) -> Tensor:
    """The flat data of ``part`` (inside ``piece``'s region) from a rank's local tensor."""
    return within(piece.region, part).read(_view(local, piece))


def _views(cuts: Cuts | None, tensors: object) -> list[Tensor] | None:
    """Each part's flat view (:meth:`Cuts.views`), or None: no flat form, or a tensor not contiguous."""
    return None if cuts is None else cuts.views(tensors)


def _to_ranks(
    outgoing: list[list[Tensor]], views: list[Tensor] | None, to: Sequence[tuple[int, int]], chosen: list[int]
) -> bool:
    """Append each flat view (range ``n`` goes to ``to[n]``: its split, the rank) of the ``chosen``
    splits to its rank's list, each part's ranges in order (what its flat data concatenates);
    False where there are no views (then part by part)."""
    if views is None:
        return False
    picked = set(chosen)
    for view, (i, rank) in zip(views, to, strict=True):
        if i in picked:
            outgoing[rank].append(view)
    return True


class _Writes:
    """Copies into the updates, applied at once: one ``torch._foreach_copy_`` (converting to the
    update's dtype; the data is never written: it may be a view of a result still to be sent)."""

    def __init__(self) -> None:
        self.destinations: list[Tensor] = []
        self.sources: list[Tensor] = []

    def add(self, copies: list[tuple[Tensor, Tensor]]) -> None:
        """Each ``(destination, source)`` of ``copies``."""
        self.add_all([d for d, _ in copies], [s for _, s in copies])

    def add_all(self, destinations: list[Tensor], sources: Sequence[Tensor]) -> None:
        """Each ``(destinations[n], sources[n])``."""
        self.destinations += destinations
        self.sources += sources

    def apply(self) -> None:
        if self.destinations:
            torch._foreach_copy_(self.destinations, self.sources)


class SplitRun:
    """The split jobs of one :meth:`PlannedStrategy.run` on this rank (see the module docstring)."""

    def __init__(
        self,
        comm: Collectives,
        compute: Compute,
        plan: Plan,
        plan_schedule: SplitSchedule,
        updates: Sequence[Tensor],
        config: MuonConfig,
        exchange: Exchange,
    ) -> None:
        self.comm, self.compute, self.stats, self.plan, self.schedule = (
            comm,
            compute,
            compute.stats,
            plan,
            plan_schedule,
        )
        self.exchange = exchange
        self.updates, self.config = updates, config
        self.gathers: list[tuple[Pending, Tensor, list[tuple[int, int, int, Part]]]] = []
        self.results: dict[int, Tensor] = {}  # split index -> my shard's direction (storage shape)

    # -- stage 1 -------------------------------------------------------------------------------

    def start(self) -> None:
        """Send members the parts of their shards they lack (one all_to_all per update dtype)."""
        if not any(s.gathers for s in self.plan.splits):
            return
        for dtype in self._dtypes(lambda i: self.updates[self._job(i).tensor].dtype):
            chosen = [i for i in range(len(self.plan.splits)) if self.updates[self._job(i).tensor].dtype == dtype]
            outgoing: list[list[Tensor]] = [[] for _ in range(self.comm.world_size)]
            if not _to_ranks(
                outgoing, _views(self.schedule.flat.sends, self.updates), self.schedule.flat.send_to, chosen
            ):
                for i in chosen:
                    local = self.updates[self._job(i).tensor]
                    for rank, (piece, part) in self.schedule.sends[i]:
                        outgoing[rank].append(_read(local, piece, part))
            expected, incoming = self._expected("gather", chosen)
            like = self.updates[self._job(chosen[0]).tensor]
            pending, buffer = self.exchange(outgoing, incoming, like=like, dtype=dtype)
            self.gathers.append((pending, buffer, expected))

    def _expected(self, way: str, chosen: list[int]) -> tuple[list[tuple[int, int, int, Part]], list[int]]:
        """An exchange's expected parts ``(source rank, split, index, part)`` in buffer order (by
        source rank, stably) and the elements from each rank: the parts of ``chosen`` splits' shards
        sent to me (``way="gather"``, index -1) or of their results (``"return"``, the index in the
        split's receives). Computed at the first step, kept."""
        key = (way, tuple(chosen))
        known = self.schedule.memo.get(key)
        if known is None:
            if way == "gather":
                parts = [
                    (rank, i, -1, item)
                    for i in chosen
                    if (member := self.schedule.members[i]) is not None
                    for rank, item in member.incoming
                ]
            else:
                parts = [(rank, i, k, item) for i in chosen for k, (rank, item) in enumerate(self.schedule.receives[i])]
            expected = sorted(parts, key=lambda e: e[0])
            incoming = [0] * self.comm.world_size
            for rank, _, _, (_, part) in expected:
                incoming[rank] += part.numel
            known = self.schedule.memo[key] = (expected, incoming)
        return known

    # -- stage 2 -------------------------------------------------------------------------------

    def iterate(self, moments: Moments | None) -> None:
        """Orthogonalize my shards, in plan order (blocking collectives over each job's members)."""
        received = self._received()
        for i, split in enumerate(self.plan.splits):
            member = self.schedule.members[i]
            if member is not None:
                self.results[i] = self._direction(i, split, member, received, moments)

    def _received(self) -> dict[tuple[int, Piece], list[Tensor]]:
        """The received parts of my shards, by (split, source piece): each cut as its shard's
        flat form cuts it (:attr:`FlatForms.incoming`), else whole; one ``split`` per buffer."""
        out: dict[tuple[int, Piece], list[Tensor]] = {}
        cut = self.schedule.flat.incoming
        for pending, buffer, expected in self.gathers:
            pending.wait()
            # the buffer holds each source rank's parts in turn, each in sending order
            key = ("gather sizes", id(expected))  # expected: kept in the memo, as this
            sizes = self.schedule.memo.get(key)
            if sizes is None:
                sizes = self.schedule.memo[key] = [
                    cut.get((i, piece), (part.numel,)) for _, i, _, (piece, part) in expected
                ]
            views = torch.split(buffer, [n for part in sizes for n in part]) if expected else ()
            n = 0
            for (_, i, _, (piece, _)), part in zip(expected, sizes, strict=True):
                out[(i, piece)] = list(views[n : n + len(part)])
                n += len(part)
        self.gathers = []
        return out

    def _shard(self, i: int, split: Split, member: Member, received: dict[tuple[int, Piece], list[Tensor]]) -> Tensor:
        job = self.plan.jobs[split.job]
        local = self.updates[job.tensor]
        if member.view is not None:
            where = slice_of(member.view.region, member.shard, split.dim, job.shape)
            assert where is not None
            view = _view(local, member.view)
            if isinstance(member.view.region, Span):
                return view[where].view(member.shard.shape)
            return view.narrow(split.dim, where.start, where.stop - where.start)
        shard = local.new_empty(member.shard.shape)
        cuts = self.schedule.flat.shards.get(i)
        destinations = _views(cuts[0], [shard]) if cuts is not None else None
        own = _views(cuts[1], self.updates) if cuts is not None else None
        if destinations is not None and own is not None:  # one split per tensor, one batched copy
            sources = own + [v for _, (piece, _) in member.incoming for v in received[(i, piece)]]
            if sources:
                torch._foreach_copy_(destinations, sources)
            return shard
        copies = [  # one batched copy of every part
            pair
            for piece, part in member.own
            for pair in shifted(part, member.shard, split.dim, job.shape).copies(shard, _read(local, piece, part))
        ]
        copies += [
            pair
            for _, (piece, part) in member.incoming
            for pair in shifted(part, member.shard, split.dim, job.shape).copies(shard, received[(i, piece)][0])
        ]
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
        return shard

    def _direction(
        self,
        i: int,
        split: Split,
        member: Member,
        received: dict[tuple[int, Piece], list[Tensor]],
        moments: Moments | None,
    ) -> Tensor:
        """My shard of the job's direction (storage orientation, update dtype, unscaled: the lr shape
        scale is the commit's)."""
        job, config = self.plan.jobs[split.job], self.config

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
        direction = self.compute.shard(
            shard, dim=split.dim, size=n, reduce=reduce, coefficients=options.coefficients, steps=options.steps,
            eps=options.eps, dtype=options.dtype, method=options.method, member=(position, len(split.ranks)),
            gather=gather if split.by_rows else None,
        )  # fmt: skip
        if config.rule.changes_directions:
            direction = self._after(split, member, direction, moments, reduce)
        width = split.bounds[member.k + 1] - split.bounds[member.k]
        rows = len(p_rows(m, len(split.ranks), position)) if split.by_rows else None
        self.stats.flops += shard_flops(
            m, width, n, config.steps, method=config.ns_method, dtype=config.ns_dtype, rows=rows
        )
        self.stats.matrices += int(member.k == 0)  # one matrix, counted once
        return direction

    def _after(
        self, split: Split, member: Member, o: Tensor, moments: Moments | None, reduce: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """The update rule's hook on my shard (:meth:`~muonkit.functional.update_rule.UpdateRule.after_shard`):
        matrix rows are storage rows (``matrix``) or columns (``transposed``); the shard holds whole
        rows when it is cut along them, and then the ``"rows"`` states of those rows."""
        job = self.plan.jobs[split.job]
        row_dim = 1 if job.layout.resolved(2) == "transposed" else 0
        rows_cut = split.dim != row_dim
        matrix = o.mT if row_dim == 1 else o
        start = 0 if rows_cut else split.bounds[member.k]
        olds = [] if moments is None else moments.old(split.job)
        olds = [v[None] if rows_cut else v[start : start + matrix.size(0)][None] for v in olds]
        cols = job.shape[1 - row_dim]
        normalized, news = self.compute.after_shard(
            self.config, matrix[None], olds, rows_cut=rows_cut, cols=cols, reduce=reduce
        )
        if moments is not None and (not rows_cut or member.k == 0):  # each new value from one member
            moments.computed_part(split.job, start, [new[0] for new in news])
        return normalized[0].mT if row_dim == 1 else normalized[0]

    # -- stage 3 -------------------------------------------------------------------------------

    def finish(self, out: Sequence[Tensor]) -> None:
        """Send each rank its parts of my shards' results, receive mine, write them into ``out``
        (batched: one copy of every part, as owned jobs' writes)."""
        writes = _Writes()
        flat = self.schedule.flat.writes
        destinations = _views(flat[0], out) if flat is not None else None
        sources = _views(flat[1], self.results) if flat is not None else None
        if flat is not None and destinations is not None and sources is not None:
            writes.add_all(destinations, sources)
        else:
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
            picked = set(chosen)  # one conversion per shard sent at this wire dtype (the others: not read)
            results = {i: r.to(wire) if i in picked else r for i, r in self.results.items()}
            if not _to_ranks(
                outgoing, _views(self.schedule.flat.outgoing, results), self.schedule.flat.outgoing_to, chosen
            ):
                for i in chosen:
                    member = self.schedule.members[i]
                    if member is None:
                        continue
                    job = self.plan.jobs[self.plan.splits[i].job]
                    for rank, (_, part) in member.outgoing:
                        region = shifted(part, member.shard, self.plan.splits[i].dim, job.shape)
                        outgoing[rank].append(region.read(results[i]))
            expected, incoming = self._expected("return", chosen)
            pending, buffer = self.exchange(outgoing, incoming, like=like_of[chosen[0]], dtype=wire)
            pending.wait()
            self._write_received(expected, buffer, out, writes)

    def _write_received(
        self, expected: list[tuple[int, int, int, Part]], buffer: Tensor, out: Sequence[Tensor], writes: _Writes
    ) -> None:
        """The received parts of results (``expected``: in buffer order) into ``out``: one ``split`` of
        the buffer and of each update where every part has a flat form."""
        flat = self.schedule.flat.receives
        destinations = _views(flat[0], out) if flat is not None else None
        if flat is None or destinations is None:
            parts = torch.split(buffer, [part.numel for _, _, _, (_, part) in expected]) if expected else ()
            for (_, i, _, (piece, part)), data in zip(expected, parts, strict=True):
                self._write(i, piece, part, data, out, writes)
            return
        key = ("return ranges", id(expected))  # expected: kept in the memo, as this
        known = self.schedule.memo.get(key)
        if known is None:  # per range, in buffer order: its size and where it goes
            where = [(i, flat[1][(i, k)]) for _, i, k, _ in expected]
            known = self.schedule.memo[key] = (
                [n for _, (_, sizes) in where for n in sizes],
                [first + m for _, (first, sizes) in where for m in range(len(sizes))],
            )
        sizes, into = known
        views = torch.split(buffer, sizes) if sizes else ()
        writes.add_all([destinations[n] for n in into], views)

    def _write(self, i: int, piece: Piece, part: Region, data: Tensor, out: Sequence[Tensor], writes: _Writes) -> None:
        """Put flat ``data`` (``part`` of the job, storage order) into my receiver ``piece`` of ``out``, in ``writes``."""
        job = self.plan.jobs[self.plan.splits[i].job]
        view = _view(out[job.tensor], piece)
        writes.add(within(piece.region, part).copies(view, data))

    def _job(self, i: int) -> Job:
        return self.plan.jobs[self.plan.splits[i].job]

    def _dtypes(self, dtype_of: Callable[[int], torch.dtype]) -> list[torch.dtype]:
        """The distinct dtypes of the splits, in a fixed order (the same on every rank)."""
        return sorted({dtype_of(i) for i in range(len(self.plan.splits))}, key=str)
