"""Single device: every tensor is whole and local."""

from __future__ import annotations

import functools

from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Strategy
from muonkit.functional.muon import muon_directions


class SingleDeviceStrategy(Strategy):
    """All matrices on this process; same-shape matrices batched into one call."""

    name = "single"

    def muon_directions(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Tensor]:
        hook = functools.partial(self.count_batch, steps=config.steps)
        return muon_directions(updates, [config.layout] * len(updates), config.ns_options, on_batch=hook)
