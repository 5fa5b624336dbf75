"""Where the parts of a Muon tensor live across ranks: the vocabulary of the one planner.

Every distributed layout (DDP, FSDP2 / HSDP / tensor / expert parallel DTensors on any mesh,
DeepSpeed ZeRO flat partitions) is described to :mod:`muonkit.distributed.planner` the same way:

- a :class:`Job` is one unit of orthogonalization: a whole tensor (with its own
  :class:`~muonkit.functional.matrices.MatrixLayout`: split blocks, flatten, transposed) or one
  expert matrix of a stack. One rank, its *owner*, orthogonalizes it.
- a :class:`Piece` says that ``rank`` holds (or needs) the part ``region`` of a job's whole
  tensor, stored in its local tensor at ``where`` (a key the layout reader understands).
- a region is a :class:`Box` (index runs per dimension of the job's whole shape: row blocks of
  ``Shard(0)``, column blocks of ``Shard(1)``, strided row sets of ``_StridedShard``, their
  products on N-D meshes, the whole tensor for a replicated copy) or a :class:`Span` (a range of
  the job's flattened elements: a piece of a DeepSpeed ZeRO flat partition).

Regions read and write their part of a whole tensor as flat data in the holder's storage order,
so pieces travel as flat buffers and any layout reassembles exactly.

Example: a (6, 4) matrix sharded ``Shard(0)`` over 2 ranks::

    >>> Box.full((6, 4)).numel
    24
    >>> Box(((0, 3),), ((0, 4),)).shape        # rows 0-2 of all 4 columns: rank 0's part
    (3, 4)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from muonkit.functional.matrices import MatrixLayout

__all__ = ["At", "Box", "Expert", "Job", "Piece", "Region", "Span", "local_part"]

Runs = tuple[tuple[int, int], ...]
"""Index runs ``(start, stop)`` of one dimension, in the holder's storage order."""


@dataclass(frozen=True)
class Box:
    """The sub-array ``whole[runs_0 x runs_1 x ...]``: per dimension, index runs in storage order."""

    runs: tuple[Runs, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box(tuple(((0, n),) if n else () for n in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in runs) for runs in self.runs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def _blocks(self) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
        """Each product of runs: (whole slices, local slices) per dimension."""
        out: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = [([], [])]
        for runs in self.runs:
            step = []
            local = 0
            for a, b in runs:
                for whole, mine in out:
                    step.append(([*whole, (a, b)], [*mine, (local, local + b - a)]))
                local += b - a
            out = step
        return out

    def read(self, whole: Tensor) -> Tensor:
        """This region of ``whole`` as a new flat tensor, in storage order."""
        if all(len(r) == 1 for r in self.runs):
            return whole[tuple(slice(*r[0]) if r else slice(0, 0) for r in self.runs)].reshape(-1)
        out = whole.new_empty(self.shape)
        for src, dst in self._blocks():
            out[tuple(slice(*d) for d in dst)] = whole[tuple(slice(*s) for s in src)]
        return out.reshape(-1)

    def write(self, whole: Tensor, data: Tensor) -> None:
        """Copy flat ``data`` (storage order) into this region of ``whole``."""
        local = data.view(self.shape)
        for dst, src in self._blocks():
            whole[tuple(slice(*d) for d in dst)] = local[tuple(slice(*s) for s in src)]


@dataclass(frozen=True)
class Span:
    """Elements ``[start, stop)`` of the job's whole tensor, flattened (a ZeRO partition's piece)."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def read(self, whole: Tensor) -> Tensor:
        return whole.reshape(-1)[self.start : self.stop]

    def write(self, whole: Tensor, data: Tensor) -> None:
        whole.view(-1)[self.start : self.stop] = data


Region = Box | Span


@dataclass(frozen=True)
class Expert:
    """Where: matrix ``index`` of the local tensor's leading dims (``local.reshape(-1, rows, cols)[index]``)."""

    index: int


@dataclass(frozen=True)
class At:
    """Where: ``offset`` elements into the flattened local tensor (a ZeRO flat partition)."""

    offset: int


@dataclass(frozen=True)
class Piece:
    """``rank`` holds (or needs) ``region`` of a job, stored in its local tensor at ``where``."""

    rank: int
    region: Region
    where: Expert | At | None = None
    """Where the region lies in the rank's local tensor: ``None`` the whole local tensor,
    :class:`Expert` one matrix of its leading dims, :class:`At` a range of a flat partition."""


@dataclass(frozen=True)
class Job:
    """One unit of orthogonalization: a whole tensor or one expert matrix, and where its parts are."""

    tensor: int
    """Index of the param (in the strategy call) this job belongs to."""
    shape: tuple[int, ...]
    """The job's whole shape (a tensor's shape, or ``(rows, cols)`` for one expert)."""
    layout: MatrixLayout
    """How the whole is cut into matrices (split blocks, transposed, flatten)."""
    held: tuple[Piece, ...]
    """Who holds which region of the momentum update (replicated copies listed once per holder)."""
    needed: tuple[Piece, ...] = field(default=())
    """Who needs which region of the direction; empty: the same as ``held``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def receivers(self) -> tuple[Piece, ...]:
        return self.needed or self.held

    def held_by(self, rank: int) -> int:
        """How many elements of the job ``rank`` holds (the planner's preference)."""
        return sum(p.region.numel for p in self.held if p.rank == rank)


def local_part(local: Tensor, piece: Piece) -> Tensor:
    """The view of ``local`` (a rank's local tensor) holding ``piece``'s region in storage order.

    Its ``reshape(-1)`` is what ``piece.region.read(whole)`` returns on the owner.
    """
    where = piece.where
    if where is None:
        return local
    if isinstance(where, Expert):
        return local.reshape(-1, *local.shape[-2:])[where.index]
    return local.reshape(-1).narrow(0, where.offset, piece.region.numel)
