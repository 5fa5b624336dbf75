"""Newton-Schulz on one shard of a matrix cut along its long side.

A matrix too costly for one rank is orthogonalized by a group of ranks, each holding a block of
its long side. Write the iteration on ``X`` (short side first, ``m x n``, ``m <= n``) cut into
column blocks ``X = [X_1 | ... | X_g]``:

    ||X||_F^2 = sum_i ||X_i||_F^2                   (a sum of g numbers)
    A         = X X^T = sum_i X_i X_i^T             (a sum of g small m x m products)
    X_i      <- a X_i + (b A + c A^2) X_i           (column block by column block: local)

so every step needs one cross-shard operation, a sum of small Gram products, and nothing else
moves. The functions here take that sum as a callback ``reduce`` (``t -> sum of t over the
shards``): a sum among the group's ranks in :mod:`muonkit.distributed`, the identity on one
device holding the whole. They call ``reduce`` the same number of times on every shard whatever
the data (zero, empty or extreme-scale shards included), as a collective needs.

Three forms of the iteration, the same polynomial in exact arithmetic and the same rounding as
:func:`~muonkit.functional.orthogonalize` but for the order of the sum of ``A``:

- replicated (Megatron's distributed mode): ``P = b A + c A^2`` on every shard (the same
  ``2 m^3`` FLOPs on each), then ``X_i <- a X_i + P X_i``: ``4 m^2 n_i + 2 m^3`` FLOPs per shard
  and step, one sum;
- by rows (``member=(k, g)`` and ``gather``): shard ``k`` of ``g`` forms only its block of
  ``ceil(m/g)`` rows of ``P`` (``P`` is a polynomial in ``A``: ``P[r] = b A[r] + c A[r] A``, the
  same products as the whole), and ``gather`` joins the blocks: ``4 m^2 n_i + 2 m^3 / g`` FLOPs,
  so g shards take 1/g of the time each however large ``m`` is, for one more collective (an
  all-gather of ``m^2`` numbers) per step. (``X_i <- a X_i + b A X_i + c A (A X_i)`` needs no
  gather but rounds ``A X_i`` before the cancelling sum: measured 10-20% off in bf16, not used);
- the Gram iteration (``method="gram"``, where :func:`~muonkit.functional.orthogonalize.uses_gram`
  says so for the whole matrix): ``R = A`` once, then the ``m x m`` iteration replicated on every
  shard and ``X_i <- Q X_i`` at the end; a sum only at the start and at each restart.

The normalization is the whole matrix's Frobenius norm, formed from each shard's sum of squares
in float64 (banded by binary exponent for float64 input, whose squares would overflow), so every
finite scale gives what scale 1 gives, and zero stays zero. Each partial Gram product is
accumulated and summed in float32 (float64 for float64 compute) and rounded once to the compute
dtype, as one device's product rounds its float32 accumulation once: bf16 shards give one
device's bf16 result (bit for bit on the test zoo), where summing g rounded bf16 products moved
the parameters by 2-10% of their travel.

Which side to cut: the long one, so that ``A`` is the small ``m x m`` Gram matrix (``m^2``
numbers summed per step, against the ``m n / g`` numbers a shard holds), and the one
:func:`~muonkit.functional.orthogonalize` iterates along (the columns of a square matrix), so
that the products round alike. For a tall matrix in PyTorch's ``(out, in)`` orientation that is
its rows: the row blocks FSDP2's ``Shard(0)`` already holds. An update rule that normalizes each
row of the whole result (:meth:`~muonkit.functional.update_rule.UpdateRule.after_shard`) needs one
more sum either way: 2 numbers when the shards hold whole rows (a tall matrix, cut along its
rows), a vector of one number per row (the short side) when every row is cut (a wide one, cut
along its columns); both are small, so such a rule does not decide the side.

Example (one shard holding the whole matrix: ``reduce`` is the identity)::

    >>> import torch
    >>> from muonkit.functional.orthogonalize import orthogonalize
    >>> u = torch.randn(64, 16, dtype=torch.float64)
    >>> o = orthogonalize_shard(u, dim=0, size=64, reduce=lambda t: t, dtype=torch.float64)
    >>> bool(torch.allclose(o, orthogonalize(u, dtype=torch.float64), rtol=0, atol=1e-12))
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from muonkit.functional import validation as check
from muonkit.functional.coefficients import resolve_preset
from muonkit.functional.orthogonalize import (
    METHODS,
    GramOf,
    _gram_newton_schulz_,
    _newton_schulz_,
    default_compute_dtype,
    gram_restarts,
    scaled_as,
    uses_gram,
)

__all__ = [
    "Gather",
    "Reduce",
    "norm_sum_numel",
    "orthogonalize_shard",
    "p_rows",
    "shard_collectives",
    "shard_flops",
]

Reduce = Callable[[Tensor], Tensor]
"""``t -> the sum of t over every shard`` (same shape and dtype); may work in place."""
Gather = Callable[[Tensor], Tensor]
"""``block (B, c, m) -> (B, g c, m)``: every shard's block, in member order ``k = 0 .. g-1``."""


def orthogonalize_shard(
    shard: Tensor,
    *,
    dim: int,
    size: int,
    reduce: Reduce,
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    steps: int | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = "newton_schulz",
    member: tuple[int, int] | None = None,
    gather: Gather | None = None,
    scale: float = 1.0,
) -> Tensor:
    """This shard of ``scale * orthogonalize(U)``, for a shard of ``U`` (or of each matrix of a batch).

    Args:
        shard: ``(..., rows, cols)``: a block of ``U``'s rows (``dim=0``) or columns (``dim=1``),
            whole along the other dim; returned with its shape and dtype.
        dim: the matrix dim the shards cut, 0 or 1 (the long side; either is exact).
        size: ``U``'s whole extent along ``dim`` (the sum of every shard's).
        reduce: the sum over every shard (see the module docstring); called ``1 + steps`` times
            (plain iteration) or ``2 + restarts`` times (Gram), alike on every shard.
        coefficients, steps, eps, dtype, method: as :func:`~muonkit.functional.orthogonalize`,
            which chooses between the plain and Gram iterations from the whole matrix's shape.
        member, gather: ``(k, g)``, this shard's place among g, and the gather of ``P``'s row
            blocks (called ``steps`` times): the plain iteration by rows (see the module
            docstring); ``None``: ``P`` replicated. The Gram iteration ignores them.
        scale: the lr shape scale, applied as :func:`~muonkit.functional.orthogonalize_batches` does.
    """
    if shard.is_complex() or not shard.is_floating_point():
        raise ValueError(f"orthogonalize needs real floating-point tensors, got {shard.dtype}")
    if dim not in (0, 1) or shard.ndim < 2:
        raise ValueError(f"Invalid dim={dim!r} for a shard of shape {tuple(shard.shape)}: must be 0 or 1 of a matrix")
    if not 0 <= shard.size(dim - 2) <= size:
        raise ValueError(f"Invalid size={size!r}: the shard has {shard.size(dim - 2)} of the whole's dim {dim}")
    if method not in METHODS:
        raise ValueError(f"Invalid method={method!r}: must be one of {METHODS}")
    steps = check.ns_steps("steps", steps)
    eps = check.positive("eps", eps)
    schedule, norm_factor = resolve_preset(coefficients, steps=steps, name="coefficients")
    compute = check.ns_dtype("dtype", dtype) or default_compute_dtype(shard.device)
    batch = shard.shape[:-2]
    x = shard.reshape(math.prod(batch), *shard.shape[-2:])
    x = x.mT if dim == 0 else x  # (B, m, n_i): the cut dim last, the Gram matrix m x m
    work = torch.empty(x.shape, dtype=compute, device=shard.device)
    _normalize_shard_into(x, work, norm_factor + eps, reduce)
    gram_of = _summed_gram(reduce)
    box = [work]
    del work
    if uses_gram(x.size(-2), size, method=method, dtype=compute):
        out = _gram_newton_schulz_(box, schedule, gram_restarts(len(schedule), compute), gram_of)
    elif member is not None and gather is not None:
        out = _newton_schulz_by_rows_(box, schedule, gram_of, member, gather)
    else:
        out = _newton_schulz_(box, schedule, gram_of)
    out = out.mT if dim == 0 else out
    return scaled_as(out, shard.dtype, scale).reshape(*batch, *shard.shape[-2:])


def _summed_gram(reduce: Reduce) -> GramOf:
    """``X -> sum over shards of X_i X_i^T``: each product and the sum in float32 (float64 for
    float64), rounded once to X's dtype, as one device's product rounds its float32 accumulation
    once (the same bf16 Gram matrix but for the order of the sum). Only the upper triangles travel
    (``m (m+1) / 2`` numbers: the Gram matrix is symmetric)."""

    def gram_of(x: Tensor) -> Tensor:
        partial = _wide_gram(x)
        m = partial.size(-1)
        upper = torch.triu_indices(m, m, device=x.device)
        summed = reduce(partial[:, upper[0], upper[1]]).to(x.dtype)
        gram = torch.empty_like(partial, dtype=x.dtype)
        gram[:, upper[0], upper[1]] = summed
        gram[:, upper[1], upper[0]] = summed
        return gram

    return gram_of


_WIDE_OUTPUT: dict[str, bool] = {}  # device type -> whether bmm(bf16, bf16, out_dtype=float32) runs there


def _wide_gram(x: Tensor) -> Tensor:
    """``X X^T`` accumulated and returned in float32 (float64 for float64 ``X``).

    Where the device multiplies bf16 / fp16 into a float32 result (CUDA, ``out_dtype``) at bf16
    speed; elsewhere from a float32 copy (exact: every bf16 value is a float32, and so is each
    product's accumulation).
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    if x.dtype != wide and _WIDE_OUTPUT.get(x.device.type, x.device.type == "cuda"):
        try:
            return torch.bmm(x, x.mT, out_dtype=wide)
        except (TypeError, NotImplementedError):  # a torch without the overload: the copy below
            _WIDE_OUTPUT[x.device.type] = False
    return torch.bmm(x.to(wide), x.to(wide).mT)


def p_rows(m: int, parts: int, k: int) -> range:
    """The rows of ``P`` (``m x m``) that member ``k`` of ``parts`` forms: blocks of ``ceil(m / parts)``."""
    size = -(-m // parts)
    return range(min(m, k * size), min(m, (k + 1) * size))


def _newton_schulz_by_rows_(
    box: list[Tensor],
    schedule: Sequence[tuple[float, float, float]],
    gram_of: GramOf,
    member: tuple[int, int],
    gather: Gather,
) -> Tensor:
    """:func:`~muonkit.functional.orthogonalize._newton_schulz_` with ``P`` formed by row blocks
    (this member's, padded with zero rows to ``ceil(m/g)``) and gathered."""
    x = box.pop()
    k, parts = member
    m = x.size(-2)
    size = -(-m // parts)
    mine = p_rows(m, parts, k)
    spare = torch.empty_like(x)
    for a, b, c in schedule:
        gram = gram_of(x)
        block = x.new_zeros(x.size(0), size, m)
        rows = gram[:, mine.start : mine.stop]
        block[:, : len(mine)] = torch.baddbmm(rows, rows, gram, beta=b, alpha=c)  # P's rows: b A + c A^2
        del gram, rows
        poly = gather(block)[:, :m]
        del block
        torch.baddbmm(x, poly, x, beta=a, out=spare)
        x, spare = spare, x
        del poly
    return x


# Float64 input: its squares overflow above ~1e154 and underflow below ~1e-162, so each entry is
# summed in the band of its binary exponent, scaled into [2^-1, 2^BAND): 9 bands span every
# float64 (exponents -1073 to 1024).
_BAND = 256
_BANDS = range(-5, 4 + 1)


def _normalize_shard_into(x: Tensor, out: Tensor, k: float, reduce: Reduce) -> None:
    """``out = x / (k ||U||_F)`` per matrix, the norm over every shard (one ``reduce``); zero stays zero."""
    if x.dtype != torch.float64:  # squares of any fp32 / bf16 / fp16 value are normal float64 numbers
        squares = torch.linalg.vector_norm(x, dim=(-2, -1), dtype=torch.float64).square()
        norm = reduce(squares.reshape(-1, 1)).sqrt()
        scale = norm.mul_(k).clamp_min_(torch.finfo(torch.float64).tiny).reciprocal_()
        torch.mul(x, scale.view(-1, 1, 1), out=out)
        return
    mantissa, exponent = torch.frexp(x)
    band = torch.div(exponent, _BAND, rounding_mode="floor")
    squares = torch.ldexp(mantissa, exponent - band * _BAND).square()
    slots = (band - _BANDS[0]) + len(_BANDS) * torch.arange(x.size(0), device=x.device).view(-1, 1, 1)
    sums = torch.zeros(x.size(0) * len(_BANDS), dtype=torch.float64, device=x.device)
    sums.index_add_(0, slots.reshape(-1), squares.reshape(-1))
    sums = reduce(sums.view(x.size(0), len(_BANDS)))
    # ||U||^2 = sum_b sums[b] 2^(2 BAND b): factor out the top band T, norm = 2^(BAND T) sqrt(S).
    offsets = torch.tensor(list(_BANDS), device=x.device)
    top = torch.where(sums > 0, offsets, offsets[0]).amax(dim=1, keepdim=True)
    s = torch.ldexp(sums, 2 * _BAND * (offsets - top).clamp_max(0)).sum(dim=1)  # bands above T hold 0
    divisor = torch.where(s > 0, k * s.sqrt(), torch.ones_like(s)).view(-1, 1, 1)
    torch.div(torch.ldexp(mantissa, exponent - _BAND * top.view(-1, 1, 1)), divisor, out=out)


def shard_flops(
    short: int,
    width: int,
    long: int,
    steps: int,
    *,
    method: str,
    dtype: torch.dtype | None,
    rows: int | None = None,
) -> int:
    """Matrix-product FLOPs of :func:`orthogonalize_shard` on one shard ``short x width`` of a
    ``short x long`` matrix (``dtype``: the compute dtype, None counting as fp32, as
    :func:`~muonkit.functional.orthogonalize.orthogonalization_flops` counts).

    Per step: the partial Gram ``2 m^2 n_i``, ``P X_i`` ``2 m^2 n_i``, and ``2 m^2 r`` for the
    ``r`` rows of ``P`` it forms (``rows``; None: all ``m``, replicated). Gram iteration:
    ``4 m^2 n_i`` per start and restart, its ``m^3`` work replicated on every shard.
    """
    m, n = short, width
    if uses_gram(short, long, method=method, dtype=dtype):
        restarts = gram_restarts(steps, dtype)
        replicated = 0
        for i in range(steps):
            replicated += 2 * m**3 + (0 if i == 0 or i in restarts else 2 * m**3)
            if i + 1 < steps and i + 1 not in restarts:
                replicated += 4 * m**3
        return (1 + len(restarts)) * 4 * m * m * n + replicated
    return steps * (4 * m * m * n + 2 * m * m * (m if rows is None else rows))


def norm_sum_numel(dtype: torch.dtype | None) -> int:
    """Float64 elements of the norm's one sum per matrix (:func:`_normalize_shard_into`): one square
    sum, or one per exponent band where the shard is float64."""
    return len(_BANDS) if dtype == torch.float64 else 1


def shard_collectives(
    short: int, long: int, steps: int, *, method: str, dtype: torch.dtype | None, by_rows: bool
) -> tuple[int, int]:
    """``(sums, gathers)`` of ``m x m`` matrices :func:`orthogonalize_shard` makes, besides the
    norm's one small sum: a Gram sum per step and, by rows, a gather of ``P`` per step (the Gram
    iteration: one sum, and one per restart)."""
    if uses_gram(short, long, method=method, dtype=dtype):
        return 1 + len(gram_restarts(steps, dtype)), 0
    return steps, steps if by_rows else 0
