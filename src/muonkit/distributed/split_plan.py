"""Which jobs' Newton-Schulz the planner splits over a group of ranks, and how: the plan's :class:`Split` s.

One owner per job balances well while there are many jobs per rank. With thousands of ranks
and a few hundred large matrices (Llama-70B: 560 Muon matrices) one rank would spend 13x the
mean orthogonalizing a 28672 x 8192 matrix while most ranks idle. A job costing more than the
mean per-rank share is then run by a group of ranks instead, each holding a block of its long
side (:mod:`muonkit.functional.sharded`: every Newton-Schulz step sums one small ``m x m``
Gram product over the group, nothing else moves).

**Cost model** (:class:`SplitPolicy`), in FLOPs: a job of ``m x n`` (``m <= n``) cut into ``g``
shards costs each member the FLOPs of :func:`~muonkit.functional.sharded.shard_flops` for its
shard (per step ``4 m^2 n/g + 2 m^3`` with ``P`` replicated, ``4 m^2 n/g + 2 m^3/g`` by rows),
plus its collectives: ``flops_per_byte`` per byte it sends (a ring all-reduce of the ``m (m+1)/2``
numbers of the Gram matrix's upper triangle in float32 sends ``2 (g-1)/g`` times their bytes per
step; by rows, an all-gather sends its ``m^2/g`` numbers of ``P`` to ``g - 1`` ranks per step)
and ``flops_per_collective`` per collective (latency); the form with the lesser time is used. A
job is split when it costs more than ``threshold`` times the mean (``sum(costs) / W``) and
splitting pays: the busiest member's time is below the job's own cost. The shards' size is the
least per-rank share at which every split job's shards and the other jobs fit on the W ranks
(:func:`choose_splits`): no rank gets two shares.

**Members**: shard ``k``'s bounds sit on the holders' own boundaries along the long side where
one lies near the even cut (FSDP2 ``Shard(0)`` row blocks: at W ranks and W shards each member
already holds its shard and nothing moves); its member is the rank holding most of it among
those within ``tolerance`` of the least load, else the least-loaded rank. Members are chosen
after :func:`~muonkit.distributed.planner.choose_owners` placed the other jobs, so the loads
include them. **Sources**: one holder per distinct region feeds the members that lack it (the
one that has sent the fewest elements); a member holding a region reads its own copy.

Everything is a pure function of the jobs, costs and world size: every rank plans the same.

Example: a (64, 16) matrix on 4 DDP ranks, forced into 4 row blocks::

    >>> from muonkit.distributed.pieces import Box, Job, Piece
    >>> from muonkit.functional.matrices import MatrixLayout
    >>> job = Job(0, (64, 16), MatrixLayout(), tuple(Piece(r, Box.full((64, 16))) for r in range(4)))
    >>> cost = SplitCost(steps=5, method="newton_schulz", dtype=None, policy=SplitPolicy(threshold=0, parts=4))
    >>> split = place_splits([job], choose_splits([job], [1.0], 4, cost), [0.0] * 4, costs=[1.0], cost=cost)[0]
    >>> split.ranks, split.bounds
    ((0, 1, 2, 3), (0, 16, 32, 48, 64))
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from muonkit.distributed.pieces import Box, Job, Piece, Region, Span
from muonkit.functional.sharded import norm_sum_numel, p_rows, shard_collectives, shard_flops

__all__ = [
    "Split",
    "SplitCost",
    "SplitPolicy",
    "SplitShape",
    "choose_splits",
    "clip",
    "member_flops",
    "place_splits",
    "rank_loads",
    "split_dim",
    "split_traffic",
]


@dataclass(frozen=True)
class SplitPolicy:
    """When the planner splits a job's Newton-Schulz over several ranks (see the module docstring).

    The defaults describe a group inside one NVLink domain of a current GPU: ~600 TFLOP/s of bf16
    products against ~300 GB/s of all-reduce bandwidth (``flops_per_byte=2000``) and ~50 us per
    collective (``flops_per_collective=3e10``); over a slower network raise them.
    """

    threshold: float = 1.0
    """Split a job costing more than ``threshold`` times the mean per-rank cost; ``inf``: never split."""
    flops_per_byte: float = 2000.0
    """FLOPs one byte sent by a member costs in time."""
    flops_per_collective: float = 3e10
    """FLOPs one collective's latency costs in time."""
    parts: int | None = None
    """Force this many shards on every job above the threshold, the cost model ignored (tests)."""

    def __post_init__(self) -> None:
        for name in ("threshold", "flops_per_byte", "flops_per_collective"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"Invalid {name}={value!r}: must be a number >= 0")
        if self.parts is not None and (
            isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 2
        ):
            raise ValueError(f"Invalid parts={self.parts!r}: must be None or an int >= 2")


NEVER = SplitPolicy(threshold=math.inf)
"""A policy that splits nothing (every job on one owner, as before splits existed)."""


@dataclass(frozen=True)
class SplitCost:
    """What the cost of a split depends on: the policy and the iteration (steps, method, compute dtype)."""

    steps: int
    method: str
    dtype: torch.dtype | None
    """The compute dtype as the planner's costs count it (None: fp32)."""
    policy: SplitPolicy = SplitPolicy()


@dataclass(frozen=True)
class SplitShape:
    """A job chosen for splitting: its long dim, how many shards, which form."""

    dim: int
    parts: int
    by_rows: bool


@dataclass(frozen=True)
class Split:
    """How one job's Newton-Schulz runs over a group of ranks (the same on every rank)."""

    job: int
    ranks: tuple[int, ...]
    """The members, in shard order; member k holds shard k."""
    dim: int
    """The dim of the job's (2-D) whole that is cut: its long side."""
    bounds: tuple[int, ...]
    """``len(ranks) + 1`` offsets along ``dim``: shard k is ``[bounds[k], bounds[k + 1])``."""
    by_rows: bool
    """Each member forms only its row block of ``P`` (:func:`~muonkit.functional.sharded.orthogonalize_shard`)."""
    sources: tuple[Piece, ...]
    """One held piece per distinct region: the holder that feeds the members lacking it."""
    flops: tuple[int, ...]
    """Newton-Schulz FLOPs of each member."""
    gathers: bool
    """Whether any member lacks a part of its shard (pieces travel to members)."""
    returns: bool
    """Whether any rank other than a shard's member needs a part of the shard's result."""

    def shard(self, k: int, shape: Sequence[int]) -> Box:
        """Shard ``k`` as a region of the whole (2-D) job."""
        runs = [((0, n),) for n in shape]
        runs[self.dim] = ((self.bounds[k], self.bounds[k + 1]),)
        return Box(tuple(runs))


def split_dim(job: Job) -> int | None:
    """The dim a job may be cut along, or None if it cannot be split: the long side of the stored
    matrix (columns when square), the side :func:`~muonkit.functional.orthogonalize` iterates along.

    Splittable: one whole 2-D matrix (``matrix`` or ``transposed`` layout, no ``split_sizes``:
    the planner's split blocks and experts are such jobs already) whose regions are boxes, or
    flat spans when the cut is along the rows (a span of rows is a span).
    """
    if len(job.shape) != 2 or not job.numel or job.layout.split_sizes is not None:
        return None
    if job.layout.resolved(2) not in ("matrix", "transposed"):
        return None
    (block,) = job.layout.blocks(job.shape)
    dim = 0 if block.rows > block.cols else 1  # of the matrix; a transposed layout stores it the other way
    dim = dim if job.layout.resolved(2) == "matrix" else 1 - dim
    if any(isinstance(p.region, Span) and dim != 0 for p in (*job.held, *job.receivers)):
        return None
    return dim


def _element_bytes(dtype: torch.dtype | None) -> tuple[int, int]:
    """Bytes of an element of a shard's Gram sums (fp32, fp64 for fp64) and of its gathered blocks of
    ``P`` (the compute dtype; None: fp32)."""
    wide = 8 if dtype == torch.float64 else 4
    return wide, wide if dtype in (None, torch.float32, torch.float64) else 2


def _shape_cost(job: Job, dim: int, parts: int, cost: SplitCost) -> tuple[int, bool, float]:
    """(FLOPs of the busiest shard, by rows, its time in FLOPs with the collectives) of ``parts``
    shards, in the faster form: ``P`` replicated or by rows (see :mod:`muonkit.functional.sharded`)."""
    n, m = job.shape[dim], job.shape[1 - dim]
    width, rows = -(-n // parts), len(p_rows(m, parts, 0))
    wide, narrow = _element_bytes(cost.dtype)
    policy = cost.policy
    forms = []
    for by_rows in (False, True):
        flops = shard_flops(
            m, width, n, cost.steps, method=cost.method, dtype=cost.dtype, rows=rows if by_rows else None
        )
        sums, gathers = shard_collectives(m, n, cost.steps, method=cost.method, dtype=cost.dtype, by_rows=by_rows)
        # a ring all-reduce sends 2 (g-1)/g of the upper triangle; an all-gather its block to g-1 ranks
        sent = 2 * (parts - 1) / parts * sums * (m * (m + 1) // 2) * wide + gathers * (parts - 1) * rows * m * narrow
        time = flops + policy.flops_per_byte * sent + policy.flops_per_collective * (1 + sums + gathers)
        forms.append((time, by_rows, flops))
    time, by_rows, flops = min(forms)
    return flops, by_rows, time


def choose_splits(
    jobs: Sequence[Job], costs: Sequence[float], world_size: int, cost: SplitCost
) -> dict[int, SplitShape]:
    """The jobs to split and their shapes (see the module docstring); none below 2 ranks.

    The candidates are the splittable jobs costing more than ``threshold`` times the mean. Each is
    cut into the fewest shards whose widest costs at most a share ``T``: the least ``T`` for which
    the shards and the other jobs (packed ``T`` to a rank) fit on the ``W`` ranks, so that no rank
    needs two shares; a job costing less than ``T`` stays whole. Then a job is split only where
    that pays (its busiest member's time, collectives included, below the job's cost).
    """
    policy = cost.policy
    if world_size < 2 or math.isinf(policy.threshold):
        return {}
    mean = sum(costs) / world_size
    candidates = {}
    for j in sorted(range(len(jobs)), key=lambda j: (-costs[j], j)):
        if costs[j] <= policy.threshold * mean:
            break
        dim = split_dim(jobs[j])
        if dim is not None and min(world_size, jobs[j].shape[dim]) >= 2:
            candidates[j] = _Candidate(jobs[j], dim, min(world_size, jobs[j].shape[dim]), cost)
    if policy.parts is not None:
        return {j: c.shape(min(policy.parts, c.most)) for j, c in candidates.items()}
    if not candidates:
        return {}
    share = _least_share(candidates, costs, world_size, mean)
    chosen = {}
    for j, candidate in candidates.items():
        if costs[j] > share:
            parts = candidate.parts_for(share)
            if candidate.time(parts) < costs[j]:
                chosen[j] = candidate.shape(parts)
    return chosen


class _Candidate:
    """A job that may be split: its shards' FLOPs and time by their count (cached)."""

    def __init__(self, job: Job, dim: int, most: int, cost: SplitCost) -> None:
        self.job, self.dim, self.most, self.cost = job, dim, most, cost
        self._costs: dict[int, tuple[int, bool, float]] = {}
        self.floor = self.flops(most)

    def _of(self, parts: int) -> tuple[int, bool, float]:
        if parts not in self._costs:
            self._costs[parts] = _shape_cost(self.job, self.dim, parts, self.cost)
        return self._costs[parts]

    def flops(self, parts: int) -> int:
        return self._of(parts)[0]

    def time(self, parts: int) -> float:
        return self._of(parts)[2]

    def shape(self, parts: int) -> SplitShape:
        return SplitShape(self.dim, parts, self._of(parts)[1])

    def parts_for(self, share: float) -> int:
        """The fewest shards (2 to ``most``) whose widest costs at most ``share``, or within 1.25x of
        the least any count reaches (the Gram iteration's replicated ``m^3`` work); FLOPs fall with
        the count."""
        target = max(share, 1.25 * self.floor)
        lo, hi = 2, self.most
        while lo < hi:
            mid = (lo + hi) // 2
            if self.flops(mid) <= target:
                hi = mid
            else:
                lo = mid + 1
        return lo


def _least_share(candidates: dict[int, _Candidate], costs: Sequence[float], world_size: int, mean: float) -> float:
    """The least per-rank share (bisected, 1e-3 relative) at which every job fits on ``world_size`` ranks."""

    def fits(share: float) -> bool:
        ranks, whole = 0, sum(costs)
        for j, candidate in candidates.items():
            if costs[j] > share:
                ranks += candidate.parts_for(share)
                whole -= costs[j]
        return ranks + math.ceil(whole / share) <= world_size

    lo, hi = mean, max(costs)
    if fits(lo):
        return lo
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def place_splits(
    jobs: Sequence[Job],
    shapes: dict[int, SplitShape],
    load: list[float],
    *,
    costs: Sequence[float],
    cost: SplitCost,
    sent: list[int] | None = None,
    tolerance: float = 0.1,
) -> tuple[Split, ...]:
    """Bounds, members and sources of each chosen job, largest first.

    ``load``: each rank's cost so far (the jobs it owns), updated with its shares; ``sent``:
    elements each rank sends so far (see :func:`~muonkit.distributed.planner.choose_sources`),
    updated; ``tolerance``: as :func:`~muonkit.distributed.planner.choose_owners`'s.
    """
    sent = sent if sent is not None else [0] * len(load)
    slack = tolerance * sum(costs) / len(load)
    heap = [(value, r) for r, value in enumerate(load)]
    heapq.heapify(heap)
    splits = []
    for j in sorted(shapes, key=lambda j: (-costs[j], j)):
        job, shape = jobs[j], shapes[j]
        n, m = job.shape[shape.dim], job.shape[1 - shape.dim]
        bounds = _bounds(job, shape.dim, shape.parts)
        held = _held_per_shard(job, shape.dim, bounds)
        ranks: list[int] = []
        for k in range(shape.parts):
            member = _member(held[k], ranks, load, heap, slack)
            ranks.append(member)
            # ``P``'s row blocks go by the members' order in their process group: by rank
            load[member] += member_flops(m, bounds[k + 1] - bounds[k], n, cost, shape.by_rows, k, shape.parts)
            heapq.heappush(heap, (load[member], member))
        order = sorted(ranks)
        flops = tuple(
            member_flops(m, bounds[k + 1] - bounds[k], n, cost, shape.by_rows, order.index(r), shape.parts)
            for k, r in enumerate(ranks)
        )
        cut = _Cut(job, shape.dim, bounds, tuple(ranks))
        sources = cut.sources(sent)
        gathers, returns = cut.gathers(sources), cut.returns()
        splits.append(Split(j, cut.ranks, shape.dim, bounds, shape.by_rows, sources, flops, gathers, returns))
    return tuple(splits)


def _bounds(job: Job, dim: int, parts: int) -> tuple[int, ...]:
    """Even cuts of the long side, moved onto a holder's boundary within ``n / (4 parts)`` of each."""
    n = job.shape[dim]
    edges = sorted({e for p in job.held for e in _edges(p.region, dim, job.shape)})
    bounds = [0]
    for k in range(1, parts):
        target = round(k * n / parts)
        lo, hi = bounds[-1] + 1, n - (parts - k)  # room for the shards still to come
        i = bisect.bisect_left(edges, target)
        near = [e for e in edges[max(0, i - 1) : i + 1] if lo <= e <= hi and abs(e - target) <= n / (4 * parts)]
        bounds.append(min(near, key=lambda e: (abs(e - target), e)) if near else min(max(target, lo), hi))
    return (*bounds, n)


def _edges(region: Region, dim: int, shape: Sequence[int]) -> list[int]:
    if isinstance(region, Span):  # rows: dim == 0 (split_dim)
        cols = shape[1]
        return [e // cols for e in (region.start, region.stop) if e % cols == 0]
    return [e for run in region.runs[dim] for e in run]


def _extent(region: Region, dim: int, shape: Sequence[int]) -> tuple[int, int]:
    """The range of indices along ``dim`` that ``region`` touches."""
    if isinstance(region, Span):
        return region.start // shape[1], -(-region.stop // shape[1])
    runs = region.runs[dim]
    return (runs[0][0], runs[-1][1]) if runs else (0, 0)


def _overlapping(region: Region, dim: int, shape: Sequence[int], bounds: Sequence[int]) -> range:
    """The shards ``region`` may overlap (by its extent along ``dim``)."""
    a, b = _extent(region, dim, shape)
    if a >= b:
        return range(0)
    return range(bisect.bisect_right(bounds, a) - 1, bisect.bisect_left(bounds, b))


def clip(region: Region, dim: int, lo: int, hi: int, shape: Sequence[int]) -> Region | None:
    """The part of ``region`` inside ``[lo, hi)`` along ``dim`` of the (2-D) whole ``shape``; None if empty."""
    if isinstance(region, Span):
        start, stop = max(region.start, lo * shape[1]), min(region.stop, hi * shape[1])
        return Span(start, stop) if start < stop else None
    kept = tuple((max(a, lo), min(b, hi)) for a, b in region.runs[dim] if max(a, lo) < min(b, hi))
    if not kept:
        return None
    runs = list(region.runs)
    runs[dim] = kept
    box = Box(tuple(runs))
    return box if box.numel else None


def _held_per_shard(job: Job, dim: int, bounds: Sequence[int]) -> list[dict[int, int]]:
    """Per shard: elements of it each rank holds."""
    held: list[dict[int, int]] = [{} for _ in range(len(bounds) - 1)]
    for piece in job.held:
        for k, numel in _clipped(piece.region, dim, bounds, job.shape):
            held[k][piece.rank] = held[k].get(piece.rank, 0) + numel
    return held


def _clipped(region: Region, dim: int, bounds: Sequence[int], shape: Sequence[int]) -> list[tuple[int, int]]:
    """``(k, elements of region in shard k)`` for every shard ``region`` overlaps (arithmetic, no boxes)."""
    out = []
    if isinstance(region, Span):
        cols = shape[1]
        for k in _overlapping(region, dim, shape, bounds):
            numel = min(region.stop, bounds[k + 1] * cols) - max(region.start, bounds[k] * cols)
            if numel > 0:
                out.append((k, numel))
        return out
    runs = region.runs[dim]
    other = 1
    for d, r in enumerate(region.runs):
        if d != dim:
            other *= sum(b - a for a, b in r)
    if not other or not runs:
        return out
    first, last = runs[0][0], runs[-1][1]
    k = bisect.bisect_right(bounds, first) - 1
    while k < len(bounds) - 1 and bounds[k] < last:
        lo, hi = bounds[k], bounds[k + 1]
        if len(runs) == 1:  # a block (the common case): no generator
            along = min(last, hi) - max(first, lo)
        else:
            along = sum(max(0, min(b, hi) - max(a, lo)) for a, b in runs)
        if along > 0:
            out.append((k, along * other))
        k += 1
    return out


def _member(
    held: dict[int, int], taken: list[int], load: list[float], heap: list[tuple[float, int]], slack: float
) -> int:
    """The rank holding most of a shard among those within ``slack`` of the least load (then the least
    loaded, the lowest), else the least-loaded rank; never one already ``taken`` by the job."""
    aside = []
    while True:  # the least-loaded rank not yet a member: stale heap entries are dropped
        value, r = heapq.heappop(heap)
        if value != load[r]:
            continue
        if r in taken:
            aside.append((value, r))
            continue
        least = (value, r)
        break
    heapq.heappush(heap, least)
    for entry in aside:
        heapq.heappush(heap, entry)
    near = [r for r in held if r not in taken and load[r] <= least[0] + slack]
    if near:
        return min(near, key=lambda r: (-held[r], load[r], r))
    return least[1]


@dataclass(frozen=True)
class _Cut:
    """A job, where it is cut and who holds each shard: what sources and transfers follow from."""

    job: Job
    dim: int
    bounds: tuple[int, ...]
    ranks: tuple[int, ...]

    def parts(self, region: Region) -> list[tuple[int, int]]:
        """``(k, elements of region in shard k)`` for every shard ``region`` overlaps."""
        return _clipped(region, self.dim, self.bounds, self.job.shape)

    def sources(self, sent: list[int]) -> tuple[Piece, ...]:
        """One holder per distinct region: the one that has sent the fewest elements (``sent`` updated
        with what it sends to the members lacking the region)."""
        regions: dict[Region, list[Piece]] = {}
        for piece in self.job.held:
            regions.setdefault(piece.region, []).append(piece)
        chosen = []
        for region, holders in regions.items():
            piece = min(holders, key=lambda p: (sent[p.rank], p.rank))
            holding = {p.rank for p in holders}
            sent[piece.rank] += sum(numel for k, numel in self.parts(region) if self.ranks[k] not in holding)
            chosen.append(piece)
        return tuple(chosen)

    def gathers(self, sources: Sequence[Piece]) -> bool:
        holding = {(p.rank, p.region) for p in self.job.held}
        return any((self.ranks[k], p.region) not in holding for p in sources for k, _ in self.parts(p.region))

    def returns(self) -> bool:
        return any(self.ranks[k] != p.rank for p in self.job.receivers for k, _ in self.parts(p.region))


def member_flops(m: int, width: int, n: int, cost: SplitCost, by_rows: bool, k: int, parts: int) -> int:
    """Newton-Schulz FLOPs of member ``k`` (its shard ``width`` wide; by rows: its block of ``P``)."""
    rows = len(p_rows(m, parts, k)) if by_rows else None
    return shard_flops(m, width, n, cost.steps, method=cost.method, dtype=cost.dtype, rows=rows)


def rank_loads(owners: Sequence[int], splits: Sequence[Split], costs: Sequence[float], world_size: int) -> list[float]:
    """Newton-Schulz FLOPs per rank: each owned job's cost, and each member's share of a split job."""
    load = [0.0] * world_size
    for j, owner in enumerate(owners):
        if owner >= 0:
            load[owner] += costs[j]
    for split in splits:
        for r, flops in zip(split.ranks, split.flops, strict=True):
            load[r] += flops
    return load


def split_traffic(
    job: Job, split: Split, cost: SplitCost, *, update_bytes: int, wire_bytes: int
) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes each rank sends and receives for one split job in one step: ``(sent, received)``.

    The parts of each shard its member lacks (holds no replica of) travel to it (``update_bytes``
    per element); each
    member's sums and gathers (a ring all-reduce sends and receives ``2 (g-1)/g`` of what it sums:
    the norm's one square sum, and per step the upper triangle of an ``m x m`` Gram; an all-gather
    a member's block of ``P`` to ``g-1`` ranks), as the executor counts them; each receiver's part of a
    shard's result comes back from its member (``wire_bytes`` per element).
    """
    sent: dict[int, int] = {}
    received: dict[int, int] = {}

    def move(src: int, dst: int, nbytes: int) -> None:
        if src != dst and nbytes:
            sent[src] = sent.get(src, 0) + nbytes
            received[dst] = received.get(dst, 0) + nbytes

    dim, shape = split.dim, job.shape
    holding: dict[Region, set[int]] = {}
    for piece in job.held:
        holding.setdefault(piece.region, set()).add(piece.rank)
    for piece in split.sources:
        for k, numel in _clipped(piece.region, dim, split.bounds, shape):
            if split.ranks[k] not in holding[piece.region]:  # a member holding a replica reads its own
                move(piece.rank, split.ranks[k], numel * update_bytes)
    for piece in job.receivers:
        for k, numel in _clipped(piece.region, dim, split.bounds, shape):
            move(split.ranks[k], piece.rank, numel * wire_bytes)
    g, m, n = len(split.ranks), shape[1 - dim], shape[dim]
    sums, gathers = shard_collectives(m, n, cost.steps, method=cost.method, dtype=cost.dtype, by_rows=split.by_rows)
    wide, narrow = _element_bytes(cost.dtype)
    ring = 2 * (g - 1) / g  # of the summed bytes, sent (and received) by each member of a ring
    for k, rank in enumerate(split.ranks):
        per_step = round(ring * 8 * norm_sum_numel(cost.dtype)) + sums * round(
            ring * (m * (m + 1) // 2) * wide
        )  # the norm's sum, the Grams'
        per_step += gathers * (g - 1) * len(p_rows(m, g, k)) * m * narrow if split.by_rows else 0
        sent[rank] = sent.get(rank, 0) + per_step
        received[rank] = received.get(rank, 0) + per_step
    return sent, received
