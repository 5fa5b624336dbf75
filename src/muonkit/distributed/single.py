"""Single device: every tensor is whole and local."""

from __future__ import annotations

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Strategy

CPU_CHUNK_ELEMENTS = 2**22
"""Chunk budget on CPU (and devices other than CUDA): 16 MiB per fp32 copy of a chunk."""
GPU_CHUNK_FRACTION = 64
"""On a GPU a chunk holds at most 1/64 of the device's memory in fp32 (its scratch, about three
such copies, stays under 5% of the device): GPT-2 774M's matrices are 4 chunks (one per shape)
on an 80 GB GPU, 7 on a 40 GB one, where the CPU budget cuts them into 126 (124M: 32)."""


def default_chunk_elements(device: torch.device | str) -> int:
    """The default ``max_chunk_elements`` for params on ``device``: :data:`CPU_CHUNK_ELEMENTS`,
    or on CUDA the device's total memory / :data:`GPU_CHUNK_FRACTION` / 4 bytes (the total, not
    the free memory, so the chunks, and therefore the results, are the same at every step)."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_CHUNK_ELEMENTS
    total = torch.cuda.get_device_properties(device).total_memory
    return max(CPU_CHUNK_ELEMENTS, total // (GPU_CHUNK_FRACTION * 4))


class SingleDeviceStrategy(Strategy):
    """All matrices on this process; same-shape matrices batched into one call."""

    name = "single"

    def __init__(self, *, max_chunk_elements: int | None = None) -> None:
        """``max_chunk_elements``: params are stepped in chunks of one set of matrix shapes and at
        most this many elements (a single larger param is its own chunk), which bounds the step's
        scratch memory (see :meth:`muon_chunks`) whatever the model size, while small matrices are
        still batched by the dozen. Default (None): :func:`default_chunk_elements` of the params'
        device, 2^22 (16 MiB of fp32) on CPU, 1/64 of the device's memory on a GPU."""
        super().__init__()
        if max_chunk_elements is not None and (
            isinstance(max_chunk_elements, bool) or not isinstance(max_chunk_elements, int) or max_chunk_elements < 1
        ):
            raise ValueError(f"Invalid max_chunk_elements={max_chunk_elements!r}: must be None or an int >= 1")
        self.max_chunk_elements = max_chunk_elements

    def muon_chunks(self, params: list[Tensor], config: MuonConfig) -> list[list[int]]:
        """Params with the same set of matrix shapes, in runs of at most ``max_chunk_elements``.

        One chunk's scratch memory: its momentum updates (state dtype), two copies of it in the
        compute dtype for the iteration, and per matrix four (Gram) or two (plain iteration)
        ``m x m`` products of its short side ``m``; plus its directions when the compute dtype
        differs from the params'.
        """
        limit = self.max_chunk_elements
        if limit is None:
            limit = default_chunk_elements(params[0].device) if params else 1
        by_shapes: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for i, p in enumerate(params):
            shapes = tuple(sorted({(b.rows, b.cols) for b in config.layout.blocks(p.shape)}))
            by_shapes.setdefault(shapes, []).append(i)
        chunks: list[list[int]] = []
        for members in by_shapes.values():
            chunks.append([])
            size = 0
            for i in members:
                if chunks[-1] and size + params[i].numel() > limit:
                    chunks.append([])
                    size = 0
                chunks[-1].append(i)
                size += params[i].numel()
        return chunks

    def directions(
        self,
        params: list[Tensor],
        updates: list[Tensor],
        config: MuonConfig,
        *,
        states: list[list[Tensor]] | None = None,
    ) -> list[Tensor]:
        directions, new_states = self.compute(updates, [config.layout] * len(updates), config, states=states)
        for olds, news in zip(states or [], new_states, strict=True):
            for old, new in zip(olds, news, strict=True):
                old.copy_(new)
        return directions
