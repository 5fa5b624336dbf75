"""Whether a step applies: the non-finite verdict of :class:`muonkit.HybridMuon` (``nonfinite=``).

Three policies, chosen per step by :func:`before_commit`:

- **unchecked** (``nonfinite="unchecked"``): no check, no read; every chunk is applied as it comes.
- **streamed** (``"skip"``/``"raise"`` with the presets' schedules, whose directions are finite
  wherever their momentum update is): the verdict on the gradients (every one within its limit,
  :mod:`muonkit.limits`) is known before any direction, on every rank. Where reads are free (the
  CPU) it is read at once; elsewhere it stays on the device as the mask of every Muon commit
  (:class:`Stream`), and its one blocking read (:func:`stream_outcome`) comes after every Muon
  update is launched; AdamW, which keeps its step counts on the host, follows it.
- **held** (a custom ``ns_coefficients`` schedule, which may diverge): every direction is
  computed and held before the verdict, so a non-finite one anywhere leaves everything untouched.

A skipped step is counted in ``skipped_steps`` and logged on the ``muonkit.optimizer`` logger;
``"raise"`` raises ``FloatingPointError``; both from a verdict every rank shares.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed import Strategy
from muonkit.distributed.failure import every_rank
from muonkit.functional.coefficients import is_preset_schedule
from muonkit.functional.orthogonalize import host_read_waits
from muonkit.limits import GroupLimits, within_flags, within_on_host, work_dtype

logger = logging.getLogger("muonkit.optimizer")  # the logger users filter on: the optimizer's, as before the split

OVERFLOW = (
    ", or finite but so large that the step would overflow its state or a param: above ~1.8e19 in an fp32 "
    "AdamW group, ~1e31 in an fp32 Muon group; muonkit.functional.overflow"
)
"""What else a gradient verdict of "non-finite" covers (:mod:`muonkit.limits`)."""


class Judged(Protocol):
    """What the verdict reads and writes of the optimizer."""

    skipped_steps: int

    @property
    def nonfinite(self) -> str: ...

    @property
    def strategy(self) -> Strategy: ...

    @property
    def state(self) -> MutableMapping[Tensor, Any]: ...


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


def before_commit(
    opt: Judged,
    work: list[list[Tensor]],
    configs: list[MuonConfig | AdamWConfig],
    chunks: list[Iterable[C]],
) -> tuple[bool, Stream | None, list[Iterable[C]]]:
    """``(whether the step goes on, the streamed verdict or None, the chunks to commit)``.

    ``chunks``: each group's Muon chunks, computed as they are iterated; a held verdict computes
    them all first (and returns them as lists).
    """
    if opt.nonfinite == "unchecked":
        return True, None, chunks
    if all(bounded(c) for c in configs if isinstance(c, MuonConfig)):
        stream = start_stream(opt, work, configs)
        return stream is not None, stream, chunks
    held: list[list[C]] = [list(c) for c in chunks]
    return finite_or_skip(opt, work, configs, held), None, cast(list[Iterable[C]], held)


def bounded(config: MuonConfig) -> bool:
    """Whether the group's schedule is a preset's, whose directions are finite wherever its updates are."""
    options = config.ns_options
    return is_preset_schedule(options.coefficients, steps=options.steps)


def finite_or_skip(
    opt: Judged, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig], chunks: list[list[C]]
) -> bool:
    """Whether to apply the step: every gradient within its limit (:func:`checked_inputs`) and
    every Muon direction finite, on every rank.

    One agreement for both (one tiny all-reduce when distributed) and, on accelerators, one
    blocking read: the verdict is computed on the device (:func:`~muonkit.limits.within_flags`)
    and read once.
    """
    inputs, limits = checked_inputs(opt.strategy, work, configs)
    if not inputs:
        return True
    directions = [d for group in chunks for chunk in group for d in chunk.directions]
    flags = within_flags([inputs, directions], [limits, finite_limits(directions)])
    grads_ok, updates_ok = opt.strategy.all_true(flags)
    return verdict(opt, grads_ok, updates_ok)


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


def start_stream(opt: Judged, work: list[list[Tensor]], configs: list[MuonConfig | AdamWConfig]) -> Stream | None:
    """The streamed step's verdict on the gradients, on every rank (no read where reads wait).

    Where reads are free (the CPU) it is read now: a non-finite gradient (or one above its
    limit) skips (or raises) before anything is computed, and None is returned on a skip.
    Elsewhere it stays on the device as the mask of every Muon commit, and
    :func:`stream_outcome` reads it.
    """
    strategy = opt.strategy
    inputs, limits = checked_inputs(strategy, work, configs)
    if not inputs:
        return Stream()
    start = strategy.reduce_flags(within_flags([inputs], [limits]))  # [gradients within, values agree]
    if host_read_waits(start.device):
        return Stream(start=start, mask=start.all(), finite=torch.ones((), dtype=torch.bool, device=start.device))
    grads_ok, values_ok = start.tolist()
    if not values_ok:
        raise strategy.values_error()
    return Stream(bad_chunks=0) if verdict(opt, grads_ok, True) else None


def stream_outcome(opt: Judged, stream: Stream) -> bool:
    """Read the streamed step's verdict (its one blocking read, after every Muon update is
    launched); undo a skipped step's new states; whether to go on with AdamW."""
    strategy = opt.strategy
    if stream.mask is None:  # decided on the host
        if stream.bad_chunks is None:  # no gradients: nothing was checked, nothing to agree on
            return True
        finite = strategy.reduce_flags(torch.tensor([stream.bad_chunks == 0])).tolist()[0]  # free read
        grads_ok = values_ok = True
    else:
        start, finite_flag = cast(Tensor, stream.start), cast(Tensor, stream.finite)
        end = strategy.reduce_flags(finite_flag.reshape(1))
        grads_ok, values_ok, finite, _ = torch.cat([start, end.to(start.device)]).tolist()
    if not (grads_ok and values_ok):
        for p in stream.created:  # masked: only the states the step made are left to undo
            opt.state.pop(p, None)
        if not values_ok:
            raise strategy.values_error()
        return verdict(opt, False, True)
    if not finite:
        error = RuntimeError(
            "A Muon direction was non-finite although every gradient was finite (a non-finite momentum "
            "buffer, or a bug): the step was applied except to the matrices of those directions; the "
            "optimizer state is suspect, restore the last checkpoint"
        )
        raise every_rank(error)  # from the verdict every rank shares
    return True


def verdict(opt: Judged, grads_ok: bool, updates_ok: bool) -> bool:
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
