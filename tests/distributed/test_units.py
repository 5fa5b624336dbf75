"""Single-process tests of the pure pieces of the distributed strategies (no ranks launched)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from common import dim0_sizes

import muonkit
from muonkit.distributed import SingleDeviceStrategy, select_strategy
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions


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


@pytest.mark.parametrize(
    ("meshes", "name"),
    [
        ([((4,), None)], "fsdp2"),
        ([((2, 2), None)], "hsdp"),  # fully_shard reads an unnamed 2-D mesh as (replicate, shard)
        ([((1,), None)], "fsdp2"),  # one rank: no parallelism to name
        ([((1, 4), ("dp_replicate", "dp_shard_cp"))], "fsdp2"),
        ([((2, 4), ("data_parallel", "tensor_parallel"))], "fsdp2+tp"),
        ([((4, 1), ("data_parallel", "tensor_parallel"))], "fsdp2"),
        ([((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))], "hsdp+tp"),
        ([((4,), ("tp",))], "tp"),
        ([((2,), ("ep",)), ((2,), ("dp",))], "ep+fsdp2"),
        ([((2, 2), ("dp", "cp"))], "fsdp2+cp"),
    ],
)
def test_parallelism_name_from_the_mesh_dims(meshes: list[tuple[tuple[int, ...], Any]], name: str) -> None:
    from muonkit.distributed.parallelism import parallelism_name

    stand_ins = [SimpleNamespace(shape=shape, mesh_dim_names=names) for shape, names in meshes]
    assert parallelism_name(stand_ins) == name
