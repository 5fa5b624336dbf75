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

The band holds for the preset's own step count (5) and for any more, up to the 100 allowed
(the schedule repeats its last step): measured 0 failures at 5, 6, 7, 8, 10, 12, 16, 32 and 100
steps in bf16 and fp32, plain and Gram iteration, on those inputs plus power-law, heavy-tailed
(Cauchy) and clustered spectra, 8x64 to 32x256 (fp32 Gram also at 768x3072); more steps tighten
it (Polar Express lands in [0.95, 1.14] from 8 steps). Fewer steps truncate the schedule before it has lifted the small
singular values, so no lower bound holds; only ``truncated_top`` bounds the output singular values
(measured maxima over 1-4 steps: polar_express 1.99, its first step alone peaks at 1.993; keller
1.20; you 1.27).

Smaller singular values are lifted towards the band but may not reach it within 5 steps
(keller and you leave s ~ 1e-3*|U| near 0.48). In fp32 and fp64 compute a rank-deficient input
gives a rank-deficient output for up to :data:`RANK_KEPT_STEPS` steps, 10 in fp32 and 26 in fp64
(every preset, plain and Gram iteration): its missing directions hold only rounding noise
(~1e-7*|U| in fp32, ~1e-16 in fp64), which each step lifts like any small singular value, to
below 5e-5 at 5 steps in fp32 (1e-13 in fp64) and below 1e-2 at those counts (measured at most
9.4e-3; ``tools/measure_promises.py --rank``: ranks 1, 4 and 8 of 16x48, 48x16, 32x128 and
64x256). Each further step multiplies the noise by the last step's ``a`` (2.3-3.4) until it
reaches ~1, by 20 steps in fp32 and 50 in fp64: the output is then full rank and depends on the
input's scale (a rank-4 16x48 input at 25 fp32 steps: 16 of 16 singular values near 1, the
result 0.6 away from that of the same input times 1e-3). No iteration that lifts small singular
values can tell noise from a small singular value. In bf16 it does not hold even at 5 steps:
rounding U to bf16 adds noise of ~2^-9*|U|, as large as the smallest singular values the
presets are designed to lift, and it is lifted like them (a rank-1 input measured spurious
singular values up to 0.69 with polar_express, 0.36 with keller and you; torch.optim.Muon's bf16
path gives 0.51 on the same input).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from muonkit.functional.validation import is_finite_number

Coefficients = tuple[float, float, float]

RANK_KEPT_STEPS: dict[str, int] = {"float32": 10, "float64": 26}
"""Up to how many steps (by compute dtype) a rank-deficient input's output stays rank-deficient:
spurious singular values below 1e-2 with every preset (module docstring; tested)."""


@dataclass(frozen=True)
class Preset:
    """A named Newton-Schulz schedule and the singular-value band it promises.

    ``band`` holds with ``len(steps)`` steps or more, for input singular values
    ``>= min_relative * ||U||_F``; with fewer steps only ``truncated_top`` bounds the output.
    """

    name: str
    steps: tuple[Coefficients, ...]
    norm_factor: float
    band: tuple[float, float]
    min_relative: float
    truncated_top: float = math.inf

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
    truncated_top=1.25,
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
    truncated_top=1.30,
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
    truncated_top=2.05,
)

PRESETS: dict[str, Preset] = {p.name: p for p in (POLAR_EXPRESS, KELLER, YOU)}


def resolve_preset(
    coefficients: str | Sequence[Sequence[float]], *, steps: int | None = None, name: str = "ns_coefficients"
) -> tuple[tuple[Coefficients, ...], float]:
    """Turn a preset name or an explicit schedule into ``(schedule, norm_factor)``.

    An explicit schedule is a sequence of ``(a, b, c)``; with ``steps`` larger than its length
    the last tuple repeats, so ``[(3.4445, -4.7750, 2.0315)]`` with ``steps=5`` is Keller's.
    A single flat ``(a, b, c)`` triple (torch.optim.Muon's ``ns_coefficients``) is accepted too.
    ``name`` is the argument named in errors. An explicit schedule is refused (ValueError) when a
    coefficient lies outside ``[-COEFFICIENT_LIMIT, COEFFICIENT_LIMIT]`` or when, over its
    ``steps``, it can grow a singular value past :data:`GROWTH_LIMIT` (:func:`worst_growth`):
    such a schedule overflows, or orthogonalizes nothing, and would fail at step time.
    """
    if isinstance(coefficients, str):
        preset = PRESETS.get(coefficients)
        if preset is None:
            raise ValueError(
                f"Invalid {name}={coefficients!r}: must be one of {sorted(PRESETS)} or a sequence of (a, b, c) tuples"
            )
        return preset.schedule(steps), preset.norm_factor
    schedule = Preset("custom", as_schedule(coefficients, name=name), 1.0, (0.0, 0.0), 0.0).schedule(steps)
    step, bound = worst_growth(schedule, limit=GROWTH_LIMIT)
    if bound > GROWTH_LIMIT:
        raise ValueError(
            f"Invalid {name}={coefficients!r} with {len(schedule)} steps: step {step + 1} can map a singular "
            f"value in [0, 1] to {bound:.3g}, above the allowed {GROWTH_LIMIT:g} (the presets stay below 2): the "
            "iteration diverges and would overflow or give a useless update"
        )
    return schedule, 1.0


COEFFICIENT_LIMIT = 1e3
"""The largest ``|a|``, ``|b|``, ``|c|`` an explicit schedule may have.

The published presets' largest is 22.5 (Polar Express's first ``b``; Polar Express tuned for a
smaller lower bound 1e-3 reaches 23.6, Keller's and You's stay under 7); the limit leaves 40x
room for experiments while refusing what can only overflow: a coefficient past 3.4e38 does not
even convert to float32, and ``c * s^5`` with ``s`` near 1 is the update's size."""

GROWTH_LIMIT = 1e3
"""The largest worst-case singular value (from inputs in [0, 1]) allowed after any step of an
explicit schedule (:func:`worst_growth`). The presets stay below 2 (Polar Express's first step
peaks at 1.993) at every step count up to 100. Below the limit every intermediate of a step is
below ``COEFFICIENT_LIMIT * GROWTH_LIMIT**5 = 1e18``, far inside bfloat16's and float32's range
(3.4e38); float16 (max 65504) is narrower, and its range is the caller's to respect."""


def worst_growth(schedule: Sequence[Coefficients], *, limit: float = math.inf) -> tuple[int, float]:
    """``(step, bound)``: the first step whose worst-case output exceeds ``limit``, else the step
    with the largest worst-case output; and that output.

    The input singular values lie in [0, 1] (the iteration divides by the Frobenius norm); each
    step maps [0, m] into [0, max |p(s)| for s in [0, m]], computed exactly from ``m`` and the
    critical points of ``p(s) = a s + b s^3 + c s^5`` (the roots of ``5c u^2 + 3b u + a`` in
    ``u = s^2``). A bound, not a prediction: a singular value cannot grow beyond it.
    """
    return _worst_growth(tuple(schedule), limit)


@functools.lru_cache(maxsize=64)
def _worst_growth(schedule: tuple[Coefficients, ...], limit: float) -> tuple[int, float]:
    m, peak = 1.0, (0, 0.0)
    for i, (a, b, c) in enumerate(schedule):
        m = max(abs(_quintic(a, b, c, s)) for s in (m, *_critical_points(a, b, c, m)))
        if m > limit or not math.isfinite(m):
            return i, m
        peak = max(peak, (i, m), key=lambda x: x[1])
    return peak


def _quintic(a: float, b: float, c: float, s: float) -> float:
    return s * (a + s * s * (b + c * s * s))


def _critical_points(a: float, b: float, c: float, m: float) -> list[float]:
    """The ``s`` in (0, m) where ``p'(s) = a + 3b s^2 + 5c s^4`` is zero."""
    if c != 0.0:
        disc = 9 * b * b - 20 * a * c
        roots = [] if disc < 0 else [(-3 * b + r) / (10 * c) for r in (math.sqrt(disc), -math.sqrt(disc))]
    else:
        roots = [] if b == 0.0 else [-a / (3 * b)]
    return [math.sqrt(u) for u in roots if 0.0 < u < m * m]


def as_schedule(
    coefficients: Sequence[Sequence[float]] | Sequence[float], *, name: str = "ns_coefficients"
) -> tuple[Coefficients, ...]:
    """An explicit schedule as a tuple of float triples (a flat triple is one step)."""
    bad_step = f"Invalid {name}={coefficients!r}: each step must be an (a, b, c) triple of finite floats"
    if not isinstance(coefficients, Sequence) or isinstance(coefficients, str):
        raise ValueError(
            f"Invalid {name}={coefficients!r}: must be one of {sorted(PRESETS)} or a sequence of (a, b, c) tuples"
        )
    items: list[Any] = list(coefficients)
    if len(items) == 3 and all(is_finite_number(v) for v in items):
        items = [items]  # a flat (a, b, c) triple
    schedule: list[Coefficients] = []
    for item in items:
        if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 3:
            raise ValueError(bad_step)
        if not all(is_finite_number(v) for v in item):
            raise ValueError(bad_step)
        a, b, c = (float(v) for v in item)
        if not max(abs(a), abs(b), abs(c)) <= COEFFICIENT_LIMIT:
            raise ValueError(
                f"Invalid {name}={coefficients!r}: every coefficient must be within [-{COEFFICIENT_LIMIT:g}, "
                f"{COEFFICIENT_LIMIT:g}] (the published presets' largest is 22.5), got {(a, b, c)!r}"
            )
        schedule.append((a, b, c))
    if not schedule:
        raise ValueError(f"Invalid {name}=[]: need at least one (a, b, c) triple")
    return tuple(schedule)


def is_preset_schedule(coefficients: str | Sequence[Sequence[float]], *, steps: int | None = None) -> bool:
    """Whether this schedule is a preset's (by name, or its steps written out, as ``muonkit.Muon``'s
    default ``(3.4445, -4.7750, 2.0315)`` is Keller's), at any step count.

    The presets' iterations are bounded (``tests/numerics/test_orthogonalize_fuzz.py``: output singular
    values within ``truncated_top`` at 1-12, 16, 32 and 100 steps, plain and Gram, every compute
    dtype, inputs from 1e-40 to 1e30 scale), so
    their output is finite wherever their input is: a step can judge finiteness from the gradients
    alone. A custom schedule may diverge (``X <- 10 X`` for 40 steps overflows fp32).
    """
    if isinstance(coefficients, str):
        return coefficients in PRESETS
    try:
        schedule, _ = resolve_preset(coefficients, steps=steps)
    except ValueError:
        return False
    return any(schedule == preset.schedule(len(schedule)) for preset in PRESETS.values())


def output_bound(coefficients: str | Sequence[Sequence[float]], *, steps: int | None = None) -> float:
    """A bound on the output singular values of the iteration: a preset's ``truncated_top`` (at
    any step count; ``tests/numerics/test_orthogonalize_fuzz.py``), else the schedule's
    :func:`worst_growth` from inputs in [0, 1] (the normalization's range)."""
    if isinstance(coefficients, str):
        return PRESETS[coefficients].truncated_top
    schedule, _ = resolve_preset(coefficients, steps=steps)
    for preset in PRESETS.values():
        if schedule == preset.schedule(len(schedule)):
            return preset.truncated_top
    return worst_growth(schedule)[1]
