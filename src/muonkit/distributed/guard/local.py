"""One device's guard (nothing to agree on, every verdict read where it is), the policies every guard
follows, and the verdict's parts.

:meth:`Guard.before` chooses the step's policy (unchecked, streamed or held, see
:mod:`muonkit.distributed.guard`) after the ranks' agreement; :meth:`Guard.outcome` reads a
streamed verdict. Guards of communicating strategies (:mod:`.ranks`) change only how flags are
AND-ed over ranks and what is agreed on, never the policies.

The verdict's parts: :class:`Stream` (a streamed verdict, checked per committed chunk),
:class:`Verdict` (what :meth:`Guard.before` decided), :func:`judge` (apply, skip, counted in
``skipped_steps`` and logged on the ``muonkit.optimizer`` logger, or raise) and
:func:`checked_inputs`: every gradient, and where a group's settings could overflow a param,
every param of it, against the largest magnitude for which the step writes only finite values
(:mod:`muonkit.limits`, derived in :mod:`muonkit.functional.overflow`). A magnitude above its
limit (or an inf or NaN) makes the verdict "non-finite": the step is skipped or raises exactly
as for an inf in a gradient. The comparison (:func:`within_flags`) is one max-abs pass: on
accelerators one ``_foreach_norm(ord=inf)`` per list and device, compared on the device; on the
CPU, where reads are free, a fused 2-norm per tensor read at once, and only where that norm is
near a limit, the exact range (:func:`within_on_host`).

Example::

    >>> import torch
    >>> within_on_host([torch.tensor([1e20, 0.0])], [1.8e19]), within_on_host([torch.ones(3)], [1.8e19])
    (False, True)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed.collectives import every_rank
from muonkit.functional.orthogonalize import host_read_waits
from muonkit.limits import gradient_limit, param_limit, work_dtype

if TYPE_CHECKING:  # no import edge: the strategies import the guard
    from muonkit.distributed.base import Strategy

__all__ = [
    "Guard",
    "Judged",
    "Stream",
    "Verdict",
    "bounded",
    "checked_inputs",
    "finite_limits",
    "judge",
    "within_flags",
    "within_on_host",
]


logger = logging.getLogger("muonkit.optimizer")  # the logger users filter on: the optimizer's, as before the split

OVERFLOW = (
    ", or finite but so large that the step would overflow its state or a param: above ~1.8e19 in an fp32 "
    "AdamW group, ~1e31 in an fp32 Muon group; muonkit.functional.overflow"
)
"""What else a gradient verdict of "non-finite" covers (:mod:`muonkit.limits`)."""


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


def bounded(config: MuonConfig) -> bool:
    """Whether the group's schedule is a preset's, whose directions are finite wherever its updates are."""
    return config.ns_options.bounded


def checked_inputs(
    strategy: Strategy, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig]
) -> tuple[list[Tensor], list[float]]:
    """The tensors a checked step's verdict compares, and their limits (:mod:`muonkit.limits`):
    every local gradient, and the local params of groups whose settings could overflow one.

    Each limit is worked out once per group config and dtypes (and whole shapes), kept in
    :data:`_LIMITS`: in a steady step, a dict lookup per param."""
    local, inputs, limits = strategy.local, [], []
    if len(_LIMITS) > _LIMITS_KEPT:
        _LIMITS.clear()
    for config, params in zip(configs, work, strict=True):
        muon = isinstance(config, MuonConfig)
        for p in params:
            grad = local(cast(Tensor, p.grad))
            inputs.append(grad)
            key = (config, p.dtype, grad.dtype)
            if key not in _LIMITS:
                _LIMITS[key] = gradient_limit(config, state_dtype=work_dtype(p.dtype), grad_dtype=grad.dtype)
            limits.append(cast(float, _LIMITS[key]))
        for p in params:
            shapes = tuple(strategy.whole_shapes(p)) if muon else ()
            shaped = (config, shapes, p.dtype)
            if shaped not in _LIMITS:
                _LIMITS[shaped] = param_limit(config, shapes=shapes, param_dtype=p.dtype)
            bound = _LIMITS[shaped]
            if bound is not None:
                inputs.append(local(p))
                limits.append(bound)
    return inputs, limits


_LIMITS: dict[tuple[Any, ...], float | None] = {}
"""The limits :func:`checked_inputs` worked out, by (group config, dtypes or whole shapes)."""
_LIMITS_KEPT = 4096
"""Cleared beyond this many entries (an lr scheduler makes a new config every step)."""


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
    """Limits that pass exactly the finite values (:func:`within_flags`)."""
    return [torch.finfo(t.dtype).max for t in ts]


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

    def agree(
        self, groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig], *, nonfinite: str
    ) -> None:
        """Check that all ranks step the same params (which have gradients) with the same settings.

        ``groups`` and ``configs``: the optimizer's param groups and their validated configs;
        ``nonfinite``: the optimizer's policy, a setting every rank shares. Guards that
        communicate raise on every rank when ranks disagree, which would otherwise hang a
        collective, mix different tensors in it or let the replicas drift apart; they check it in
        one small all-reduce on the host (no device read; :mod:`.ranks`). One device: nothing to do.
        """
        del groups, configs, nonfinite

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
        (:mod:`muonkit.distributed.collectives`). Default: nothing.
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
        self.agree(opt.param_groups, configs, nonfinite=opt.nonfinite)
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
        blocking read: the verdict is computed on the device (:func:`within_flags`)
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


def within_flags(lists: Sequence[Sequence[Tensor]], limits: Sequence[Sequence[float]]) -> Tensor:
    """For each list of tensors, whether every element is finite and within its tensor's limit
    (``limits[i][j]`` for ``lists[i][j]``, a value of that tensor's dtype): a bool vector.

    On accelerators (:func:`~muonkit.functional.orthogonalize.host_read_waits`) it is computed on
    the device and nothing is read: per list and device one max-abs (``_foreach_norm(ord=inf)``,
    exact), compared with the limit (one comparison where a list shares one limit; else each
    max-abs less its limit, ``_foreach_sub``, whose sign is exact); the vector lives on the first
    such device. On the CPU, where reads are free, :func:`within_on_host`. Empty tensors (a
    rank's empty FSDP2 shards) pass.
    """
    flags: list[bool | list[Tensor]] = []
    for ts, ls in zip(lists, limits, strict=True):
        by_device: dict[torch.device, tuple[list[Tensor], list[float]]] = {}
        for t, limit in zip(ts, ls, strict=True):
            if t.numel() > 0:
                xs, ys = by_device.setdefault(t.device, ([], []))
                xs.append(t)
                ys.append(limit)
        host = [pair for device, pair in by_device.items() if not host_read_waits(device)]
        if not all(within_on_host(xs, ys) for xs, ys in host):
            flags.append(False)
            continue
        flags.append([_within_on_device(xs, ys) for device, (xs, ys) in by_device.items() if host_read_waits(device)])
    devices = [f[0].device for f in flags if isinstance(f, list) and f]
    if not devices:
        return torch.tensor([f is not False for f in flags])
    parts = [
        torch.tensor(f, device=devices[0])
        if isinstance(f, bool)
        else torch.stack([x.to(devices[0]) for x in f]).all()
        if f
        else torch.tensor(True, device=devices[0])
        for f in flags
    ]
    return torch.stack(parts)


def _within_on_device(xs: list[Tensor], limits: list[float]) -> Tensor:
    """A 0-dim bool on the device: every max-abs of ``xs`` within its limit (NaN: False)."""
    peaks = torch._foreach_norm(xs, math.inf)
    if len(set(limits)) == 1:
        return torch.stack(peaks).max().le(limits[0])
    return torch.stack(torch._foreach_sub(peaks, limits)).max().le(0)


_NORM_MARGIN = 1 + 2.0**-7
"""A computed 2-norm is at least the largest magnitude less its own last rounding (the sum of
squares, accumulated in fp32 or wider, never drops below its largest term; bf16 and fp16 norms
are rounded once more, by at most 2^-9): a norm this far below the limit proves the tensor within."""


def within_on_host(ts: Sequence[Tensor], limits: Sequence[float]) -> bool:
    """Whether every element is finite and ``|x| <= limit`` of its tensor, with host reads (free
    on the CPU): one fused 2-norm per tensor and one read; only for a tensor whose norm does not
    prove it within (a norm above ``limit / (1 + 2^-7)``, inf or NaN), its exact range (min and
    max), so a finite tensor whose sum of squares overflows (values above ~1e19) is judged by its
    values. ``_foreach_norm(ord=inf)`` would be exact in one pass but is several times slower on
    CPU (BENCHMARKS.md)."""
    norms = torch.stack(torch._foreach_norm(list(ts))).tolist()
    for t, norm, limit in zip(ts, norms, limits, strict=True):
        if not norm * _NORM_MARGIN <= limit:  # NaN and inf too
            low, high = (float(x) for x in torch.aminmax(t))
            if not max(-low, high) <= limit:
                return False
    return True
