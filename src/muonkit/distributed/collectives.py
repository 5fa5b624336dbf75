"""The few collectives the strategies issue, each one counted in :class:`StrategyStats`.

Bytes are counted as the data this rank must deliver to *other* ranks by the collective's
meaning, independent of the algorithm the backend picks (ring, tree, direct):

==============================  =======================================================
collective                      bytes sent by this rank
==============================  =======================================================
all_to_all (single or lists)    everything it addresses to other ranks (not itself)
all_gather                      its input, once per other rank: ``(W-1) * input``
all_reduce                      ``2 (W-1)/W * size`` (the ring lower bound)
==============================  =======================================================

``bench dist`` counts other optimizers' traffic with the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonkit.distributed.base import StrategyStats

__all__ = ["Collectives", "Pending", "group_of"]


class Pending:
    """An async collective and the buffers it reads and writes, kept alive until :meth:`wait`."""

    def __init__(self, work: Any, *buffers: Tensor) -> None:
        self.work = work
        self.buffers = buffers

    def wait(self) -> None:
        self.work.wait()
        self.buffers = ()


def group_of(process_group: Any) -> Any:
    """The process group of ``process_group`` (a ProcessGroup or a 1-D DeviceMesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            raise ValueError(
                f"Invalid process_group={process_group!r}: a DeviceMesh must be 1-D here (got {process_group.ndim}-D); "
                "pass the mesh dimension the gradients are averaged over, e.g. mesh['dp']"
            )
        return process_group.get_group()
    return process_group


class Collectives:
    """Counted collectives on one process group."""

    def __init__(self, group: Any, stats: StrategyStats) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        self.group = group
        self.stats = stats
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Where the small bookkeeping tensors (flags) must live for this backend: NCCL only
        # reduces GPU tensors.
        nccl = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
        self.flag_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _count(self, nbytes: float) -> None:
        self.stats.collectives += 1
        self.stats.bytes_sent += round(nbytes)

    def all_to_all_single(
        self, output: Tensor, input: Tensor, *, output_splits: list[int], input_splits: list[int]
    ) -> Pending:
        """Async ``all_to_all_single`` on flat buffers; ``input_splits[j]`` elements go to rank j."""
        others = sum(n for j, n in enumerate(input_splits) if j != self.rank)
        self._count(others * input.element_size())
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group, async_op=True)
        return Pending(work, output, input)

    def all_gather_uneven(self, input: Tensor, sizes: list[int]) -> tuple[Pending, list[Tensor]]:
        """Async all-gather of flat tensors whose sizes may differ by rank (``sizes[j]`` from rank j).

        Returns the pending work and one view per rank into the received buffer (valid after
        ``wait()``). Inputs are padded to the largest size (gloo's all_gather needs equal sizes,
        and one ``all_gather_into_tensor`` is the fastest collective on NCCL); the padding is
        counted in the bytes sent, so callers should keep sizes even.
        """
        assert input.numel() == sizes[self.rank], "this rank's size must match its input"
        most = max(sizes)
        self._count((self.world_size - 1) * most * input.element_size())
        if input.numel() != most:
            padded = input.new_zeros(most)
            padded[: input.numel()] = input
            input = padded
        buffer = input.new_empty(most * self.world_size)
        pieces = [chunk[:n] for chunk, n in zip(buffer.chunk(self.world_size), sizes, strict=True)]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        return Pending(gather(buffer, input, group=self.group, async_op=True), buffer, input), pieces

    def all_reduce(self, t: Tensor, *, op: Any) -> None:
        """Blocking in-place ``all_reduce``."""
        self._count(2 * (self.world_size - 1) / self.world_size * t.numel() * t.element_size())
        dist.all_reduce(t, op=op, group=self.group)

    def all_ranks_true(self, flags: Tensor) -> list[bool]:
        """Whether each of a few booleans is true on every rank (one tiny all_reduce MIN)."""
        t = flags.detach().to(device=self.flag_device, dtype=torch.int32).reshape(-1).clone()
        self.all_reduce(t, op=dist.ReduceOp.MIN)
        return [bool(x) for x in t.tolist()]

    def check_same(self, flags: Sequence[bool], *, what: str) -> None:
        """Raise on every rank (never hang) unless all ranks hold the same boolean vector."""
        if not flags:
            return
        mine = torch.tensor(list(flags), dtype=torch.int32, device=self.flag_device)
        both = torch.cat([mine, 1 - mine])
        self.all_reduce(both, op=dist.ReduceOp.MAX)
        differ = (both[: len(flags)] * both[len(flags) :]).nonzero().flatten().tolist()
        if differ:
            raise RuntimeError(
                f"Ranks disagree on {what} at positions {differ[:10]}{'...' if len(differ) > 10 else ''}: "
                "every rank must step the same params (a param's .grad must be None on all ranks or on none)"
            )
