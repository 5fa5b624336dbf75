"""Newton-Schulz coefficient presets.

Each step of the quintic iteration maps the singular values of ``X`` through
``p(s) = a*s + b*s^3 + c*s^5``. A preset is the list of ``(a, b, c)`` for its steps plus the
factor by which the Frobenius norm is inflated before the first step (a margin that keeps
every singular value inside the region where the polynomials were designed to work).

``band`` is the interval the output singular values land in for every input singular value
``s >= min_relative * ||U||_F`` (the Frobenius norm, which is what the iteration normalizes
by). Measured in bf16 and fp32 on random, tall, wide, square, low-rank, ill-conditioned
(condition 1e3 and 1e6), rank-1, tiny (1e-30) and huge (1e30) inputs; the promised band is the
measured one widened by a small margin, and the tests check it:

=============== ===================== ============== ==========================
preset          measured              promised       for s >= min_relative*|U|
=============== ===================== ============== ==========================
polar_express   [0.854, 1.143]        [0.80, 1.20]   1e-3
keller          [0.679, 1.203]        [0.60, 1.25]   3e-3
you             [0.975, 1.145]        [0.90, 1.20]   3e-3
=============== ===================== ============== ==========================

Smaller singular values are lifted towards the band but may not reach it within 5 steps
(keller and you leave s ~ 1e-3*|U| near 0.48). In fp32 and fp64 compute exact zeros stay zero:
a rank-deficient input gives a rank-deficient output (spurious singular values < 1e-4). In bf16
they do not: rounding U to bf16 adds noise of ~2^-9*|U|, as large as the smallest singular
values the presets are designed to lift, and it is lifted like them (a rank-1 input measured
spurious singular values up to 0.69 with polar_express, 0.36 with keller and you;
torch.optim.Muon's bf16 path gives 0.51 on the same input).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

Coefficients = tuple[float, float, float]


@dataclass(frozen=True)
class Preset:
    """A named Newton-Schulz schedule and the singular-value band it promises."""

    name: str
    steps: tuple[Coefficients, ...]
    norm_factor: float
    band: tuple[float, float]
    min_relative: float

    def schedule(self, n_steps: int | None) -> tuple[Coefficients, ...]:
        """The coefficients for ``n_steps`` steps (the preset's own count when None).

        Presets with a single repeated tuple extend to any count; tuned multi-step schedules
        are truncated, or extended by repeating their last (most conservative) step.
        """
        if n_steps is None:
            return self.steps
        if n_steps < 1:
            raise ValueError(f"Invalid ns_steps={n_steps}: must be >= 1")
        if n_steps <= len(self.steps):
            return self.steps[:n_steps]
        return self.steps + (self.steps[-1],) * (n_steps - len(self.steps))


KELLER = Preset(
    name="keller",
    steps=((3.4445, -4.7750, 2.0315),) * 5,
    norm_factor=1.0,
    band=(0.60, 1.25),
    min_relative=3e-3,
)

YOU = Preset(
    name="you",
    steps=(
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    norm_factor=1.0,
    band=(0.90, 1.20),
    min_relative=3e-3,
)

POLAR_EXPRESS = Preset(
    name="polar_express",
    steps=(
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    norm_factor=1.02,
    band=(0.80, 1.20),
    min_relative=1e-3,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (POLAR_EXPRESS, KELLER, YOU)}


def resolve_preset(
    coefficients: str | Sequence[Sequence[float]], *, steps: int | None = None
) -> tuple[tuple[Coefficients, ...], float]:
    """Turn a preset name or an explicit schedule into ``(schedule, norm_factor)``.

    An explicit schedule is a sequence of ``(a, b, c)``; with ``steps`` larger than its length
    the last tuple repeats, so ``[(3.4445, -4.7750, 2.0315)]`` with ``steps=5`` is Keller's.
    A single flat ``(a, b, c)`` triple (torch.optim.Muon's ``ns_coefficients``) is accepted too.
    """
    if isinstance(coefficients, str):
        preset = PRESETS.get(coefficients)
        if preset is None:
            raise ValueError(
                f"Invalid ns_coefficients={coefficients!r}: must be one of {sorted(PRESETS)} "
                "or a sequence of (a, b, c) tuples"
            )
        return preset.schedule(steps), preset.norm_factor
    schedule = as_schedule(coefficients)
    return Preset("custom", schedule, 1.0, (0.0, 0.0), 0.0).schedule(steps), 1.0


def as_schedule(coefficients: Sequence[Sequence[float]] | Sequence[float]) -> tuple[Coefficients, ...]:
    """An explicit schedule as a tuple of float triples (a flat triple is one step)."""
    bad_step = f"Invalid ns_coefficients={coefficients!r}: each step must be an (a, b, c) triple of finite floats"
    if not isinstance(coefficients, Sequence):
        raise ValueError(
            f"Invalid ns_coefficients={coefficients!r}: must be one of {sorted(PRESETS)} or a sequence of (a, b, c) tuples"
        )
    items: list[Any] = list(coefficients)
    if len(items) == 3 and all(_is_real(v) for v in items):
        items = [items]  # a flat (a, b, c) triple
    schedule: list[Coefficients] = []
    for item in items:
        if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 3:
            raise ValueError(bad_step)
        if not all(_is_real(v) and _finite(v) for v in item):
            raise ValueError(bad_step)
        a, b, c = (float(v) for v in item)
        schedule.append((a, b, c))
    if not schedule:
        raise ValueError("Invalid ns_coefficients=[]: need at least one (a, b, c) triple")
    return tuple(schedule)


def _is_real(value: Any) -> bool:
    """A real number (Python, numpy scalar or 0-d array, ``Decimal``, ``Fraction``), not a bool."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()
    return isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (ValueError, OverflowError):  # Decimal('sNaN'), ints beyond float range
        return False
