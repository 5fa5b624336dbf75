"""Single device: every tensor is whole and local."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Strategy
from muonkit.functional.muon import muon_directions


class SingleDeviceStrategy(Strategy):
    """All matrices on this process; same-shape matrices batched into one call."""

    name = "single"

    def __init__(self, *, max_chunk_elements: int = 2**22) -> None:
        """``max_chunk_elements``: params are stepped in chunks of one set of matrix shapes and at
        most this many elements (a single larger param is its own chunk), which bounds the step's
        scratch memory at ~3 fp32 copies of a chunk (16 MiB each by default) whatever the model
        size, while small matrices are still batched by the dozen."""
        super().__init__()
        if max_chunk_elements < 1:
            raise ValueError(f"Invalid max_chunk_elements={max_chunk_elements}: must be >= 1")
        self.max_chunk_elements = max_chunk_elements

    def muon_chunks(self, params: list[Tensor], config: MuonConfig) -> list[list[int]]:
        """Params with the same set of matrix shapes, in runs of at most ``max_chunk_elements``."""
        by_shapes: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for i, p in enumerate(params):
            shapes = tuple(sorted({(b.rows, b.cols) for b in config.layout.blocks(p.shape)}))
            by_shapes.setdefault(shapes, []).append(i)
        chunks: list[list[int]] = []
        for members in by_shapes.values():
            chunks.append([])
            size = 0
            for i in members:
                if chunks[-1] and size + params[i].numel() > self.max_chunk_elements:
                    chunks.append([])
                    size = 0
                chunks[-1].append(i)
                size += params[i].numel()
        return chunks

    def directions(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Tensor]:
        # Not counted in a compiled step: torch.compile would guard on the counters' values (Python
        # ints), which change every step, and recompile every step.
        hook = None if torch.compiler.is_compiling() else functools.partial(self.count_batch, config=config)
        return muon_directions(updates, [config.layout] * len(updates), config.ns_options, on_batch=hook)
