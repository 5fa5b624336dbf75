"""Orthogonalization of matrices by a quintic Newton-Schulz iteration.

For ``U = P S Q^T`` (SVD) the ideal result is the polar factor ``P Q^T``: every singular value
sent to 1. Newton-Schulz gets there approximately with matrix products only:

    X_0 = U / (k * ||U||_F + eps)                  (k = the preset's norm factor)
    A   = X X^T
    X  <- a X + (b A + c A^2) X                   (one (a, b, c) per step)

computed on the short side (tall inputs are transposed first, so ``A`` is the small Gram
matrix). Before normalizing we divide by ``max|U|`` (in fp32, or fp64 for fp64 input), so tiny
(1e-30) and huge (1e30) inputs reach the iteration with a Frobenius norm >= 1 and never underflow
or overflow.

Example::

    >>> import torch, muonkit
    >>> o = muonkit.orthogonalize(torch.randn(64, 256))
    >>> s = torch.linalg.svdvals(o.double())  # all close to 1
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from muonkit.functional.coefficients import resolve_preset

__all__ = ["METHODS", "default_compute_dtype", "orthogonalize"]

METHODS: tuple[str, ...] = ("newton_schulz", "gram")


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where matrix products in bf16 are fast, else fp32. Never fp16 (slow on CPUs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    return torch.float32


@functools.cache
def _cpu_has_fast_bf16() -> bool:
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def orthogonalize(
    x: Tensor,
    *,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "newton_schulz",
) -> Tensor:
    """Approximate polar factor of a matrix or of each matrix in a batch ``(..., m, n)``.

    Args:
        x: a matrix or a batch of matrices; returned with the same shape and dtype.
        coefficients: ``"polar_express"`` (default), ``"keller"``, ``"you"`` or a sequence of
            ``(a, b, c)`` steps. See :mod:`muonkit.functional.coefficients` for each preset's
            singular-value band.
        steps: number of iterations (default: the preset's own, 5 for all built-ins).
        eps: added to the norm, so an all-zero matrix maps to zero.
        dtype: compute dtype of the matrix products (default: :func:`default_compute_dtype`).
        method: ``"newton_schulz"`` (default) iterates on ``X``; ``"gram"`` iterates on the small
            Gram matrix (:func:`_gram_newton_schulz`), the same polynomial in exact arithmetic and
            fewer FLOPs when the aspect ratio is >= 2; other shapes use ``"newton_schulz"``.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    if x.is_complex():
        raise ValueError("orthogonalize does not support complex tensors")
    if method not in METHODS:
        raise ValueError(f"Invalid method={method!r}: must be one of {METHODS}")
    schedule, norm_factor = resolve_preset(coefficients, steps=steps)
    compute = dtype if dtype is not None else default_compute_dtype(x.device)
    if compute == torch.float16 and x.device.type == "cpu":
        raise ValueError("Invalid dtype=torch.float16 on CPU: fp16 matmul is ~1000x slower there; use bf16 or fp32")
    tall = x.size(-2) > x.size(-1)
    work = x.mT if tall else x
    batch_shape = work.shape[:-2]
    work = work.reshape(-1, work.size(-2), work.size(-1))
    iterate = _gram_newton_schulz if method == "gram" and 2 * work.size(-2) <= work.size(-1) else _newton_schulz
    out = iterate(_normalize(work, norm_factor, eps).to(compute), schedule)
    out = out.reshape(*batch_shape, out.size(-2), out.size(-1))
    return (out.mT if tall else out).to(x.dtype)


def _normalize(x: Tensor, norm_factor: float, eps: float) -> Tensor:
    """x / (k*||x||_F + eps) per matrix, in fp32 (fp64 for fp64 input), safe for any finite scale."""
    # fp64 stays fp64: casting it to fp32 first would overflow above ~3e38, flush values below
    # ~1e-45 to zero, and cap a float64 Newton-Schulz at fp32 accuracy.
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    peak = x.abs().amax(dim=(-2, -1), keepdim=True)
    x = x / torch.where(peak > 0, peak, torch.ones_like(peak))
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    return x / (norm_factor * norm + eps)


def _newton_schulz(x: Tensor, schedule: Sequence[tuple[float, float, float]]) -> Tensor:
    """The quintic iteration on a batch (B, m, n) with m <= n, in x's dtype."""
    for a, b, c in schedule:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def _gram_newton_schulz(
    x: Tensor, schedule: Sequence[tuple[float, float, float]], *, restarts: tuple[int, ...] = (2,)
) -> Tensor:
    """The same iteration run on the n x n Gram matrix of a batch (B, n, m), n <= m/2.

    Each step is ``X <- P X`` with ``P = a I + b R + c R^2`` and ``R = X X^T``. Since P is a
    polynomial in R, ``X_k = Q_k X_0`` with ``Q <- P Q`` and ``R <- P R P``: all n x n products
    except one ``X X^T`` at the start and ``Q X`` at the end. Per step 4 n^3 + 4 n^3 FLOPs instead
    of 4 n^2 m + 2 n^3. Rounding in R compounds in low precision, so at each step in ``restarts``
    ``X`` is rebuilt from ``Q`` and R recomputed from it (one extra pair of n x m products).
    """
    gram = torch.bmm(x, x.mT)
    q: Tensor | None = None
    for i, (a, b, c) in enumerate(schedule):
        if i in restarts and q is not None:
            x = torch.bmm(q, x)
            gram = torch.bmm(x, x.mT)
            q = None
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        q = poly if q is None else torch.bmm(poly, q)
        if i + 1 < len(schedule) and i + 1 not in restarts:
            gram = torch.bmm(poly, torch.bmm(gram, poly))
    return x if q is None else torch.bmm(q, x)
