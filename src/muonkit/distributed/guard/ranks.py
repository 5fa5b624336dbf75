"""The guard of communicating strategies: the ranks' agreement, verdicts AND-ed over ranks, late checks.

What ranks must agree on before a step (settings, which params have gradients) is known on
the host, so it is reduced on the host: over the collectives'
:attr:`~muonkit.distributed.collectives.Collectives.host_group`, never through the device, so the
check makes the host wait for no device work (:mod:`muonkit.distributed.agreement`). Values
that live on the device and must be equal on every rank (:meth:`CollectiveGuard.expect_equal`:
the TP fingerprints of :class:`MeshGuard`) ride with the step's non-finite verdict
(:meth:`CollectiveGuard.all_true`, the step's one blocking read) or, in a step without one, are
checked one step late from a host copy that waited for nothing (:meth:`CollectiveGuard.end`).

A rank that raises inside a step tells the others through the collectives' failure channel
(:meth:`CollectiveGuard.step_failed`, :mod:`muonkit.distributed.failure`). Every collective goes
through :class:`~muonkit.distributed.collectives.Collectives`, counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonkit.distributed import agreement
from muonkit.distributed.agreement import Setting
from muonkit.distributed.collectives import flag_device, reduce_device
from muonkit.distributed.failure import every_rank
from muonkit.distributed.guard.local import Guard, Settings

if TYPE_CHECKING:
    from muonkit.distributed.collectives import Collectives

__all__ = ["CollectiveGuard", "MeshGuard"]


class CollectiveGuard(Guard):
    """The guard of a communicating strategy, over its collectives ``comm``.

    ``strategy``: the strategy's name, one of the settings every rank must share.
    """

    def __init__(self, comm: Collectives, *, strategy: str) -> None:
        self.comm = comm
        self.strategy = strategy
        self._values: tuple[str, Tensor] | None = None
        self._named = ""  # the name of the values the latest reduce_flags compared
        self._late: tuple[str, Tensor, Any] | None = None
        self.host_buffers: list[Tensor] = []
        """The host tensors of the latest checks (for counting reads: host memory in a device run too)."""

    def agree(self, has_grad: Sequence[bool], settings: Settings = list) -> None:
        """Raise on every rank (never hang) unless all ranks hold the same settings and gradient
        flags (one tiny all_reduce MAX on the host; see :mod:`muonkit.distributed.agreement`).

        First the values of the previous step's late check (:meth:`end`), if any. Opens the step
        (the first collective of every step): a rank out of step since a failed step raises here.
        """
        shared = [*settings(), Setting("strategy", self.strategy)]
        comm = self.comm
        comm.channel.begin()
        self._values = None
        self._check_late()
        encoded = agreement.encode(shared, has_grad)
        group = comm.host_group
        if group is None:  # no gloo: through the device, with a read
            encoded, self.host_buffers = encoded.to(flag_device(comm.group)), []
        else:
            self.host_buffers = [encoded]
        comm.all_reduce(encoded, op=dist.ReduceOp.MAX, group=group)
        try:
            agreement.check_agreement(encoded.cpu(), shared, has_grad)
        except (ValueError, RuntimeError) as e:
            every_rank(e)  # every rank reads the same reduced vector: the group stays in step
            raise

    def expect_equal(self, name: str, values: Tensor) -> None:
        """Device ``values`` (float, any shape) every rank must hold bit for bit, checked with this
        step's verdict (:meth:`all_true`) or, in a step without one, one step late (:meth:`end`)."""
        self._values = (name, values.detach())

    def all_true(self, flags: Tensor) -> list[bool]:
        """Whether each of a few booleans is true on every rank: :meth:`reduce_flags`, read (the
        step's one blocking read); values given to :meth:`expect_equal` that differ raise
        ``ValueError`` on every rank."""
        got = self.reduce_flags(flags).tolist()
        if not got[-1]:
            raise self.values_error()
        return [bool(x) for x in got[:-1]]

    def reduce_flags(self, flags: Tensor) -> Tensor:
        """Each of a few booleans AND-ed over every rank, then whether the :meth:`expect_equal` values
        agree: one tiny all_reduce MIN where ``flags`` live (where the backend reduces them), no read.

        The values go as :func:`~muonkit.distributed.agreement.value_vector` (their words and the
        words negated). The result is a bool vector on that device, ``flags.numel() + 1`` long; a
        false last flag means :meth:`values_error`.
        """
        device = reduce_device(flags, self.comm.group)
        t = flags.detach().to(device=device, dtype=torch.int64).reshape(-1)
        count = t.numel()
        named = self._values
        self._values = None
        if named is None:
            t = t.clone()
        else:
            t = torch.cat([t, agreement.value_vector(named[1]).to(device)])
            self._named = named[0]
        self.comm.all_reduce(t, op=dist.ReduceOp.MIN)
        equal = torch.ones((), dtype=torch.bool, device=device) if named is None else agreement.values_agree(t[count:])
        return torch.cat([t[:count].bool(), equal.reshape(1)])

    def values_error(self) -> Exception:
        """The error :meth:`reduce_flags`'s last flag stands for (values that differ across ranks)."""
        return every_rank(_values_differ(self._named, late=False))

    def end(self) -> None:
        """After a step without a verdict: start the late check of its :meth:`expect_equal` values.

        They are compared as in :meth:`reduce_flags` (no flags) where they are, and the result is
        copied to the host without waiting (``non_blocking``, pinned memory, an event); the next
        step's :meth:`agree` waits for that event, which waits only for this step's work, never
        for what was launched since. Closes the step.
        """
        if self._values is not None:
            self._start_late_check()
        self.comm.channel.end()

    def step_failed(self, error: BaseException, *, applied: bool) -> None:
        """``step()`` raised ``error`` on this rank (see :meth:`~muonkit.distributed.failure.FailureChannel.failed`)."""
        self.comm.channel.failed(error, applied=applied)

    def host_tensors(self) -> list[Tensor]:
        return list(self.host_buffers)

    def _start_late_check(self) -> None:
        assert self._values is not None
        name = self._values[0]
        equal = self.reduce_flags(self._values[1].new_empty(0, dtype=torch.bool))
        host = torch.empty(equal.shape, dtype=equal.dtype, pin_memory=equal.is_cuda)
        host.copy_(equal, non_blocking=True)
        event = None
        if equal.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._late = (name, host, event)
        self.host_buffers = [*self.host_buffers, host]

    def _check_late(self) -> None:
        if self._late is None:
            return
        name, host, event = self._late
        self._late = None
        if event is not None:
            event.synchronize()
        if not all(host.tolist()):
            raise every_rank(_values_differ(name, late=True))


class MeshGuard(CollectiveGuard):
    """The guard of DTensor params on device meshes (:class:`~muonkit.distributed.dtensor.DTensorStrategy`).

    ``replicated``: the plain params read as whole copies on every rank beside the DTensors.
    """

    def __init__(self, comm: Collectives, *, strategy: str, replicated: Sequence[Tensor] = ()) -> None:
        super().__init__(comm, strategy=strategy)
        self.replicated = replicated

    def align_grads(self, params: Sequence[Tensor]) -> None:
        """A DTensor gradient placed otherwise than its param is redistributed to the param's placements.

        Tensor parallel models may leave a gradient ``Replicate()`` or ``Partial()`` where the param is
        ``Shard(0)`` (an embedding under transformers' ``tp_plan``); torch's own optimizers would
        redistribute it op by op. ``Partial`` is reduced, as the placement means.
        """
        from torch.distributed.tensor import DTensor  # imported already: this guard's params are DTensors

        for p in params:
            grad = p.grad
            if not (isinstance(p, DTensor) and isinstance(grad, DTensor)):
                continue
            if grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
                p.grad = grad.redistribute(p.device_mesh, p.placements)

    def agree(self, has_grad: Sequence[bool], settings: Settings = list) -> None:
        """Also: the plain params (replicated beside the DTensors) have the same gradients on every rank.

        Tensor parallelism leaves some params plain (norms under ``parallelize_module``, or
        transformers' ``tp_plan``); they are read as whole copies on every rank of the group, which
        is right only if every rank computes the same gradient for them. One fingerprint per
        step (their gradients' sums, in float64, computed on the device) rides with the step's
        non-finite verdict (:meth:`~CollectiveGuard.expect_equal`: no read of its own), so plain
        params left out of a data-parallel wrapper (their gradients never averaged) raise on every
        rank, before anything changes, instead of drifting apart. With ``nonfinite="unchecked"``
        (no verdict, no read) it is checked one step late.
        """
        super().agree(has_grad, settings)
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if grads:
            sums = torch.stack([g.detach().sum(dtype=torch.float64) for g in grads])
            self.expect_equal("gradients of the plain params replicated beside the DTensors", sums)


def _values_differ(name: str, *, late: bool) -> ValueError:
    when = (
        " at the previous step (checked one step late, as a step without a non-finite check reads nothing; "
        "that step was applied)"
        if late
        else ""
    )
    return ValueError(
        f"HybridMuon's {name} differ across ranks{when}. Every rank must step the same values: average "
        "them over the ranks that share them (e.g. leave the module inside the data-parallel wrapper)"
    )
