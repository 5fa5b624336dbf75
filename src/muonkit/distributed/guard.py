"""Whether a step applies: the one home of the rank agreement, the non-finite verdict and the late checks.

Every strategy makes one :class:`Guard` (:attr:`muonkit.distributed.Strategy.guard`); the
optimizer calls it at a few named points of ``step()`` and knows nothing else about verdicts:

============================  ===================================================================
point                         what the guard does there
============================  ===================================================================
``align_grads(params)``       lays out each gradient like its param (before anything is checked)
``before(opt, ...)``          the ranks' agreement (settings, which params have gradients, TP
                              fingerprints), then the verdict's policy: a :class:`Verdict`
``Stream.check(directions)``  per committed Muon chunk of a streamed verdict (in
                              :func:`muonkit.stages.commit_muon`): apply it, or the device mask
``outcome(opt, verdict)``     the streamed verdict's one read; whether AdamW goes on
``end()``                     the late checks of a step without a verdict; closes the step
``step_failed(error, ...)``   tells the other ranks (:mod:`muonkit.distributed.failure`)
============================  ===================================================================

:class:`Guard` is one device's (nothing to agree on, nothing to tell); :class:`CollectiveGuard`
that of every communicating strategy (over its :class:`~muonkit.distributed.collectives.Collectives`);
:class:`MeshGuard` adds what DTensor meshes need (gradients placed otherwise than their params,
plain params replicated beside tensor-parallel ones).

The verdict of :class:`muonkit.HybridMuon` (``nonfinite=``) has three policies, chosen per step
by :meth:`Guard.before`:

- **unchecked** (``nonfinite="unchecked"``): no check, no read; every chunk is applied as it comes.
- **streamed** (``"skip"``/``"raise"`` with the presets' schedules, whose directions are finite
  wherever their momentum update is): the verdict on the gradients (every one within its limit,
  :mod:`muonkit.limits`) is known before any direction, on every rank. Where reads are free (the
  CPU, :meth:`Guard.reads_wait`) it is read at once; elsewhere it stays on the device as the mask
  of every Muon commit (:class:`Stream`), and its one blocking read (:meth:`Guard.outcome`) comes
  after every Muon update is launched; AdamW, which keeps its step counts on the host, follows it.
- **held** (a custom ``ns_coefficients`` schedule, which may diverge): every direction is
  computed and held before the verdict, so a non-finite one anywhere leaves everything untouched.

A skipped step is counted in ``skipped_steps`` and logged on the ``muonkit.optimizer`` logger;
``"raise"`` raises ``FloatingPointError``; both from a verdict every rank shares.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed.agreement import Setting, settings_of
from muonkit.distributed.failure import every_rank
from muonkit.functional.coefficients import is_preset_schedule
from muonkit.functional.orthogonalize import host_read_waits
from muonkit.limits import GroupLimits, within_flags, within_on_host, work_dtype

if TYPE_CHECKING:  # no import edge: the strategies import this module
    from muonkit.distributed.base import Strategy
    from muonkit.distributed.collectives import Collectives

__all__ = ["CollectiveGuard", "Guard", "MeshGuard", "Stream", "Verdict"]

logger = logging.getLogger("muonkit.optimizer")  # the logger users filter on: the optimizer's, as before the split

OVERFLOW = (
    ", or finite but so large that the step would overflow its state or a param: above ~1.8e19 in an fp32 "
    "AdamW group, ~1e31 in an fp32 Muon group; muonkit.functional.overflow"
)
"""What else a gradient verdict of "non-finite" covers (:mod:`muonkit.limits`)."""

Settings = Callable[[], Sequence[Setting]]
"""What else ranks must share (:func:`~muonkit.distributed.agreement.settings_of`), made only where sent."""


class Judged(Protocol):
    """What the guard reads and writes of the optimizer."""

    skipped_steps: int

    @property
    def nonfinite(self) -> str: ...

    @property
    def strategy(self) -> Strategy: ...

    @property
    def state(self) -> MutableMapping[Tensor, Any]: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class Chunk(Protocol):
    """A computed Muon chunk (:class:`muonkit.stages.MuonChunk`), as far as the verdict reads it."""

    @property
    def directions(self) -> list[Tensor]: ...


C = TypeVar("C", bound=Chunk)


@dataclass
class Stream:
    """The verdict of a streamed step: on the device, or decided on the host."""

    start: Tensor | None = None
    """On the device: ``[every gradient finite, the shared values agree]`` over every rank."""
    mask: Tensor | None = None
    """On the device: ``start.all()``, what every Muon commit is masked by."""
    finite: Tensor | None = None
    """On the device: every Muon direction of the step so far finite."""
    bad_chunks: int | None = None
    """Decided on the host: chunks left unapplied for a non-finite direction (None: no gradients)."""
    created: list[Tensor] = dataclasses.field(default_factory=list)
    """Params whose state the step created (removed again if the verdict skips it)."""

    def check(self, directions: Sequence[Tensor]) -> Tensor | bool:
        """Whether to apply a chunk with these directions: a device flag (the mask and their
        finiteness, recorded in :attr:`finite`), or on the host, where reads are free, a bool."""
        nonempty = [d for d in directions if d.numel() > 0]
        if self.mask is None:
            fine = not nonempty or within_on_host(nonempty, finite_limits(nonempty))
            if not fine and self.bad_chunks is not None:
                self.bad_chunks += 1
            return fine
        if not nonempty:
            return self.mask
        mine = torch.stack(torch._foreach_norm(nonempty, float("inf"))).max().lt(math.inf).to(self.mask.device)
        self.finite = cast(Tensor, self.finite) & mine
        return self.mask & mine

    @property
    def defers_adamw(self) -> bool:
        """Whether AdamW waits for the verdict's read (it is on the device)."""
        return self.mask is not None


@dataclass
class Verdict(Generic[C]):
    """What :meth:`Guard.before` decided: whether the step goes on, and how its chunks are committed."""

    applies: bool
    """Whether the step goes on (False: skipped, before anything changed)."""
    chunks: list[Iterable[C]]
    """Each group's Muon chunks to commit: computed as they are iterated, or (held) lists."""
    stream: Stream | None = None
    """A streamed verdict, checked per committed chunk (:meth:`Stream.check`); None: unchecked or held."""

    @property
    def defers_adamw(self) -> bool:
        """Whether AdamW groups wait for :meth:`Guard.outcome` (the verdict is still on the device)."""
        return self.stream is not None and self.stream.defers_adamw


class Guard:
    """Whether a step applies, on one device: nothing to agree on, every verdict read where it is.

    Strategies that communicate make a :class:`CollectiveGuard`. The collectives and reads of a
    step are those of the methods below, in the order ``step()`` calls them.
    """

    # ------------------------------------------------------------------ what ranks share

    def align_grads(self, params: Sequence[Tensor]) -> None:
        """Lay out each param's gradient like the param, where an engine left it otherwise.

        Called by ``step()`` on every param with a gradient, the same params on every rank, before
        anything is checked. Default: nothing (plain tensors).
        """
        del params

    def agree(self, has_grad: Sequence[bool], settings: Settings = list) -> None:
        """Check that all ranks step the same params with the same settings.

        ``has_grad``: whether each param has a gradient, every param in group order;
        ``settings``: what else ranks must share (see :func:`muonkit.distributed.agreement.settings_of`),
        called only by guards that communicate. Those raise on every rank when ranks disagree,
        which would otherwise hang a collective, mix different tensors in it or let the replicas
        drift apart; they check it in one small all-reduce on the host (no device read). One
        device: nothing to do.
        """
        del has_grad, settings

    def all_true(self, flags: Tensor) -> list[bool]:
        """Each of this rank's few verdicts (a bool tensor) AND-ed over every rank, in one collective."""
        return [bool(f) for f in flags.reshape(-1).tolist()]

    def reduce_flags(self, flags: Tensor) -> Tensor:
        """This rank's few verdicts (a bool vector) AND-ed over every rank, without a read: a bool
        vector where ``flags`` live (where the backend reduces), with one more flag at the end:
        whether the device values every rank must share agree (guards of replicated params, see
        :meth:`values_error`; always true here)."""
        return torch.cat([flags.reshape(-1).bool(), torch.ones(1, dtype=torch.bool, device=flags.device)])

    def values_error(self) -> Exception:
        """The error for a false last flag of :meth:`reduce_flags`."""
        return RuntimeError("no device values to compare on one device")

    def reads_wait(self, device: torch.device) -> bool:
        """Whether reading a verdict on ``device`` makes the host wait for device work (an
        accelerator), or is free (the CPU): :func:`~muonkit.functional.orthogonalize.host_read_waits`,
        which :func:`muonkit.testing.op_counts.as_on_an_accelerator` switches for a CPU test."""
        return host_read_waits(device)

    def end(self) -> None:
        """Called at the end of every ``step()`` that applied or skipped its updates (not after an error).

        Communicating guards start there the late checks of a step without a verdict
        (:meth:`CollectiveGuard.end`). Default: nothing.
        """
        return None

    def step_failed(self, error: BaseException, *, applied: bool) -> None:
        """Called when ``step()`` raises ``error`` on this rank; ``applied``: whether the step had changed
        any param or state before it. Never raises.

        Communicating guards tell the other ranks (they would wait for this one until the process
        group's timeout) and stop stepping where the group is left out of step
        (:mod:`muonkit.distributed.failure`). Default: nothing.
        """
        del error, applied

    def host_tensors(self) -> list[Tensor]:
        """The tensors of this guard's latest checks that live in host memory on any device.

        Reading them makes the host wait for no device work (for counting reads in a CPU run that
        stands in for a device run: :mod:`muonkit.testing.op_counts`). Default: none.
        """
        return []

    # ------------------------------------------------------------------ the verdict

    def before(
        self,
        opt: Judged,
        work: list[list[Tensor]],
        configs: list[MuonConfig | AdamWConfig],
        chunks: list[Iterable[C]],
    ) -> Verdict[C]:
        """The ranks' agreement on the step (:meth:`agree`), then its verdict's policy.

        ``work``: the params each group steps; ``chunks``: each group's Muon chunks, computed as they
        are iterated (a held verdict computes them all first and commits them as lists).
        """
        self.agree(*participation(opt.param_groups, configs, nonfinite=opt.nonfinite))
        if opt.nonfinite == "unchecked":
            return Verdict(True, chunks)
        if all(bounded(c) for c in configs if isinstance(c, MuonConfig)):
            stream = self._start_stream(opt, work, configs)
            return Verdict(stream is not None, chunks, stream)
        held: list[list[C]] = [list(c) for c in chunks]
        return Verdict(self._finite_or_skip(opt, work, configs, held), cast(list[Iterable[C]], held))

    def outcome(self, opt: Judged, verdict: Verdict[Any]) -> bool:
        """Whether the step goes on to its deferred AdamW updates: a streamed verdict's one blocking
        read (after every Muon update is launched, the step's last collective); undoes a skipped
        step's new states."""
        stream = verdict.stream
        if stream is None:
            return True
        if stream.mask is None:  # decided on the host
            if stream.bad_chunks is None:  # no gradients: nothing was checked, nothing to agree on
                return True
            finite = self.reduce_flags(torch.tensor([stream.bad_chunks == 0])).tolist()[0]  # free read
            grads_ok = values_ok = True
        else:
            start, finite_flag = cast(Tensor, stream.start), cast(Tensor, stream.finite)
            end = self.reduce_flags(finite_flag.reshape(1))
            grads_ok, values_ok, finite, _ = torch.cat([start, end.to(start.device)]).tolist()
        if not (grads_ok and values_ok):
            for p in stream.created:  # masked: only the states the step made are left to undo
                opt.state.pop(p, None)
            if not values_ok:
                raise self.values_error()
            return judge(opt, False, True)
        if not finite:
            error = RuntimeError(
                "A Muon direction was non-finite although every gradient was finite (a non-finite momentum "
                "buffer, or a bug): the step was applied except to the matrices of those directions; the "
                "optimizer state is suspect, restore the last checkpoint"
            )
            raise every_rank(error)  # from the verdict every rank shares
        return True

    def _finite_or_skip(
        self, opt: Judged, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig], chunks: list[list[C]]
    ) -> bool:
        """The held verdict: every gradient within its limit (:func:`checked_inputs`) and every Muon
        direction finite, on every rank.

        One agreement for both (one tiny all-reduce when distributed) and, on accelerators, one
        blocking read: the verdict is computed on the device (:func:`~muonkit.limits.within_flags`)
        and read once.
        """
        inputs, limits = checked_inputs(opt.strategy, work, configs)
        if not inputs:
            return True
        directions = [d for group in chunks for chunk in group for d in chunk.directions]
        flags = within_flags([inputs, directions], [limits, finite_limits(directions)])
        grads_ok, updates_ok = self.all_true(flags)
        return judge(opt, grads_ok, updates_ok)

    def _start_stream(
        self, opt: Judged, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig]
    ) -> Stream | None:
        """The streamed step's verdict on the gradients, on every rank (no read where reads wait).

        Where reads are free (the CPU) it is read now: a non-finite gradient (or one above its
        limit) skips (or raises) before anything is computed, and None is returned on a skip.
        Elsewhere it stays on the device as the mask of every Muon commit, and :meth:`outcome`
        reads it.
        """
        inputs, limits = checked_inputs(opt.strategy, work, configs)
        if not inputs:
            return Stream()
        start = self.reduce_flags(within_flags([inputs], [limits]))  # [gradients within, values agree]
        if self.reads_wait(start.device):
            return Stream(start=start, mask=start.all(), finite=torch.ones((), dtype=torch.bool, device=start.device))
        grads_ok, values_ok = start.tolist()
        if not values_ok:
            raise self.values_error()
        return Stream(bad_chunks=0) if judge(opt, grads_ok, True) else None


class CollectiveGuard(Guard):
    """The guard of a communicating strategy, over its collectives ``comm`` (agreement, verdicts,
    late checks and the failure channel: :class:`~muonkit.distributed.collectives.Collectives`).

    ``strategy``: the strategy's name, one of the settings every rank must share.
    """

    def __init__(self, comm: Collectives, *, strategy: str) -> None:
        self.comm = comm
        self.strategy = strategy

    def agree(self, has_grad: Sequence[bool], settings: Settings = list) -> None:
        self.comm.check_agreement([*settings(), Setting("strategy", self.strategy)], has_grad)

    def all_true(self, flags: Tensor) -> list[bool]:
        return self.comm.all_ranks_true(flags)

    def reduce_flags(self, flags: Tensor) -> Tensor:
        return self.comm.reduce_flags(flags)

    def values_error(self) -> Exception:
        return self.comm.values_error()

    def end(self) -> None:
        self.comm.end_step()

    def step_failed(self, error: BaseException, *, applied: bool) -> None:
        self.comm.step_failed(error, applied=applied)

    def host_tensors(self) -> list[Tensor]:
        return list(self.comm.host_buffers)


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
        non-finite verdict (:meth:`~muonkit.distributed.collectives.Collectives.expect_equal`: no
        read of its own), so plain params left out of a data-parallel wrapper (their gradients
        never averaged) raise on every rank, before anything changes, instead of drifting apart.
        With ``nonfinite="unchecked"`` (no verdict, no read) it is checked one step late.
        """
        super().agree(has_grad, settings)
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if grads:
            sums = torch.stack([g.detach().sum(dtype=torch.float64) for g in grads])
            self.comm.expect_equal("gradients of the plain params replicated beside the DTensors", sums)


def participation(
    groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig], *, nonfinite: str
) -> tuple[list[bool], Settings]:
    """What every rank must agree on before a step (:meth:`Guard.agree`): whether each param has a
    gradient, and the settings (made only by a guard that sends them)."""
    has_grad = [p.grad is not None for g in groups for p in g["params"]]
    return has_grad, functools.partial(settings_of, configs, groups, nonfinite=nonfinite)


def bounded(config: MuonConfig) -> bool:
    """Whether the group's schedule is a preset's, whose directions are finite wherever its updates are."""
    options = config.ns_options
    return is_preset_schedule(options.coefficients, steps=options.steps)


def checked_inputs(
    strategy: Strategy, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig]
) -> tuple[list[Tensor], list[float]]:
    """The tensors a checked step's verdict compares, and their limits (:mod:`muonkit.limits`):
    every local gradient, and the local params of groups whose settings could overflow one."""
    local, inputs, limits = strategy.local, [], []
    for config, params in zip(configs, work, strict=True):
        group = GroupLimits(config)
        for p in params:
            grad = local(cast(Tensor, p.grad))
            inputs.append(grad)
            limits.append(group.gradient(state_dtype=work_dtype(p.dtype), grad_dtype=grad.dtype))
        for p in params:
            shapes = strategy.whole_shapes(p) if isinstance(config, MuonConfig) else []
            limit = group.param(shapes=shapes, param_dtype=p.dtype)
            if limit is not None:
                inputs.append(local(p))
                limits.append(limit)
    return inputs, limits


def judge(opt: Judged, grads_ok: bool, updates_ok: bool) -> bool:
    """Whether to apply the step; on a non-finite gradient or update, raise or count and log the skip.

    ``grads_ok`` is False also for a finite gradient (or param) above its limit, which would
    overflow the step's state or params (:mod:`muonkit.limits`); on an accelerator the one
    read of the verdict cannot tell which, so neither message does."""
    if grads_ok and updates_ok:
        return True
    what = "gradient" if not grads_ok else "Muon update from finite gradients"
    if opt.nonfinite == "raise":  # from the verdict every rank shares: raised alike on every rank
        raise every_rank(
            FloatingPointError(f"non-finite {what} (inf or nan{OVERFLOW if not grads_ok else ''}); nothing was updated")
        )
    opt.skipped_steps += 1
    what = "gradient (or one so large the step would overflow)" if not grads_ok else what
    logger.warning("Skipping optimizer step: non-finite %s (skipped so far: %d)", what, opt.skipped_steps)
    return False


def finite_limits(ts: Sequence[Tensor]) -> list[float]:
    """Limits that pass exactly the finite values (:func:`~muonkit.limits.within_flags`)."""
    return [torch.finfo(t.dtype).max for t in ts]
