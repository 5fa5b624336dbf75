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

**When one rank raises inside ``step()``, every rank raises, within about a second** (the
failure channel, :class:`FailureChannel`, below). A distributed step is the same sequence of collectives on every rank. A rank that raises in the
middle of it (an out-of-memory error in Newton-Schulz, a bug, an interrupt) never issues the
rest, and the ranks waiting for its part would wait until the process group's timeout (gloo's
default: 30 minutes). So, through the store every process group already has (the TCPStore
``init_process_group`` made), under a key of this step:

- the failing rank writes what it raised and re-raises its own error, with a note saying what
  the others were told (one that failed before its first collective of the step first waits,
  up to 5 s, until every rank has left the step: see :meth:`FailureChannel._others_left`);
- a rank that waits on the host for a collective (every collective of a gloo group; the host
  agreement beside an NCCL group) waits in slices (``Work.wait(timeout)``: 10 ms, doubling up to
  1 s) and reads the key between them. Once it is there, it leaves the step: it raises
  :class:`RankFailedError`, which names the failing rank, its error, and what the step had
  applied on each of the two.

A wait that completes within its first slice costs about a microsecond more than ``Work.wait()``
(0.9 us against 0.1 us on a completed collective, measured); a longer one reads the store once
per slice (two round trips, ~45 us each on one machine). No collective is added and nothing is
read from the device.

The process group is out of step afterwards and cannot be repaired in place: a waiting rank
abandons a collective that the backend keeps queued (gloo until the group's timeout), the next
collective of a rank that goes on would pair with it, and gloo's ``abort()`` and ``shutdown()``
cancel nothing (torch 2.13, measured). So every rank that issued or abandoned a collective of the
failed step refuses to step again (and says so in the store, for ranks that learn it later), and
the job restarts from its last checkpoint: let the error end the script on every rank, and
``torchrun --max-restarts=N`` starts every rank again.

Errors every rank raises alike from a result they share (the agreement, the non-finite verdict)
are marked with :func:`every_rank`: they leave the group in step and signal nothing. When every
rank raises before the step's first collective (a setting every rank got wrong), no rank
abandons anything and the group stays in step too.

A step's key is ``muonkit/step_failure/{run}/{the group's sequence number at its start}/{steps opened
on the group in this process}``: the same on every rank while the ranks are in step, and new at
every step (``run``: torchrun's run id and restart count, since its agent keeps one store across
restarts). The steps are counted per group over every optimizer of the process, not per
optimizer: a step that every rank fails before its first collective leaves the group's sequence
number where it was, and the next optimizer's first step must not read that step's record.

On NCCL the device collectives do not block the host: a rank whose peer failed enqueues the
rest of its step and blocks in the read of the non-finite verdict, which waits for the device,
until NCCL's watchdog aborts the communicator at the process group's timeout (10 minutes by
default) and ends the process. Only the host agreement (over its gloo side group) is bounded
as above.

Example: a training script keeps checkpoints and lets the error end it on every rank::

    for step, batch in enumerate(loader, start=resumed_step):
        model(batch).sum().backward()
        opt.step()  # one rank fails inside: every rank raises within about a second
        opt.zero_grad()
        if step % 1000 == 0:
            save_checkpoint(f"ckpt/{step}", model=model, optimizer=opt)

    # torchrun --max-restarts=3 train.py: each restart loads the last checkpoint before the loop
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:  # no import edge: the guard, which the strategies import, imports this module
    from muonkit.distributed.base import StrategyStats

__all__ = [
    "Collectives",
    "FailureChannel",
    "Pending",
    "RankFailedError",
    "every_rank",
    "flag_device",
    "group_of",
    "reduce_device",
    "reduces_cpu",
]


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
    :class:`~muonkit.distributed.collectives.RankFailedError` within about a second instead of at
    the group's timeout (:mod:`muonkit.distributed.collectives`).
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


# ---------------------------------------------------------------- the failure channel

logger = logging.getLogger(__name__)

_PREFIX = "muonkit/step_failure"
_FIRST_SLICE = datetime.timedelta(milliseconds=10)  # a wait this short reads nothing
_LAST_SLICE = datetime.timedelta(seconds=1)  # the longest a waiting rank goes without reading the store
_ARRIVAL_LIMIT = 5.0  # how long a failing rank waits for the others to leave the step
_MARK = "_muonkit_every_rank"
_RESTART = (
    "Restore the last checkpoint: let the error end the script on every rank and restart the job "
    "(torchrun --max-restarts=N restarts every rank)"
)

E = TypeVar("E", bound=BaseException)

_STEPS_OPENED: dict[Any, int] = {}
"""Steps opened on each process group in this process, by every channel (see the module docstring)."""


def every_rank(error: E) -> E:
    """Mark ``error`` as raised alike on every rank from a result they share (the group stays in step)."""
    setattr(error, _MARK, True)
    return error


def _state(applied: bool | None) -> str:
    if applied is None:
        return "not known"
    return "partly applied (a step applies each chunk of matrices as it is computed)" if applied else "unchanged"


class RankFailedError(RuntimeError):
    """Another rank raised inside ``HybridMuon.step()``, and this one was waiting for it.

    ``rank``: the failing rank (in the optimizer's process group); ``error``: what it raised
    (type and message); ``applied_there`` and ``applied_here``: whether the step had changed the
    optimizer state (params, momentum, moments) on that rank and on this one (None: not known).
    """

    def __init__(self, record: dict[str, Any], *, here: int = -1) -> None:
        super().__init__(record)
        self.rank = int(record.get("rank", -1))
        self.error = str(record.get("error", "?"))
        self.applied_there: bool | None = record.get("applied")
        self.applied_here: bool | None = None
        self.here = here

    def __str__(self) -> str:
        return (
            f"rank {self.rank} raised inside HybridMuon.step(): {self.error}. This rank ({self.here}) was waiting "
            "for it in a collective that cannot complete, so the process group's collectives are out of step: "
            "this optimizer will not step again on this process group. Optimizer state: "
            f"{_state(self.applied_here)} on this rank, {_state(self.applied_there)} on rank {self.rank}. {_RESTART}"
        )


class FailureChannel:
    """This rank's side of the failure protocol on one process group (see the module docstring).

    :class:`~muonkit.distributed.collectives.Collectives` opens a step before its first
    collective (:meth:`begin`), waits through :meth:`wait` and closes the step (:meth:`end`);
    the optimizer reports an error of ``step()`` with :meth:`failed`.
    """

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group if group is not None else dist.group.WORLD
        self._store = _store_of(self._group)
        self._prefix = f"{_PREFIX}/{_incarnation()}"
        self._out_of_step_key = f"{self._prefix}/out_of_step"
        self._counter = (_group_id(self._group), rank)  # one rank per group in a process; tests simulate several
        self._key: str | None = None  # the open step's key
        self.issued = 0
        """How many collectives this rank issued in the open step (counted by ``Collectives``: every
        rank in step issues the same ones, in the same order)."""
        self.out_of_step: str | None = None
        """Why this rank must not step again on this group (None: it may)."""

    def begin(self) -> None:
        """Open a step, before its first collective (nothing if one is open); raise if this rank is out of step."""
        self._open()
        if self.out_of_step is not None:
            raise RuntimeError(f"HybridMuon cannot step on this process group any more: {self.out_of_step}. {_RESTART}")

    def _open(self) -> None:
        if self._key is None:
            steps = _STEPS_OPENED[self._counter] = _STEPS_OPENED.get(self._counter, 0) + 1
            self._key = f"{self._prefix}/{_sequence_number(self._group)}/{steps}"
            self.issued = 0

    def end(self) -> None:
        """Close the open step (it completed, or raised)."""
        self._key = None

    def issue(self) -> int:
        """Count a collective this rank issues in the open step; returns its number (1, 2, ...)."""
        self.issued += 1
        return self.issued

    def wait(self, work: Any, number: int = 0) -> None:
        """``work.wait()``, in slices; between them, raise :class:`RankFailedError` if another rank failed.

        ``number``: the collective's number in the step (:meth:`issue`). A failed rank that had
        issued it too (its record counts the collectives it issued) takes part: it completes, so
        this rank waits for it and learns of the failure at its next step.
        """
        if self._store is None:
            work.wait()
            return
        wait = _FIRST_SLICE
        try:
            while not _finished_within(work, wait):
                record = self._read(self._key) if self._key is not None else None  # failed in this step
                if record is not None and number > 0 and _issued(record) >= number:
                    work.wait()
                    return
                self._raise_if_failed(cause=None)
                wait = min(2 * wait, _LAST_SLICE)
        except RankFailedError:
            raise
        except RuntimeError as error:  # the collective failed (a peer exited, the group's timeout): say why if told
            self._raise_if_failed(cause=error)
            raise

    def failed(self, error: BaseException, *, applied: bool) -> None:
        """``step()`` raised ``error`` on this rank; ``applied``: whether it had changed any state. Never raises
        (but an interrupt while it waits for the others)."""
        if getattr(error, _MARK, False):
            self.end()
            return
        if isinstance(error, RankFailedError):  # it waited for another rank: it left the step in wait()
            error.applied_here = applied
            self.end()
            return
        refused = self.out_of_step is not None  # this rank stopped stepping before: it issues no collective
        self._open()  # an error before the step's first collective signals under this step's key
        record = {
            "rank": self.rank,
            "error": f"{type(error).__name__}: {error}"[:2000],
            "applied": applied,
            "issued": self.issued,  # the collectives of the step it issued: those complete
        }
        self._write(self._key, record)
        if self.issued or not isinstance(error, Exception):
            self._leave(record)  # out of step for sure (an interrupt: do not wait to find out)
        elif not refused and (not self._others_left() or self._read(self._out_of_step_key) is not None):
            self._leave(record)  # before its first collective: some rank abandoned one, or did not leave in time
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(
                f"muonkit: raised inside HybridMuon.step() on rank {self.rank}; the ranks waiting for it were told "
                f"and raise RankFailedError. The optimizer state on this rank is {_state(applied)}."
                + (
                    " The process group's collectives are out of step: this optimizer will not step again on it. "
                    + _RESTART
                    if self.out_of_step is not None
                    else " Every rank raised before the step's first collective: the process group is in step."
                )
            )
        self.end()

    def _others_left(self) -> bool:
        """Count this rank out of the open step; whether every rank of the group left it (failed or stopped
        waiting) within ``_ARRIVAL_LIMIT``.

        Only a rank that failed before its first collective waits: the others wait in the step's
        first collective, or failed alike. If all failed, the group is in step; if one waited, this
        rank must not go on before it stopped waiting, or its next step's first collective would
        pair with that one (the same shape: a step of mixed steps, silently). A rank that issued
        collectives never steps again, so whatever it issues next pairs with nothing alike.
        """
        key = f"{self._key}/left"
        deadline = time.monotonic() + _ARRIVAL_LIMIT
        pause = 0.001
        left = self._add(key, 1)
        while left is not None and left < self.world_size and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            left = self._add(key, 0)
        return left is not None and left >= self.world_size

    def _failure(self) -> dict[str, Any] | None:
        """The record of a rank that failed in the open step, or of one that left the group out of step."""
        record = self._read(self._key) if self._key is not None else None
        return record or self._read(self._out_of_step_key)

    def _raise_if_failed(self, *, cause: BaseException | None) -> None:
        record = self._failure()
        if record is None:
            return
        self._leave(record)
        if self._key is not None:
            self._add(f"{self._key}/left", 1)
        raise RankFailedError(record, here=self.rank) from cause

    def _leave(self, record: dict[str, Any]) -> None:
        """This rank is out of step: refuse to step again, and say so to the ranks that learn it later."""
        if self.out_of_step is None:
            self.out_of_step = f"rank {record.get('rank')} raised inside a step ({record.get('error')})"
            self._write(self._out_of_step_key, record)

    def _write(self, key: str | None, record: dict[str, Any]) -> None:
        if self._store is None or key is None:
            return
        try:
            self._store.set(key, json.dumps(record))
        except Exception as e:  # the store is gone (its host exited): the others see their collective fail
            logger.warning("muonkit could not tell the other ranks of a failed step (%s)", e)

    def _add(self, key: str, amount: int) -> int | None:
        if self._store is None:
            return None
        try:
            return int(self._store.add(key, amount))
        except Exception:  # the store is gone: nobody can be told or waited for
            return None

    def _read(self, key: str) -> dict[str, Any] | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([key]):
                return None
            record = json.loads(self._store.get(key))
        except Exception:  # the store is gone, or holds something else: nothing to add
            return None
        return record if isinstance(record, dict) else None


def _finished_within(work: Any, wait: datetime.timedelta) -> bool:
    """Whether ``work`` completed within ``wait`` (a timed-out wait leaves it running). A completed
    collective that failed (a peer exited, the group's timeout) raises its error."""
    try:
        work.wait(timeout=wait)  # returns at once when the collective is already complete
    except RuntimeError:
        if not work.is_completed():
            return False
        work.wait()  # it finished just after the slice (returns), or failed (raises its own error)
    return True


def _issued(record: dict[str, Any]) -> int:
    """How many collectives of the step the failed rank had issued (-1: not known)."""
    issued = record.get("issued", -1)
    return issued if isinstance(issued, int) and not isinstance(issued, bool) else -1


def _store_of(group: Any) -> Any:
    """The process group's own store (a prefix of the default one), or None where it has none."""
    try:
        return group.get_group_store()
    except Exception:
        return None


def _incarnation() -> str:
    """This run of the job: torchrun's agent keeps one store across the restarts of its workers
    (``--max-restarts``), so a restarted job must not read the keys of the run it replaces."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


def _group_id(group: Any) -> Any:
    """What names ``group`` alike on every rank (its name; a stand-in without one: the object, kept
    alive by its channel, so its id is not reused while the channel counts under it)."""
    name = getattr(group, "group_name", None)
    return ("name", name) if isinstance(name, str) else ("object", id(group))


def _sequence_number(group: Any) -> int:
    """How many collectives ``group`` has issued on this rank (the same on every rank in step); 0 if unknown."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:
        return 0
