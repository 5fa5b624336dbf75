"""muonkit.orthogonalize against the float64 SVD polar factor and a float64 Newton-Schulz.

Tolerances, and why:
- dtype=float64 vs the float64 reference iteration (tests/reference.py): 1e-12, both are the
  same arithmetic in a different order.
- Singular values: Newton-Schulz is an odd matrix polynomial, so O = P f(S) Q^T for U = P S Q^T.
  We read f(s_i) as the diagonal of P^T O Q and check it lies in the preset's promised band for
  every s_i >= min_relative * ||U||_F, in bf16 and fp32 compute. The off-diagonal part of P^T O Q
  is rounding only: <= 1e-4 in fp32; <= 0.15 in bf16, where rounding U to bf16 (2^-9 ||U||) is as
  large as the smallest kept singular values (1e-3 ||U||) and mixes their singular vectors
  (measured: <= 0.025 on well-conditioned input, up to 0.095 at condition 1e3-1e6).
"""

from __future__ import annotations

import re
from decimal import Decimal

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import muonkit
import reference as ref
from muonkit.functional import PRESETS, default_compute_dtype

F64 = torch.float64
COMPUTE = [torch.bfloat16, torch.float32]
OFFDIAG_TOL = {torch.bfloat16: 0.15, torch.float32: 1e-4}


def _with_spectrum(rows: int, cols: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=F64))
    q, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=F64))
    return (p * s) @ q.T


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "square": torch.randn(64, 64, generator=g),
        "wide": torch.randn(32, 96, generator=g),
        "tall": torch.randn(96, 32, generator=g),
        "low_rank": torch.randn(64, 4, generator=g) @ torch.randn(4, 48, generator=g),
        "rank_1": torch.randn(40, 1, generator=g) @ torch.randn(1, 30, generator=g),
        "cond_1e3": _with_spectrum(48, 40, torch.logspace(0, -3, 40, dtype=F64), 2).float(),
        "cond_1e6": _with_spectrum(40, 48, torch.logspace(0, -6, 40, dtype=F64), 3).float(),
        "tiny_1e-30": torch.randn(32, 48, generator=g) * 1e-30,
        "huge_1e30": torch.randn(48, 32, generator=g) * 1e30,
        "tiny_fp64_1e-300": torch.randn(24, 16, generator=g, dtype=F64) * 1e-300,
        "huge_fp64_1e300": torch.randn(16, 24, generator=g, dtype=F64) * 1e300,
    }


INPUTS = _inputs()
WELL_CONDITIONED = _with_spectrum(48, 48, torch.linspace(1, 10, 48, dtype=F64), 4).float()


def _spectral_response(x: torch.Tensor, o: torch.Tensor, min_relative: float) -> tuple[torch.Tensor, float]:
    """f(s_i) for the kept singular directions, and the largest off-diagonal entry of P^T O Q there."""
    x = x.to(F64) / x.to(F64).abs().max()  # the 1e+-300 inputs would over/underflow ||x||_F
    p, s, qt = torch.linalg.svd(x, full_matrices=False)
    m = p.T @ o.to(F64) @ qt.T
    keep = s >= min_relative * torch.linalg.norm(x)
    diag = torch.diagonal(m)[keep]
    offdiag = m - torch.diag(torch.diagonal(m))
    return diag, offdiag[keep].abs().max().item()


@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.parametrize("dtype", COMPUTE, ids=str)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_singular_values_inside_the_promised_band(preset: str, dtype: torch.dtype, kind: str) -> None:
    x = INPUTS[kind]
    o = muonkit.orthogonalize(x, coefficients=preset, dtype=dtype)
    assert o.shape == x.shape and o.dtype == x.dtype
    assert torch.isfinite(o).all()
    lo, hi = PRESETS[preset].band
    diag, offdiag = _spectral_response(x, o, PRESETS[preset].min_relative)
    assert len(diag) > 0
    assert diag.min() >= lo and diag.max() <= hi, (diag.min().item(), diag.max().item())
    assert offdiag <= OFFDIAG_TOL[dtype]
    # Every output singular value, kept or not, stays below the band's top (+ bf16 rounding).
    assert torch.linalg.svdvals(o.to(F64)).max() <= hi + 0.01


@pytest.mark.parametrize("kind", ["well_conditioned", "wide", "tall", "huge_1e30"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_close_to_the_svd_polar_factor(preset: str, kind: str) -> None:
    """On full-rank, well-conditioned input: ||O - P Q^T||_2 <= the band's distance from 1 (+ bf16)."""
    x = WELL_CONDITIONED if kind == "well_conditioned" else INPUTS[kind]
    o = muonkit.orthogonalize(x, coefficients=preset, dtype=torch.bfloat16).to(F64)
    lo, hi = PRESETS[preset].band
    err = torch.linalg.matrix_norm(o - ref.polar_factor(x), ord=2).item()
    assert err <= max(1 - lo, hi - 1) + 0.03


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 16), (2, 3, 20, 12)])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_float64_compute_matches_the_reference_iteration(preset: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape, dtype=F64)
    o = muonkit.orthogonalize(x, coefficients=preset, dtype=F64)
    schedule, k = ref.SCHEDULES[preset]
    flat = x.reshape(-1, shape[-2], shape[-1])
    expected = torch.stack([ref.newton_schulz(m, schedule, k, 1e-7) for m in flat]).reshape(shape)
    torch.testing.assert_close(o, expected, rtol=0, atol=1e-12)


def test_zero_maps_to_zero() -> None:
    for dtype in COMPUTE:
        assert torch.equal(muonkit.orthogonalize(torch.zeros(2, 8, 12), dtype=dtype), torch.zeros(2, 8, 12))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_rank_deficient_stays_deficient_in_fp32(preset: str) -> None:
    """In bf16 the rounding noise is lifted too (documented in functional/coefficients.py)."""
    o = muonkit.orthogonalize(INPUTS["low_rank"], coefficients=preset, dtype=torch.float32)
    s = torch.linalg.svdvals(o.to(F64))
    assert s[:4].min() >= PRESETS[preset].band[0] and s[4:].max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64], ids=str)
def test_batched_equals_looped(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 16, 24)
    batched = muonkit.orthogonalize(x, dtype=dtype)
    looped = torch.stack([muonkit.orthogonalize(m, dtype=dtype) for m in x.reshape(-1, 16, 24)]).reshape(x.shape)
    # Same products on each matrix; only the batched kernel's blocking may differ.
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-5, F64: 1e-12}[dtype]
    torch.testing.assert_close(batched, looped, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", COMPUTE, ids=str)
def test_tall_equals_transposed_wide(dtype: torch.dtype) -> None:
    x = torch.randn(4, 40, 16)
    tall = muonkit.orthogonalize(x, dtype=dtype)
    wide = muonkit.orthogonalize(x.mT.contiguous(), dtype=dtype)
    # The tall input reaches the products as a transposed view, the wide one contiguous: BLAS
    # may sum in another order (measured up to 1.4e-6 in fp32; 0 in bf16).
    torch.testing.assert_close(tall, wide.mT, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_explicit_schedules_equal_the_presets() -> None:
    x = torch.randn(16, 24)
    keller = muonkit.orthogonalize(x, coefficients="keller", dtype=torch.float32)
    assert torch.equal(muonkit.orthogonalize(x, coefficients=ref.KELLER, dtype=torch.float32), keller)
    flat = muonkit.orthogonalize(x, coefficients=(3.4445, -4.7750, 2.0315), steps=5, dtype=torch.float32)
    assert torch.equal(flat, keller)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_steps_truncate_or_repeat_the_last_step(steps: int) -> None:
    x = torch.randn(12, 20, dtype=F64)
    schedule = (ref.POLAR_EXPRESS + [ref.POLAR_EXPRESS[-1]] * 5)[:steps]
    o = muonkit.orthogonalize(x, steps=steps, dtype=F64)
    torch.testing.assert_close(o, ref.newton_schulz(x, schedule, 1.02, 1e-7), rtol=0, atol=1e-12)


def test_default_compute_dtype_is_bf16_or_fp32_never_fp16() -> None:
    dtype = default_compute_dtype("cpu")
    assert dtype in (torch.bfloat16, torch.float32)
    x = torch.randn(8, 12)
    assert torch.equal(muonkit.orthogonalize(x), muonkit.orthogonalize(x, dtype=dtype))


def test_low_precision_input_keeps_its_dtype() -> None:
    x = torch.randn(3, 8, 12, dtype=torch.bfloat16)
    o = muonkit.orthogonalize(x, dtype=torch.float32)
    assert o.dtype == torch.bfloat16 and o.shape == x.shape


@pytest.mark.parametrize(
    ("kwargs", "x", "message"),
    [
        ({}, torch.randn(5), "orthogonalize needs a matrix or a batch of matrices, got shape (5,)"),
        (
            {},
            torch.randn(4, 4, dtype=torch.complex64),
            "orthogonalize needs real floating-point tensors, got torch.complex64",
        ),
        ({}, torch.ones(4, 4, dtype=torch.int64), "orthogonalize needs real floating-point tensors, got torch.int64"),
        ({"dtype": torch.float16}, torch.randn(4, 4), "Invalid dtype=torch.float16 on CPU"),
        ({"dtype": torch.complex64}, torch.randn(4, 4), "Invalid dtype=torch.complex64: must be None, torch.float32"),
        ({"dtype": torch.int32}, torch.randn(4, 4), "Invalid dtype=torch.int32: must be None, torch.float32"),
        ({"dtype": "float32"}, torch.randn(4, 4), "Invalid dtype='float32': must be None, torch.float32"),
        ({"coefficients": "newton"}, torch.randn(4, 4), "Invalid coefficients='newton': must be one of"),
        ({"steps": 0}, torch.randn(4, 4), "Invalid steps=0: must be None or an int in [1, 100]"),
        ({"steps": 101}, torch.randn(4, 4), "Invalid steps=101: must be None or an int in [1, 100]"),
        ({"steps": True}, torch.randn(4, 4), "Invalid steps=True: must be None or an int in [1, 100]"),
        ({"steps": 2.0}, torch.randn(4, 4), "Invalid steps=2.0: must be None or an int in [1, 100]"),
        ({"eps": -1.02}, torch.randn(4, 4), "Invalid eps=-1.02: must be > 0"),
        ({"eps": 0.0}, torch.randn(4, 4), "Invalid eps=0.0: must be > 0"),
        ({"eps": float("inf")}, torch.randn(4, 4), "Invalid eps=inf: must be a finite number"),
        ({"eps": float("nan")}, torch.randn(4, 4), "Invalid eps=nan: must be a finite number"),
        ({"eps": True}, torch.randn(4, 4), "Invalid eps=True: must be a finite number"),
        ({"eps": "1e-7"}, torch.randn(4, 4), "Invalid eps='1e-7': must be a finite number"),
        ({"eps": Decimal("NaN")}, torch.randn(4, 4), "Invalid eps=Decimal('NaN'): must be a finite number"),
        ({"method": "svd"}, torch.randn(4, 4), "Invalid method='svd': must be one of ('newton_schulz', 'gram')"),
        (
            {"coefficients": [(1.0, 2.0)]},
            torch.randn(4, 4),
            "Invalid coefficients=[(1.0, 2.0)]: each step must be an (a, b, c) triple",
        ),
        (
            {"coefficients": [(1.0, 2.0, float("nan"))]},
            torch.randn(4, 4),
            "Invalid coefficients=[(1.0, 2.0, nan)]: each step must be an (a, b, c) triple of finite floats",
        ),
        ({"coefficients": []}, torch.randn(4, 4), "Invalid coefficients=[]: need at least one (a, b, c) triple"),
        (
            {"coefficients": [(1.0, 0.0, 1e39)]},  # no float32 holds it: was a RuntimeError mid-iteration
            torch.randn(4, 4),
            "Invalid coefficients=[(1.0, 0.0, 1e+39)]: every coefficient must be within [-1000, 1000]",
        ),
        (
            {"coefficients": [(3.0, 0.0, 0.0)], "steps": 7},  # 3^7 = 2187: finite, but no orthogonalization
            torch.randn(4, 4),
            "Invalid coefficients=[(3.0, 0.0, 0.0)] with 7 steps: step 7 can map a singular value in [0, 1] to 2.19e+03",
        ),
        # Checked before the early return for empty input: bad arguments never pass silently.
        ({"eps": -1.0}, torch.randn(0, 8), "Invalid eps=-1.0: must be > 0"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, x: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        muonkit.orthogonalize(x, **kwargs)


def test_numpy_and_decimal_scalars_are_accepted() -> None:
    x = torch.randn(12, 20, dtype=F64)
    expected = muonkit.orthogonalize(x, coefficients="keller", steps=6, eps=1e-7, dtype=F64)
    steps, eps = np.int64(6), np.float32(1e-7)
    got = muonkit.orthogonalize(x, coefficients="keller", steps=steps, eps=eps, dtype=F64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)  # eps differs by fp32 rounding
    schedule = [tuple(np.float32(v) for v in ref.KELLER[0])]
    by_numpy = muonkit.orthogonalize(x, coefficients=schedule, steps=6, eps=Decimal("1e-7"), dtype=F64)
    by_float = muonkit.orthogonalize(
        x, coefficients=[tuple(float(np.float32(v)) for v in ref.KELLER[0])], steps=6, dtype=F64
    )
    assert torch.equal(by_numpy, by_float)


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0, 0), (3, 0, 5), (0, 4, 8), (2, 0, 3, 3)])
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, F64], ids=str)
def test_empty_in_empty_out(shape: tuple[int, ...], method: str, in_dtype: torch.dtype) -> None:
    o = muonkit.orthogonalize(torch.empty(shape, dtype=in_dtype), method=method)
    assert o.shape == shape and o.dtype == in_dtype


@given(
    batch=st.lists(st.integers(1, 3), max_size=2),
    rows=st.integers(1, 24),
    cols=st.integers(1, 24),
    log_scale=st.integers(-30, 30),
    in_dtype=st.sampled_from([torch.float32, torch.bfloat16, F64]),
    compute=st.sampled_from(COMPUTE),
    preset=st.sampled_from(list(PRESETS)),
    seed=st.integers(0, 2**16),
)
def test_property_finite_shape_dtype_and_bounded(
    batch: list[int],
    rows: int,
    cols: int,
    log_scale: int,
    in_dtype: torch.dtype,
    compute: torch.dtype,
    preset: str,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    # bf16 shares fp32's exponent range, so 1e+-30 is representable in all three input dtypes.
    x = (torch.randn(*batch, rows, cols, generator=g, dtype=F64) * 10.0**log_scale).to(in_dtype)
    o = muonkit.orthogonalize(x, coefficients=preset, dtype=compute)
    assert o.shape == x.shape and o.dtype == x.dtype
    assert torch.isfinite(o).all()
    if x.abs().max() > 0:
        top = torch.linalg.svdvals(o.to(F64)).max().item()
        assert 0.5 <= top <= PRESETS[preset].band[1] + 0.01


def test_worst_growth_is_the_exact_peak_and_the_presets_sit_far_inside_the_limits() -> None:
    """``worst_growth`` is the largest |output| of the composed scalar iteration over s in [0, 1]
    (a dense float64 grid reaches it), and every preset, at every step count, peaks below 2 with
    coefficients 40x inside ``COEFFICIENT_LIMIT``."""
    from muonkit.functional.coefficients import COEFFICIENT_LIMIT, GROWTH_LIMIT, worst_growth

    gen = torch.Generator().manual_seed(0)
    schedules = [PRESETS[p].schedule(n) for p in PRESETS for n in (1, 2, 5)]
    schedules += [tuple(tuple(float(v) for v in 3 * torch.rand(3, generator=gen) - 1.5) for _ in range(3))]
    s = torch.linspace(0, 1, 200_001, dtype=torch.float64)
    for schedule in schedules:
        x, peaks = s.clone(), []
        for a, b, c in schedule:
            x = a * x + b * x**3 + c * x**5
            peaks.append(x.abs().max().item())
        step, bound = worst_growth(schedule)
        peak = max(peaks)
        assert peaks[step] == peak and bound * (1 - 1e-6) <= peak <= bound * (1 + 1e-12), (schedule, peaks, bound)
    for preset in PRESETS.values():
        assert max(worst_growth(preset.schedule(n))[1] for n in range(1, 101)) < 2 < GROWTH_LIMIT / 100
        assert max(abs(v) for step in preset.steps for v in step) * 40 < COEFFICIENT_LIMIT
