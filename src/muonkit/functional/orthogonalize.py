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
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.functional import validation as check
from muonkit.functional.coefficients import resolve_preset

__all__ = [
    "METHODS",
    "SYNCHRONOUS_DEVICES",
    "compiled_iteration",
    "default_compute_dtype",
    "gram_restarts",
    "host_read_waits",
    "orthogonalization_flops",
    "orthogonalize",
    "orthogonalize_batches",
    "uses_gram",
]

METHODS: tuple[str, ...] = ("newton_schulz", "gram")


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where matrix products in bf16 are fast, else fp32. Never fp16 (slow on CPUs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    return torch.float32


_FAST_BF16: list[bool] = []  # the answer, once known (functools.cache is a wrapper torch.compile warns about)


@torch.compiler.assume_constant_result  # a constant to torch.compile, not a call it cannot trace
def _cpu_has_fast_bf16() -> bool:
    if not _FAST_BF16:
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        _FAST_BF16.append(any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks))
    return _FAST_BF16[0]


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
        x: a real floating matrix or batch of matrices; returned with the same shape and dtype
            (an empty one, e.g. ``(0, 8)``, comes back empty).
        coefficients: ``"polar_express"`` (default), ``"keller"``, ``"you"`` or a sequence of
            ``(a, b, c)`` steps. See :mod:`muonkit.functional.coefficients` for each preset's
            singular-value band.
        steps: number of iterations, an int in [1, 100] (default: the preset's own, 5 for all
            built-ins).
        eps: relative margin in the normalization ``U / ((k + eps) ||U||_F)``, in ``(0, 0.01]``
            (:data:`~muonkit.functional.validation.MAX_NS_EPS`: up to it every preset keeps its
            band; a larger margin shrinks every singular value); an all-zero matrix maps to zero.
        dtype: compute dtype of the matrix products, float32, bfloat16, float64 or (GPU only)
            float16 (default: :func:`default_compute_dtype`).
        method: ``"newton_schulz"`` (default) iterates on ``X``; ``"gram"`` iterates on the small
            Gram matrix (:func:`_gram_newton_schulz_`), the same polynomial in exact arithmetic and
            fewer FLOPs, where it is safe: aspect ratio >= 2 and fp32 or fp64 compute. Other
            shapes, and bf16 or fp16 compute, use ``"newton_schulz"`` (see :func:`uses_gram`).
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    batch_shape, (rows, cols) = x.shape[:-2], x.shape[-2:]
    flat = x.reshape(math.prod(batch_shape), rows, cols)
    out = orthogonalize_batches([flat], coefficients=coefficients, steps=steps, eps=eps, dtype=dtype, method=method)
    return out.reshape(x.shape)


def orthogonalize_batches(
    parts: Sequence[Tensor],
    *,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "newton_schulz",
    scale: float = 1.0,
    compiled: bool = False,
) -> Tensor:
    """``scale * orthogonalize(cat(parts))`` for batches ``(b_i, m, n)`` of one matrix shape.

    The parts are normalized straight into one compute-dtype batch (no fp32 concatenation), and
    the result, ``(sum b_i, m, n)`` in the parts' dtype, is scaled in that dtype as it is cast
    back: the Muon step's batching and lr shape scale at no extra pass over the data.
    ``compiled=True`` runs the iteration through ``torch.compile`` (:func:`compiled_iteration`).
    """
    schedule, norm_factor, eps, dtype, method = resolved_options(coefficients, steps, eps, dtype, method)
    return orthogonalize_resolved(
        parts, schedule=schedule, norm_factor=norm_factor, eps=eps, dtype=dtype, method=method, scale=scale,
        compiled=compiled,
    )  # fmt: skip


def resolved_options(
    coefficients: str | Sequence[Sequence[float]], steps: int | None, eps: float, dtype: torch.dtype | None, method: str
) -> tuple[tuple[tuple[float, float, float], ...], float, float, torch.dtype | None, str]:
    """``(schedule, norm_factor, eps, dtype, method)`` of :func:`orthogonalize_batches`' arguments,
    validated (ValueError naming what is wrong), for :func:`orthogonalize_resolved`."""
    if method not in METHODS:
        raise ValueError(f"Invalid method={method!r}: must be one of {METHODS}")
    steps = check.ns_steps("steps", steps)
    eps = check.eps("eps", eps, kind="newton_schulz")
    schedule, norm_factor = resolve_preset(coefficients, steps=steps, name="coefficients")
    return schedule, norm_factor, eps, check.ns_dtype("dtype", dtype), method


def orthogonalize_resolved(
    parts: Sequence[Tensor],
    *,
    schedule: Sequence[tuple[float, float, float]],
    norm_factor: float,
    eps: float,
    dtype: torch.dtype | None,
    method: str,
    scale: float = 1.0,
    compiled: bool = False,
) -> Tensor:
    """:func:`orthogonalize_batches` with its options already resolved by :func:`resolved_options`
    (a step resolves them once per group config, not once per batch)."""
    first = parts[0]
    if first.is_complex() or not first.is_floating_point():
        raise ValueError(f"orthogonalize needs real floating-point tensors, got {first.dtype}")
    compute = dtype or default_compute_dtype(first.device)
    if compute == torch.float16 and first.device.type == "cpu":
        raise ValueError("Invalid dtype=torch.float16 on CPU: fp16 matmul is ~1000x slower there; use bf16 or fp32")
    tall = first.size(-2) > first.size(-1)
    short, long = sorted((first.size(-2), first.size(-1)))
    work = torch.empty((sum(p.size(0) for p in parts), short, long), dtype=compute, device=first.device)
    if work.numel() == 0:  # no matrices, or matrices with no rows or columns: nothing to do
        return torch.empty((work.size(0), first.size(-2), first.size(-1)), dtype=first.dtype, device=first.device)
    _normalize_into(parts, work, norm_factor + eps, transpose=tall)
    # The iterations overwrite ``work`` and take it over (``box``), so that it is not held here.
    box = [work]
    del work
    restarts = gram_restarts(len(schedule), compute) if uses_gram(short, long, method=method, dtype=compute) else None
    if compiled:
        out = compiled_iteration(_iterate)(box.pop(), tuple(schedule), restarts)
    elif restarts is not None:
        out = _gram_newton_schulz_(box, schedule, restarts)
    else:
        out = _newton_schulz_(box, schedule)
    return scaled_as(out.mT if tall else out, first.dtype, scale)


def scaled_as(out: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``scale * out`` in ``dtype``, from an iteration's own result ``out`` (scaled in place where it can).

    The rounding of the Muon step on one device: in a compute dtype wider than ``dtype`` the product
    is formed there and rounded once; from a narrower one the cast is exact and the product is
    rounded once in ``dtype``.
    """
    if out.dtype == dtype:
        return out if scale == 1.0 else out.mul_(scale)  # this call's own buffer: scaled in place
    if scale != 1.0 and torch.promote_types(out.dtype, dtype) == out.dtype:
        # A compute dtype wider than the parts' (fp32 for bf16 params): scale there, round once.
        return out.mul_(scale).to(dtype)
    # A narrower one (bf16 for fp32 params): the cast is exact, the product rounded once.
    out = out.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


@functools.cache
def compiled_iteration(iterate: Callable[..., Tensor]) -> Any:
    """``torch.compile(iterate, fullgraph=True)``, made once per iteration function.

    The schedule's loop is unrolled and its coefficients are constants of the graph; torch.compile
    recompiles for a new schedule, and after a second batch shape makes the shapes dynamic. Under
    ``TORCH_COMPILE_DISABLE=1`` (or ``torch._dynamo.config.disable``) it runs ``iterate`` eagerly.
    """
    return torch.compile(iterate, fullgraph=True)


def _iterate(x: Tensor, schedule: Sequence[tuple[float, float, float]], restarts: Collection[int] | None) -> Tensor:
    """The iteration as a function of the batch (what :func:`compiled_iteration` compiles): the
    Gram iteration with these ``restarts``, or the plain one for ``None``."""
    box = [x]
    return _newton_schulz_(box, schedule) if restarts is None else _gram_newton_schulz_(box, schedule, restarts)


def uses_gram(rows: int, cols: int, *, method: str, dtype: torch.dtype | None) -> bool:
    """Whether ``method`` runs the Gram iteration on a ``rows x cols`` matrix in ``dtype``.

    Only for ``method="gram"``, aspect ratio >= 2 (else it saves nothing) and fp32 or fp64
    compute (``dtype=None`` counts as fp32). In bf16 and fp16 the rounding of the tracked Gram
    matrix compounds between restarts until singular values leave the band or diverge, however
    often it is restarted short of every step (measured: see :func:`_gram_newton_schulz_`), so
    there ``"gram"`` runs the plain iteration.
    """
    m, n = sorted((rows, cols))
    return method == "gram" and 2 * m <= n and dtype in (None, torch.float32, torch.float64)


SYNCHRONOUS_DEVICES: frozenset[str] = frozenset({"cpu"})
"""Device types whose ops finish before they return, so reading a result waits for nothing."""


def host_read_waits(device: torch.device) -> bool:
    """Whether reading a value of a tensor on ``device`` makes the host wait for the device.

    Not on the CPU (its ops run synchronously): there muonkit takes the cheapest exact path even
    when it reads a value (an fp32 norm and its range, below). On accelerators it keeps every
    decision of a step on the device, so the host can run ahead launching work. Nor while
    ``torch.compile`` traces (a read would break the graph, or recompile on the value read): the
    compiled step takes the read-free path on every device.
    """
    return device.type not in SYNCHRONOUS_DEVICES or torch.compiler.is_compiling()


def _normalize_into(parts: Sequence[Tensor], out: Tensor, k: float, *, transpose: bool) -> None:
    """``out = cat(parts) / (k * ||x||_F)`` per matrix ``x`` (zero stays zero), cast to ``out``'s dtype.

    ``transpose``: write each part's transpose (a tall matrix seen short side first). Every
    finite scale works (1e-40 or 1e30 gives what 1 gives), by two routes:

    - where a host read waits for nothing (:func:`host_read_waits`, the CPU), per part one fp32
      norm, a check of its range and, inside it, one fused scale-and-cast pass
      (:func:`_normalize_checked_into`);
    - on accelerators, no host read and a few calls for the whole batch: one fused norm of every
      matrix (``_foreach_norm``), reduced and applied in float64, where the sum of squares of any
      finite fp32, bf16 or fp16 matrix neither overflows nor underflows, so no range check is
      needed; then one scale-and-cast pass per part. fp64 input (and devices without fp64) go
      through a pre-division by ``max|x|`` (:func:`_normalize_wide_into`), read-free as well.

    The norm is reduced from a contiguous copy when a part is a strided view (a transposed or
    split layout): a reduction's summation order follows memory order, so this makes each
    matrix's result depend on its values alone, not on how the caller stores them (one device
    passes views, the distributed owners stacked copies).
    """
    wide = torch.float64 if out.device.type not in _NO_FP64 else torch.float32
    checked = not host_read_waits(out.device)
    if checked or parts[0].dtype == torch.float64 or wide != torch.float64:
        offset = 0
        for part in parts:
            target = out[offset : offset + part.size(0)]
            x = part.mT if transpose else part
            _normalize_checked_into(x, target, k) if checked else _normalize_wide_into(x, target, k)
            offset += part.size(0)
        return
    parts = [part.contiguous() for part in parts]
    matrices = [m for part in parts for m in ((part,) if part.size(0) == 1 else part.unbind(0))]
    norms = torch.stack(torch._foreach_norm(matrices, 2, dtype=wide))
    # A zero matrix stays zero: its norm is raised to the least normal float64, whose
    # reciprocal is finite; every nonzero fp32/bf16/fp16 norm is far above it.
    scales = norms.mul_(k).clamp_min_(torch.finfo(wide).tiny).reciprocal_().view(-1, 1, 1)
    if len(parts) == 1:
        torch.mul(parts[0].mT if transpose else parts[0], scales, out=out)
        return
    sizes = [part.size(0) for part in parts]
    for part, scale, target in zip(parts, scales.split(sizes), out.split(sizes), strict=True):
        torch.mul(part.mT if transpose else part, scale, out=target)


_NO_FP64 = ("mps",)
"""Device types without float64 arithmetic: their normalization pre-divides by ``max|x|``."""

# Frobenius norms in this range are computed without overflow or underflow by a plain fp32
# reduction (its sum of squares stays within fp32's normal range).
_TRUSTED_NORMS = (1e-15, 1e18)


def _normalize_checked_into(x: Tensor, out: Tensor, k: float) -> None:
    """One part of :func:`_normalize_into` where reads are free: an fp32 norm and one fused
    scale-and-cast pass when the norm is in the range a plain fp32 reduction gets right (entries
    between ~1e-17 and ~1e18), else (and for fp64 input) :func:`_normalize_wide_into`.

    A strided ``x`` is reduced from a contiguous copy (see :func:`_normalize_into`); that copy is
    ``out`` itself where the dtypes match (then normalized in place: no temporary)."""
    x = out.copy_(x) if not x.is_contiguous() and x.dtype == out.dtype else x.contiguous()
    if x.dtype != torch.float64:
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
        lo, hi = _TRUSTED_NORMS
        if bool(((norm >= lo) & (norm <= hi)).all()):  # a host read: free where this runs
            torch.mul(x, (k * norm).reciprocal_(), out=out)
            return
    _normalize_wide_into(x, out, k)


def _normalize_wide_into(x: Tensor, out: Tensor, k: float) -> None:
    """:func:`_normalize_into` for one part by pre-division by ``max|x|`` (fp64 input, devices
    without fp64): right at every finite scale too, at two more passes."""
    x = x.contiguous()
    # fp64 stays fp64: casting it to fp32 first would overflow above ~3e38, flush values below
    # ~1e-45 to zero, and cap a float64 Newton-Schulz at fp32 accuracy.
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    peak = wide.abs().amax(dim=(-2, -1), keepdim=True)
    wide = wide / torch.where(peak > 0, peak, torch.ones_like(peak))
    norm = torch.linalg.vector_norm(wide, dim=(-2, -1), keepdim=True)
    torch.div(wide, torch.where(norm > 0, k * norm, torch.ones_like(norm)), out=out)


GramOf = Callable[[Tensor], Tensor]
"""``X -> X X^T`` for a batch (B, m, n): ``torch.bmm(x, x.mT)`` on one device; on a shard of the
columns, the sum of every shard's product (:mod:`muonkit.functional.sharded`)."""


def _gram(x: Tensor) -> Tensor:
    return torch.bmm(x, x.mT)


def _newton_schulz_(
    box: list[Tensor], schedule: Sequence[tuple[float, float, float]], gram_of: GramOf = _gram
) -> Tensor:
    """The quintic iteration on the batch (B, m, n), m <= n, in ``box`` (emptied), in its dtype.

    The batch is overwritten: the iterates alternate between it and one spare buffer, so the
    iteration holds two copies of the batch however many steps it runs (the caller holds none).
    ``gram_of``: how ``A = X X^T`` is formed (the only step that reads every column).
    """
    x = box.pop()
    spare = _spare(x, len(schedule) > 1)
    for a, b, c in schedule:
        gram = gram_of(x)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        del gram  # not held during the large product
        if spare is None:
            x = torch.baddbmm(x, poly, x, beta=a)
        else:
            torch.baddbmm(x, poly, x, beta=a, out=spare)
            x, spare = spare, x
        del poly
    return x


def _spare(x: Tensor, needed: bool) -> Tensor | None:
    """A second buffer like ``x`` to write iterates into, or None to allocate each one (with
    autograd: ``out=`` does not support it, and saved iterates must not be overwritten)."""
    return torch.empty_like(x) if needed and not (x.requires_grad and torch.is_grad_enabled()) else None


# Restart the Gram iteration at step 2 and then every 4 steps (2, 6, 10, ...): at most three
# tracked updates of R between restarts. Measured in fp32 on ill-conditioned (1e3-1e6), low-rank,
# rank-1, power-law, Cauchy, clustered and Gaussian inputs (8x64 to 32x256, every preset, 5-100
# steps; 768x3072 with polar_express and keller at 5-32 steps): restarts every 3, 4 or 5 steps all
# hold the presets' bands (0 failures); a restart at step 2 alone fails from 10 steps (inf from
# 12). Up to 6 steps that is the only restart.
_GRAM_FIRST_RESTART, _GRAM_RESTART_EVERY = 2, 4
# Up to this many steps the Gram iteration runs without any restart (see gram_restarts).
_GRAM_NO_RESTART_UP_TO = {torch.float32: 5, torch.float64: 10}


def gram_restarts(steps: int, dtype: torch.dtype | None = None) -> tuple[int, ...]:
    """The steps at which the Gram iteration rebuilds ``X`` and recomputes ``R = X X^T``.

    A function of the compute ``dtype`` (None counts as fp32) and the step count, measured on
    hard inputs (``tools/measure_gram.py``: condition 1e3 to 1e12, low rank, rank 1, power-law,
    Cauchy, clustered, near-orthogonal, 1e-30 and 1e30 scales, Gaussian; 128x512 for every
    preset and 3-12 steps, and GPT-2's 768x3072, 3072x768 and 768x2304), against the plain
    iteration in the same dtype and in fp64:

    - fp32, up to 5 steps (every preset's own count): no restart. Its relative distance to the
      plain fp32 iteration is at most 4.6e-3 (Polar Express on 16x80 to 128x512 hard inputs;
      2.4e-4 on GPT-2's 768x3072, 1.2e-4 with the restart), every output singular value stays in
      the preset's band and the polar distance is unchanged to 4 digits;
      dropping the restart saves 17% of the Gram FLOPs at 768x3072 (27.2 -> 22.6 GFLOP; plain
      iteration 40.8) and 12% at 768x2304 (23.6 -> 20.8). From 6 steps the drift grows ~4x per step
      (8.6e-3 at 6, 4.0e-2 at 7; singular values 1.7 at 8 steps, 1e17 at 10), so from 6 steps
      the restarts above apply.
    - fp64, up to 10 steps: no restart (distance to the plain fp64 iteration at most 1.1e-7 at
      10 steps, 1.3e-5 at 12), then the restarts above.
    - bf16 and fp16: the restarts above, which are not enough (singular values up to 45 at 6
      steps, inf from 10; without the restart 2e13 at 5 steps): :func:`uses_gram` keeps these
      dtypes on the plain iteration, so ``orthogonalize`` never runs this.
    """
    if steps <= _GRAM_NO_RESTART_UP_TO.get(dtype or torch.float32, 0):
        return ()
    return tuple(range(_GRAM_FIRST_RESTART, steps, _GRAM_RESTART_EVERY))


def orthogonalization_flops(
    rows: int, cols: int, steps: int, method: str = "newton_schulz", dtype: torch.dtype | None = None
) -> int:
    """Matrix-product FLOPs of ``orthogonalize`` on one ``rows x cols`` matrix (m <= n its sides).

    Plain iteration, per step: ``X X^T`` (2 m^2 n), ``A A`` (2 m^3), ``B X`` (2 m^2 n). Gram
    (where :func:`uses_gram`; ``dtype`` is the compute dtype, None counting as fp32): ``X X^T``
    and ``Q X`` once (2 m^2 n each), per step ``P`` (2 m^3), ``P Q`` (2 m^3, except right after
    the start or a restart) and ``P R P`` (4 m^3, except before a restart and after the last
    step), and 4 m^2 n per restart (:func:`gram_restarts`).
    """
    m, n = min(rows, cols), max(rows, cols)
    if not uses_gram(m, n, method=method, dtype=dtype):
        return steps * (4 * m * m * n + 2 * m**3)
    restarts = gram_restarts(steps, dtype)
    flops = 4 * m * m * n + len(restarts) * 4 * m * m * n
    for i in range(steps):
        flops += 2 * m**3 + (0 if i == 0 or i in restarts else 2 * m**3)
        if i + 1 < steps and i + 1 not in restarts:
            flops += 4 * m**3
    return flops


def _gram_newton_schulz_(
    box: list[Tensor],
    schedule: Sequence[tuple[float, float, float]],
    restarts: Collection[int],
    gram_of: GramOf = _gram,
) -> Tensor:
    """The same iteration run on the n x n Gram matrix of the batch (B, n, m), n <= m/2, in ``box``.

    Like :func:`_newton_schulz_` it takes the batch out of ``box``, overwrites it and holds at
    most one spare copy (for the restarts and the final ``Q X``).

    Each step is ``X <- P X`` with ``P = a I + b R + c R^2`` and ``R = X X^T``. Since P is a
    polynomial in R, ``X_k = Q_k X_0`` with ``Q <- P Q`` and ``R <- P R P``: all n x n products
    except one ``X X^T`` at the start and ``Q X`` at the end. Per step 4 n^3 + 4 n^3 FLOPs instead
    of 4 n^2 m + 2 n^3.

    ``a I`` is added only where Q starts (the first step, and after a restart); elsewhere each
    product by P is one fused ``a Y + S Y`` (``baddbmm``) with ``S = b R + c R^2``: ``Q <- a Q + S Q``
    and ``R <- T P`` with ``T = P R = a R + S R`` (P commutes with R). Four aten calls per step, not
    six, at the same FLOPs. Each fused product is closer to fp64 (4x) than one by a rounded P; over
    the iteration the worst distance to the plain iteration on hard inputs is unchanged (within 3%
    either way; 2.4e-4 on GPT-2's 768x3072, was 3.5e-4), while on small Gaussian inputs (16x80 to
    128x512) the distance to fp64 grows 1.5-2.4x, to at most 7.4e-6 (plain fp32 4.3e-6; both
    1.1e-4 at 768x3072).

    Unlike the plain iteration, nothing pulls the tracked R back to the Gram matrix of ``Q X_0``:
    its rounding error (and negative eigenvalues where X is rank-deficient or ill-conditioned)
    grows by up to a^2 (66 for Polar Express's first step, 5.5 for its last) at each update, and a
    negative eigenvalue r makes ``a + b r + c r^2`` grow without bound. So at each step of
    ``restarts`` (:func:`gram_restarts`; none up to 5 steps in fp32, where the drift stays within
    4.6e-3 of the plain iteration) ``X`` is rebuilt from ``Q`` and R recomputed from it. That
    bounds the growth in fp32 and fp64 (fp32 error ~1e-7 times at most ~1e4); in bf16 (~4e-3) the
    schedule of :func:`gram_restarts` measured singular values up to 45 at 6 steps and inf from
    10, so :func:`uses_gram` keeps bf16 and fp16 on the plain iteration.
    """
    x = box.pop()
    spare = _spare(x, True)
    gram = gram_of(x)
    q: Tensor | None = None
    for i, (a, b, c) in enumerate(schedule):
        if i in restarts and q is not None:
            if spare is None:
                x = torch.bmm(q, x)
            else:
                torch.bmm(q, x, out=spare)
                x, spare = spare, x
            gram = gram_of(x)
            q = None
        s = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # S = b R + c R^2, so P = a I + S
        if q is None:  # Q starts as P, formed in place of S (so the products below take a = 0)
            s.diagonal(dim1=-2, dim2=-1).add_(a)
            q, a = s, 0.0
        else:
            q = torch.baddbmm(q, s, q, beta=a)  # P Q = a Q + S Q
        if i + 1 < len(schedule) and i + 1 not in restarts:
            # R <- P R P = T P (T = P R = a R + S R; P commutes with R), written over the old R.
            t = torch.baddbmm(gram, s, gram, beta=a)
            gram = torch.baddbmm(t, t, s, beta=a, out=None if spare is None else gram)
            del t
    del gram, s  # only Q is needed for the result
    if q is None:
        return x
    return torch.bmm(q, x) if spare is None else torch.bmm(q, x, out=spare)
