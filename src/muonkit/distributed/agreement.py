"""What every rank must agree on before a distributed step, checked in one tiny all-reduce on the host.

Ranks that step different params hang a collective or mix unrelated tensors in it; ranks with
different hyperparameters (an lr set per rank by mistake) silently train different models. So
every step, strategies that communicate send one small integer vector, all-reduced with MAX:

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
from typing import Any

import torch

from muonkit.config import AdamWConfig, MuonConfig

__all__ = ["Setting", "check_agreement", "settings_of"]

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
