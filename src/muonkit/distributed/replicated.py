"""Replicated params (DDP): each matrix orthogonalized on one owner rank, results shared.

Under ``DistributedDataParallel`` every rank holds every parameter whole and, after the backward
pass, the same averaged gradient. The elementwise work (momentum, AdamW) is cheap and runs on
every rank, so **optimizer state is replicated**: ``state_dict()`` is complete and identical on
every rank, a checkpoint needs no gather, and it loads at any world size. (Keeping momentum only
on owners, as Keller Jordan's reference does, saves memory but makes checkpoints differ per rank;
FSDP2 and ZeRO are the placements that shard state.)

Orthogonalization is the expensive part, and each matrix needs it only once. Each matrix (each
expert of a 3D stack, each ``split_sizes`` block; a transposed tensor as a whole) is a
:class:`~muonkit.distributed.pieces.Job` held whole by every rank (:func:`whole_jobs`). The planner (:mod:`muonkit.distributed.planner`) gives each one owner,
balancing Newton-Schulz cost (largest first, least-loaded rank); every rank computes the same
owners from the shapes alone. Nothing needs to travel to owners, so per set of matrix shapes the
executor (:mod:`muonkit.distributed.executor`) orthogonalizes this rank's jobs in one batched call
and sends every other rank the results in one ``all_to_all``, which travels while the next set is
orthogonalized.

Results travel in the Newton-Schulz compute dtype (bf16 by default): ``orthogonalize`` computes
in that dtype and only casts up at the end, so sending it is lossless and halves the bytes; the
shape scale is applied after the transfer, in the update dtype, exactly as on one device. Each
matrix is orthogonalized from the same values as on one device (normalized from a contiguous
copy, so its storage does not matter either), but in a batch of other matrices: states are
bit-identical to :class:`SingleDeviceStrategy`, and params are too wherever the batched matrix
products give each matrix the same result whatever the batch (the x86 CPUs we ran); a kernel that
does not may move them by its rounding (tests allow 1e-4 of a param's travel in fp32, 2e-2 in bf16).

Example (under ``torchrun``)::

    model = DistributedDataParallel(model)
    opt = muonkit.HybridMuon(muonkit.param_groups(model.module), process_group=dist.group.WORLD)
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any

from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.guard import CollectiveGuard, ReplicaGuard
from muonkit.distributed.pieces import At, Box, Expert, Holders, Job, Pieces, Region, Span
from muonkit.functional.matrices import MatrixLayout

__all__ = ["ReplicatedStrategy", "whole_jobs"]

_MATRIX = MatrixLayout("matrix")


class ReplicatedStrategy(PlannedStrategy):
    """Whole params on every rank (DDP); each matrix orthogonalized once, by its owner.

    ``verify_grads``: check every step that the gradients are the same on every rank
    (:class:`~muonkit.distributed.guard.ReplicaGuard`), for params taken as replicas because every
    rank holds the same shapes rather than because the user said so with ``process_group=``.
    """

    name = "replicated"

    def __init__(self, process_group: Any, *, verify_grads: bool = False) -> None:
        super().__init__(process_group)
        self.verify_grads = verify_grads

    @functools.cached_property
    def guard(self) -> CollectiveGuard:
        """:class:`~muonkit.distributed.guard.CollectiveGuard`, or with ``verify_grads`` its
        :class:`~muonkit.distributed.guard.ReplicaGuard`."""
        if self.verify_grads:
            return ReplicaGuard(self.comm, strategy=self.name)
        return CollectiveGuard(self.comm, strategy=self.name)

    def placement_key(self, params: list[Tensor], updates: list[Tensor]) -> Hashable:
        del params
        return tuple((tuple(u.shape), u.dtype) for u in updates)

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        del params  # whole and local: the updates say everything
        world = range(self.comm.world_size)
        return [
            job
            for i, u in enumerate(updates)
            if u.numel()
            for job in whole_jobs(i, tuple(u.shape), config.layout, world)
        ]


def whole_jobs(tensor: int, shape: tuple[int, ...], layout: MatrixLayout, ranks: Sequence[int]) -> list[Job]:
    """The jobs of a tensor every rank in ``ranks`` holds whole (index ``tensor`` of the call).

    One job per matrix (each expert of a stack, each ``split_sizes`` block) wherever the matrix
    lies contiguously in the tensor, so that the planner balances matrices, not tensors; one job
    for the whole tensor otherwise (a transposed layout's blocks are columns of its storage, a
    column split's blocks columns of the matrix).
    The copies of one region on ``ranks`` are one shared :class:`~muonkit.distributed.pieces.Holders`.
    """
    ranks = tuple(ranks)
    kind = layout.resolved(len(shape))
    if kind == "transposed" or layout.splits_cols or (kind != "experts" and layout.split_sizes is None):
        return [Job(tensor, shape, layout, Pieces(_copies(Box.full(shape), ranks)))]
    count, rows, cols = layout.base_shape(shape)
    if layout.split_sizes is None:  # experts: where=Expert(k) views matrix k of the stack
        matrix = (rows, cols)
        copies = _copies(Box.full(matrix), ranks)
        return [Job(tensor, matrix, _MATRIX, Pieces(copies, Expert(k))) for k in range(count)]
    jobs = []
    for k in range(count):  # split blocks: rows [start, start + size) of matrix k, a flat range
        start = k * rows
        for size in layout.split_sizes:
            held = Pieces(_copies(Span(0, size * cols), ranks), At(start * cols))
            jobs.append(Job(tensor, (size, cols), _MATRIX, held))
            start += size
    return jobs


@functools.lru_cache(maxsize=1024)
def _copies(region: Region, ranks: tuple[int, ...]) -> Holders:
    return Holders(ranks, (region,) * len(ranks))
