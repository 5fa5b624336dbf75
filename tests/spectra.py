"""Hard inputs for orthogonalize: matrices with a chosen singular spectrum, and a band check.

Gaussian matrices are the easy case (condition ~10); Muon's momentum matrices are often far
worse. These spectra are the ones that broke the bf16 Gram iteration (issue 9 point 2).
"""

from __future__ import annotations

import torch

F64 = torch.float64


def spectra(k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Named singular spectra of length k (largest 1), float64."""
    i = torch.arange(1, k + 1, dtype=F64)
    out = {f"cond_{c:.0e}": torch.logspace(0, -e, k, dtype=F64) for e, c in ((3, 1e3), (4, 1e4), (6, 1e6))}
    out["cond_1e6_random"] = 10 ** (-6 * torch.rand(k, generator=g, dtype=F64))
    out["power_law_1"] = i**-1.0
    out["power_law_2"] = i**-2.0
    # |Cauchy|: a heavy tail, a few singular values far above the rest.
    out["cauchy"] = torch.randn(k, generator=g, dtype=F64).div(torch.randn(k, generator=g, dtype=F64)).abs() + 1e-6
    out["clustered_1e-3"] = torch.where(i <= k // 2, 1.0, 1e-3)
    out["one_big"] = torch.where(i == 1, 1.0, 1e-3)
    out["low_rank_4"] = torch.where(i <= 4, 1.0 / i, 0.0)
    out["rank_1"] = torch.where(i == 1, 1.0, 0.0)
    return out


def with_spectrum(rows: int, cols: int, s: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A rows x cols float64 matrix with singular values s and random singular vectors."""
    p, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=F64))
    q, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=F64))
    return (p * s) @ q.T


def hard_batch(rows: int, cols: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """Every spectrum of :func:`spectra` plus a Gaussian matrix, as one (B, rows, cols) batch."""
    g = torch.Generator().manual_seed(seed)
    named = spectra(min(rows, cols), g)
    mats = [with_spectrum(rows, cols, s, g) for s in named.values()]
    mats.append(torch.randn(rows, cols, generator=g, dtype=F64))
    return [*named, "gaussian"], torch.stack(mats)


def decompose(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P, S, Q^T, ||x||_F) of x scaled to max|x| = 1, in float64: what :func:`response` needs of x."""
    x = x.to(F64) / x.to(F64).abs().max()
    p, s, qt = torch.linalg.svd(x, full_matrices=False)
    return p, s, qt, torch.linalg.norm(x)


def response(
    x: torch.Tensor,
    o: torch.Tensor,
    min_relative: float,
    *,
    svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float]:
    """f(s_i) for the singular values s_i >= min_relative * ||x||_F, and the top singular value of o.

    Newton-Schulz is an odd matrix polynomial, so for x = P S Q^T the output is P f(S) Q^T and
    f(s_i) is the diagonal of P^T o Q (tests/numerics/test_orthogonalize.py). ``svd``: x's
    :func:`decompose`, when several outputs are read against the same x.
    """
    p, s, qt, norm = decompose(x) if svd is None else svd
    kept = s >= min_relative * norm
    diag = torch.diagonal(p.T @ o.to(F64) @ qt.T)[kept]
    return diag, torch.linalg.svdvals(o.to(F64)).max().item()
