"""What one rank sends, receives and computes for a plan's split jobs: :func:`schedule`, pure.

A :class:`~muonkit.distributed.split_plan.Split` cuts a job's matrix into shards, one per member;
:func:`schedule` gives this rank's share of every split of a plan (its member role, the parts of
its pieces it sends to members, the parts of results it receives), computed once per plan and
kept in the plan's memo by the executor; :class:`~muonkit.distributed.split_run.SplitRun` runs it.

Where the parts are a few flat ranges of the tensors they lie in (whole rows, one row's columns),
the schedule also holds them as :class:`~muonkit.distributed.base.Cuts` (:class:`FlatForms`):
a step then gets a stage's views with one ``split`` per tensor instead of a few view ops per part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from muonkit.distributed.base import Cuts
from muonkit.distributed.pieces import Box, Job, Piece, Region, Span
from muonkit.distributed.planner import Plan
from muonkit.distributed.schedule import local_range
from muonkit.distributed.split_plan import Split, clip

__all__ = ["FlatForms", "Member", "Part", "Ranges", "SplitSchedule", "schedule", "shifted", "slice_of", "within"]


Part = tuple[Piece, Region]
"""A piece and its part inside one shard (a region of the whole job)."""


@dataclass
class Member:
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
class SplitSchedule:
    """This rank's share of a plan's splits: per split, its member role (or None) and transfers."""

    members: list[Member | None]
    sends: list[list[tuple[int, Part]]]
    """Per split: the parts of my source pieces I send: ``(member rank, (my piece, part))``."""
    receives: list[list[tuple[int, Part]]]
    """Per split: the parts of results sent to me: ``(member rank, (my receiver piece, part))``."""
    flat: FlatForms
    """Where those parts lie as flat ranges (views by one split per tensor a step), where they do."""
    memo: dict[Any, Any] = field(default_factory=dict)
    """Each exchange's expected parts and sizes, by the splits it carries (made at the first step)."""


Ranges = tuple[tuple[int, int], ...]
"""Flat ranges of a tensor, in a part's storage order."""

MAX_ROW_RANGES = 8
"""A part of some columns of at most this many rows (a column cut of a row block) is a range per
row; of more rows, one strided view (its region's copy) costs less."""

MAX_SEGMENTS = 4096
"""A part cut into more flat ranges than this is copied as a region (by its box)."""


@dataclass(frozen=True)
class FlatForms:
    """The parts of :class:`SplitSchedule` as flat ranges of the tensors they lie in (:class:`Cuts`), so
    that a step gets their views with one ``split`` per tensor (and per received buffer) instead of
    a few view ops per part; None where some part has no such form (then part by part, as regions).
    A copy's two sides are cut alike (:func:`_aligned`): destination range ``n`` takes source range ``n``.

    Keys: an update's tensor index for local tensors (``updates``, ``out``), a split's index for
    its shard (key 0 alone) or its result."""

    sends: Cuts | None
    """My sent parts in my updates, in (split, send) order."""
    send_to: tuple[tuple[int, int], ...]
    """Per range of :attr:`sends`: (its split, the member it goes to)."""
    shards: dict[int, tuple[Cuts, Cuts]]
    """Per split whose shard I assemble: where its own then received parts go in the shard (key 0),
    and where the own ones are in my updates."""
    incoming: dict[tuple[int, Piece], tuple[int, ...]]
    """Per received part of a shard (split, source piece): the sizes its buffer part is cut into."""
    outgoing: Cuts | None
    """My shards' result parts for other ranks, in (split, outgoing) order."""
    outgoing_to: tuple[tuple[int, int], ...]
    """Per range of :attr:`outgoing`: (its split, the rank it goes to)."""
    writes: tuple[Cuts, Cuts, tuple[int, ...]] | None
    """Parts of my shards' results I keep: where they go in ``out``, where they are in the results,
    each range's split."""
    receives: tuple[Cuts, dict[tuple[int, int], tuple[int, tuple[int, ...]]]] | None
    """Received result parts: where they go in ``out`` (in (split, receive) order), and per part
    (split, its index in the split's receives): its first range there and the sizes its buffer
    part is cut into."""


def schedule(plan: Plan, rank: int) -> SplitSchedule:
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
    return SplitSchedule(members, sends, receives, _flat_forms(plan, members, sends, receives))


def _flat_forms(
    plan: Plan,
    members: list[Member | None],
    sends: list[list[tuple[int, Part]]],
    receives: list[list[tuple[int, Part]]],
) -> FlatForms:
    def tensor(i: int) -> int:
        return plan.jobs[plan.splits[i].job].tensor

    def in_shard(i: int, member: Member, part: Region) -> Ranges | None:
        split = plan.splits[i]
        return _ranges(shifted(part, member.shard, split.dim, plan.jobs[split.job].shape), member.shard.shape)

    sent = [(i, rank, tensor(i), _in_piece(piece, part)) for i, s in enumerate(sends) for rank, (piece, part) in s]
    shards, incoming = {}, {}
    for i, member in enumerate(members):
        if member is None or member.view is not None:
            continue
        own = [_aligned(in_shard(i, member, part), _in_piece(piece, part)) for piece, part in member.own]
        received = [(piece, in_shard(i, member, part)) for _, (piece, part) in member.incoming]
        if any(o is None for o in own) or any(r is None for _, r in received):
            continue
        pairs = cast(list[tuple[Ranges, Ranges]], own)
        dst = _cuts([(0, d) for d, _ in pairs] + [(0, r) for _, r in received])
        src = _cuts([(tensor(i), r) for _, r in pairs])
        if dst is not None and src is not None:
            shards[i] = (dst, src)
            incoming.update({(i, piece): _sizes(cast(Ranges, r)) for piece, r in received})
    outgoing = [(i, rank, in_shard(i, m, part)) for i, m in enumerate(members) if m for rank, (_, part) in m.outgoing]
    kept = [
        (i, _aligned(_in_piece(piece, part), in_shard(i, m, part)))
        for i, m in enumerate(members)
        if m
        for piece, part in m.writes
    ]
    writes = None
    if all(pair is not None for _, pair in kept):
        aligned = [(i, cast(tuple[Ranges, Ranges], pair)) for i, pair in kept]
        to, source = _cuts([(tensor(i), d) for i, (d, _) in aligned]), _cuts([(i, r) for i, (_, r) in aligned])
        if to is not None and source is not None:
            writes = (to, source, tuple(i for i, (d, _) in aligned for _ in d))
    into = [
        ((i, k), tensor(i), _in_piece(piece, part))
        for i, r in enumerate(receives)
        for k, (_, (piece, part)) in enumerate(r)
    ]
    received_cuts = _cuts([(t, r) for _, t, r in into])
    where: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
    first = 0
    for key, _, r in into if received_cuts is not None else []:
        where[key] = (first, _sizes(cast(Ranges, r)))
        first += len(cast(Ranges, r))
    return FlatForms(
        sends=_cuts([(t, r) for _, _, t, r in sent]),
        send_to=tuple((i, rank) for i, rank, _, r in sent for _ in r or ()),
        shards=shards,
        incoming=incoming,
        outgoing=_cuts([(i, r) for i, _, r in outgoing]),
        outgoing_to=tuple((i, rank) for i, rank, r in outgoing for _ in r or ()),
        writes=writes,
        receives=None if received_cuts is None else (received_cuts, where),
    )


def _sizes(ranges: Ranges) -> tuple[int, ...]:
    """Each range's size."""
    return tuple(b - a for a, b in ranges)


def _aligned(dst: Ranges | None, src: Ranges | None) -> tuple[Ranges, Ranges] | None:
    """Both sides (ranges of the same total size) cut at every boundary of either: range ``n`` of one
    copies into range ``n`` of the other; None where a side has no flat form."""
    if dst is None or src is None:
        return None
    out_d, out_s = [], []
    i = j = 0
    (a, b), (c, e) = dst[0], src[0]
    while True:
        n = min(b - a, e - c)
        out_d.append((a, a + n))
        out_s.append((c, c + n))
        a, c = a + n, c + n
        if a == b:
            i += 1
            if i == len(dst):
                return tuple(out_d), tuple(out_s)
            a, b = dst[i]
        if c == e:
            j += 1
            c, e = src[j]


def _cuts(pieces: list[tuple[int, Ranges | None]]) -> Cuts | None:
    """:meth:`Cuts.of` where every piece has a flat form and none overlaps another partly (equal
    ranges share a view: one result part for two replicas), else None."""
    if any(ranges is None for _, ranges in pieces):
        return None
    try:
        return Cuts.of(cast(list[tuple[int, Ranges]], pieces))
    except ValueError:  # overlapping ranges
        return None


def _ranges(region: Region, shape: Sequence[int]) -> Ranges | None:
    """``region`` of a 2-D storage of ``shape`` (flat for a span) as flat ranges in its storage
    order, adjacent ones merged: whole rows, or some columns of at most :data:`MAX_ROW_RANGES`
    rows; None for other shapes or beyond :data:`MAX_SEGMENTS` ranges."""
    if isinstance(region, Span):
        return ((region.start, region.stop),)
    if len(region.runs) != 2 or len(shape) != 2:
        return None
    (rows, cols), width = region.runs, shape[1]
    if cols == ((0, width),):
        spans = [(a * width, b * width) for a, b in rows]
    elif sum(b - a for a, b in rows) * len(cols) <= MAX_ROW_RANGES:  # a few rows' columns: a range each
        spans = [(r * width + c, r * width + d) for a, b in rows for r in range(a, b) for c, d in cols]
    else:  # a block of columns of many rows: one strided view of it costs less than a range per row
        return None
    out: list[tuple[int, int]] = []
    for start, stop in spans:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
        if len(out) > MAX_SEGMENTS:
            return None
    return tuple(out)


def _in_piece(piece: Piece, part: Region) -> Ranges | None:
    """``part`` (inside ``piece``'s region) as flat ranges of its holder's local tensor, or None."""
    inner = within(piece.region, part)
    base = local_range(piece)[0]
    if isinstance(inner, Span):
        return ((base + inner.start, base + inner.stop),)
    assert isinstance(piece.region, Box)
    ranges = _ranges(inner, piece.region.shape)
    return None if ranges is None else tuple((base + a, base + b) for a, b in ranges)


def _member(job: Job, split: Split, rank: int) -> Member | None:
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
    view = next((p for p in mine if slice_of(p.region, shard, split.dim, job.shape) is not None), None)
    outgoing, writes = [], []
    for piece in job.receivers:
        part = clip(piece.region, split.dim, lo, hi, job.shape)
        if part is None:
            continue
        if piece.rank == rank:
            writes.append((piece, part))
        else:
            outgoing.append((piece.rank, (piece, part)))
    return Member(k, shard, own, incoming, view, outgoing, writes)


def _parts(job: Job, split: Split, region: Region) -> list[tuple[int, Region]]:
    out = []
    for k in range(len(split.ranks)):
        part = clip(region, split.dim, split.bounds[k], split.bounds[k + 1], job.shape)
        if part is not None:
            out.append((k, part))
    return out


def slice_of(region: Region, shard: Box, dim: int, shape: Sequence[int]) -> slice | None:
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
