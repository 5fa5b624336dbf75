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

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonkit.distributed.failure import FailureChannel

if TYPE_CHECKING:  # no import edge: the guard, which the strategies import, imports this module
    from muonkit.distributed.base import StrategyStats

__all__ = ["Collectives", "Pending", "flag_device", "group_of", "reduce_device", "reduces_cpu"]


class Pending:
    """An async collective and the buffers it reads and writes, kept alive until :meth:`wait`.

    ``waiter``: how to wait for it (:meth:`Collectives.wait`: in slices on the host, so that a
    rank that failed inside the step releases this one); default ``work.wait()``.
    """

    def __init__(self, work: Any, *buffers: Tensor, waiter: Callable[[Any, Tensor], None] | None = None) -> None:
        self.work = work
        self.buffers = buffers
        self.waiter = waiter

    def wait(self) -> None:
        if self.waiter is None or not self.buffers:
            self.work.wait()
        else:
            self.waiter(self.work, self.buffers[0])
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
    devices = _backend_devices(group)  # "cpu:gloo,cuda:nccl", "cuda:nccl", "cpu:gloo,cuda:gloo"...
    if not devices or "cpu" in devices:
        return torch.device("cpu")
    return torch.device(devices[0], torch.get_device_module(devices[0]).current_device())


def reduce_device(t: Tensor, group: Any) -> torch.device:
    """Where to reduce ``t`` over ``group``: its own device where the backend reduces that device
    type, else :func:`flag_device`."""
    return t.device if t.device.type in _backend_devices(group) else flag_device(group)


def reduces_cpu(group: Any) -> bool:
    """Whether ``group``'s backend reduces CPU tensors (gloo, MPI, UCC, ``"cpu:gloo,cuda:nccl"``)."""
    devices = _backend_devices(group)
    return not devices or "cpu" in devices


class Collectives:
    """Counted collectives on one process group.

    Whether a step applies (the ranks' agreement, the non-finite verdict's flags, the late checks)
    is the strategy's guard's (:mod:`muonkit.distributed.guard`), which issues its collectives
    here. A rank that raises inside a step tells the others through :attr:`channel` (the group's
    store), and every wait on the host reads it (:meth:`wait`): the ranks waiting for it raise
    :class:`~muonkit.distributed.failure.RankFailedError` within about a second instead of at
    the group's timeout (:mod:`muonkit.distributed.failure`).
    """

    def __init__(self, group: Any, stats: StrategyStats) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        self.group = group
        self.stats = stats
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._host_group: tuple[Any] | None = None  # made at the first use
        self.channel = FailureChannel(group, self.rank, self.world_size)

    def _count(self, nbytes: float) -> int:
        """Count a collective about to be issued; returns its number in the step (for :meth:`wait`)."""
        self.stats.collectives += 1
        self.stats.bytes_sent += round(nbytes)
        return self.channel.issue()

    def wait(self, work: Any, tensor: Tensor, number: int = 0) -> None:
        """Wait for the collective ``work`` on ``tensor``: on the host in slices where it blocks the host
        (CPU tensors: gloo, MPI, UCC), reading between them whether another rank failed inside the
        step; a device collective (NCCL) blocks no host, so ``work.wait()`` only orders the stream."""
        if tensor.device.type == "cpu":
            self.channel.wait(work, number)
        else:
            work.wait()

    @property
    def host_group(self) -> Any:
        """The group that reduces this group's host tensors: the group itself where its backend
        reduces CPU tensors, else (an NCCL-only group) a gloo group over the same ranks, made at the
        first use, which every rank of the group reaches at the same point of the same step.
        ``None`` where gloo is not available: host tensors then go through the device."""
        if self._host_group is None:
            if reduces_cpu(self.group):
                self._host_group = (self.group if self.group is not None else dist.group.WORLD,)
            elif dist.is_gloo_available():
                ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
                self._host_group = (dist.new_group(ranks, backend="gloo", use_local_synchronization=True),)
            else:
                self._host_group = (None,)
        return self._host_group[0]

    def all_to_all_single(
        self, output: Tensor, input: Tensor, *, output_splits: list[int], input_splits: list[int]
    ) -> Pending:
        """Async ``all_to_all_single`` on flat buffers; ``input_splits[j]`` elements go to rank j."""
        others = sum(input_splits) - input_splits[self.rank]  # O(W) in C: thousands of ranks
        number = self._count(others * input.element_size())
        work = dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group, async_op=True)
        return Pending(work, output, input, waiter=functools.partial(self.wait, number=number))

    def all_reduce(self, t: Tensor, *, op: Any, group: Any = None) -> None:
        """Blocking in-place ``all_reduce`` (over ``group``: default, this one), waited for by :meth:`wait`."""
        number = self._count(2 * (self.world_size - 1) / self.world_size * t.numel() * t.element_size())
        self.wait(dist.all_reduce(t, op=op, group=self.group if group is None else group, async_op=True), t, number)

    def ring_all_reduce(self, t: Tensor, ranks: Sequence[int]) -> None:
        """Blocking in-place sum of flat ``t`` over ``ranks`` (ranks of this group, this one among them),
        by point-to-point messages among them alone: a ring, reduce-scatter then all-gather.

        No process group per set of ranks: torch names a group made by its members alone after how
        many groups each member already made, so members with different histories never meet
        (pytorch#173608), and one made by every rank costs a barrier over all of them. Every member
        ends with the same bits (each chunk is summed once, in a fixed order, then passed on).
        Members must call it in the same order for their sets (as for any collective).
        """
        ring = sorted(ranks)
        size = len(ring)
        self._count(2 * (size - 1) / size * t.numel() * t.element_size())
        if size == 1:
            return
        chunks = list(torch.tensor_split(t, size))
        me = ring.index(self.rank)
        for step in range(size - 1):  # reduce-scatter: member p ends with chunk p + 1 summed
            send, recv = chunks[(me - step) % size], chunks[(me - step - 1) % size]
            buffer = torch.empty_like(recv)
            self._exchange(ring, me, send, buffer)
            recv.add_(buffer)
        for step in range(size - 1):  # all-gather of the summed chunks
            send, recv = chunks[(me + 1 - step) % size], chunks[(me - step) % size]
            self._exchange(ring, me, send, recv)

    def ring_all_gather(self, output: Tensor, input: Tensor, ranks: Sequence[int]) -> None:
        """Blocking all-gather among ``ranks`` alone (see :meth:`ring_all_reduce`): ``output`` (flat)
        holds every member's flat ``input``, in rank order."""
        ring = sorted(ranks)
        size = len(ring)
        self._count((size - 1) * input.numel() * input.element_size())
        blocks = list(output.view(size, -1).unbind(0))
        me = ring.index(self.rank)
        blocks[me].copy_(input)
        for step in range(size - 1):
            self._exchange(ring, me, blocks[(me - step) % size], blocks[(me - step - 1) % size])

    def _exchange(self, ring: list[int], me: int, send: Tensor, recv: Tensor) -> None:
        """Send ``send`` to the next member of ``ring`` while receiving ``recv`` from the previous one."""
        group: Any = self.group if self.group is not None else dist.group.WORLD
        right = dist.get_global_rank(group, ring[(me + 1) % len(ring)])
        left = dist.get_global_rank(group, ring[(me - 1) % len(ring)])
        ops = []  # an empty chunk is empty on both sides: neither sends nor expects it
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send.contiguous(), right, group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, left, group))
        # Not :meth:`wait`'s slices: a gloo receive that times out closes its connection for good.
        # So a member waiting here on a member that failed inside the step is released when that
        # process exits or at the group's timeout, not by the failure channel.
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


def _backend_devices(group: Any) -> list[str]:
    """The device types ``group``'s backend reduces (``["cpu", "cuda"]`` for ``"cpu:gloo,cuda:nccl"``)."""
    config = str(dist.get_backend_config(group))
    return [entry.split(":", 1)[0].strip() for entry in config.split(",") if ":" in entry]
