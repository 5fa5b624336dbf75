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
