"""Replicated params (DDP): each matrix orthogonalized on one owner rank, results shared.

Under ``DistributedDataParallel`` every rank holds every parameter whole and, after the backward
pass, the same averaged gradient. The elementwise work (momentum, AdamW) is cheap and runs on
every rank, so **optimizer state is replicated**: ``state_dict()`` is complete and identical on
every rank, a checkpoint needs no gather, and it loads at any world size. (Keeping momentum only
on owners, as Keller Jordan's reference does, saves memory but makes checkpoints differ per rank;
FSDP2 and ZeRO are the layouts that shard state.)

Orthogonalization is the expensive part, and each matrix needs it only once. Each whole tensor (each expert of a 3D stack) is a :class:`~muonkit.distributed.pieces.Job`
held whole by every rank. The planner (:mod:`muonkit.distributed.planner`) gives each one owner,
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

from typing import Any

from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.pieces import Box, Expert, Job, Piece
from muonkit.functional.matrices import MatrixLayout

__all__ = ["ReplicatedStrategy"]


class ReplicatedStrategy(PlannedStrategy):
    """Whole params on every rank (DDP); each matrix orthogonalized once, by its owner."""

    name = "replicated"

    def __init__(self, process_group: Any) -> None:
        super().__init__(process_group)

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        del params  # whole and local: the updates say everything
        world = range(self.comm.world_size)
        return [job for i, u in enumerate(updates) if u.numel() for job in whole_jobs(i, tuple(u.shape), config, world)]


def whole_jobs(tensor: int, shape: tuple[int, ...], config: MuonConfig, ranks: range) -> list[Job]:
    """The jobs of a tensor every rank in ``ranks`` holds whole: one per expert of a stack, else one."""
    if config.layout.resolved(len(shape)) != "experts":
        return [Job(tensor, shape, config.layout, tuple(Piece(r, Box.full(shape)) for r in ranks))]
    matrix = shape[-2:]
    layout = MatrixLayout("matrix", config.layout.split_sizes)
    count = config.layout.base_shape(shape)[0]
    return [
        Job(tensor, matrix, layout, tuple(Piece(r, Box.full(matrix), Expert(k)) for r in ranks)) for k in range(count)
    ]
