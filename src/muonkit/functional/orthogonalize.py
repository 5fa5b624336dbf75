"""Orthogonalization of matrices by a quintic Newton-Schulz iteration.

For ``U = P S Q^T`` (SVD) the ideal result is the polar factor ``P Q^T``: every singular value
sent to 1. Newton-Schulz gets there approximately with matrix products only:

    X_0 = U / ((k + eps) ||U||_F)                  (k = the preset's norm factor; 0 if U = 0)
    A   = X X^T
    X  <- a X + (b A + c A^2) X                   (one (a, b, c) per step)

computed on the short side (tall inputs are transposed first, so ``A`` is the small Gram
matrix). The normalization is scale-invariant: tiny (1e-30) and huge (1e30) inputs give the same
result as moderate ones (``eps`` is a relative margin, not an absolute floor that would shrink a
small momentum's update), and nothing underflows or overflows.

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

__all__ = ["METHODS", "default_compute_dtype", "orthogonalization_flops", "orthogonalize", "orthogonalize_batches"]

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
        eps: relative margin in the normalization ``U / ((k + eps) ||U||_F)``; an all-zero
            matrix maps to zero.
        dtype: compute dtype of the matrix products (default: :func:`default_compute_dtype`).
        method: ``"newton_schulz"`` (default) iterates on ``X``; ``"gram"`` iterates on the small
            Gram matrix (:func:`_gram_newton_schulz`), the same polynomial in exact arithmetic and
            fewer FLOPs when the aspect ratio is >= 2; other shapes use ``"newton_schulz"``.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    batch_shape = x.shape[:-2]
    flat = x.reshape(-1, x.size(-2), x.size(-1))
    out = orthogonalize_batches([flat], coefficients=coefficients, steps=steps, eps=eps, dtype=dtype, method=method)
    return out.reshape(*batch_shape, x.size(-2), x.size(-1))


def orthogonalize_batches(
    parts: Sequence[Tensor],
    *,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "newton_schulz",
    scale: float = 1.0,
) -> Tensor:
    """``scale * orthogonalize(cat(parts))`` for batches ``(b_i, m, n)`` of one matrix shape.

    The parts are normalized straight into one compute-dtype batch (no fp32 concatenation), and
    the result, ``(sum b_i, m, n)`` in the parts' dtype, is scaled in that dtype as it is cast
    back: the Muon step's batching and lr shape scale at no extra pass over the data.
    """
    first = parts[0]
    if first.is_complex():
        raise ValueError("orthogonalize does not support complex tensors")
    if method not in METHODS:
        raise ValueError(f"Invalid method={method!r}: must be one of {METHODS}")
    schedule, norm_factor = resolve_preset(coefficients, steps=steps)
    compute = dtype if dtype is not None else default_compute_dtype(first.device)
    if compute == torch.float16 and first.device.type == "cpu":
        raise ValueError("Invalid dtype=torch.float16 on CPU: fp16 matmul is ~1000x slower there; use bf16 or fp32")
    tall = first.size(-2) > first.size(-1)
    short, long = sorted((first.size(-2), first.size(-1)))
    work = torch.empty((sum(p.size(0) for p in parts), short, long), dtype=compute, device=first.device)
    offset = 0
    for part in parts:
        _normalize_into(part.mT if tall else part, work[offset : offset + part.size(0)], norm_factor + eps)
        offset += part.size(0)
    iterate = _gram_newton_schulz if method == "gram" and 2 * short <= long else _newton_schulz
    out = iterate(work, schedule)
    out = out.mT if tall else out
    if out.dtype == first.dtype and scale == 1.0:
        return out
    # A dimensioned factor makes the product compute in the wider of the two dtypes (a Python
    # float would keep bf16 arithmetic): fp32(out) * scale, rounded once, in the same pass as the cast.
    wide = torch.promote_types(out.dtype, first.dtype)
    return torch.mul(out, torch.full((1, 1, 1), scale, dtype=wide, device=first.device)).to(first.dtype)


# Frobenius norms in this range are computed without overflow or underflow by a plain fp32
# reduction (its sum of squares stays within fp32's normal range).
_TRUSTED_NORMS = (1e-15, 1e18)


def _normalize_into(x: Tensor, out: Tensor, k: float) -> None:
    """``out = x / (k * ||x||_F)`` per matrix (zero stays zero), cast to ``out``'s dtype.

    Fast path: one fp32 norm reduction and one fused scale-and-cast pass. Norms outside the range
    a plain fp32 reduction gets right (entries above ~1e18 or below ~1e-17), and fp64 input, go
    through a pre-division by ``max|x|`` in fp32 (fp64 for fp64 input), so every finite scale
    works. Checking the range costs one host sync per batch (free on CPU).

    The norm is reduced from a contiguous copy when ``x`` is a strided view (a transposed or
    split layout, a tall matrix seen short side first): a reduction's summation order follows
    memory order, so this makes each matrix's result depend on its values alone, not on how the
    caller stores them (one device passes views, the distributed owners stacked copies).
    """
    x = x.contiguous()
    if x.dtype != torch.float64:
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
        lo, hi = _TRUSTED_NORMS
        if bool(((norm >= lo) & (norm <= hi)).all()):
            torch.mul(x, (k * norm).reciprocal_(), out=out)
            return
    # fp64 stays fp64: casting it to fp32 first would overflow above ~3e38, flush values below
    # ~1e-45 to zero, and cap a float64 Newton-Schulz at fp32 accuracy.
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    peak = wide.abs().amax(dim=(-2, -1), keepdim=True)
    wide = wide / torch.where(peak > 0, peak, torch.ones_like(peak))
    norm = torch.linalg.vector_norm(wide, dim=(-2, -1), keepdim=True)
    torch.div(wide, torch.where(norm > 0, k * norm, torch.ones_like(norm)), out=out)


def _newton_schulz(x: Tensor, schedule: Sequence[tuple[float, float, float]]) -> Tensor:
    """The quintic iteration on a batch (B, m, n) with m <= n, in x's dtype."""
    for a, b, c in schedule:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


_GRAM_RESTARTS = (2,)


def orthogonalization_flops(rows: int, cols: int, steps: int, method: str = "newton_schulz") -> int:
    """Matrix-product FLOPs of ``orthogonalize`` on one ``rows x cols`` matrix (m <= n its sides).

    Plain iteration, per step: ``X X^T`` (2 m^2 n), ``A A`` (2 m^3), ``B X`` (2 m^2 n). Gram
    (where it applies, n >= 2m): ``X X^T`` and ``Q X`` once (2 m^2 n each), per step ``P`` (2 m^3),
    ``P Q`` (2 m^3, from the second step) and ``P R P`` (4 m^3, except before a restart and
    after the last step), and 4 m^2 n per restart.
    """
    m, n = min(rows, cols), max(rows, cols)
    if method != "gram" or 2 * m > n:
        return steps * (4 * m * m * n + 2 * m**3)
    flops, fresh = 4 * m * m * n, True
    for i in range(steps):
        if i in _GRAM_RESTARTS and not fresh:
            flops, fresh = flops + 4 * m * m * n, True
        flops += 2 * m**3 + (0 if fresh else 2 * m**3)
        fresh = False
        if i + 1 < steps and i + 1 not in _GRAM_RESTARTS:
            flops += 4 * m**3
    return flops


def _gram_newton_schulz(
    x: Tensor, schedule: Sequence[tuple[float, float, float]], *, restarts: tuple[int, ...] = _GRAM_RESTARTS
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
