"""DTensor params sharded on dim 0 (FSDP2 ``fully_shard``): a layout reader for the one planner.

``fully_shard`` stores each parameter, its gradient and (here) its optimizer state as a DTensor
sharded on dim 0 over a 1-D mesh, in ``torch.chunk`` pieces: rank r holds rows
``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / W)``; trailing ranks may hold nothing. Momentum
and AdamW are elementwise and run on those local pieces. For orthogonalization each Muon tensor
is described as :class:`~muonkit.distributed.pieces.Job` s:

- a 3D+ expert stack (dim 0 counts experts, so each rank holds whole experts): one job per
  expert, held whole by its rank, which orthogonalizes it (nothing is sent);
- any other tensor: one job whose rank r holds the row box ``[start_r, stop_r) x everything``.
  A tensor whose rows all sit on one rank stays there; the others get an owner balanced by
  Newton-Schulz cost (:mod:`muonkit.distributed.planner`).

The executor (:mod:`muonkit.distributed.executor`) sends, per set of matrix shapes, the row
pieces to owners in one ``all_to_all`` (the update dtype, exact) and each rank its rows of the
results in a second one (the Newton-Schulz compute dtype, lossless), with every gather started at
once, local matrices computed while they travel and each return overlapping the next
Newton-Schulz. Directions match :class:`SingleDeviceStrategy` as
:mod:`muonkit.distributed.replicated` says: states bit for bit, params too where batched
products are batch-size independent.

Example (under ``torchrun``)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = muonkit.HybridMuon(muonkit.param_groups(model))  # picks this strategy from the DTensors
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from muonkit.config import MuonConfig
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.pieces import Box, Expert, Job, Piece
from muonkit.functional.matrices import MatrixLayout

__all__ = ["DTensorStrategy", "dim0_sizes"]


def dim0_sizes(n: int, world_size: int) -> list[int]:
    """Rows of a ``Shard(0)`` tensor on each rank (``torch.chunk`` rule), e.g. 5 rows on 4 ranks: 2, 2, 1, 0."""
    chunk = -(-n // world_size)
    return [max(0, min(chunk, n - r * chunk)) for r in range(world_size)]


class DTensorStrategy(PlannedStrategy):
    """Params, grads and states sharded on dim 0 over a 1-D device mesh (FSDP2)."""

    name = "fsdp2"

    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"HybridMuon supports DTensor params on a 1-D device mesh (FSDP2 fully_shard); got a {mesh.ndim}-D mesh "
                f"{mesh!r} (HSDP and tensor parallelism are not supported yet)"
            )
        super().__init__(mesh.get_group())
        self.mesh = mesh

    def local(self, t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def new_state(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.zeros_like(param, dtype=dtype)  # a DTensor with the param's mesh and placements

    def check_params(self, params: list[Tensor]) -> None:
        for param in params:
            if not isinstance(param, DTensor):
                raise ValueError(
                    f"{type(self).__name__} needs DTensor params; got a plain tensor of shape {tuple(param.shape)}"
                )
            if param.device_mesh != self.mesh or tuple(param.placements) != (Shard(0),):
                raise ValueError(
                    f"Invalid DTensor param of shape {tuple(param.shape)}: placements {param.placements} on "
                    f"{param.device_mesh!r}; HybridMuon needs (Shard(0),) on {self.mesh!r} (FSDP2's default)"
                )

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        self.check_params(params)
        return [
            job for i, (p, u) in enumerate(zip(params, updates, strict=True)) for job in self._jobs(i, p, u, config)
        ]

    def _jobs(self, index: int, param: Tensor, update: Tensor, config: MuonConfig) -> list[Job]:
        shape = tuple(param.shape)
        sizes = dim0_sizes(shape[0], self.comm.world_size)
        if math.prod(shape) == 0:  # empty directions, nothing to send (FSDP2 shards it as (0, 0) everywhere)
            return []
        if update.size(0) != sizes[self.comm.rank]:
            raise RuntimeError(f"Local shard of a {shape} param has {update.size(0)} rows; expected {sizes}")
        starts = [sum(sizes[:r]) for r in range(len(sizes))]
        if config.layout.resolved(len(shape)) == "experts":  # whole experts on each rank: one job each
            matrix, per_row = shape[-2:], math.prod(shape[1:-2])
            layout = MatrixLayout("matrix", config.layout.split_sizes)
            return [
                Job(index, matrix, layout, (Piece(r, Box.full(matrix), Expert(k)),))
                for r, (start, n) in enumerate(zip(starts, sizes, strict=True))
                for k in range(n * per_row)
            ]
        rest = tuple(((0, d),) for d in shape[1:])
        held = tuple(
            Piece(r, Box((((start, start + n),), *rest)))
            for r, (start, n) in enumerate(zip(starts, sizes, strict=True))
            if n
        )
        return [Job(index, shape, config.layout, held)]
