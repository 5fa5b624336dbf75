"""How :class:`muonkit.HybridMuon` comes to its distribution strategy, and what it may do before.

The strategy is chosen from the params the optimizer holds when it is first needed (the first
``step()`` or read of ``opt.strategy``), by :func:`muonkit.distributed.select_strategy`; an
explicit ``strategy=`` is used as given. Before the choice, the optimizer reads params the way
every automatic strategy does (:func:`placement_before_choice`). Only this module and the
distributed package look at DTensors, and only through ``sys.modules`` (:func:`muonkit._compat.dtensor_params`): where
``torch.distributed.tensor`` was never imported, no DTensor can exist.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit._compat import dtensor_params
from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed import SingleDeviceStrategy, Strategy, select_strategy
from muonkit.distributed.base import full_shape

PlacementReaders = tuple[Callable[[Tensor], list[tuple[int, ...]]], Callable[[Tensor], Tensor]]
"""A strategy's ``whole_shapes`` and ``local``."""


def check_strategy(strategy: Any, *, required: bool = False) -> None:
    """A strategy is a :class:`muonkit.distributed.Strategy` (or None: chosen at the first step)."""
    if isinstance(strategy, Strategy) or (strategy is None and not required):
        return
    allowed = "a muonkit.distributed.Strategy" + (
        "" if required else " or None (chosen from the params at the first step)"
    )
    raise TypeError(
        f"Invalid strategy={strategy!r}: must be {allowed}, e.g. muonkit.distributed.SingleDeviceStrategy() "
        "or ReplicatedStrategy(process_group); for DDP pass process_group= instead"
    )


def check_process_group(process_group: Any, strategy: Strategy | None) -> None:
    """``process_group=`` needs torch.distributed initialized (unless an explicit strategy takes over)."""
    if process_group is not None and strategy is None and not distributed_initialized():
        raise ValueError(
            "process_group= was given but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first (build the optimizer after it, e.g. after Accelerator())"
        )


def distributed_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def dtensors(params: Sequence[Tensor]) -> list[Tensor]:
    """The DTensors among ``params``."""
    return dtensor_params(params)


def local_view(t: Tensor) -> Tensor:
    """The part of ``t`` this rank stores: a DTensor's local shard, any other tensor itself."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return t.to_local() if cls is not None and isinstance(t, cls) else t


def choose_strategy(
    params: list[Tensor], *, process_group: Any, built_distributed: bool, compare_ranks: bool = False
) -> Strategy:
    """The strategy for ``params``; ``built_distributed``: whether the optimizer was built at world size > 1
    (if not, a refusal says to build it after torch.distributed is initialized).

    ``compare_ranks``: every rank chooses now, at the same point (the first ``step()``), so plain
    params without ``process_group=`` may be compared across ranks and taken for DDP replicas
    (:func:`muonkit.distributed.select_strategy`): what accelerate's and Lightning's DDP need, whose
    optimizers are built from the plain model. A read of ``opt.strategy`` before the first step
    may happen on one rank only, so it never compares (a collective there would hang).
    """
    try:
        return select_strategy(params, process_group=process_group, compare_ranks=compare_ranks)
    except ValueError as e:
        if compare_ranks or built_distributed or process_group is not None or dtensors(params):
            raise
        raise ValueError(
            f"{e} This HybridMuon was built before torch.distributed was initialized (e.g. before "
            "accelerate's Accelerator()): build it afterwards with process_group=torch.distributed.group.WORLD, "
            "or call opt.set_strategy(muonkit.distributed.ReplicatedStrategy(torch.distributed.group.WORLD)) "
            "before the first step."
        ) from None


def agree_before_refusing(
    params: list[Tensor],
    *,
    process_group: Any,
    groups: Sequence[Mapping[str, Any]],
    configs: Sequence[MuonConfig | AdamWConfig],
    nonfinite: str,
) -> None:
    """Join the other ranks' agreement before refusing a mix of DTensor and plain params.

    Ranks whose params differ (one holds a plain tensor beside the DTensors) choose differently:
    those that chose wait in their strategy's agreement collective. A strategy for the DTensors
    alone joins it, so that every rank raises the agreement's error instead of hanging; where
    all ranks hold the same mix, the agreement passes and every rank refuses it alike.
    """
    sharded = dtensors(params)
    if not sharded or len(sharded) == len(params):
        return
    try:
        probe = select_strategy(sharded, process_group=process_group)
    except (ValueError, NotImplementedError):
        return  # the DTensors alone are refused too: on every rank that holds them
    probe.guard.agree(groups, configs, nonfinite=nonfinite)


def placement_before_choice(strategy: Strategy | None) -> PlacementReaders:
    """``whole_shapes`` and ``local`` of ``strategy``, or before it is chosen, of every automatic one.

    Before the first step (``load_state_dict`` right after construction, as accelerate's
    ``prepare`` does before it swaps the params), choosing would fix the strategy for params
    that may not be the ones that step. Every automatic strategy reads a param the same way:
    its full shape, and a DTensor's local shard.
    """
    if strategy is not None:
        return strategy.whole_shapes, strategy.local
    return (lambda p: [full_shape(p)]), local_view


def refuse_copy(strategy: Strategy | None, *, process_group: Any, params: Sequence[Tensor]) -> None:
    """Only a single-device optimizer can be copied or pickled: a distributed strategy holds process groups."""
    if strategy is None:  # not chosen yet: distributed for sure with a group or DTensor params
        distributed = process_group is not None or bool(dtensors(params))
        name = "chosen from process_group= or DTensor params" if distributed else ""
    else:
        name = "" if isinstance(strategy, SingleDeviceStrategy) else type(strategy).__name__
    if name:
        raise TypeError(
            f"Cannot copy or pickle a HybridMuon with strategy {name}: only a "
            "single-device optimizer can be copied (a distributed strategy holds process groups). Save "
            "opt.state_dict() (or use muonkit.distributed.checkpoint) and load it into a new optimizer"
        )
