"""Gram Newton-Schulz (method="gram") against the standard iteration.

In exact arithmetic both compute the same polynomial of X, so in float64 they agree to rounding
(tolerance 1e-10). In bf16 the Gram form compounds rounding in R = X X^T; the restart keeps its
singular values inside the preset's promised band.
"""

from __future__ import annotations

import pytest
import torch

import muonkit
from muonkit.functional.coefficients import PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("shape", [(2, 16, 64), (24, 96), (200, 40)])
def test_gram_equals_standard_in_float64(preset: str, shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    standard = muonkit.orthogonalize(x, coefficients=preset, dtype=torch.float64)
    gram = muonkit.orthogonalize(x, coefficients=preset, dtype=torch.float64, method="gram")
    torch.testing.assert_close(gram, standard, rtol=0, atol=1e-10)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gram_bf16_stays_in_band(preset: str) -> None:
    x = torch.randn(4, 64, 320, generator=torch.Generator().manual_seed(1))
    out = muonkit.orthogonalize(x, coefficients=preset, dtype=torch.bfloat16, method="gram")
    lo, hi = PRESETS[preset].band
    s = torch.linalg.svdvals(out.double())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert lo <= s.min().item() and s.max().item() <= hi


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


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize(("shape", "steps"), [((16, 64), 5), ((64, 16), 5), ((24, 30), 5), ((8, 40), 3), ((8, 40), 7)])
def test_flops_formula_counts_the_matrix_products(method: str, shape: tuple[int, int], steps: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from muonkit.functional import orthogonalization_flops

    x = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        muonkit.orthogonalize(x, steps=steps, method=method)
    assert counter.get_total_flops() == orthogonalization_flops(*shape, steps, method)
