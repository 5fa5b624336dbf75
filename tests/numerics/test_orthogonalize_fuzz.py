"""Bounded fuzz tests (hypothesis) of muonkit.orthogonalize: hard inputs and arbitrary arguments.

The promise checked is the documented one (functional/coefficients.py): with the preset's own
step count or more, f(s) lies in the preset's band for every input singular value s >=
min_relative * ||U||_F and no output singular value exceeds the band's top (+0.01 for bf16
rounding); with fewer steps, none exceeds ``truncated_top``. Always: same shape and dtype,
finite, zero maps to zero, empty maps to empty. Examples: ``max(60, profile)`` (~10 s here);
``HYPOTHESIS_PROFILE=deep`` runs 500.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import muonkit
import spectra
from muonkit.functional import PRESETS

F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16, F64]
KINDS = ["gaussian", "zero", "low_rank", "rank_1", "ill_conditioned", "power_law", "clustered"]
EXAMPLES = max(60, settings.default.max_examples)


def _matrices(kind: str, batch: int, rows: int, cols: int, log_cond: int, g: torch.Generator) -> torch.Tensor:
    """(batch, rows, cols) float64 matrices of one kind of spectrum, largest singular value 1."""
    k = min(rows, cols)
    i = torch.arange(1, k + 1, dtype=F64)
    if kind == "gaussian":
        return torch.randn(batch, rows, cols, generator=g, dtype=F64)
    if kind == "zero" or k == 0 or batch == 0:
        return torch.zeros(batch, rows, cols, dtype=F64)
    s = {
        "low_rank": torch.where(i <= max(1, k // 4), 1.0, 0.0),
        "rank_1": torch.where(i == 1, 1.0, 0.0),
        "ill_conditioned": torch.logspace(0, -log_cond, k, dtype=F64),
        "power_law": i ** -(log_cond / 3),
        "clustered": torch.where(i <= k // 2, 1.0, 10.0**-log_cond),
    }[kind]
    return torch.stack([spectra.with_spectrum(rows, cols, s, g) for _ in range(batch)])


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    batch=st.lists(st.integers(0, 3), max_size=2),
    rows=st.integers(0, 40),
    cols=st.integers(0, 40),
    kind=st.sampled_from(KINDS),
    log_cond=st.integers(1, 6),
    log_scale=st.integers(-30, 30),
    in_dtype=st.sampled_from(DTYPES),
    compute=st.sampled_from(DTYPES),
    preset=st.sampled_from(list(PRESETS)),
    steps=st.one_of(st.none(), st.integers(1, 12), st.sampled_from([16, 32, 100])),
    method=st.sampled_from(["newton_schulz", "gram"]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_output_is_finite_and_keeps_the_promise(
    batch: list[int],
    rows: int,
    cols: int,
    kind: str,
    log_cond: int,
    log_scale: int,
    in_dtype: torch.dtype,
    compute: torch.dtype,
    preset: str,
    steps: int | None,
    method: str,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(batch)
    # bf16 shares fp32's exponent range, so 1e+-30 is representable in every input dtype.
    x = (_matrices(kind, n, rows, cols, log_cond, g) * 10.0**log_scale).reshape(*batch, rows, cols).to(in_dtype)
    o = muonkit.orthogonalize(x, coefficients=preset, steps=steps, dtype=compute, method=method)
    assert o.shape == x.shape and o.dtype == x.dtype
    assert torch.isfinite(o).all()
    if o.numel() == 0:
        return
    p = PRESETS[preset]
    (lo, hi), full = p.band, (steps or len(p.steps)) >= len(p.steps)
    slack = 0.01 if torch.bfloat16 in (compute, in_dtype) else 0.0
    for xi, oi in zip(x.reshape(-1, rows, cols), o.reshape(-1, rows, cols), strict=True):
        if not xi.any():
            assert not oi.any()  # zero maps to zero
            continue
        diag, top = spectra.response(xi, oi, p.min_relative)
        if full:
            assert lo - slack <= diag.min().item() and diag.max().item() <= hi + slack, (diag.min(), diag.max())
            assert top <= hi + 0.01
        else:
            assert top <= p.truncated_top + slack


NUMBERS: list[Any] = [1e-7, 0.5, 3, -1.0, 0.0, math.inf, -math.inf, math.nan, True, "1e-7", None, [1e-7]]
NUMBERS += [np.float32(1e-7), np.float64(2.0), np.int64(1), np.float32(np.nan), Decimal("1e-7"), Decimal("-1")]
NUMBERS += [Decimal("Infinity"), Decimal("NaN"), torch.tensor(1e-7), 1 + 2j]
STEPS: list[Any] = [None, 1, 5, 100, 0, -3, 101, True, False, 2.0, "5", np.int64(7), np.int32(0)]
COMPUTE: list[Any] = [None, torch.float32, torch.bfloat16, F64, torch.float16, torch.complex64, torch.int32, "float32"]
COEFFICIENTS: list[Any] = ["polar_express", "keller", "newton", (3.4445, -4.775, 2.0315), [(1.0, 2.0)], [], 3.0]


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    eps=st.sampled_from(NUMBERS),
    steps=st.sampled_from(STEPS),
    dtype=st.sampled_from(COMPUTE),
    coefficients=st.sampled_from(COEFFICIENTS),
    method=st.sampled_from(["newton_schulz", "gram", "svd", None]),
    shape=st.sampled_from([(6, 20), (0, 8), (3, 0, 5), (20, 6)]),
)
def test_fuzz_arguments_either_work_or_raise_a_named_value_error(
    eps: Any, steps: Any, dtype: Any, coefficients: Any, method: Any, shape: tuple[int, ...]
) -> None:
    """Never NaN, never an unrelated exception: a result, or ValueError naming the argument."""
    x = torch.randn(shape)
    try:
        o = muonkit.orthogonalize(x, eps=eps, steps=steps, dtype=dtype, coefficients=coefficients, method=method)
    except ValueError as e:
        names = ("eps", "steps", "dtype", "coefficients", "method")
        assert any(str(e).startswith(f"Invalid {name}=") for name in names), str(e)
        return
    assert o.shape == x.shape and o.dtype == x.dtype and torch.isfinite(o).all()
    assert isinstance(steps, (type(None), int, np.integer)) and not isinstance(steps, bool)
    assert float(eps) > 0 and math.isfinite(float(eps))
    if x.numel() and x.any() and coefficients in PRESETS and (steps or 5) >= 5:
        assert torch.linalg.svdvals(o.to(F64)).max().item() <= PRESETS[coefficients].band[1] + 0.01


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0, 0), (3, 0, 5)])
def test_issue_examples_of_bad_arguments(shape: tuple[int, ...]) -> None:
    """Issue 9 point 4: empty in, empty out; eps=-1.02, inf, steps=True, complex dtype refused."""
    assert muonkit.orthogonalize(torch.randn(shape)).shape == shape
    for kwargs in ({"eps": -1.02}, {"eps": math.inf}, {"steps": True}, {"dtype": torch.complex64}):
        with pytest.raises(ValueError, match=f"^Invalid {next(iter(kwargs))}="):
            muonkit.orthogonalize(torch.randn(4, 8), **kwargs)
