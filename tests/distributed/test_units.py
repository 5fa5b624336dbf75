"""Single-process tests of the pure pieces of the distributed strategies (no ranks launched)."""

from __future__ import annotations

import itertools

import pytest
import torch

import muonkit
from muonkit.distributed import SingleDeviceStrategy, select_strategy
from muonkit.distributed.dtensor import block_scale, dim0_sizes
from muonkit.distributed.ownership import assign_owners
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions


def _makespan(costs: list[float], owners: list[int], world_size: int) -> float:
    loads = [0.0] * world_size
    for c, o in zip(costs, owners, strict=True):
        loads[o] += c
    return max(loads)


def test_assign_owners_example_and_determinism() -> None:
    assert assign_owners([9.0, 4.0, 4.0, 1.0], world_size=2) == [0, 1, 1, 1]
    costs = [3.0, 3.0, 3.0, 1.0, 7.0, 2.0]
    assert assign_owners(costs, 3) == assign_owners(list(costs), 3)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_assign_owners_within_graham_bound_of_the_optimum(world_size: int) -> None:
    g = torch.Generator().manual_seed(world_size)
    for _ in range(20):
        costs = [float(c) for c in torch.randint(1, 50, (7,), generator=g)]
        best = min(_makespan(costs, list(o), world_size) for o in itertools.product(range(world_size), repeat=7))
        got = _makespan(costs, assign_owners(costs, world_size), world_size)
        assert got <= (4 / 3 - 1 / (3 * world_size)) * best + 1e-9


def test_assign_owners_counts_existing_loads_and_validates() -> None:
    assert assign_owners([1.0, 1.0], 2, loads=[5.0, 0.0]) == [1, 1]
    with pytest.raises(ValueError, match="Invalid world_size=0"):
        assign_owners([1.0], 0)
    with pytest.raises(ValueError, match="must all be >= 0"):
        assign_owners([-1.0], 2)
    with pytest.raises(ValueError, match="must have world_size=2 entries"):
        assign_owners([1.0], 2, loads=[0.0])


@pytest.mark.parametrize(("n", "world_size"), [(n, w) for n in range(0, 12) for w in (1, 2, 3, 4, 8)])
def test_dim0_sizes_follow_torch_chunk(n: int, world_size: int) -> None:
    chunks = [len(c) for c in torch.arange(n).chunk(world_size)] if n else []
    assert dim0_sizes(n, world_size) == chunks + [0] * (world_size - len(chunks))


CASES = [
    ("matrix", (12, 6), None),
    ("matrix", (12, 6), (4, 8)),
    ("transposed", (6, 12), (4, 8)),
    ("experts", (3, 12, 5), (4, 8)),
    ("flatten", (12, 2, 3), (5, 7)),
    ("auto", (3, 12, 5), None),
]


@pytest.mark.parametrize(("kind", "shape", "split"), CASES)
@pytest.mark.parametrize("adjust_lr", ["keller", "spectral", "match_adamw"])
def test_block_scale_matches_scaling_whole_blocks(kind: str, shape: tuple, split: tuple | None, adjust_lr: str) -> None:
    layout = MatrixLayout(kind, split)  # type: ignore[arg-type]
    blocks = layout.blocks(shape)
    whole = layout.from_matrices(
        [
            torch.full((b.count, b.rows, b.cols), lr_scale(adjust_lr, b.rows, b.cols), dtype=torch.float64)
            for b in blocks
        ],
        shape,
    )
    for start, stop in [(0, shape[0]), (1, shape[0] - 1), (2, 2)]:
        scale = block_scale(layout, shape, adjust_lr, start=start, stop=stop, dtype=torch.float64)
        got = torch.ones(stop - start, *shape[1:], dtype=torch.float64) * scale
        assert torch.equal(got, whole[start:stop])


def test_select_strategy_without_torch_distributed() -> None:
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert isinstance(select_strategy(params), SingleDeviceStrategy)
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        muonkit.HybridMuon(params, process_group=object())


@pytest.mark.parametrize("method", ["newton_schulz", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kind", "shape", "split"), CASES)
def test_orthogonalization_does_not_depend_on_how_a_matrix_is_stored(
    kind: str, shape: tuple, split: tuple | None, dtype: torch.dtype, method: str
) -> None:
    """One device orthogonalizes views of the updates (transposed, split, tall ones seen short
    side first); a DDP owner orthogonalizes stacked copies of the same matrices. The same values
    in the same batch must give bit-identical results (before the normalization reduced a
    contiguous copy, its Frobenius norm followed the memory order and could differ by an ulp)."""
    layout = MatrixLayout(kind, split)  # type: ignore[arg-type]
    options = NSOptions(dtype=dtype, method=method)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        t = torch.randn(shape, generator=g) * 10.0 ** (trial % 5 - 2)
        for views in layout.to_matrices(t):
            rows, cols = views.shape[1:]
            stacked = torch.stack(list(views))
            got = options.orthogonalize_batches([views], rows=rows, cols=cols)
            expected = options.orthogonalize_batches([stacked], rows=rows, cols=cols)
            assert torch.equal(got, expected), f"trial {trial}: {(got - expected).abs().max().item():.3e}"
