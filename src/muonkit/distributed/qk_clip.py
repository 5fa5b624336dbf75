"""QK-Clip across ranks: the one all-reduce of the logit maxima, and which rows of a param a rank holds.

Every data-parallel rank sees other micro-batches, so the maxima are reduced with MAX over the
ranks (all layers' maxima concatenated: one collective per step); every rank then computes the
same factors and rescales the part of each q/k weight it holds: the whole tensor under DDP, its
rows (or any box a DTensor placement gives it) under FSDP2 and N-D meshes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonkit.distributed.collectives import flag_device, group_of

__all__ = ["all_reduce_max_", "local_index_runs", "local_tensor", "reduction_device"]


def _active(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group_of(group)) > 1


def reduction_device(group: Any, fallback: torch.device) -> torch.device:
    """Where the maxima are reduced: the backend's device (:func:`flag_device`), ``fallback`` alone."""
    return flag_device(group_of(group)) if _active(group) else fallback


def all_reduce_max_(values: Tensor, group: Any = None) -> None:
    """``values`` <- elementwise max over the ranks of ``group`` (default: the world); no-op alone."""
    if _active(group):
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group_of(group))


def local_tensor(param: Tensor) -> Tensor:
    """The storage this rank updates: a DTensor's local shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def local_index_runs(param: Tensor, dim: int) -> tuple[tuple[int, int], ...]:
    """The global index runs ``(start, stop)`` of ``dim`` that this rank's local tensor holds, in storage order.

    A plain tensor holds all of it; a DTensor what its placements give this mesh coordinate
    (``Shard``, ``_StridedShard`` and uneven splits included, as the optimizer reads them).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return ((0, param.shape[dim]),)
    from muonkit.distributed.dtensor_layout import check_placements, mesh_boxes

    mesh, shape = param.device_mesh, tuple(param.shape)
    spec = param._spec
    order = None if getattr(spec, "use_strided_shard_as_shard_order", True) else spec.shard_order
    check_placements(shape, param.placements, mesh.shape, shard_order=order)
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not on the param's mesh: it holds nothing
        return ()
    box = mesh_boxes(shape, tuple(param.placements), tuple(mesh.shape))[tuple(coordinate)]
    return box.runs[dim]
