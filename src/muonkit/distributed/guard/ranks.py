"""The guard of communicating strategies: the ranks' agreement, verdicts AND-ed over ranks, late checks.

What ranks must agree on before a step (settings, which params have gradients) is known on
the host, so it is reduced on the host: over the collectives'
:attr:`~muonkit.distributed.collectives.Collectives.host_group`, never through the device, so the
check makes the host wait for no device work (:func:`encode`, below). Values
that live on the device and must be equal on every rank (:meth:`CollectiveGuard.expect_equal`:
the TP fingerprints of :class:`MeshGuard`) ride with the step's non-finite verdict
(:meth:`CollectiveGuard.all_true`, the step's one blocking read) or, in a step without one, are
checked one step late from a host copy that waited for nothing (:meth:`CollectiveGuard.end`).

A rank that raises inside a step tells the others through the collectives' failure channel
(:meth:`CollectiveGuard.step_failed`, :mod:`muonkit.distributed.collectives`). Every collective goes
through :class:`~muonkit.distributed.collectives.Collectives`, counted.

Ranks that step different params hang a collective or mix unrelated tensors in it; ranks with
different hyperparameters (an lr set per rank by mistake) silently train different models. So
every step they agree on one small integer vector:

====================================  ===============================================================
word                                  meaning
====================================  ===============================================================
``hash(setting)``, one per setting    the param groups' structure (algorithms, param shapes and
                                      dtypes), ``nonfinite``, the strategy, then every field of every
                                      group's typed config (``lr``, ``momentum``, ``betas``...)
``0`` or ``1``, one per param         whether it has a gradient on this rank
====================================  ===============================================================

followed by the same words negated. The maximum of ``-x`` is minus the minimum of ``x``, so one
``all_reduce(MAX)`` gives every word's maximum and minimum over ranks, and a word differs
somewhere exactly when they differ. Hashes are 62 bits (blake2b of the setting's name and
``repr``, which is exact for floats), so ``x`` and ``-x`` both fit in int64; a collision between
two different values has probability ~2^-62 per setting. The vector is zero-padded to a power of
two (at least 64 words): ranks whose param counts differ by a few (an extra group on one rank)
still issue the same collective and get the "param groups differ" error instead of a crash in it.

All of it is known on the host, so the vector is built and reduced there (over
:attr:`~muonkit.distributed.collectives.Collectives.host_group`: the group itself, or a gloo
group beside an NCCL one), and reading it makes the host wait for no device work. Device values
ranks must share (:func:`value_vector`) are checked with the step's non-finite verdict instead.

Every rank sees the same reduced vector, so every rank raises the same error (naming the setting
and its value on that rank) and none is left waiting in a later collective. Lr schedulers that
change ``lr`` identically on every rank keep the ranks in agreement.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.distributed.collectives import every_rank, flag_device, reduce_device
from muonkit.distributed.guard.local import Guard

if TYPE_CHECKING:
    from muonkit.distributed.collectives import Collectives

__all__ = [
    "CollectiveGuard",
    "MeshGuard",
    "ReplicaGuard",
    "Setting",
    "check_agreement",
    "encode",
    "same_on_every_rank",
    "settings_of",
    "value_vector",
    "values_agree",
]


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

    def agree(
        self, groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig], *, nonfinite: str
    ) -> None:
        """Raise on every rank (never hang) unless all ranks hold the same settings and gradient
        flags (one tiny all_reduce MAX on the host, :func:`encode`).

        First the values of the previous step's late check (:meth:`end`), if any. Opens the step
        (the first collective of every step): a rank out of step since a failed step raises here.
        """
        has_grad = [p.grad is not None for g in groups for p in g["params"]]
        shared = [*settings_of(configs, groups, nonfinite=nonfinite), Setting("strategy", self.strategy)]
        comm = self.comm
        comm.channel.begin()
        self._values = None
        self._check_late()
        encoded = encode(shared, has_grad)
        group = comm.host_group
        if group is None:  # no gloo: through the device, with a read
            encoded, self.host_buffers = encoded.to(flag_device(comm.group)), []
        else:
            self.host_buffers = [encoded]
        comm.all_reduce(encoded, op=dist.ReduceOp.MAX, group=group)
        try:
            check_agreement(encoded.cpu(), shared, has_grad)
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

        The values go as :func:`value_vector` (their words and the
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
            t = torch.cat([t, value_vector(named[1]).to(device)])
            self._named = named[0]
        self.comm.all_reduce(t, op=dist.ReduceOp.MIN)
        equal = torch.ones((), dtype=torch.bool, device=device) if named is None else values_agree(t[count:])
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
        """``step()`` raised ``error`` on this rank (see :meth:`~muonkit.distributed.collectives.FailureChannel.failed`)."""
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

    def agree(
        self, groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig], *, nonfinite: str
    ) -> None:
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
        super().agree(groups, configs, nonfinite=nonfinite)
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if grads:
            self.expect_equal("gradients of the plain params replicated beside the DTensors", grad_sums(grads))


REPLICA_GRADIENTS = "gradients (plain params taken as DDP replicas: every rank holds the same params)"


class ReplicaGuard(CollectiveGuard):
    """The guard of plain params read as DDP replicas without ``process_group=`` (chosen because
    every rank holds the same params, :func:`muonkit.distributed.select_strategy`).

    Same shapes do not make replicas: ranks that each train their own model, or pipeline stages
    of equal shapes, hold params whose gradients differ. So every step the gradients' fingerprint
    (their sums, in float64, computed on the device) rides with the non-finite verdict, as
    :class:`MeshGuard` checks plain params beside tensor-parallel ones: gradients that differ raise
    on every rank before anything changes (one step late with ``nonfinite="unchecked"``).
    """

    def agree(
        self, groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig], *, nonfinite: str
    ) -> None:
        super().agree(groups, configs, nonfinite=nonfinite)
        grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
        if grads:
            self.expect_equal(REPLICA_GRADIENTS, grad_sums(grads))


def grad_sums(grads: Sequence[Tensor]) -> Tensor:
    """The fingerprint of gradients every rank must share: each one's sum in float64, on the device."""
    return torch.stack([g.detach().sum(dtype=torch.float64) for g in grads])


def same_on_every_rank(comm: Collectives, setting: Setting) -> bool:
    """Whether every rank of ``comm`` holds the same ``setting``: one tiny all_reduce MAX of
    :func:`encode` on the host (as :meth:`CollectiveGuard.agree`), so every rank gets the same
    answer and none raises alone. Every rank of the group must call it at the same point."""
    comm.channel.begin()
    try:
        encoded = encode([setting], [])
        group = comm.host_group
        if group is None:  # no gloo: through the device, with a read
            encoded = encoded.to(flag_device(comm.group))
        comm.all_reduce(encoded, op=dist.ReduceOp.MAX, group=group)
        got = encoded.cpu().tolist()
    finally:
        comm.channel.end()
    return got[0] + got[len(got) // 2] == 0  # max == min


_ADVICE = {
    REPLICA_GRADIENTS: (
        "HybridMuon took the params for DDP replicas because every rank holds the same shapes and no "
        "process_group= was given. Wrap the model in DistributedDataParallel (accelerate, Lightning and "
        "torchrun scripts do), pass strategy=muonkit.distributed.SingleDeviceStrategy() if each rank trains "
        "its own model, or process_group= the group of the ranks that average their gradients (a pipeline "
        "stage's data-parallel group)"
    ),
}


def _values_differ(name: str, *, late: bool) -> ValueError:
    when = (
        " at the previous step (checked one step late, as a step without a non-finite check reads nothing; "
        "that step was applied)"
        if late
        else ""
    )
    advice = _ADVICE.get(
        name,
        "Every rank must step the same values: average them over the ranks that share them (e.g. leave the "
        "module inside the data-parallel wrapper)",
    )
    return ValueError(f"HybridMuon's {name} differ across ranks{when}. {advice}")


# ---------------------------------------------------------------- the agreement

_MIN_WORDS = 64


@dataclasses.dataclass(frozen=True)
class Setting:
    """One thing every rank must agree on: its name and its value on this rank (a ``repr``)."""

    name: str
    value: str

    def word(self) -> int:
        """A 62-bit hash of name and value (so that ``-word`` fits in int64 too)."""
        digest = hashlib.blake2b(f"{self.name}={self.value}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2


def settings_of(
    configs: Sequence[MuonConfig | AdamWConfig], groups: Sequence[Mapping[str, Any]], **options: Any
) -> list[Setting]:
    """The settings of an optimizer's param groups that every rank must share.

    First the structure (per group: the algorithm and each param's shape and dtype, as this
    rank's optimizer sees them: whole, DTensor global or ZeRO partition shapes), then
    ``options`` (optimizer-wide settings such as ``nonfinite``), then each group's typed
    config field by field.
    """
    structure = [
        (type(c).__name__, [(tuple(p.shape), str(p.dtype)) for p in g["params"]])
        for c, g in zip(configs, groups, strict=True)
    ]
    settings = [Setting("param groups (algorithms, param shapes and dtypes)", repr(structure))]
    settings += [Setting(name, repr(value)) for name, value in options.items()]
    for i, config in enumerate(configs):
        for field in dataclasses.fields(config):
            settings.append(Setting(f"param group {i} {field.name}", repr(getattr(config, field.name))))
    return settings


def encode(settings: Sequence[Setting], has_grad: Sequence[bool]) -> torch.Tensor:
    """This rank's int64 vector (on the CPU): setting hashes, gradient flags, zero padding, then all negated."""
    words = [s.word() for s in settings] + [int(bool(f)) for f in has_grad]
    size = max(_MIN_WORDS, 1 << max(0, len(words) - 1).bit_length())
    mine = torch.zeros(size, dtype=torch.int64)
    mine[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return torch.cat([mine, -mine])


def value_words(values: torch.Tensor) -> torch.Tensor:
    """Values (any float dtype, on any device) as words every rank must share, computed where they
    are (no host read): the low and high 32 bits of each value's float64 bit pattern."""
    bits = values.detach().to(torch.float64).reshape(-1).view(torch.int64)
    return torch.cat([bits & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF])


def value_vector(values: torch.Tensor) -> torch.Tensor:
    """The words of ``values`` (:func:`value_words`) and their negations, for an ``all_reduce(MIN)``:
    the minimum of ``-x`` is minus the maximum of ``x``, so after it a word differs somewhere
    exactly when its two minima do not cancel (:func:`values_agree`)."""
    words = value_words(values)
    return torch.cat([words, -words])


def values_agree(minima: torch.Tensor) -> torch.Tensor:
    """Whether every rank held the same values, from the MIN-reduced :func:`value_vector`: a 0-dim
    bool where ``minima`` are (no read)."""
    half = minima.numel() // 2
    return (minima[:half] + minima[half:]).eq(0).all()


def check_agreement(reduced: torch.Tensor, settings: Sequence[Setting], has_grad: Sequence[bool]) -> None:
    """Raise unless the MAX all-reduce of :func:`encode` (a host tensor) shows every rank holding the same words.

    Raises ``ValueError`` when param groups or settings differ (a setup mistake) and
    ``RuntimeError`` when only the params with gradients differ.
    """
    got = reduced.tolist()  # a host tensor: reading it waits for nothing
    size = len(got) // 2
    differ = [k for k in range(size) if got[k] + got[size + k] != 0]  # max != min
    if not differ:
        return
    flags_end = len(settings) + len(has_grad)
    if differ[0] == 0 or differ[0] >= flags_end:  # shapes differ: nothing aligns
        first = settings[0]
        raise ValueError(
            f"HybridMuon's {first.name} differ across ranks; on this rank: {_short(first.value)}. Every rank must "
            "build the same model and param groups"
        )
    names = [settings[k] for k in differ if k < len(settings)]
    if names:
        listed = "; ".join(f"{s.name} (here {_short(s.value)})" for s in names[:10])
        raise ValueError(
            f"HybridMuon settings differ across ranks: {listed}{'...' if len(names) > 10 else ''}. Every rank must "
            "use the same hyperparameters (set them, and step lr schedulers, identically on every rank)"
        )
    positions = [k - len(settings) for k in differ if k < flags_end]
    raise RuntimeError(
        f"Ranks disagree on which params have gradients at positions {positions[:10]}"
        f"{'...' if len(positions) > 10 else ''}: every rank must step the same params (a param's .grad must be "
        "None on all ranks or on none)"
    )


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
