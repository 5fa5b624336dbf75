"""Distribution strategies: where tensors live and how whole matrices are assembled.

:func:`select_strategy` is the one place that decides which strategy an optimizer uses.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from muonkit.distributed.base import Strategy, StrategyStats
from muonkit.distributed.single import SingleDeviceStrategy

__all__ = ["SingleDeviceStrategy", "Strategy", "StrategyStats", "select_strategy"]


def select_strategy(params: Iterable[Tensor], *, process_group: object | None = None) -> Strategy:
    """Pick the strategy for these params.

    Single device unless the params are DTensors (FSDP2) or ``process_group`` is given (DDP).
    """
    del params
    if process_group is not None:
        raise NotImplementedError("process_group= (DDP) is not supported yet")
    return SingleDeviceStrategy()
