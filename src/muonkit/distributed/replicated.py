"""Replicated params (DDP): each matrix orthogonalized on one owner rank, results shared.

Under ``DistributedDataParallel`` every rank holds every parameter whole and, after the backward
pass, the same averaged gradient. The elementwise work (momentum, AdamW) is cheap and runs on
every rank, so **optimizer state is replicated**: ``state_dict()`` is complete and identical on
every rank, a checkpoint needs no gather, and it loads at any world size. (Keeping momentum only
on owners, as Keller Jordan's reference does, saves memory but makes checkpoints differ per rank;
FSDP2 and ZeRO are the layouts that shard state.)

Orthogonalization is the expensive part, and each matrix needs it only once:

1. every matrix (each expert of a 3D tensor, each ``split_sizes`` block) is a job costing its
   Newton-Schulz FLOPs. Each rank owns ``n // W`` of the ``n`` matrices of every shape, and the
   remainders are spread by :func:`assign_owners` (largest first, to the least-loaded rank).
   Every rank computes the same assignment from the shapes alone (no communication);
2. for each matrix shape, largest total cost first, a rank orthogonalizes the matrices it owns
   in one batched call and starts an asynchronous all-gather of the results, then moves on to
   the next shape while that transfer runs;
3. once all transfers are done every rank scales and applies the same directions.

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

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.agreement import Setting
from muonkit.distributed.base import Strategy
from muonkit.distributed.collectives import Collectives, Pending, group_of
from muonkit.distributed.ownership import assign_owners
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_directions
from muonkit.functional.orthogonalize import default_compute_dtype

__all__ = ["ReplicatedStrategy", "wire_dtype"]

_STACKED = MatrixLayout("experts")  # a (n, rows, cols) stack: n matrices, nothing else


def wire_dtype(config: MuonConfig, update: Tensor) -> torch.dtype:
    """The dtype orthogonalized matrices travel in: the compute dtype when it is narrower (lossless)."""
    compute = config.ns_dtype if config.ns_dtype is not None else default_compute_dtype(update.device)
    return compute if compute.itemsize < update.dtype.itemsize else update.dtype


@dataclasses.dataclass(frozen=True)
class _Job:
    """Matrix ``index`` of block ``block`` of tensor ``tensor``."""

    tensor: int
    block: int
    index: int


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """The jobs of one matrix shape and dtype, in job order (the same on every rank)."""

    rows: int
    cols: int
    members: list[int]


class ReplicatedStrategy(Strategy):
    """Whole params on every rank (DDP); each matrix orthogonalized once, by its owner."""

    name = "replicated"

    def __init__(self, process_group: Any) -> None:
        super().__init__()
        self.comm = Collectives(group_of(process_group), self.stats)

    def all_true(self, flags: Tensor) -> list[bool]:
        return self.comm.all_ranks_true(flags)

    def check_participation(self, has_grad: Sequence[bool], settings: Callable[[], Sequence[Setting]] = list) -> None:
        self.comm.check_agreement([*settings(), Setting("strategy", self.name)], has_grad)

    def muon_directions(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Tensor]:
        del params  # whole and local: the updates say everything
        mats = [config.layout.to_matrices(u) for u in updates]
        jobs = [  # empty matrices (a zero-size param) have empty directions: no job
            _Job(t, b, i)
            for t, blocks in enumerate(mats)
            for b, m in enumerate(blocks)
            if m.numel()
            for i in range(m.size(0))
        ]
        keys = [(*mats[j.tensor][j.block].shape[1:], mats[j.tensor][j.block].dtype) for j in jobs]
        costs = [config.flops(rows, cols) for rows, cols, _ in keys]
        by_key: dict[Any, list[int]] = {}
        for k in sorted(range(len(jobs)), key=lambda k: (-costs[k], k)):  # largest shapes first
            by_key.setdefault(keys[k], []).append(k)
        buckets = [_Bucket(rows, cols, sorted(ks)) for (rows, cols, _), ks in by_key.items()]
        owners = _owners(buckets, costs, self.comm.world_size)
        pending = [self._orthogonalize_and_share(mats, jobs, b, owners, config) for b in buckets]
        # Directions are written over the updates (scratch, see Strategy) when the matrices are
        # views of them: the owners' inputs were copied by torch.stack before any write.
        in_place = all(_is_view_of(m, u) for blocks, u in zip(mats, updates, strict=True) for m in blocks)
        results = mats if in_place else [[torch.empty_like(m) for m in blocks] for blocks in mats]
        for work, bucket, pieces in pending:
            work.wait()
            for rank, piece in enumerate(pieces):
                owned = [k for k in bucket.members if owners[k] == rank]
                for k, matrix in zip(owned, piece.view(-1, bucket.rows, bucket.cols), strict=True):
                    results[jobs[k].tensor][jobs[k].block][jobs[k].index].copy_(matrix)
        for blocks in results:
            for block in blocks:  # after the transfer, in the update dtype, as on one device
                if block.numel():
                    block.mul_(lr_scale(config.adjust_lr, block.size(1), block.size(2)))
        if in_place:
            return updates
        return [config.layout.from_matrices(r, u.shape) for r, u in zip(results, updates, strict=True)]

    def _orthogonalize_and_share(
        self, mats: list[list[Tensor]], jobs: list[_Job], bucket: _Bucket, owners: list[int], config: MuonConfig
    ) -> tuple[Pending, _Bucket, list[Tensor]]:
        """Orthogonalize this rank's matrices of one shape (one batched call); start sharing them."""
        sample = mats[jobs[bucket.members[0]].tensor][jobs[bucket.members[0]].block]
        mine = [
            mats[jobs[k].tensor][jobs[k].block][jobs[k].index] for k in bucket.members if owners[k] == self.comm.rank
        ]
        wire = wire_dtype(config, sample)
        if mine:
            options = dataclasses.replace(config.ns_options, adjust_lr=None)  # scaled after the transfer
            hook = functools.partial(self.count_batch, config=config)
            out = muon_directions([torch.stack(mine)], [_STACKED], options, on_batch=hook)[0].to(wire)
        else:
            out = sample.new_empty((0, bucket.rows, bucket.cols), dtype=wire)
        sizes = [
            sum(owners[k] == r for k in bucket.members) * bucket.rows * bucket.cols for r in range(self.comm.world_size)
        ]
        work, pieces = self.comm.all_gather_uneven(out.reshape(-1), sizes)
        return work, bucket, pieces


def _owners(buckets: list[_Bucket], costs: list[int], world_size: int) -> list[int]:
    """Owner of each job: the same number of each shape per rank, the remainders balanced by cost.

    Every rank gets ``n // W`` of the ``n`` matrices of a shape (equal work, and equal sizes
    for the all-gather, which pads to the largest contribution); the ``n % W`` left over from
    every shape are spread by :func:`assign_owners`, largest first.
    """
    owners = [0] * len(costs)
    leftover: list[int] = []
    for bucket in buckets:
        per_rank = len(bucket.members) // world_size
        for pos, k in enumerate(bucket.members[: per_rank * world_size]):
            owners[k] = pos // per_rank
        leftover += bucket.members[per_rank * world_size :]
    for k, rank in zip(leftover, assign_owners([costs[k] for k in leftover], world_size), strict=True):
        owners[k] = rank
    return owners


def _is_view_of(view: Tensor, base: Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
