"""Argument checks shared by the math (``orthogonalize``) and the optimizer's configs.

Each raises ``ValueError`` naming the argument, the value and what is allowed. Numbers may be
Python, numpy or ``Decimal`` scalars, or one-element tensors; ``bool`` is never a number.
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any, cast

import torch

MAX_NS_STEPS = 100
NS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def real(value: Any) -> int | float | None:
    """``value`` as a Python int or float if it is a real number, else None.

    Real numbers: Python ints and floats, numpy scalars and 0-d arrays, ``Decimal``, ``Fraction``
    and one-element tensors; never bools (``True`` is no learning rate), complex numbers or strings.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # numpy scalar or 0-d array -> Python bool, int, float or complex
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        try:
            return float(value)
        except (ValueError, OverflowError):  # Decimal('sNaN')
            return None
    return None


def integer(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (Python or numpy; not a float such as 5.0)."""
    number = real(value)
    return number if isinstance(number, int) else None


def is_finite_number(value: Any) -> bool:
    """A finite real number in the sense of :func:`real`."""
    number = real(value)
    try:
        return number is not None and math.isfinite(number)
    except OverflowError:  # an int beyond float range
        return False


def number(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number (or a one-element real tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Invalid {name}={value!r}: Tensor {name} must be 1-element")
    if not is_finite_number(value):
        raise ValueError(f"Invalid {name}={value!r}: must be a finite number")
    return float(cast(float, real(value)))


def nonneg(name: str, value: Any) -> float:
    v = number(name, value)
    if v < 0:
        raise ValueError(f"Invalid {name}={value!r}: must be >= 0")
    return v


def positive(name: str, value: Any) -> float:
    v = number(name, value)
    if v <= 0:
        raise ValueError(f"Invalid {name}={value!r}: must be > 0")
    return v


MAX_NS_EPS = 1e-2
"""The largest Newton-Schulz ``eps``, a relative margin in ``U / ((k + eps) ||U||_F)``: up to it every
preset keeps its singular-value band on the hard inputs (measured, ``tools/measure_promises.py
--eps``: Polar Express at 5 steps holds its [0.80, 1.20] up to 3e-2, not at 0.1, where the inputs'
smallest kept singular values land below 0.80; Keller's and You's hold further)."""

MIN_ADAMW_EPS = torch.finfo(torch.float32).tiny
"""The smallest AdamW ``eps``: float32's smallest normal value (1.2e-38). A smaller one is
subnormal or zero in the float32 moments' arithmetic (where hardware may flush subnormals to
zero), and ``0 / (0 + 0)`` where a gradient entry has always been 0 makes the param NaN."""


EPS_BANDS: dict[str, tuple[float, float, str]] = {
    "newton_schulz": (
        0.0,
        MAX_NS_EPS,
        "a relative margin in Newton-Schulz's normalization U / ((k + eps)*||U||_F); a larger one shrinks "
        "every singular value, and the result leaves the preset's band (Polar Express from eps = 0.1) and, at "
        "1e30, is ~1e-28",
    ),
    "adamw": (
        MIN_ADAMW_EPS,
        math.inf,
        "float32's smallest normal value; a smaller one is subnormal or zero in the float32 moments' "
        "arithmetic, where a gradient entry that has always been 0 gives 0 / 0 = NaN",
    ),
}
"""Each ``eps``'s allowed band (``(0, high]`` or ``[low, inf)``) and why."""


def eps(name: str, value: Any, *, kind: str) -> float:
    """An ``eps`` of ``kind`` (``"newton_schulz"`` or ``"adamw"``): ``> 0`` (:func:`positive`'s
    message) and in its :data:`EPS_BANDS` band, else a ValueError naming the band and why."""
    low, high, why = EPS_BANDS[kind]
    v = positive(name, value)
    if not low <= v <= high:
        band = f"in (0, {high:g}]" if high < math.inf else f">= {low:.4g}"
        raise ValueError(f"Invalid {name}={value!r}: must be {band}: {why}")
    return v


def unit(name: str, value: Any) -> float:
    v = number(name, value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"Invalid {name}={value!r}: must be in [0, 1)")
    return v


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"Invalid {name}={value!r}: must be True or False")
    return value


def positive_int(name: str, value: Any) -> int:
    n = integer(value)
    if n is None or n <= 0:
        raise ValueError(f"Invalid {name} entry {value!r}: must be a positive int")
    return n


def ns_steps(name: str, value: Any) -> int | None:
    """None (the preset's own count) or an int in [1, MAX_NS_STEPS]."""
    if value is None:
        return None
    n = integer(value)
    if n is None or not 1 <= n <= MAX_NS_STEPS:
        raise ValueError(f"Invalid {name}={value!r}: must be None or an int in [1, {MAX_NS_STEPS}]")
    return n


def ns_dtype(name: str, value: Any) -> torch.dtype | None:
    """None (the device's default) or a real floating dtype the iteration runs in."""
    if value is not None and (not isinstance(value, torch.dtype) or value not in NS_DTYPES):
        raise ValueError(
            f"Invalid {name}={value!r}: must be None, torch.float32, torch.bfloat16, torch.float64 "
            "or (GPU only) torch.float16"
        )
    return value
