"""Newton-Schulz on shards of a matrix (muonkit.functional.sharded) against the whole-matrix orthogonalize.

Shards run as threads standing in for ranks, each calling the function on its own shard with a
``reduce`` (and ``gather``) that meets the others at a barrier: the per-rank code path, with
every call made alike on every shard or the barrier deadlocks (a timeout fails the test).

Tolerances, and why:
- float64: the same arithmetic in another order (the sums of the Gram products, the norm from
  float64 sums of squares): <= 1e-12 plain, <= 1e-10 Gram (whose tracked R amplifies rounding by
  up to a^2 per step; measured 4.7e-12 on the hard inputs).
- fp32 and bf16 on hard inputs (ill-conditioned to 1e6, low rank, rank 1, 1e+-30 and 1e+-300):
  the promise of tests/numerics/test_orthogonalize.py, with its tolerances (the band, off-diagonal <= 1e-4
  fp32 / 0.15 bf16, top singular value <= band top + 0.01).
- fp32 and bf16 on Gaussian input: within test_orthogonalize's batched-vs-looped tolerance (1e-5 /
  1e-2) of orthogonalize; measured bit-identical in bf16 (the Gram sums are formed in float32 and
  rounded once, as one device's product rounds its float32 accumulation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from test_orthogonalize import INPUTS, OFFDIAG_TOL, _spectral_response
from torch import Tensor

import muonkit
from muonkit.functional import PRESETS, orthogonalization_flops
from muonkit.functional.normuon import normuon_normalize, normuon_normalize_shard
from muonkit.functional.orthogonalize import gram_restarts, orthogonalize_batches, uses_gram
from muonkit.functional.sharded import (
    orthogonalize_shard,
    p_rows,
    shard_collectives,
    shard_flops,
)

F64 = torch.float64
CUSTOM = ((3.0, -3.2, 1.2), (2.9, -3.0, 1.2))


class Ranks:
    """``n`` threads standing in for ranks, with counted sums and gathers across them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slots: list[Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)
        self.calls = [0] * n
        self.gathers = [0] * n

    def reduce(self, i: int) -> Callable[[Tensor], Tensor]:
        def reduce(t: Tensor) -> Tensor:
            self.calls[i] += 1
            self.slots[i] = t.clone()
            self.barrier.wait()
            total = sum(s for s in self.slots[1:] if s is not None) + self.slots[0]  # rank order, like a fixed ring
            self.barrier.wait()
            return total.to(t.dtype)

        return reduce

    def gather(self, i: int) -> Callable[[Tensor], Tensor]:
        def gather(block: Tensor) -> Tensor:
            self.gathers[i] += 1
            self.slots[i] = block.clone()
            self.barrier.wait()
            out = torch.cat([s for s in self.slots if s is not None], dim=1)
            self.barrier.wait()
            return out

        return gather

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        out: list[Any] = [None] * self.n
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                out[i] = fn(i)
            except BaseException as e:
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def sharded(
    x: Tensor, parts: int, *, dim: int | None = None, by_rows: bool = False, sizes: Sequence[int] | None = None, **kw
) -> tuple[Tensor, Ranks]:
    """``orthogonalize`` of ``x`` computed by ``parts`` shards of its long side (or ``dim``), joined."""
    dim = (0 if x.size(-2) > x.size(-1) else 1) if dim is None else dim
    axis = x.ndim - 2 + dim
    shards = torch.split(x, list(sizes), dim=axis) if sizes else torch.tensor_split(x, parts, dim=axis)
    ranks = Ranks(len(shards))
    results = ranks.run(
        lambda i: orthogonalize_shard(
            shards[i],
            dim=dim,
            size=x.size(axis),
            reduce=ranks.reduce(i),
            member=(i, ranks.n) if by_rows else None,
            gather=ranks.gather(i) if by_rows else None,
            **kw,
        )
    )
    return torch.cat(results, dim=axis), ranks


CASES = [(1, False), (2, True), (3, False), (3, True)]  # by rows with one part: the replicated form


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize(("parts", "by_rows"), CASES)
@pytest.mark.parametrize("coefficients", [*PRESETS, CUSTOM])
@pytest.mark.parametrize("kind", list(INPUTS))
def test_float64_equals_orthogonalize_to_rounding(
    kind: str, coefficients: str | tuple, parts: int, by_rows: bool, method: str
) -> None:
    x = INPUTS[kind].to(F64) if INPUTS[kind].dtype != F64 else INPUTS[kind]
    got, _ = sharded(x, parts, by_rows=by_rows, coefficients=coefficients, dtype=F64, method=method)
    want = muonkit.orthogonalize(x, coefficients=coefficients, dtype=F64, method=method)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 if method == "gram" else 1e-12)


@pytest.mark.parametrize(("parts", "by_rows"), [(3, False), (3, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("kind", list(INPUTS))
def test_hard_inputs_keep_the_promised_band(
    kind: str, preset: str, dtype: torch.dtype, parts: int, by_rows: bool
) -> None:
    x = INPUTS[kind]
    o, _ = sharded(x, parts, by_rows=by_rows, coefficients=preset, dtype=dtype, method="gram")
    assert o.shape == x.shape and o.dtype == x.dtype and torch.isfinite(o).all()
    lo, hi = PRESETS[preset].band
    diag, offdiag = _spectral_response(x, o, PRESETS[preset].min_relative)
    assert diag.min() >= lo and diag.max() <= hi, (diag.min().item(), diag.max().item())
    assert offdiag <= OFFDIAG_TOL[dtype]
    assert torch.linalg.svdvals(o.to(F64)).max() <= hi + 0.01


@pytest.mark.parametrize("by_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (40, 12), (7, 5), (1, 6)])
def test_gaussian_close_to_orthogonalize(shape: tuple[int, int], dtype: torch.dtype, by_rows: bool) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    got, _ = sharded(x, 4, by_rows=by_rows, dtype=dtype)
    want = muonkit.orthogonalize(x, dtype=dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_zero_stays_zero_and_empty_shards_take_part() -> None:
    """A zero matrix, a zero shard beside others and a shard with no columns: every shard sums alike."""
    zero, _ = sharded(torch.zeros(6, 9), 3, dtype=torch.float32)
    assert not zero.any()
    x = torch.randn(6, 9, dtype=F64)
    x[:, :3] = 0
    for sizes in ((3, 3, 3), (0, 4, 5), (9, 0, 0)):
        got, ranks = sharded(x, 3, sizes=sizes, dtype=F64)
        torch.testing.assert_close(got, muonkit.orthogonalize(x, dtype=F64), rtol=0, atol=1e-12)
        assert ranks.calls == [1 + 5] * 3, ranks.calls


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("steps", [3, 5, 9])
def test_collectives_counted_alike_on_every_shard(steps: int, method: str) -> None:
    x = torch.randn(8, 40)
    for by_rows in (False, True):
        _, ranks = sharded(x, 3, by_rows=by_rows, steps=steps, dtype=torch.float32, method=method)
        sums, gathers = shard_collectives(8, 40, steps, method=method, dtype=torch.float32, by_rows=by_rows)
        assert ranks.calls == [1 + sums] * 3 and ranks.gathers == [gathers] * 3, (ranks.calls, ranks.gathers)
        if method == "gram":
            assert sums == 1 + len(gram_restarts(steps, torch.float32)) and gathers == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64], ids=str)
def test_batches_lr_scale_and_dtypes_as_orthogonalize_batches(dtype: torch.dtype) -> None:
    """A batch of matrices in the params' dtype, scaled as one device scales them (cast, then multiply)."""
    x = torch.randn(3, 12, 5, generator=torch.Generator().manual_seed(7)).to(dtype)
    for compute in (torch.float32, torch.bfloat16):
        got, _ = sharded(x, 2, dtype=compute, scale=1.7)
        want = orthogonalize_batches([x], dtype=compute, scale=1.7)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 if torch.bfloat16 in (dtype, compute) else 1e-5)


def test_cut_along_the_short_side_is_exact_too() -> None:
    """Either side gives the polar factor (the Gram matrix is then the large one): dim is the caller's choice."""
    x = torch.randn(9, 20, dtype=F64)
    got, _ = sharded(x, 3, dim=0, dtype=F64)
    torch.testing.assert_close(got, muonkit.orthogonalize(x, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("rows_cut", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_normuon_on_shards_equals_the_whole(dtype: torch.dtype, rows_cut: bool) -> None:
    g = torch.Generator().manual_seed(5)
    o = muonkit.orthogonalize(torch.randn(2, 12, 20, generator=g, dtype=dtype), dtype=dtype)
    o[1, 3] = 0  # a zero row
    v = torch.rand(2, 12, generator=g, dtype=dtype) * 0.1
    want, want_v = normuon_normalize(o, v, beta2=0.95, eps=1e-8)
    axis = -1 if rows_cut else -2
    shards = torch.tensor_split(o, 3, dim=axis)
    vs = [v] * 3 if rows_cut else list(torch.tensor_split(v, 3, dim=-1))
    ranks = Ranks(3)
    out = ranks.run(
        lambda i: normuon_normalize_shard(
            shards[i], vs[i], rows_cut=rows_cut, cols=20, reduce=ranks.reduce(i), beta2=0.95, eps=1e-8
        )
    )
    assert ranks.calls == [1, 1, 1]
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(torch.cat([o for o, _ in out], dim=axis), want, rtol=0, atol=tol)
    new_v = [v for _, v in out]
    if rows_cut:
        assert all(torch.equal(v, new_v[0]) for v in new_v)  # every shard holds every row's moment
        new_v = new_v[:1]
    torch.testing.assert_close(torch.cat(new_v, dim=-1), want_v, rtol=0, atol=tol)


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
def test_flops_of_one_shard_and_of_row_blocks_add_up(method: str) -> None:
    """One shard (``P`` replicated) costs what orthogonalize costs; by rows, the shards' FLOPs add up to it."""
    m, n, steps = 48, 200, 5
    whole = orthogonalization_flops(m, n, steps, method, torch.float32)
    assert shard_flops(m, n, n, steps, method=method, dtype=torch.float32) == whole
    widths = [len(r) for r in (range(0, 70), range(70, 140), range(140, 200))]
    rows = [len(p_rows(m, 3, k)) for k in range(3)]
    total = sum(
        shard_flops(m, w, n, steps, method=method, dtype=torch.float32, rows=r)
        for w, r in zip(widths, rows, strict=True)
    )
    if uses_gram(m, n, method=method, dtype=torch.float32):
        assert total > whole  # the m x m iteration on every shard
    else:
        assert total == whole


def test_bad_arguments_raise_named_errors() -> None:
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="Invalid dim=2"):
        orthogonalize_shard(x, dim=2, size=6, reduce=lambda t: t)
    with pytest.raises(ValueError, match="Invalid size=3"):
        orthogonalize_shard(x, dim=1, size=3, reduce=lambda t: t)
    with pytest.raises(ValueError, match="Invalid method="):
        orthogonalize_shard(x, dim=1, size=6, reduce=lambda t: t, method="svd")
    with pytest.raises(ValueError, match="real floating-point"):
        orthogonalize_shard(x.int(), dim=1, size=6, reduce=lambda t: t)
