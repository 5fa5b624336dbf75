"""The verdict's parts (``nonfinite=``): what :class:`~muonkit.distributed.guard.Guard` decides with.

:class:`Stream`: a streamed verdict, checked per committed chunk; :class:`Verdict`: what
:meth:`Guard.before <muonkit.distributed.guard.Guard.before>` decided; :func:`judge`: apply,
skip (counted in ``skipped_steps``, logged on the ``muonkit.optimizer`` logger) or raise;
:func:`checked_inputs`: what a checked step compares, against which limits (:mod:`muonkit.limits`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed.failure import every_rank
from muonkit.limits import GroupLimits, within_on_host, work_dtype

if TYPE_CHECKING:  # no import edge: the strategies import the guard
    from muonkit.distributed.base import Strategy

__all__ = ["Judged", "Stream", "Verdict", "bounded", "checked_inputs", "finite_limits", "judge"]

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
