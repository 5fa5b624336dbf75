"""Where every part of a DTensor lives, on any device mesh: what the DTensor reader reads.

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

:func:`mesh_group` finds the one process group that spans every rank of the params' meshes (the
only function here that touches torch.distributed: it may create that group, nothing else
communicates); the rest are pure functions of shapes, placements and mesh shapes.

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

from muonkit.distributed.pieces import At, Box, Expert, Holders, Job, Piece, Pieces, Runs
from muonkit.functional.matrices import MatrixLayout

__all__ = [
    "SUPPORTED",
    "MeshGroup",
    "check_placements",
    "clear_caches",
    "dim_runs",
    "mesh_boxes",
    "mesh_group",
    "placement_caches",
    "rank_boxes",
    "tensor_jobs",
]

SUPPORTED = "Shard(d), _StridedShard(d, split_factor=f) (FSDP2 over tensor parallel) and Replicate() on any mesh dim"

Split = tuple[Shard | _StridedShard, int, int]
"""One mesh dim's cut of a tensor dim: ``(placement on dim 0, mesh dim size, coordinate)``."""


def check_placements(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], *, shard_order: Any = None
) -> None:
    """Raise ``ValueError`` unless :func:`mesh_boxes` reads these placements.

    Read: ``Replicate()``, ``Shard(d)``, and ``_StridedShard(d, split_factor=f)`` where ``f``
    tells in which order the mesh dims shard ``d`` (torch's rule, as its redistribution decodes
    it: ``f`` is the product of the sizes of the mesh dims that shard ``d`` before it).
    ``shard_order``: the DTensor spec's explicit order of several shardings of one tensor dim,
    read only when it is the default (mesh dim order).
    """
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements {tuple(placements)} for a {len(mesh_shape)}-D mesh")
    what = f"a param of shape {tuple(shape)} with placements {tuple(placements)}"
    for i, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard | _StridedShard):
            hint = "; a Partial param holds unreduced values: redistribute it first" if p.is_partial() else ""
            raise ValueError(
                f"Unsupported DTensor placement {p!r} on mesh dim {i} of {what}: HybridMuon reads {SUPPORTED}{hint}"
            )
        if not -len(shape) <= p.dim < len(shape):
            raise ValueError(f"Invalid DTensor placement {p!r} on mesh dim {i}: {what} has no dim {p.dim}")
    for dim in range(len(shape)):
        if _shard_order_of(dim, len(shape), placements, mesh_shape) is None:
            raise ValueError(
                f"Unsupported DTensor placements of {what} on a mesh of shape {tuple(mesh_shape)}: their "
                f"split factors give no order in which the mesh dims shard dim {dim} (torch cannot gather it "
                f"either); HybridMuon reads {SUPPORTED}"
            )
    if shard_order is not None and tuple(shard_order) != _default_order(placements):
        raise ValueError(
            f"Unsupported DTensor shard order {tuple(shard_order)} of {what}: HybridMuon reads shardings applied "
            f"in mesh dim order (the default, or as _StridedShard encodes them), with {SUPPORTED}"
        )


def _shard_order_of(
    dim: int, ndim: int, placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> list[int] | None:
    """The mesh dims that shard tensor dim ``dim``, in the order they cut it; None: no such order.

    Right to left, a ``Shard`` (split factor 1) or ``_StridedShard`` with split factor ``f``
    goes where the mesh dims already placed before it multiply to ``f``
    (``DTensorSpec._maybe_convert_StridedShard_to_shard_order``'s rule).
    """
    order: list[int] = []
    for i in reversed(range(len(placements))):
        p = placements[i]
        if not isinstance(p, Shard | _StridedShard) or p.dim % ndim != dim:
            continue
        factor = int(p.split_factor) if isinstance(p, _StridedShard) else 1
        sizes = [math.prod(mesh_shape[j] for j in order[:k]) for k in range(len(order) + 1)]
        if factor not in sizes:
            return None
        order.insert(sizes.index(factor), i)
    return order


def _default_order(placements: Sequence[Placement]) -> tuple[Any, ...]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return tuple(DTensorSpec.compute_default_shard_order(tuple(placements)))


def dim_runs(size: int, splits: tuple[Split, ...]) -> Runs:
    """The runs of ``arange(size)`` left after each split in turn, in storage order.

    ``splits``: the cuts of this tensor dim by the mesh dims that shard it, in mesh dim order,
    each ``(Shard(0) or _StridedShard(0, split_factor=f), mesh dim size, coordinate)``.

    >>> dim_runs(5, ((Shard(0), 4, 2),))   # torch.chunk(arange(5), 4): [0, 1], [2, 3], [4], []
    ((4, 5),)
    """
    table = _split_table(size, tuple((placement, parts) for placement, parts, _ in splits))
    return table[tuple(coordinate for _, _, coordinate in splits)]


@functools.lru_cache(maxsize=4096)
def _split_table(size: int, cuts: tuple[tuple[Shard | _StridedShard, int], ...]) -> dict[tuple[int, ...], Runs]:
    """:func:`dim_runs` of every coordinate of the cutting mesh dims at once.

    Each index set is split once for all its parts (torch's split, as one coordinate's would be),
    so a dim cut W ways costs O(size + W), not W splits of the whole.
    """
    level: dict[tuple[int, ...], torch.Tensor] = {(): torch.arange(size)}
    for placement, parts in cuts:
        split: dict[tuple[int, ...], torch.Tensor] = {}
        for coordinate, index in level.items():
            chunks = placement._split_tensor(index, parts, with_padding=False, contiguous=False)[0]
            for c in range(parts):
                split[(*coordinate, c)] = chunks[c]
        level = split
    return {coordinate: _runs(index.tolist()) for coordinate, index in level.items()}


def placement_caches() -> tuple[Any, ...]:
    """The caches of placements computed so far (boxes, splits, shared holders), kept for the process."""
    return (_split_table, mesh_boxes, _rank_boxes, _table)


def clear_caches() -> None:
    """Forget every placement computed so far: for measuring a cold start."""
    for cached in placement_caches():
        cached.cache_clear()


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
    check_placements(shape, placements, mesh_shape)
    ndim = len(shape)
    cuts: list[list[tuple[int, Shard | _StridedShard]]] = [
        [] for _ in shape
    ]  # per tensor dim: (mesh dim, placement on dim 0)
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


def rank_boxes(
    shape: Sequence[int], placements: Sequence[Placement], ranks: torch.Tensor
) -> tuple[tuple[int, Box], ...]:
    """``(rank, box)`` for every rank of the mesh, in rank order (the same object for the same placements).

    ``ranks``: a mesh-shaped integer tensor, the process group rank at each mesh coordinate.
    """
    flat = tuple(int(r) for r in ranks.reshape(-1).tolist())
    return _rank_boxes(tuple(int(n) for n in shape), tuple(placements), tuple(ranks.shape), flat)


@functools.lru_cache(maxsize=4096)
def _rank_boxes(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], ranks: tuple[int, ...]
) -> tuple[tuple[int, Box], ...]:
    boxes = mesh_boxes(shape, placements, mesh_shape)
    return tuple(sorted(zip(ranks, boxes.values(), strict=True)))  # both in row-major order


def tensor_jobs(
    tensor: int, shape: Sequence[int], layout: MatrixLayout, holders: Sequence[tuple[int, Box]]
) -> list[Job]:
    """The planner's jobs for one Muon param whose ranks hold ``holders`` (``(rank, box)``).

    One job per matrix, so that the planner balances matrices, not tensors: each expert of an
    ``experts`` stack (its pieces: where each holder stores it, ``Expert(k)``: the k-th matrix of
    its local stack), each ``split_sizes`` block (rows ``[a, b)``: a holder's rows of it lie
    contiguously in its local tensor, at ``At(offset)``), else the whole tensor; a transposed
    tensor with ``split_sizes`` is one job (its blocks are columns of the storage), and so is a
    column split (``split_along="cols"``: its blocks are columns of the matrix), unless its holders
    hold it in column ranges on the blocks' edges (:func:`_column_jobs`: one job per range). Empty pieces
    are left out; a param with no elements has no job.

    Whole tensors and experts get :class:`~muonkit.distributed.pieces.Pieces` over one
    :class:`~muonkit.distributed.pieces.Holders` per ``holders`` object (per group of ranks holding
    the same experts), shared by every param laid out alike: O(jobs + holders), not one object
    per job and holder.
    """
    shape = tuple(int(n) for n in shape)
    if not math.prod(shape):
        return []
    kind = layout.resolved(len(shape))
    if kind == "matrix" and layout.splits_cols and (by_columns := _column_jobs(tensor, shape, layout, holders)):
        return by_columns
    table = _table(_ById(holders))
    if kind == "transposed" or layout.splits_cols or (kind != "experts" and layout.split_sizes is None):
        return [Job(tensor, shape, layout, Pieces(table.whole))]
    if kind == "experts":
        units = [(shape[-2:], pieces) for pieces in table.experts(shape)]
        base = MatrixLayout("matrix")
    else:
        units = [(shape, Pieces(table.whole))]
        base = MatrixLayout(kind)
    if layout.split_sizes is None:
        return [Job(tensor, whole, base, pieces) for whole, pieces in units]
    jobs = []
    for whole, pieces in units:
        start = 0
        for size in layout.split_sizes:
            block = (_rows(piece, start, start + size) for piece in pieces)
            jobs.append(Job(tensor, (size, *whole[1:]), base, tuple(p for p in block if p is not None)))
            start += size
    return jobs


def _column_jobs(
    tensor: int, shape: tuple[int, ...], layout: MatrixLayout, holders: Sequence[tuple[int, Box]]
) -> list[Job] | None:
    """A column-split matrix (per-head output projection) held in column ranges that fall on its
    blocks' edges (tensor parallelism's row-wise ``Shard(1)``, each rank whole heads): one job per
    column range, its pieces each holder's whole local tensor (rows cut any way), so a range held by
    one rank is orthogonalized there and moves nothing. None where the ranges are not such a
    partition of the columns (every holder holds all columns, or a head is cut): one job then."""
    assert layout.split_sizes is not None
    edges = {0, *itertools.accumulate(layout.split_sizes)}
    ranges: dict[tuple[int, int], list[Piece]] = {}
    for rank, box in holders:
        if not box.numel:
            continue
        cols = box.runs[1]
        if len(cols) != 1 or cols[0][0] not in edges or cols[0][1] not in edges:
            return None
        a, b = cols[0]
        ranges.setdefault((a, b), []).append(Piece(rank, Box((box.runs[0], ((0, b - a),)))))
    spans = sorted(ranges)
    if len(spans) < 2 or [a for a, _ in spans] != [0, *(b for _, b in spans[:-1])] or spans[-1][1] != shape[1]:
        return None
    jobs = []
    for a, b in spans:
        ends = itertools.accumulate(layout.split_sizes)
        sizes = tuple(s for s, end in zip(layout.split_sizes, ends, strict=True) if a < end <= b)
        jobs.append(Job(tensor, (shape[0], b - a), MatrixLayout("matrix", sizes, "cols"), tuple(ranges[a, b])))
    return jobs


class _ById:
    """A key that is one object itself (its identity), kept alive while the key is."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.value is self.value


@functools.lru_cache(maxsize=1024)
def _table(key: _ById) -> _HolderTable:
    return _HolderTable(tuple(key.value))


class _HolderTable:
    """What every rank holds of one tensor, as the planner's shared :class:`Holders`, built once."""

    def __init__(self, holders: tuple[tuple[int, Box], ...]) -> None:
        self.holders = tuple((rank, box) for rank, box in holders if box.numel)  # empty pieces left out
        self._experts: dict[tuple[int, ...], list[Sequence[Piece]]] = {}

    @functools.cached_property
    def whole(self) -> Holders:
        return Holders(tuple(rank for rank, _ in self.holders), tuple(box for _, box in self.holders))

    def experts(self, shape: tuple[int, ...]) -> list[Sequence[Piece]]:
        """The pieces of each expert matrix of a stack of ``shape``, in expert order."""
        if shape not in self._experts:
            self._experts[shape] = _experts(shape, self.holders)
        return self._experts[shape]


def _experts(shape: tuple[int, ...], holders: Sequence[tuple[int, Box]]) -> list[Sequence[Piece]]:
    """Each expert matrix's pieces (``Expert(k)``: matrix k of the holder's local stack), in rank order.

    The ranks holding the same experts (the same runs of the leading dims) form one group: one
    :class:`Holders` (their ranks and matrix regions) for all its experts, expert ``k`` of the
    group's local stack at ``Expert(k)`` on each of them.
    """
    lead = shape[:-2]
    groups: dict[tuple[Runs, ...], list[tuple[int, Box]]] = {}
    for rank, box in holders:
        groups.setdefault(box.runs[:-2], []).append((rank, Box(box.runs[-2:])))
    experts: list[list[Sequence[Piece]]] = [[] for _ in range(math.prod(lead))]
    for runs, members in groups.items():
        shared = Holders(tuple(rank for rank, _ in members), tuple(region for _, region in members))
        index = [[i for a, b in dim for i in range(a, b)] for dim in runs]
        for k, position in enumerate(itertools.product(*index)):  # local stack order
            experts[_flat(position, lead)].append(Pieces(shared, Expert(k)))
    order = {rank: i for i, (rank, _) in enumerate(holders)}
    return [parts[0] if len(parts) == 1 else _merged(parts, order) for parts in experts]


def _merged(parts: list[Sequence[Piece]], order: dict[int, int]) -> tuple[Piece, ...]:
    """An expert held by several groups or none (not a placement torch makes): its pieces in holder order."""
    return tuple(sorted((p for pieces in parts for p in pieces), key=lambda p: order[p.rank]))


def _rows(piece: Piece, start: int, stop: int) -> Piece | None:
    """The part of ``piece`` in rows ``[start, stop)`` of its job, as a piece of the block (None: empty).

    Its rows lie contiguously in the local tensor (runs are increasing, as every torch split
    leaves them), so the part is a flat range of it: ``At(offset)``.
    """
    region = piece.region
    assert isinstance(region, Box) and not isinstance(piece.where, At), piece
    runs, inner = region.runs[0], math.prod(region.shape[1:])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(runs)), f"rows not increasing: {runs}"
    kept: list[tuple[int, int]] = []
    first = local = 0
    for a, b in runs:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            first = first if kept else local + lo - a
            kept.append((lo - start, hi - start))
        local += b - a
    if not kept or not inner:
        return None
    matrix = 0 if piece.where is None else piece.where.index * region.numel  # Expert(k): k-th local matrix
    return Piece(piece.rank, Box((tuple(kept), *region.runs[1:])), At(matrix + first * inner))


def _flat(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


@dataclass(frozen=True)
class MeshGroup:
    """One process group over every rank of the params' device meshes, and where each mesh sits in it.

    A param on a mesh over fewer ranks than the others (a layer left out of tensor parallelism
    is ``fully_shard``-ed on the ``dp`` sub-mesh of a ``(dp, tp)`` mesh; dense layers on ``dp``
    beside experts on ``ep``) is read on the mesh that joins them, replicated over the dims it
    lacks: every rank there holds the same part as its ``dp`` coordinate says.
    """

    group: Any
    ranks: dict[DeviceMesh, torch.Tensor]
    """Per param mesh: the group rank at each coordinate of the mesh it is read on (its own dims first)."""
    dims: dict[DeviceMesh, tuple[int | None, ...]]
    """Per param mesh: for each dim of ``ranks[mesh]``, the mesh's own dim (None: a dim it lacks, replicated)."""

    def boxes(self, param: Any) -> tuple[tuple[int, Box], ...]:
        """``(group rank, box)`` of every rank for a DTensor ``param`` (see :func:`rank_boxes`)."""
        mesh, shape = param.device_mesh, tuple(param.shape)
        spec = param._spec
        order = None if getattr(spec, "use_strided_shard_as_shard_order", True) else spec.shard_order
        check_placements(shape, param.placements, mesh.shape, shard_order=order)
        placements = tuple(Replicate() if d is None else param.placements[d] for d in self.dims[mesh])
        return rank_boxes(shape, placements, self.ranks[mesh])


def mesh_group(meshes: Sequence[DeviceMesh], *, process_group: Any = None) -> MeshGroup:
    """The one process group spanning every rank of ``meshes``.

    The meshes must span the same ranks, or be sub-meshes of one named root mesh (then they are
    read on ``root[their dims]``, see :class:`MeshGroup`). The group, in order of preference:
    ``process_group`` when given; the group of a 1-D mesh over all those ranks; the default
    group when they are every rank; else the joined mesh flattened (``DeviceMesh._flatten``:
    every rank must call this, each with its own meshes, as when each pipeline stage steps its
    params on its own sub-mesh of one root mesh).
    """
    meshes = list(dict.fromkeys(meshes))
    joined, dims = _joined(meshes)
    span = _span(joined)
    group = process_group if process_group is not None else _spanning_group([*meshes, joined], span)
    members = dist.get_process_group_ranks(group)
    if frozenset(members) != span:
        raise ValueError(
            f"process_group= spans ranks {sorted(members)}; the DTensor params' device meshes span {sorted(span)}: "
            "leave process_group=None with DTensor params, or pass a group over exactly the mesh's ranks"
        )
    ranks: dict[DeviceMesh, torch.Tensor] = {}
    for mesh in meshes:
        on = mesh if dims[mesh] == tuple(range(mesh.ndim)) and _span(mesh) == span else joined
        order = [dist.get_group_rank(group, g) for g in on.mesh.reshape(-1).tolist()]
        on_ranks = torch.tensor(order).view(on.shape)
        if on is mesh:
            dims[mesh] = tuple(range(mesh.ndim))
        else:  # the mesh's own dims first, in its own order (placements nest in that order), then the others
            where = dims[mesh]
            own = sorted(d for d in where if d is not None)
            perm = [where.index(d) for d in own] + [i for i, d in enumerate(where) if d is None]
            on_ranks = on_ranks.permute(perm)
            dims[mesh] = (*own, *(None for d in where if d is None))
        ranks[mesh] = on_ranks
    return MeshGroup(group, ranks, dims)


def _span(mesh: DeviceMesh) -> frozenset[int]:
    return frozenset(int(g) for g in mesh.mesh.reshape(-1).tolist())


def _joined(meshes: list[DeviceMesh]) -> tuple[DeviceMesh, dict[DeviceMesh, tuple[int | None, ...]]]:
    """The mesh the params are read on, and each mesh's dims in it."""
    spans = [_span(mesh) for mesh in meshes]
    widest = max(range(len(meshes)), key=lambda i: (len(spans[i]), meshes[i].ndim))
    if len(set(spans)) == 1:
        return meshes[widest], {mesh: tuple(range(mesh.ndim)) for mesh in meshes}
    root = meshes[0]._get_root_mesh()
    names = root.mesh_dim_names or ()
    if all(m._get_root_mesh() is root and set(m.mesh_dim_names or ["?"]) <= set(names) for m in meshes):
        used = {n for m in meshes for n in m.mesh_dim_names or ()}
        joined_names = tuple(n for n in names if n in used)
        joined = root if joined_names == names else root[joined_names]
        dims = {m: _dims_in(m, joined_names) for m in meshes}
        return joined, dims
    listed = "; ".join(f"{mesh!r}: ranks {sorted(s)}" for mesh, s in zip(meshes, spans, strict=True))
    raise ValueError(
        f"HybridMuon got DTensor params on device meshes over different ranks ({listed}) that are not sub-meshes "
        "of one root mesh by dim name; each matrix is orthogonalized once over one group, so all params of one "
        "optimizer must live on meshes over the same ranks or on named sub-meshes of one root mesh (under pipeline "
        "parallelism: one optimizer per stage, over that stage's params)"
    )


def _dims_in(mesh: DeviceMesh, joined_names: tuple[str, ...]) -> tuple[int | None, ...]:
    own = list(mesh.mesh_dim_names or ())
    return tuple(own.index(n) if n in own else None for n in joined_names)


def _spanning_group(meshes: list[DeviceMesh], span: frozenset[int]) -> Any:
    for mesh in meshes:
        if mesh.ndim == 1 and _span(mesh) == span:
            return mesh.get_group()
    if len(span) == dist.get_world_size():
        return dist.group.WORLD
    mesh = meshes[-1]
    if not mesh.mesh_dim_names:
        raise ValueError(
            f"HybridMuon needs one process group over the {len(span)} ranks of the device mesh {mesh!r} of its "
            "DTensor params, and cannot flatten a mesh without names: build it with init_device_mesh(..., "
            "mesh_dim_names=...) or pass process_group= (a group over exactly those ranks)"
        )
    return mesh._flatten().get_group()


def block_state(param: Any, dtype: torch.dtype, blocks: int) -> Any:
    """A zero DTensor holding one value per block of at most ``blocks`` values along the last dim of
    ``param``'s local tensor (each local row cut from its start), laid out like ``param`` on its other dims.

    Where no placement shards the last dim, every rank's blocks are the whole tensor's: the global
    shape is ``(*shape[:-1], ceil(cols / blocks))`` with ``param``'s placements, and a checkpoint
    reshards it like any state. Where some do, each rank cuts its own blocks: one more dim per
    mesh dim that cuts the columns, ``(*shape[:-1], n_1, ..., n_m, k)`` (``n_j`` that mesh dim's
    size, in the order DTensor cuts the columns: mesh order, a ``_StridedShard`` within the plain
    shards' pieces), each sharded by its mesh dim, so
    each rank holds ``(*local_lead, 1, ..., 1, k)``; ``k = ceil(c / blocks)`` with ``c`` the most
    columns a rank holds (a rank holding fewer leaves its last values unused). The shape says how
    the columns were cut: a checkpoint holding such scales is read as saved only by a layout that
    cuts them the same way, and decoded with that cut by any other (never taken for other blocks).
    """
    from torch.distributed.tensor import DTensor

    local = param.to_local()
    shape = tuple(param.shape)
    if not shape:
        return DTensor.from_local(
            torch.zeros(1, dtype=dtype, device=local.device), param.device_mesh, param.placements, run_check=False
        )
    last = len(shape) - 1
    cuts = [
        (i, p) for i, p in enumerate(param.placements) if isinstance(p, Shard | _StridedShard) and p.dim in (last, -1)
    ]
    # the order DTensor cuts the columns in: mesh order, except that a _StridedShard (FSDP2's shard of
    # a dim tensor parallelism cut first: a bias of a column-wise layer) cuts within the others' pieces
    cut = [i for i, p in cuts if not isinstance(p, _StridedShard)] + [
        i for i, p in cuts if isinstance(p, _StridedShard)
    ]
    lead = tuple(local.shape[:-1])
    placements = list(param.placements)
    if cut:
        sizes = [param.device_mesh.size(i) for i in cut]
        most = shape[-1]
        for n in sizes:
            most = -(-most // n)
        count = -(-most // blocks)
        whole: tuple[int, ...] = (*shape[:-1], *sizes, count)
        for j, i in enumerate(cut):
            placements[i] = Shard(last + j)
        values = torch.zeros((*lead, *[1] * len(sizes), count), dtype=dtype, device=local.device)
    else:
        whole = (*shape[:-1], -(-shape[-1] // blocks))
        values = torch.zeros((*lead, -(-local.shape[-1] // blocks)), dtype=dtype, device=local.device)
    stride = tuple(math.prod(whole[i + 1 :]) for i in range(len(whole)))
    return DTensor.from_local(
        values, param.device_mesh, placements, run_check=False, shape=torch.Size(whole), stride=stride
    )
