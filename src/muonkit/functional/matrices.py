"""How a parameter tensor is seen as matrices for orthogonalization.

Muon orthogonalizes matrices in the PyTorch ``(out_features, in_features)`` orientation. A
:class:`MatrixLayout` turns a whole tensor into one or more batches ``(B, rows, cols)`` of such
matrices and back:

==============  ==============================  ===========================================
kind            tensor shape                    matrices
==============  ==============================  ===========================================
``matrix``      ``(out, in)``                   one ``(out, in)``
``transposed``  ``(in, out)`` (GPT-2 Conv1D)    one ``(out, in)``: the transpose
``experts``     ``(E..., out, in)``             ``prod(E...)`` matrices ``(out, in)``
``flatten``     ``(out, in, k...)`` (conv)      one ``(out, in*prod(k...))``
``auto``        2D: matrix, 3D: experts, >=4D: flatten
==============  ==============================  ===========================================

``split_sizes`` cuts every matrix into blocks, each orthogonalized on its own: along its rows
(``split_along="rows"``, the default: a fused QKV projection into Q, K and V, or a Q projection
into its heads) or along its columns (``split_along="cols"``: an attention output projection into
the input columns of each head). Rows and columns are the matrix's, ``(out_features,
in_features)``, whatever the storage (a ``transposed`` tensor's columns are its storage rows).
Orthogonalization commutes with transposition, so the orientation only matters for the
shape-dependent learning-rate scale, which each block takes from its own shape.

Example: the output projection of 4 heads of 16 dims, one ``(64, 16)`` matrix per head::

    >>> MatrixLayout("matrix", (16,) * 4, "cols").blocks((64, 64))
    [MatrixBlock(count=1, rows=64, cols=16), MatrixBlock(count=1, rows=64, cols=16), MatrixBlock(count=1, rows=64, cols=16), MatrixBlock(count=1, rows=64, cols=16)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["LAYOUT_KINDS", "SPLIT_ALONG", "MatrixBlock", "MatrixLayout"]

LayoutKind = Literal["auto", "matrix", "transposed", "experts", "flatten"]
LAYOUT_KINDS: tuple[str, ...] = ("auto", "matrix", "transposed", "experts", "flatten")
SplitAlong = Literal["rows", "cols"]
SPLIT_ALONG: tuple[str, ...] = ("rows", "cols")


@dataclass(frozen=True)
class MatrixBlock:
    """``count`` matrices of shape ``(rows, cols)`` taken from one tensor."""

    count: int
    rows: int
    cols: int


@dataclass(frozen=True)
class MatrixLayout:
    """A rule that maps a tensor to batches of matrices; see the module docstring."""

    kind: LayoutKind = "auto"
    split_sizes: tuple[int, ...] | None = None
    split_along: SplitAlong = "rows"

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"Invalid layout={self.kind!r}: must be one of {LAYOUT_KINDS}")
        if self.split_sizes is not None and (not self.split_sizes or any(int(s) <= 0 for s in self.split_sizes)):
            raise ValueError(
                f"Invalid split_sizes={self.split_sizes!r}: must be None or a non-empty sequence of positive row counts"
            )
        if self.split_along not in SPLIT_ALONG:
            raise ValueError(f"Invalid split_along={self.split_along!r}: must be one of {SPLIT_ALONG}")
        if self.split_along == "cols" and self.split_sizes is None:
            raise ValueError("Invalid split_along='cols' with split_sizes=None: a column split needs split_sizes")

    @property
    def splits_cols(self) -> bool:
        """Whether ``split_sizes`` cuts the matrices along their columns (each block: all rows)."""
        return self.split_sizes is not None and self.split_along == "cols"

    @property
    def per_matrix(self) -> int:
        """How many blocks each matrix is cut into (1 without ``split_sizes``)."""
        return 1 if self.split_sizes is None else len(self.split_sizes)

    def resolved(self, ndim: int) -> LayoutKind:
        """The concrete kind for a tensor of ``ndim`` dimensions."""
        if ndim < 2:
            raise ValueError(f"Muon needs tensors with >= 2 dims, got ndim={ndim}")
        if self.kind != "auto":
            if self.kind in ("matrix", "transposed") and ndim != 2:
                raise ValueError(f"Invalid layout={self.kind!r} for a tensor with ndim={ndim}: it needs a 2D tensor")
            return self.kind
        return "matrix" if ndim == 2 else "experts" if ndim == 3 else "flatten"

    def base_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
        """``(count, rows, cols)`` of the unsplit matrices."""
        kind = self.resolved(len(shape))
        if kind == "matrix":
            return 1, shape[0], shape[1]
        if kind == "transposed":
            return 1, shape[1], shape[0]
        if kind == "experts":
            return math.prod(shape[:-2]), shape[-2], shape[-1]
        return 1, shape[0], math.prod(shape[1:])

    def blocks(self, shape: torch.Size | tuple[int, ...]) -> list[MatrixBlock]:
        """The matrices this tensor splits into, in order."""
        count, rows, cols = self.base_shape(shape)
        if self.split_sizes is None:
            return [MatrixBlock(count, rows, cols)]
        along, total = ("cols", cols) if self.splits_cols else ("rows", rows)
        if sum(self.split_sizes) != total:
            raise ValueError(
                f"Invalid split_sizes={self.split_sizes}: they must sum to the {total} {along} of a "
                f"tensor of shape {tuple(shape)} under layout={self.kind!r}"
                + (" with split_along='cols'" if self.splits_cols else "")
            )
        if self.splits_cols:
            return [MatrixBlock(count, rows, int(s)) for s in self.split_sizes]
        return [MatrixBlock(count, int(s), cols) for s in self.split_sizes]

    def to_matrices(self, t: Tensor) -> list[Tensor]:
        """Batches ``(count, rows, cols)``, one per block (views where possible)."""
        count, rows, cols = self.base_shape(t.shape)
        kind = self.resolved(t.ndim)
        base = t.mT if kind == "transposed" else t
        base = base.reshape(count, rows, cols)
        if self.split_sizes is None:
            return [base]
        return list(torch.split(base, list(self.split_sizes), dim=2 if self.splits_cols else 1))

    def from_matrices(self, mats: list[Tensor], shape: torch.Size | tuple[int, ...]) -> Tensor:
        """Inverse of :meth:`to_matrices`: a new tensor of ``shape``."""
        base = mats[0] if len(mats) == 1 else torch.cat(mats, dim=2 if self.splits_cols else 1)
        if self.resolved(len(shape)) == "transposed":
            return base.reshape(shape[1], shape[0]).mT.contiguous()
        return base.reshape(shape)
