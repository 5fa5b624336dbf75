"""One device's guard: nothing to agree on, every verdict read where it is; the policies of every guard.

:meth:`Guard.before` chooses the step's policy (unchecked, streamed or held, see
:mod:`muonkit.distributed.guard`) after the ranks' agreement; :meth:`Guard.outcome` reads a
streamed verdict. Guards of communicating strategies (:mod:`.ranks`) change only how flags are
AND-ed over ranks and what is agreed on, never the policies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed.agreement import Setting, settings_of
from muonkit.distributed.failure import every_rank
from muonkit.distributed.guard.verdict import (
    C,
    Judged,
    Stream,
    Verdict,
    bounded,
    checked_inputs,
    finite_limits,
    judge,
)
from muonkit.functional.orthogonalize import host_read_waits
from muonkit.limits import within_flags

__all__ = ["Guard", "Settings", "participation"]

Settings = Callable[[], Sequence[Setting]]
"""What else ranks must share (:func:`~muonkit.distributed.agreement.settings_of`), made only where sent."""


class Guard:
    """Whether a step applies, on one device: nothing to agree on, every verdict read where it is.

    Strategies that communicate make a :class:`~muonkit.distributed.guard.CollectiveGuard`. The collectives and reads of a
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
        (:meth:`~muonkit.distributed.guard.CollectiveGuard.end`). Default: nothing.
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


def participation(
    groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig], *, nonfinite: str
) -> tuple[list[bool], Settings]:
    """What every rank must agree on before a step (:meth:`Guard.agree`): whether each param has a
    gradient, and the settings (made only by a guard that sends them)."""
    has_grad = [p.grad is not None for g in groups for p in g["params"]]
    return has_grad, functools.partial(settings_of, configs, groups, nonfinite=nonfinite)
