"""Distribution strategies: where tensors live and how whole matrices are assembled.

:func:`select_strategy` is the one place that decides which strategy an optimizer uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from muonkit._compat import dtensor_params, requires_torch_for_meshes
from muonkit.distributed.base import Strategy, StrategyStats
from muonkit.distributed.collectives import RankFailedError
from muonkit.distributed.replicated import ReplicatedStrategy
from muonkit.distributed.single import SingleDeviceStrategy
from muonkit.distributed.split_plan import SplitPolicy

__all__ = [
    "DTensorStrategy",
    "RankFailedError",
    "ReplicatedStrategy",
    "SingleDeviceStrategy",
    "SplitPolicy",
    "Strategy",
    "StrategyStats",
    "select_strategy",
    "world_size",
]


def world_size() -> int:
    """The default process group's size, 1 when torch.distributed is not initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def select_strategy(
    params: Iterable[Tensor], *, process_group: Any | None = None, compare_ranks: bool = False
) -> Strategy:
    """Pick the strategy for these params.

    ============================================  =========================================
    params / arguments                            strategy
    ============================================  =========================================
    DTensors (FSDP2, HSDP, TP, EP, any mesh)      :class:`DTensorStrategy` on their mesh(es)
    plain tensors, ``process_group=`` given       :class:`ReplicatedStrategy` (DDP)
    (a ProcessGroup or a 1-D DeviceMesh)
    plain tensors, torch.distributed not          :class:`SingleDeviceStrategy`
    initialized or world size 1
    plain tensors, world size > 1, no group,      :class:`ReplicatedStrategy` over every rank,
    ``compare_ranks=True``, every rank holding    its gradients checked equal on every rank
    the same param shapes and dtypes in order     at every step (``verify_grads``)
    plain tensors, world size > 1, no group,      ``ValueError`` on every rank: pipeline stages
    ``compare_ranks=True``, params that differ    or per-rank models; say which group
    plain tensors, world size > 1, no group       ``ValueError``: say which you mean
    ============================================  =========================================

    ``compare_ranks=True`` compares the ranks' params in one tiny collective over every rank
    (:func:`~muonkit.distributed.guard.ranks.same_on_every_rank`): call it on every rank at the same
    point (:class:`muonkit.HybridMuon` does at its first ``step()``). It is what accelerate's and
    Lightning's DDP need: their optimizers are built from the plain model, without a group. Same
    shapes do not make replicas (each rank may train its own model): the gradients are compared
    every step, and ranks whose gradients differ raise instead of drifting apart. An optimizer
    that only some ranks step (a probe trained on rank 0) would wait there for the others: give it
    ``strategy=SingleDeviceStrategy()`` (or the ``process_group=`` of the ranks that step it).

    To run an independent single-device optimizer on each rank (no communication, e.g. each
    rank trains its own model), pass ``strategy=muonkit.distributed.SingleDeviceStrategy()`` to
    the optimizer instead.
    """
    params = list(params)
    dtensors = _dtensors(params)
    if dtensors:
        return _dtensor_strategy(params, dtensors, process_group)
    if process_group is not None:
        return ReplicatedStrategy(process_group)
    if world_size() > 1 and compare_ranks:
        return _replicas_or_refuse(params)
    if world_size() > 1:
        raise ValueError(
            f"torch.distributed is initialized with world size {dist.get_world_size()} and the params are plain "
            "tensors, so HybridMuon cannot tell how they are shared. Pass process_group=torch.distributed.group.WORLD "
            "(or the group DistributedDataParallel averages gradients over) if the model is wrapped in DDP: each "
            "matrix is then orthogonalized once across ranks. Pass strategy=muonkit.distributed.SingleDeviceStrategy() "
            "to run an independent single-device optimizer on each rank. (FSDP2 fully_shard params are DTensors and "
            "need neither. HybridMuon's first step() chooses ReplicatedStrategy by itself where every rank holds the "
            "same params; read opt.strategy after it.)"
        )
    return SingleDeviceStrategy()


def _replicas_or_refuse(params: list[Tensor]) -> Strategy:
    """Plain params at world size > 1 without a group: replicas (DDP) over every rank if every rank
    holds the same shapes and dtypes in the same order, else refused alike on every rank."""
    from muonkit.distributed.collectives import every_rank
    from muonkit.distributed.guard.ranks import Setting, same_on_every_rank

    strategy = ReplicatedStrategy(dist.group.WORLD, verify_grads=True)
    shapes = [(tuple(p.shape), str(p.dtype)) for p in params]
    if same_on_every_rank(strategy.comm, Setting("params (shapes and dtypes, in order)", repr(shapes))):
        return strategy
    raise every_rank(
        ValueError(
            f"torch.distributed is initialized with world size {dist.get_world_size()}, the params are plain tensors "
            f"and the ranks hold different ones (here {len(params)} params): pipeline stages, or a model per rank. "
            "HybridMuon cannot take them for DDP replicas. Pass process_group= the group of the ranks that hold the "
            "same params and average their gradients (a pipeline stage's data-parallel group; one optimizer per "
            "stage), or strategy=muonkit.distributed.SingleDeviceStrategy() to run an independent optimizer on each "
            "rank"
        )
    )


def _dtensors(params: list[Tensor]) -> list[Tensor]:
    return dtensor_params(params)  # not imported: no DTensor can exist (saves ~1 s); too old a torch: named error


def _dtensor_strategy(params: list[Tensor], dtensors: list[Any], process_group: Any | None) -> Strategy:
    from torch.distributed.tensor import Shard

    from muonkit.distributed.collectives import group_of
    from muonkit.distributed.dtensor import DTensorStrategy

    sharded = {id(p) for p in dtensors}
    plain = [p for p in params if id(p) not in sharded]
    fsdp_only = all(p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) for p in dtensors)
    if plain and fsdp_only:
        raise ValueError(
            f"HybridMuon got {len(dtensors)} DTensor params (FSDP2) and {len(plain)} plain tensors: "
            "apply fully_shard so that every parameter is sharded (shard the root module too: fully_shard(model)), "
            "or give the plain tensors to a separate optimizer"
        )
    meshes = list(dict.fromkeys(p.device_mesh for p in dtensors))
    requires_torch_for_meshes(meshes)
    group = None if process_group is None else group_of(process_group)
    return DTensorStrategy(meshes, process_group=group, replicated=plain)


def __getattr__(name: str) -> Any:
    if name == "DTensorStrategy":  # imported lazily: torch.distributed.tensor takes ~1 s to import
        from muonkit.distributed.dtensor import DTensorStrategy

        return DTensorStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
