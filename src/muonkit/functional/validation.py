"""Argument checks shared by the math (``orthogonalize``) and the optimizer's configs.

Each raises ``ValueError`` naming the argument, the value and what is allowed. Numbers may be
Python, numpy or ``Decimal`` scalars, or one-element tensors; ``bool`` is never a number.
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any

import torch

MAX_NS_STEPS = 100
NS_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def is_finite_number(value: Any) -> bool:
    """A finite Python, numpy or ``Decimal`` real scalar, not a bool."""
    if isinstance(value, decimal.Decimal):
        return value.is_finite()
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def number(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number (or a one-element real tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if not is_finite_number(value):
        raise ValueError(f"Invalid {name}={value!r}: must be a finite number")
    return float(value)


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


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"Invalid {name} entry {value!r}: must be a positive int")
    return int(value)


def ns_steps(name: str, value: Any) -> int | None:
    """None (the preset's own count) or an int in [1, MAX_NS_STEPS]."""
    if value is not None and (not _is_int(value) or not 1 <= value <= MAX_NS_STEPS):
        raise ValueError(f"Invalid {name}={value!r}: must be None or an int in [1, {MAX_NS_STEPS}]")
    return None if value is None else int(value)


def ns_dtype(name: str, value: Any) -> torch.dtype | None:
    """None (the device's default) or a real floating dtype the iteration runs in."""
    if value is not None and (not isinstance(value, torch.dtype) or value not in NS_DTYPES):
        raise ValueError(
            f"Invalid {name}={value!r}: must be None, torch.float32, torch.bfloat16, torch.float64 "
            "or (GPU only) torch.float16"
        )
    return value
