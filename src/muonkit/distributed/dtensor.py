"""DTensor params on any device mesh (FSDP2, HSDP, tensor / expert parallel, pipeline stages): a layout reader.

``fully_shard``, ``parallelize_module`` and ``distribute_tensor`` store each parameter, its
gradient and (here) its optimizer state as a DTensor: a global shape, a device mesh and one
placement per mesh dim (``Shard(d)``, ``_StridedShard(d, split_factor=f)`` when FSDP2 shards a
tensor-parallel param, ``Replicate()``). Momentum and AdamW are elementwise and run on the local
tensors. For orthogonalization :mod:`muonkit.distributed.dtensor_placement` says which part of the
whole tensor every rank holds (a :class:`~muonkit.distributed.pieces.Box`: row blocks, column
blocks, strided row sets, their products, whole replicated copies) and cuts each Muon param into
:class:`~muonkit.distributed.pieces.Job` s: one per tensor, one per expert matrix of a stack.

The one planner picks one owner per job over every rank of the mesh (not once per replica: an
HSDP or TP layout is orthogonalized once, not once per replica group), preferring ranks that hold
most of it; the executor (:mod:`muonkit.distributed.executor`) brings the pieces there, replicated
copies sent once, and each holder its region of the result. Directions match
:class:`SingleDeviceStrategy` as :mod:`muonkit.distributed.replicated` says: states bit for bit,
params too where batched products are batch-size independent.

Params on several meshes are one layout when the meshes span the same ranks (dense layers on a
flattened ``dp`` mesh, experts on ``(ep, dp)``) or are named sub-meshes of one root mesh (a layer
left out of tensor parallelism, ``fully_shard``-ed on ``dp`` of ``(dp, tp)``: replicated over
``tp``); see :func:`~muonkit.distributed.dtensor_placement.mesh_group`.

Plain params beside TP DTensors (the norms ``parallelize_module`` or a transformers ``tp_plan``
leaves plain) are read as whole copies on every rank; each step checks that every rank has the
same gradients for them (a fingerprint checked with the non-finite verdict), so a plain param whose gradient
nobody averaged raises instead of drifting. Beside FSDP2-only params (``Shard(0)`` on one 1-D
mesh) plain params are refused: there they mean ``fully_shard`` was not applied to the root.

Example (under ``torchrun``, any of FSDP2, HSDP, TP, FSDP2 + TP, EP; under pipeline
parallelism one optimizer per stage, over that stage's params)::

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = muonkit.HybridMuon(muonkit.param_groups(model))  # picks this strategy from the DTensors
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Held
from muonkit.distributed.dtensor_placement import block_state, mesh_group, tensor_jobs
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.guard import MeshGuard
from muonkit.distributed.parallelism import parallelism_name
from muonkit.distributed.pieces import Box, Job

__all__ = ["DTensorStrategy"]


class DTensorStrategy(PlannedStrategy):
    """DTensor params on one or more device meshes of any dimension, over one process group.

    ``mesh``: the params' device mesh, or a sequence of them (see the module docstring);
    ``process_group``: the group to use (default: one over every rank of the meshes, see
    :func:`~muonkit.distributed.dtensor_placement.mesh_group`).
    """

    name = "fsdp2"  # or "hsdp", "tp", "fsdp2+tp", "ep+fsdp2"...: set from the meshes (parallelism_name)

    def __init__(
        self,
        mesh: DeviceMesh | Sequence[DeviceMesh],
        *,
        process_group: Any | None = None,
        replicated: Sequence[Tensor] = (),
    ) -> None:
        meshes = [mesh] if isinstance(mesh, DeviceMesh) else list(mesh)
        self.mesh_group = mesh_group(meshes, process_group=process_group)
        super().__init__(self.mesh_group.group)
        self.meshes = meshes
        self.name = parallelism_name(meshes)
        self.mesh = meshes[0]
        self.replicated = list(replicated)
        self._jobs: dict[Any, list[Job]] = {}  # a param's jobs depend only on its layout: built once
        self._box_cache: dict[Any, Sequence[Any]] = {}  # by DTensor spec (mesh, placements, shape)

    @functools.cached_property
    def guard(self) -> MeshGuard:
        """Also aligns gradients placed otherwise than their params and checks that the plain params
        replicated beside the DTensors have the same gradients on every rank (:class:`~muonkit.distributed.guard.MeshGuard`)."""
        return MeshGuard(self.comm, strategy=self.name, replicated=self.replicated)

    def local(self, t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def new_state(self, param: Tensor, dtype: torch.dtype, *, blocks: int | None = None) -> Tensor:
        if blocks is None or not isinstance(param, DTensor):
            return super().new_state(param, dtype, blocks=blocks)  # a DTensor keeps the param's mesh and placements
        return block_state(param, dtype, blocks)

    def regions(self, param: Tensor) -> tuple[Held, ...]:
        """This rank's box of the DTensor ``param`` (its ``to_local()``, in storage order); a plain
        param replicated beside the DTensors: the whole of it. Raises ``ValueError`` as :meth:`check_params`."""
        return (Held(tuple(param.shape), dict(self._boxes(param))[self.comm.rank]),)

    def check_params(self, params: list[Tensor]) -> None:
        for param in params:
            self._boxes(param)

    def placement_key(self, params: list[Tensor], updates: list[Tensor]) -> Hashable:
        return tuple(
            (tuple(p.shape), (tuple(p.placements), p.device_mesh) if isinstance(p, DTensor) else None, u.dtype)
            for p, u in zip(params, updates, strict=True)
        )

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        out = []
        for i, p in enumerate(params):
            spec = (tuple(p.placements), p.device_mesh) if isinstance(p, DTensor) else None
            key = (i, tuple(p.shape), spec, config.layout)
            jobs = self._jobs.get(key)
            if jobs is None:
                jobs = self._jobs[key] = tensor_jobs(i, tuple(p.shape), config.layout, self._boxes(p))
            out += jobs
        return out

    def _boxes(self, param: Tensor) -> Sequence[Any]:
        if not isinstance(param, DTensor):
            if any(param is p for p in self.replicated):  # a whole copy on every rank of the group
                return [(r, Box.full(tuple(param.shape))) for r in range(self.comm.world_size)]
            raise ValueError(
                f"{type(self).__name__} needs DTensor params; got a plain tensor of shape {tuple(param.shape)}"
            )
        if param.device_mesh not in self.mesh_group.ranks:
            raise ValueError(
                f"Invalid DTensor param of shape {tuple(param.shape)} on {param.device_mesh!r}: this optimizer's "
                f"params live on {self.meshes!r}; build the optimizer over all its params at once"
            )
        boxes = self._box_cache.get(param._spec)
        if boxes is None:  # index arithmetic on the host, once per layout (not every step's check)
            boxes = self._box_cache[param._spec] = self.mesh_group.boxes(param)
        mine, local = dict(boxes)[self.comm.rank], param.to_local()
        if tuple(local.shape) != mine.shape and local.numel() + mine.numel:  # FSDP2 may store nothing as (0, 0, c)
            raise ValueError(
                f"Unsupported DTensor param of shape {tuple(param.shape)} with placements {param.placements} on "
                f"{param.device_mesh!r}: its local tensor has shape {tuple(local.shape)} where torch's "
                f"sharding gives {mine.shape} (a DTensor.from_local with its own uneven pieces?); HybridMuon reads "
                "DTensors laid out as distribute_tensor, fully_shard and parallelize_module lay them out"
            )
        return boxes
