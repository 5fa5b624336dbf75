"""Gram Newton-Schulz (method="gram") against the standard iteration.

In exact arithmetic both compute the same polynomial of X, so in float64 they agree to rounding
(tolerance 1e-10). In finite precision the Gram form compounds rounding in the tracked R = X X^T;
restarts every few steps keep fp32 inside the preset's promised band, and bf16 (where no restart
short of every step does) runs the plain iteration. Checked on hard spectra (tests/spectra.py),
not only Gaussian inputs, for every preset and step counts from 1 to 100.
"""

from __future__ import annotations

import math

import pytest
import torch

import muonkit
import spectra
from muonkit.functional.coefficients import PRESETS
from muonkit.functional.orthogonalize import _gram_newton_schulz_, _normalize_into, gram_restarts, uses_gram

# Aspect ratios 5 and 4, wide and tall, so "gram" takes its Gram path wherever it may.
HARD = [spectra.hard_batch(16, 80, seed=10), spectra.hard_batch(96, 24, seed=11)]
STEPS = [1, 2, 3, 5, 6, 7, 8, 10, 12, 16, 32, 100]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("shape", [(2, 16, 64), (24, 96), (200, 40)])
def test_gram_equals_standard_in_float64(preset: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    standard = muonkit.orthogonalize(x, coefficients=preset, dtype=torch.float64)
    gram = muonkit.orthogonalize(x, coefficients=preset, dtype=torch.float64, method="gram")
    torch.testing.assert_close(gram, standard, rtol=0, atol=1e-10)


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("method", ["gram", "newton_schulz"])
def test_hard_spectra_stay_in_the_promised_band(method: str, dtype: torch.dtype, preset: str, steps: int) -> None:
    """The documented promise (functional/coefficients.py), for every step count it covers.

    With the preset's own step count or more: f(s) in the band for every s >= min_relative *
    ||U||_F, and every output singular value <= the band's top (+0.01 for bf16 rounding, as in
    tests/numerics/test_orthogonalize.py). With fewer steps: every output singular value <= truncated_top.
    Before the fix bf16 Gram left the band at 5 steps and overflowed to inf from 8; fp32 Gram
    from 10 steps.
    """
    p = PRESETS[preset]
    (lo, hi), full = p.band, steps >= len(p.steps)
    for names, x in HARD:
        out = muonkit.orthogonalize(x.float(), coefficients=preset, steps=steps, dtype=dtype, method=method)
        assert torch.isfinite(out).all()
        for name, xi, oi in zip(names, x, out, strict=True):
            diag, top = spectra.response(xi, oi, p.min_relative)
            if full:
                assert lo <= diag.min().item() and diag.max().item() <= hi, (name, diag.min().item(), diag.max().item())
                assert top <= hi + 0.01, (name, top)
            else:
                assert top <= p.truncated_top, (name, top)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gram_runs_the_plain_iteration_in_half_precision(dtype: torch.dtype) -> None:
    assert uses_gram(16, 80, method="gram", dtype=torch.float32) and uses_gram(80, 16, method="gram", dtype=None)
    assert not uses_gram(16, 80, method="gram", dtype=dtype)
    if dtype == torch.bfloat16:  # fp16 is refused on CPU
        x = HARD[0][1].float()
        gram = muonkit.orthogonalize(x, dtype=dtype, method="gram", steps=8)
        assert torch.equal(gram, muonkit.orthogonalize(x, dtype=dtype, steps=8))


def test_gram_restart_policy_by_dtype_and_steps() -> None:
    """No restart up to 5 steps in fp32 (10 in fp64); then step 2 and every 4 steps after."""
    for dtype, up_to in ((torch.float32, 5), (None, 5), (torch.float64, 10)):
        assert all(gram_restarts(s, dtype) == () for s in range(1, up_to + 1))
        assert gram_restarts(up_to + 1, dtype) == tuple(range(2, up_to + 1, 4))
    assert gram_restarts(6, torch.float32) == (2,) and gram_restarts(7, torch.float32) == (2, 6)
    assert gram_restarts(100, torch.float32) == tuple(range(2, 100, 4))
    assert gram_restarts(5, torch.bfloat16) == (2,) and gram_restarts(5, torch.float16) == (2,)


def test_fp32_gram_at_five_steps_runs_without_a_restart() -> None:
    x = HARD[0][1].float()
    short = torch.empty_like(x)
    _normalize_into([x], short, 1.02 + 1e-7, transpose=False)
    schedule = PRESETS["polar_express"].schedule(5)
    expected = _gram_newton_schulz_([short.clone()], schedule, ())
    assert not torch.equal(expected, _gram_newton_schulz_([short], schedule, (2,)))
    assert torch.equal(muonkit.orthogonalize(x, method="gram", dtype=torch.float32), expected)


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_fp32_gram_without_restart_stays_near_the_plain_iteration(preset: str, steps: int) -> None:
    """Up to 5 steps fp32 Gram (no restart) is within 1e-2 of the plain fp32 iteration on hard
    inputs (relative Frobenius distance; measured at most 4.6e-3, Polar Express at 5 steps)."""
    for _, x in HARD:
        x = x.float()
        gram = muonkit.orthogonalize(x, coefficients=preset, steps=steps, dtype=torch.float32, method="gram")
        plain = muonkit.orthogonalize(x, coefficients=preset, steps=steps, dtype=torch.float32)
        gap = (gram - plain).flatten(1).norm(dim=1) / plain.flatten(1).norm(dim=1)
        assert gap.max().item() <= 1e-2, gap.max().item()


@pytest.mark.parametrize(
    ("dtype", "preset", "steps", "top"),
    [(torch.float32, "keller", 8, 2.0), (torch.bfloat16, "polar_express", 5, 100.0)],
    ids=str,
)
def test_dropping_the_restart_is_unsafe_beyond_the_policy(
    dtype: torch.dtype, preset: str, steps: int, top: float
) -> None:
    """Why the policy stops where it does: without the restart, fp32 at 8 steps (Keller) and bf16
    at 5 steps (Polar Express) send singular values far out of the band (measured 3.0 and 3e24)."""
    x = HARD[0][1].float()
    work = torch.empty_like(x, dtype=dtype)
    _normalize_into([x], work, PRESETS[preset].norm_factor + 1e-7, transpose=False)
    out = _gram_newton_schulz_([work], PRESETS[preset].schedule(steps), ()).double()
    worst = max(torch.linalg.svdvals(o).max().item() if torch.isfinite(o).all() else math.inf for o in out)
    assert worst > top
    assert gram_restarts(steps, dtype) != ()


def test_issue_repro_bf16_many_steps_update_is_bounded() -> None:
    """Issue 9's repro: 8 steps in bf16 moved a weight by 7e11 (0.018 with the plain iteration)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 256, bias=False)
    opt = muonkit.HybridMuon([layer.weight], ns_steps=8, ns_dtype=torch.bfloat16)
    before = layer.weight.detach().clone()
    layer(torch.randn(1, 64)).square().sum().backward()
    opt.step()
    assert (layer.weight - before).abs().max().item() < 0.05


def test_gram_square_falls_back_to_standard() -> None:
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(muonkit.orthogonalize(x, method="gram"), muonkit.orthogonalize(x))


def test_gram_in_optimizer_matches_standard_in_float64() -> None:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(16, 48, dtype=torch.float64)) for _ in range(2)]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    opt_std = muonkit.HybridMuon(weights, ns_dtype=torch.float64)
    opt_gram = muonkit.HybridMuon(copies, ns_dtype=torch.float64, ns_method="gram")
    for _ in range(5):
        for ws in (weights, copies):
            for w in ws:
                w.grad = torch.sin(w.detach() * 3.0)
        opt_std.step()
        opt_gram.step()
    for a, b in zip(weights, copies, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_bad_method_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Invalid method='svd': must be one of"):
        muonkit.orthogonalize(torch.randn(4, 8), method="svd")
    with pytest.raises(ValueError, match=r"Invalid ns_method='svd': must be one of"):
        muonkit.HybridMuon([torch.nn.Parameter(torch.randn(4, 8))], ns_method="svd")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize(
    ("shape", "steps"),
    [
        ((16, 64), 5),
        ((64, 16), 5),
        ((24, 30), 5),
        ((8, 40), 1),
        ((8, 40), 3),
        ((8, 40), 7),
        ((8, 40), 12),
        ((8, 40), 17),
    ],
)
def test_flops_formula_counts_the_matrix_products(
    method: str, dtype: torch.dtype, shape: tuple[int, int], steps: int
) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from muonkit.functional import orthogonalization_flops

    x = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        muonkit.orthogonalize(x, steps=steps, method=method, dtype=dtype)
    assert counter.get_total_flops() == orthogonalization_flops(*shape, steps, method, dtype)
