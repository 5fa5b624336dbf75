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

from muonkit.distributed import agreement
from muonkit.distributed.base import StrategyStats

__all__ = ["Collectives", "Pending", "flag_device", "group_of"]


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


def flag_device(group: Any) -> torch.device:
    """The device for the small tensors muonkit builds on the host and reduces over ``group``.

    Flags and fingerprints start on the CPU. They stay there when the group's backend reduces CPU
    tensors (gloo, MPI, UCC, or a mixed ``"cpu:gloo,cuda:nccl"`` group); otherwise they go to the
    current device of the accelerator the backend needs: NCCL reduces CUDA tensors only, on
    ``torch.cuda.current_device()`` (the device torchrun and DeepSpeed scripts select with
    ``set_device``). Data tensors need no such choice: they live where the params do.

    Example: ``flag_device(group)`` is ``cpu`` for a gloo group and ``cuda:3`` for an NCCL group on
    the rank that set ``torch.cuda.set_device(3)``.
    """
    config = str(dist.get_backend_config(group))  # "cpu:gloo,cuda:nccl", "cuda:nccl", "cpu:gloo,cuda:gloo"...
    devices = [entry.split(":", 1)[0].strip() for entry in config.split(",") if ":" in entry]
    if not devices or "cpu" in devices:
        return torch.device("cpu")
    return torch.device(devices[0], torch.get_device_module(devices[0]).current_device())


class Collectives:
    """Counted collectives on one process group."""

    def __init__(self, group: Any, stats: StrategyStats) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        self.group = group
        self.stats = stats
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

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

    def all_reduce(self, t: Tensor, *, op: Any) -> None:
        """Blocking in-place ``all_reduce``."""
        self._count(2 * (self.world_size - 1) / self.world_size * t.numel() * t.element_size())
        dist.all_reduce(t, op=op, group=self.group)

    def all_ranks_true(self, flags: Tensor) -> list[bool]:
        """Whether each of a few booleans is true on every rank (one tiny all_reduce MIN)."""
        t = flags.detach().to(device=flag_device(self.group), dtype=torch.int32).reshape(-1).clone()
        self.all_reduce(t, op=dist.ReduceOp.MIN)
        return [bool(x) for x in t.tolist()]

    def check_agreement(
        self,
        settings: Sequence[agreement.Setting],
        has_grad: Sequence[bool],
        *,
        values: tuple[str, Tensor] | None = None,
    ) -> None:
        """Raise on every rank (never hang) unless all ranks hold the same settings and gradient
        flags (one tiny all_reduce MAX; see :mod:`muonkit.distributed.agreement`).

        ``values``: a name and device values every rank must share too (a fingerprint of
        gradients), added to the same vector on the device: no read of their own.
        """
        words = None if values is None else agreement.value_words(values[1])
        room = 0 if words is None else words.numel()
        encoded = agreement.encode(settings, has_grad, room=room).to(flag_device(self.group))
        if words is not None:
            agreement.place(encoded, words.to(encoded.device), at=len(settings) + len(has_grad))
        self.all_reduce(encoded, op=dist.ReduceOp.MAX)
        named = None if values is None else (values[0], room)
        agreement.check_agreement(encoded.cpu(), settings, has_grad, values=named)
