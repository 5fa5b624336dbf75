"""One planner for every placement: who orthogonalizes each :class:`~muonkit.distributed.pieces.Job`, and from which copies.

A placement reader (DDP, FSDP2, ZeRO, any DTensor mesh) describes where the parts of every Muon
tensor live as :class:`~muonkit.distributed.pieces.Job` s; :func:`make_plan` turns them into a
:class:`Plan`, a pure function of the jobs, their costs and the world size, so every rank computes
the same plan with no communication. :class:`~muonkit.distributed.executor.PlannedStrategy`
carries it out.

**Owners** (:func:`choose_owners`), one per job among all ranks of the group:

1. a job held whole by exactly one rank and by no one else (a ZeRO-1/2 param inside one
   partition, an expert on its expert-parallel rank, a tensor whose rows all sit on one FSDP rank)
   is orthogonalized where it lies: nothing moves. These jobs are the initial loads.
2. the other jobs, largest Newton-Schulz cost first (Graham's LPT), go to a rank whose load is
   within ``tolerance * total / W`` of the least-loaded rank's, preferring ranks that hold the
   whole job (DDP: every rank; the least loaded of them), then ranks that hold part of it (the
   least loaded, ties to the one holding most elements: fewer bytes to move), and only when none
   of those is within the tolerance the least-loaded rank of all.

Every rank's load after a free job lands on it is at most the least load plus the tolerance plus
that job, and the least load never exceeds the average, so the largest per-rank cost is at most
``(1 + tolerance) * total / W + largest job`` (``tolerance=0.1``), except where rule 1 itself
puts more on one rank (the placement decides that; moving such a job would cost its bytes twice).
The tolerance keeps a straddling ZeRO-1/2 param or a small FSDP matrix on a rank that holds a
piece of it instead of shipping all of it to a rank that holds nothing.

**Sources** (:func:`choose_sources`): a region held by several ranks (DDP replicas, HSDP
replicas of a shard) is sent once: by the owner itself when it holds it (nothing moves), else by
the holder that has sent the fewest elements so far in this plan (ties: the lowest rank).

**Splits** (``make_plan(split=...)``, :mod:`muonkit.distributed.split_plan`): where ranks
outnumber the large matrices, a job costing more than the mean per-rank share is run by a group
of ranks, each holding a block of its long side, instead of one owner (owner -1, in no exchange
group, described by :attr:`Plan.splits`). Which jobs, into how many shards and on which ranks is
decided first by cost, then the owners of the other jobs are chosen, then each split's members
(the least loaded, preferring ranks that hold the shard's rows).

**Exchange groups**: jobs with the same group key (the executor uses the set of matrix shapes and
the update dtype) travel in one ``all_to_all`` each way; groups run largest first, so the biggest
transfers overlap the most Newton-Schulz.

**Cost**: O(jobs log W + pieces), the same on every rank. Owners take one pass over each free
job's holders (elements per rank come from the job's
:class:`~muonkit.distributed.pieces.Holders`, shared by every job laid out alike and derived
once), the least-loaded rank comes from a heap; sources walk each job's distinct regions once.
What each rank then sends and receives is derived from the plan once, by
:func:`muonkit.distributed.schedule.rank_schedule`.

Example: two ranks of DDP and one (8, 8) and two (4, 4) matrices::

    >>> from muonkit.distributed.pieces import Box
    >>> from muonkit.functional.matrices import MatrixLayout
    >>> whole = lambda shape: tuple(Piece(r, Box.full(shape)) for r in range(2))
    >>> jobs = [Job(i, s, MatrixLayout(), whole(s)) for i, s in enumerate([(8, 8), (4, 4), (4, 4)])]
    >>> make_plan(jobs, costs=[8.0, 1.0, 1.0], world_size=2).owners
    (0, 1, 1)
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.pieces import Holders, Job, Piece, Pieces, Region, holders_of
from muonkit.distributed.split_plan import Split, SplitCost, choose_splits, place_splits, rank_loads
from muonkit.functional.muon import tensor_scale
from muonkit.functional.orthogonalize import default_compute_dtype

__all__ = ["Plan", "choose_owners", "choose_sources", "job_cost", "make_plan", "scale_of", "wire_dtype"]

TOLERANCE = 0.1
"""How much more load than the least-loaded rank's (a fraction of the average) a rank may carry
to keep a job where its data already is."""


@dataclass(frozen=True)
class Plan:
    """Owners, sources and exchange groups of a list of jobs (the same on every rank)."""

    jobs: tuple[Job, ...]
    owners: tuple[int, ...]
    """Owner rank of each job; -1 for a zero-size job (no pieces, nothing to compute) or a split one."""
    sources: tuple[Sequence[Piece], ...]
    """Per job: one held piece per distinct region, together covering it once; the owner
    assembles the job from them (the job's own ``held`` when no region is held twice)."""
    groups: tuple[tuple[int, ...], ...]
    """Job indices per exchange group, in execution order (largest first); each in job order."""
    splits: tuple[Split, ...] = ()
    """Jobs run by a group of ranks instead of one owner (:mod:`muonkit.distributed.split_plan`);
    their owner is -1 and they are in no exchange group."""
    memo: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)
    """What is derived from the plan once and kept with it: each rank's exchange lists
    (:func:`muonkit.distributed.schedule.rank_schedule`)."""

    def gathers(self, group: Sequence[int]) -> bool:
        """Whether any piece of the group must travel to its owner (the same answer on every rank)."""
        return not all(_all_on(self.sources[j], self.owners[j]) for j in group)

    def returns(self, group: Sequence[int]) -> bool:
        """Whether any rank other than the owner needs a part of a direction in the group."""
        return not all(_all_on(self.jobs[j].receivers, self.owners[j]) for j in group)

    def computed(self, rank: int) -> tuple[int, ...]:
        """Indices of the jobs ``rank`` orthogonalizes."""
        return tuple(j for j, owner in enumerate(self.owners) if owner == rank)


def _all_on(pieces: Sequence[Piece], rank: int) -> bool:
    held = holders_of(pieces).held
    return not held or (len(held) == 1 and rank in held)


def job_cost(job: Job, config: MuonConfig) -> float:
    """Newton-Schulz FLOPs of orthogonalizing every matrix of ``job``."""
    if not job.numel:
        return 0.0
    return float(sum(b.count * config.flops(b.rows, b.cols) for b in job.layout.blocks(job.shape)))


def make_plan(
    jobs: Sequence[Job],
    *,
    costs: Sequence[float],
    world_size: int,
    keys: Sequence[Hashable] | None = None,
    tolerance: float = TOLERANCE,
    split: SplitCost | None = None,
) -> Plan:
    """The plan of ``jobs`` on ``world_size`` ranks, in O(jobs log W + pieces) (see the module docstring).

    Args:
        jobs: every job of the call, pieces in group ranks.
        costs: each job's cost (e.g. :func:`job_cost`), >= 0.
        world_size: ranks in the group.
        keys: each job's exchange group key (jobs with equal keys share one exchange); ``None``:
            a single group for every job.
        tolerance: see :func:`choose_owners`.
        split: when and how to run a job over a group of ranks (:mod:`~muonkit.distributed.split_plan`);
            ``None``: every job on one owner.
    """
    holders = [holders_of(job.held) for job in jobs]  # shared by jobs laid out alike: derived once
    for job, held in zip(jobs, holders, strict=True):
        _check_job(job, held, world_size)
    shapes = choose_splits(jobs, costs, world_size, split) if split is not None else {}
    owners = _owners(jobs, holders, [0.0 if j in shapes else c for j, c in enumerate(costs)], world_size, tolerance)
    for j in shapes:
        owners[j] = -1
    sent = [0] * world_size
    order = sorted(range(len(jobs)), key=lambda j: (-costs[j], j))
    chosen: dict[int, Sequence[Piece]] = {}
    for j in order:
        chosen[j] = _sources(jobs[j].held, holders[j], owners[j], sent) if owners[j] >= 0 else ()
    by_key: dict[Hashable, list[int]] = {}
    for j in order:  # a group's position: that of its largest job
        if owners[j] >= 0:
            by_key.setdefault(keys[j] if keys is not None else None, []).append(j)
    splits: tuple[Split, ...] = ()
    if shapes:
        assert split is not None
        load = rank_loads(owners, (), costs, world_size)
        splits = place_splits(jobs, shapes, load, costs=costs, cost=split, sent=sent, tolerance=tolerance)
    return Plan(
        jobs=tuple(jobs),
        owners=tuple(owners),
        sources=tuple(chosen[j] for j in range(len(jobs))),
        groups=tuple(tuple(sorted(members)) for members in by_key.values()),
        splits=splits,
    )


def choose_owners(
    jobs: Sequence[Job], costs: Sequence[float], world_size: int, *, tolerance: float = TOLERANCE
) -> list[int]:
    """The owner of each job (see the module docstring); -1 for a job with no pieces (zero-size).

    Deterministic: ties go to the lowest rank, equal costs keep job order. One pass over each free
    job's holders (the least-loaded rank is kept in a heap): O(jobs log W + pieces).
    """
    return _owners(jobs, [holders_of(job.held) for job in jobs], costs, world_size, tolerance)


def _owners(
    jobs: Sequence[Job], holders: Sequence[Holders], costs: Sequence[float], world_size: int, tolerance: float
) -> list[int]:
    if world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}: must be >= 1")
    if len(costs) != len(jobs) or not all(c >= 0 for c in costs):
        raise ValueError(f"Invalid costs={list(costs)!r}: need one cost >= 0 per job ({len(jobs)} jobs)")
    load = [0.0] * world_size
    owners = [-1] * len(jobs)
    free = []
    for j, job in enumerate(jobs):
        held = holders[j].held
        if not held:
            continue  # zero-size: no owner, nothing to compute
        if len(held) == 1 and next(iter(held.values())) >= job.numel:
            owners[j] = next(iter(held))  # whole on one rank only: computed where it lies
            load[owners[j]] += costs[j]
        else:
            free.append(j)
    slack = tolerance * (sum(costs) / world_size)
    least = _Least(load)
    for j in sorted(free, key=lambda j: (-costs[j], j)):
        floor, lowest = least.top()
        owner = _near_holder(holders[j].held, load, floor + slack, jobs[j].numel)
        if owner is None:
            owner = _idle_holder(holders[j].held, load, floor)
        owners[j] = lowest if owner is None else owner
        load[owners[j]] += costs[j]
        least.push(owners[j])
    return owners


def _near_holder(held: dict[int, int], load: list[float], limit: float, numel: int) -> int | None:
    """Among the holders loaded at most ``limit``: the least loaded of those holding all ``numel``
    elements, else of those holding some (ties: most elements held, then the lowest rank)."""
    if not numel:  # holds nothing: every near rank holds "all" of it; the least loaded one takes it
        return None
    whole = part = None
    for rank, n in held.items():
        if n and load[rank] <= limit:
            key = (load[rank], -n, rank)
            if n >= numel:
                whole = key if whole is None or key < whole else whole
            else:
                part = key if part is None or key < part else part
    best = whole or part
    return None if best is None else best[2]


def _idle_holder(held: dict[int, int], load: list[float], floor: float) -> int | None:
    """No holder is near (a negative tolerance): the holder at the least load holding most, if any."""
    best = None
    for rank, n in held.items():
        if n and load[rank] == floor and (best is None or (-n, rank) < best):
            best = (-n, rank)
    return None if best is None else best[1]


class _Least:
    """The least-loaded rank (lowest rank among equal loads) as loads only grow: a lazy heap."""

    def __init__(self, load: list[float]) -> None:
        self.load = load
        self.heap = [(x, r) for r, x in enumerate(load)]
        heapq.heapify(self.heap)

    def top(self) -> tuple[float, int]:
        while self.heap[0][0] != self.load[self.heap[0][1]]:  # an entry from before the rank grew
            heapq.heappop(self.heap)
        return self.heap[0]

    def push(self, rank: int) -> None:
        heapq.heappush(self.heap, (self.load[rank], rank))


def choose_sources(job: Job, owner: int, sent: list[int]) -> Sequence[Piece]:
    """One holder per distinct region of ``job``: the owner if it holds it, else the holder that
    has sent the fewest elements so far (``sent``, per rank, updated here).

    Pieces of the job's ``held``, in order of their regions' first appearance: the same kind of
    sequence (a tuple, or :class:`~muonkit.distributed.pieces.Pieces`; ``held`` itself when no
    region is held twice)."""
    return _sources(job.held, holders_of(job.held), owner, sent)


def _sources(pieces: Sequence[Piece], holders: Holders, owner: int, sent: list[int]) -> Sequence[Piece]:
    ranks, numels = holders.ranks, holders.numels
    if holders.unique:  # each region held once: every piece is its region's source
        for rank, n in zip(ranks, numels, strict=True):
            if rank != owner:
                sent[rank] += n
        return pieces if isinstance(pieces, Pieces | tuple) else tuple(pieces)
    chosen = []
    for index in holders.distinct:
        pick = next((i for i in index if ranks[i] == owner), None)
        if pick is None:
            pick = min(index, key=lambda i: (sent[ranks[i]], ranks[i]))
            sent[ranks[pick]] += numels[pick]
        chosen.append(pick)
    if isinstance(pieces, Pieces):
        return pieces.subset(chosen)
    return tuple(pieces[i] for i in chosen)


def _check_job(job: Job, holders: Holders, world_size: int) -> None:
    """A reader's invariant: the distinct held regions cover the job exactly (internal errors)."""
    for pieces in (job.held, job.needed):
        ranks = holders.ranks if pieces is job.held else holders_of(pieces).ranks
        if ranks and not (min(ranks) >= 0 and max(ranks) < world_size):
            piece = next(p for p in pieces if not 0 <= p.rank < world_size)
            raise ValueError(
                f"Piece {piece} of tensor {job.tensor} names rank {piece.rank}; the group has {world_size}"
            )
    if holders.covered != job.numel:
        raise ValueError(
            f"The held regions of tensor {job.tensor}'s job of shape {job.shape} cover {holders.covered} of its "
            f"{job.numel} elements; distinct regions must cover it once: {job.held}"
        )


def wire_dtype(config: MuonConfig, update: Tensor) -> torch.dtype:
    """The dtype orthogonalized matrices travel in: the compute dtype when it is narrower (lossless).

    Directions an update rule changes after the iteration are computed on the owner in the update
    dtype: they travel in it.
    """
    if config.rule.changes_directions:
        return update.dtype
    compute = config.ns_dtype if config.ns_dtype is not None else default_compute_dtype(update.device)
    return compute if compute.itemsize < update.dtype.itemsize else update.dtype


def scale_of(job: Job, region: Region, adjust_lr: str | None, *, like: Tensor) -> float | Tensor:
    """The lr shape scale of ``region`` of ``job``: a float when every block has the same scale,
    else a flat tensor (``like``'s dtype and device) of each element's scale in storage order
    (:func:`~muonkit.functional.muon.tensor_scale` read at ``region``)."""
    whole = tensor_scale(job.shape, job.layout, adjust_lr, like=like)
    return whole if isinstance(whole, float) else region.read(whole)
