"""Where every part of a DTensor lives, on any device mesh: the DTensor reader's pure half.

A DTensor of global shape ``S`` on a mesh of shape ``M`` with one placement per mesh dim stores
on the rank at mesh coordinate ``c`` a sub-array of the whole tensor. Tensor dims are
independent: dim ``d``'s indices on that rank are what is left of ``arange(S[d])`` after every
mesh dim ``i`` that shards ``d`` (``Shard(d)``, or ``_StridedShard(d, split_factor=f)`` as
``fully_shard`` produces over a tensor-parallel param) has split it into ``M[i]`` parts and kept
part ``c[i]``, mesh dims in order; ``Replicate()`` keeps all. So the rank holds the
:class:`~muonkit.distributed.pieces.Box` whose runs are those indices, in its local storage
order. :func:`dim_runs` computes them with torch's own split of each placement (uneven
``torch.chunk`` sizes, empty trailing shards and strided row sets included), so they are right
whatever torch's rule is; the DTensor suite checks every rank's ``to_local()`` against them.

From the boxes, :func:`tensor_jobs` cuts a Muon param into the planner's
:class:`~muonkit.distributed.pieces.Job`\\ s: one per tensor (matrix, transposed, flatten, split
blocks: the owner assembles the whole, so any cut of the rows is exact), one per expert matrix of
an ``experts`` stack (each expert's pieces: the rank boxes that contain it, cut to that expert).
Replicated copies are all listed; the planner sends one.

:func:`mesh_group` finds the one process group that spans every rank of the params' meshes.

Example: rows of an (8, 4) matrix under FSDP2 + TP (``parallelize_module`` ``ColwiseParallel`` on
"tp", then ``fully_shard`` on "dp", a 2x2 mesh ``[[0, 1], [2, 3]]``)::

    >>> from torch.distributed.tensor import Shard
    >>> from torch.distributed.tensor.placement_types import _StridedShard
    >>> boxes = mesh_boxes((8, 4), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2))
    >>> [boxes[c].runs[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from muonkit.distributed.pieces import Box, Expert, Job, Piece, Runs
from muonkit.functional.matrices import MatrixLayout

__all__ = ["SUPPORTED", "MeshGroup", "check_placements", "dim_runs", "mesh_boxes", "mesh_group", "rank_boxes", "tensor_jobs"]

SUPPORTED = "Shard(d), _StridedShard(d, split_factor=f) (FSDP2 over tensor parallel) and Replicate() on any mesh dim"

Split = tuple[Placement, int, int]
"""One mesh dim's cut of a tensor dim: ``(placement on dim 0, mesh dim size, coordinate)``."""


def check_placements(shape: Sequence[int], placements: Sequence[Placement], *, shard_order: Any = None) -> None:
    """Raise ``ValueError`` unless every placement is one :func:`mesh_boxes` reads.

    ``shard_order``: the DTensor spec's explicit order of the shardings of one tensor dim over
    several mesh dims, when it is not the default left-to-right one (not read).
    """
    for i, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard | _StridedShard):
            raise ValueError(
                f"Unsupported DTensor placement {p!r} on mesh dim {i} of a param of shape {tuple(shape)} "
                f"(placements {tuple(placements)}): HybridMuon reads {SUPPORTED}"
                + (
                    "; a Partial param holds unreduced values, redistribute it to Replicate() or Shard()"
                    if p.is_partial()
                    else ""
                )
            )
        if not -len(shape) <= p.dim < len(shape):
            raise ValueError(
                f"Invalid DTensor placement {p!r} on mesh dim {i}: a param of shape {tuple(shape)} has no dim {p.dim}"
            )
    if shard_order is not None and any(isinstance(p, _StridedShard) for p in placements):
        return
    if shard_order is not None and tuple(shard_order) != _default_order(shape, placements):
        raise ValueError(
            f"Unsupported DTensor shard order {tuple(shard_order)} of a param of shape {tuple(shape)} with placements "
            f"{tuple(placements)}: HybridMuon reads shardings applied in mesh dim order (the default, or as "
            f"_StridedShard encodes them), with {SUPPORTED}"
        )


def _default_order(shape: Sequence[int], placements: Sequence[Placement]) -> tuple[Any, ...]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    del shape
    return tuple(DTensorSpec.compute_default_shard_order(tuple(placements)))


@functools.lru_cache(maxsize=65536)
def dim_runs(size: int, splits: tuple[Split, ...]) -> Runs:
    """The runs of ``arange(size)`` left after each split in turn, in storage order.

    ``splits``: the cuts of this tensor dim by the mesh dims that shard it, in mesh dim order,
    each ``(Shard(0) or _StridedShard(0, split_factor=f), mesh dim size, coordinate)``.

    >>> dim_runs(5, ((Shard(0), 4, 2),))   # torch.chunk(arange(5), 4): [0, 1], [2, 3], [4], []
    ((4, 5),)
    """
    index = torch.arange(size)
    for placement, parts, coordinate in splits:
        index = placement._split_tensor(index, parts, with_padding=False, contiguous=False)[0][coordinate]
    return _runs(index.tolist())


def _runs(index: list[int]) -> Runs:
    runs: list[tuple[int, int]] = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return tuple(runs)


@functools.lru_cache(maxsize=4096)
def mesh_boxes(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> dict[tuple[int, ...], Box]:
    """The :class:`Box` held at each mesh coordinate by a DTensor of global ``shape``.

    ``placements``: one per mesh dim (checked by :func:`check_placements`).
    """
    check_placements(shape, placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements {placements} for a {len(mesh_shape)}-D mesh {mesh_shape}")
    ndim = len(shape)
    cuts: list[list[tuple[int, Placement]]] = [[] for _ in shape]  # per tensor dim: (mesh dim, placement on dim 0)
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            cuts[p.dim % ndim].append((i, _StridedShard(0, split_factor=p.split_factor)))
        elif isinstance(p, Shard):
            cuts[p.dim % ndim].append((i, Shard(0)))
    boxes = {}
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        runs = (
            dim_runs(size, tuple((p, mesh_shape[i], coordinate[i]) for i, p in dim_cuts))
            for size, dim_cuts in zip(shape, cuts, strict=True)
        )
        boxes[coordinate] = Box(tuple(runs))
    return boxes


def rank_boxes(shape: Sequence[int], placements: Sequence[Placement], ranks: torch.Tensor) -> list[tuple[int, Box]]:
    """``(rank, box)`` for every rank of the mesh, in rank order.

    ``ranks``: a mesh-shaped integer tensor, the process group rank at each mesh coordinate.
    """
    boxes = mesh_boxes(tuple(int(n) for n in shape), tuple(placements), tuple(ranks.shape))
    return sorted((int(ranks[c]), box) for c, box in boxes.items())


def tensor_jobs(
    tensor: int, shape: Sequence[int], layout: MatrixLayout, holders: Sequence[tuple[int, Box]]
) -> list[Job]:
    """The planner's jobs for one Muon param whose ranks hold ``holders`` (``(rank, box)``).

    One job for the whole tensor, or, for the ``experts`` layout, one per expert matrix (its
    pieces: where each holder stores it, ``Expert(k)``: the k-th matrix of its local stack).
    Empty pieces are left out; a param with no elements has no job.
    """
    shape = tuple(int(n) for n in shape)
    if not math.prod(shape):
        return []
    if layout.resolved(len(shape)) != "experts":
        held = tuple(Piece(rank, box) for rank, box in holders if box.numel)
        return [Job(tensor, shape, layout, held)]
    matrix = MatrixLayout("matrix", layout.split_sizes)
    lead = shape[:-2]
    experts: list[list[Piece]] = [[] for _ in range(math.prod(lead))]
    for rank, box in holders:
        if not box.numel:
            continue
        region = Box(box.runs[-2:])
        held_lead = [[i for a, b in runs for i in range(a, b)] for runs in box.runs[:-2]]
        for k, index in enumerate(itertools.product(*held_lead)):  # local stack order
            experts[_flat(index, lead)].append(Piece(rank, region, Expert(k)))
    return [Job(tensor, shape[-2:], matrix, tuple(held)) for held in experts]


def _flat(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


@dataclass(frozen=True)
class MeshGroup:
    """One process group over every rank of some device meshes, and each mesh's ranks in it."""

    group: Any
    ranks: dict[DeviceMesh, torch.Tensor]
    """Per mesh: a mesh-shaped tensor, the group rank at each mesh coordinate."""


def mesh_group(meshes: Sequence[DeviceMesh], *, process_group: Any = None) -> MeshGroup:
    """The one process group spanning every rank of ``meshes``, which must span the same ranks.

    In order of preference: ``process_group`` when given; the group of a 1-D mesh among them;
    the default group when the meshes span every rank; else the first N-D mesh flattened
    (``DeviceMesh._flatten``: every rank must call this, each with its own meshes, as when each
    pipeline stage steps its params on its own sub-mesh of one named root mesh).
    """
    meshes = list(dict.fromkeys(meshes))
    spans = [frozenset(int(g) for g in mesh.mesh.reshape(-1).tolist()) for mesh in meshes]
    if len(set(spans)) > 1:
        listed = "; ".join(f"{mesh!r}: ranks {sorted(s)}" for mesh, s in zip(meshes, spans, strict=True))
        raise ValueError(
            f"HybridMuon got DTensor params on device meshes that span different ranks ({listed}); each matrix "
            "is orthogonalized once over one group, so all params of one optimizer must live on meshes over the "
            "same ranks (build one optimizer per pipeline stage, over that stage's params)"
        )
    span = spans[0]
    group = process_group if process_group is not None else _spanning_group(meshes, span)
    members = dist.get_process_group_ranks(group)
    if frozenset(members) != span:
        raise ValueError(
            f"process_group= spans ranks {sorted(members)}; the DTensor params' device meshes span {sorted(span)}: "
            "leave process_group=None with DTensor params, or pass a group over exactly the mesh's ranks"
        )
    ranks = {
        mesh: torch.tensor([dist.get_group_rank(group, g) for g in mesh.mesh.reshape(-1).tolist()]).view(mesh.shape)
        for mesh in meshes
    }
    return MeshGroup(group, ranks)


def _spanning_group(meshes: list[DeviceMesh], span: frozenset[int]) -> Any:
    for mesh in meshes:
        if mesh.ndim == 1:
            return mesh.get_group()
    if len(span) == dist.get_world_size():
        return dist.group.WORLD
    mesh = meshes[0]
    if not mesh.mesh_dim_names:
        raise ValueError(
            f"HybridMuon needs one process group over the {len(span)} ranks of the device mesh {mesh!r} of its "
            "DTensor params, and cannot flatten a mesh without names: build it with init_device_mesh(..., "
            "mesh_dim_names=...) or pass process_group= (a group over exactly those ranks)"
        )
    return mesh._flatten().get_group()
