"""Single-process checks that the mesh scenarios' layouts are what they claim (no ranks launched).

torch's ``fake`` process group lets one process build a 4- or 8-rank mesh as any one rank would
(no collective runs). Each layout of :mod:`mesh_placements` must give the placements the scenarios
rely on (``_StridedShard`` under FSDP2 + TP, ``Shard(1)`` on rowwise TP and on experts' dim 1,
Replicate on the HSDP replica axis), and the cuts the exactness checks are about must really
happen: TP cuts the fused QKV inside a split block, some ranks hold empty shards, a matrix is
smaller than the mesh, an EP rank holds no expert. A torch release that lays these out
differently fails here first, with the placement named.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from mesh_placements import EXPECTED_PLACEMENTS, QKV_SPLIT, MeshNet, apply_placement, placements_of
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

LAYOUTS = [(4, "hsdp"), (4, "fsdp_tp"), (4, "tp"), (4, "ep"), (4, "ep_fsdp"), (8, "hsdp_tp"), (8, "ep_tp")]


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rows_held(p: DTensor, dim: int = 0) -> list[int]:
    """The global indices along ``dim`` of ``p`` this rank holds (computed locally, no communication)."""
    shape = [1] * p.dim()
    shape[dim] = p.shape[dim]
    index = torch.arange(p.shape[dim], dtype=torch.float32).view(shape).expand(p.shape).contiguous()
    # A fresh mesh of the same ranks: sub-meshes torch sliced under an earlier fake group remember that rank.
    mesh = DeviceMesh("cpu", p.device_mesh.mesh, mesh_dim_names=p.device_mesh.mesh_dim_names)
    local = distribute_tensor(index, mesh, p.placements, src_data_rank=None).to_local()
    return sorted({int(v) for v in local.reshape(-1).tolist()}) if local.numel() else []


@pytest.mark.parametrize(("world_size", "layout"), LAYOUTS, ids=[f"W{w}-{name}" for w, name in LAYOUTS])
def test_layouts_have_the_placements_the_scenarios_rely_on(world_size: int, layout: str) -> None:
    with fake_rank(world_size - 1, world_size):
        model = apply_placement(MeshNet(), layout, world_size)
        found = placements_of(model)
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not plain, f"{layout}: params left plain tensors: {plain}"
    for name, expected in EXPECTED_PLACEMENTS[layout].items():
        assert found[name] == expected, f"{layout} {name}: torch gives {found[name]}, the scenarios expect {expected}"


def _held(layout: str, world_size: int) -> dict[int, dict[str, list[int]]]:
    """For each rank: the rows (dim 0 indices) it holds of every param."""
    out = {}
    for rank in range(world_size):
        with fake_rank(rank, world_size):
            model = apply_placement(MeshNet(), layout, world_size)
            out[rank] = {n: _rows_held(p) for n, p in model.named_parameters()}
    return out


def test_fsdp2_tp_cuts_the_fused_qkv_inside_a_block_and_leaves_empty_shards() -> None:
    held = _held("fsdp_tp", 4)
    boundary = QKV_SPLIT[0]
    qkv = [held[r]["attn.qkv.weight"] for r in range(4)]
    assert any(min(rows) < boundary <= max(rows) for rows in qkv if rows), f"no rank straddles row {boundary}: {qkv}"
    assert sorted(r for rows in qkv for r in rows) == list(range(12)), qkv
    assert sum(not held[r]["mlp.tiny.weight"] for r in range(4)) == 3, "the 1-row matrix must sit on one rank"
    assert len({len(held[r]["mlp.up.weight"]) for r in range(4)}) > 1, "7 rows must split unevenly"


def test_tp_alone_and_ep_leave_ranks_empty() -> None:
    tp = _held("tp", 4)
    assert [len(tp[r]["late.weight"]) for r in range(4)] == [2, 2, 1, 0]
    ep = _held("ep", 4)
    assert [ep[r]["experts.w_one"] for r in range(4)] == [[0], [0], [], []], "one expert: the second EP rank holds none"
    assert [ep[r]["experts.w_uneven"] for r in range(4)] == [[0, 1], [0, 1], [2], [2]]


NAMES = {
    "fsdp": "fsdp2",
    "hsdp": "hsdp",
    "fsdp_tp": "fsdp2+tp",
    "tp": "tp",
    "tp_plain": "tp",
    "ep": "ep+fsdp2",
    "ep_fsdp": "ep+fsdp2",
    "pp0": "fsdp2",
    "hsdp_tp": "hsdp+tp",
    "ep_tp": "ep+fsdp2+tp",
}


@pytest.mark.parametrize("layout", list(NAMES))
def test_the_strategy_is_named_after_the_meshes(layout: str) -> None:
    """DTensorStrategy.name says the parallelism (it said "fsdp2" for TP, EP and HSDP too)."""
    from muonkit.distributed.parallelism import parallelism_name

    world_size = 8 if layout in ("hsdp_tp", "ep_tp") else 4
    with fake_rank(world_size - 1, world_size):
        model = apply_placement(MeshNet(), layout, world_size)
        meshes = list(dict.fromkeys(p.device_mesh for p in model.parameters() if isinstance(p, DTensor)))
    assert parallelism_name(meshes) == NAMES[layout]
