"""A test-only strategy for any DTensor layout: the obviously right, wasteful one.

It exists to check the mesh scenarios themselves (``MUONKIT_MESH_NAIVE=1``, see
:mod:`mesh_placements`): every rank gathers every whole update (``full_tensor()``, whatever the
placements: Replicate, Shard on any dim, ``_StridedShard``), orthogonalizes every matrix itself
with the single-device math (:func:`muonkit.functional.muon.muon_directions`) and keeps its own
local part (``distribute_tensor`` without communication). So it matches the single-device control
wherever a correct strategy must, and it does every matrix on every rank: the exactly-once checks
must fail with it, which proves they can fail.

Never used by the library; never the default.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Strategy
from muonkit.distributed.guard import Guard
from muonkit.functional.muon import muon_directions


class NaiveMeshStrategy(Strategy):
    """Gather everything, orthogonalize everything on every rank, keep the local part."""

    name = "naive-mesh"

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__()
        meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
        ranks = {r for m in meshes for r in m.mesh.flatten().tolist()}
        if len(ranks) == dist.get_world_size():
            self.group: Any = dist.group.WORLD
        elif len(meshes) == 1 and next(iter(meshes)).ndim == 1:
            self.group = next(iter(meshes)).get_group()  # a pipeline stage's own sub-mesh
        else:
            raise NotImplementedError(f"naive strategy: params on {meshes} span ranks {sorted(ranks)}")

    def local(self, t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def new_state(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.zeros_like(param, dtype=dtype)  # a DTensor laid out like the param

    @functools.cached_property
    def guard(self) -> Guard:
        return _NaiveGuard(self.group)

    def muon_directions(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Tensor]:
        whole = [_whole(p, u) for p, u in zip(params, updates, strict=True)]
        hook = functools.partial(self.compute.count, config=config)
        found = muon_directions(whole, [config.layout] * len(whole), config.ns_options, on_batch=hook)
        return [_local_part(p, d, u) for p, d, u in zip(params, found, updates, strict=True)]


class _NaiveGuard(Guard):
    """One device's guard, but its verdicts AND-ed over the group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def all_true(self, flags: Tensor) -> list[bool]:
        verdicts = flags.reshape(-1).to(torch.int32)
        dist.all_reduce(verdicts, op=dist.ReduceOp.MIN, group=self.group)
        return [bool(v) for v in verdicts.tolist()]


def whole(t: Tensor) -> Tensor:
    """``t.full_tensor()`` for a DTensor (collective), ``t`` itself otherwise.

    FSDP2 gives some empty shards a local shape of its own (an expert stack with no expert here,
    sharded on dim 1: ``(0, 0, 6)`` where DTensor expects ``(0, 2, 6)``), which ``full_tensor()``
    rejects (torch 2.13); such a shard is replaced by an empty one of DTensor's shape.
    """
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    expected = _standard_local_shape(t)
    if local.shape != expected and local.numel() == 0:
        t = DTensor.from_local(
            local.new_empty(expected), t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False
        )
    return t.full_tensor()


def _standard_local_shape(t: DTensor) -> torch.Size:
    empty = torch.empty(t.shape, device="meta")
    return distribute_tensor(empty, t.device_mesh, t.placements, src_data_rank=None).to_local().shape


def _whole(p: Tensor, update: Tensor) -> Tensor:
    if not isinstance(p, DTensor):
        return update
    return whole(
        DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    )


def _local_part(p: Tensor, direction: Tensor, update: Tensor) -> Tensor:
    if not isinstance(p, DTensor):
        return direction
    local = distribute_tensor(direction, p.device_mesh, p.placements, src_data_rank=None).to_local()
    if local.shape != update.shape and local.numel() == update.numel() == 0:
        return update  # an empty shard FSDP2 shapes its own way, e.g. (0, 0, 6)
    return local.contiguous()
