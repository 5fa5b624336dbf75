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

``split_sizes`` cuts every matrix along its rows into blocks (a fused QKV projection into Q,
K and V), each orthogonalized on its own. Orthogonalization commutes with transposition, so the
orientation only matters for the shape-dependent learning-rate scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["LAYOUT_KINDS", "MatrixBlock", "MatrixLayout"]

LayoutKind = Literal["auto", "matrix", "transposed", "experts", "flatten"]
LAYOUT_KINDS: tuple[str, ...] = ("auto", "matrix", "transposed", "experts", "flatten")


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

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"Invalid layout={self.kind!r}: must be one of {LAYOUT_KINDS}")
        if self.split_sizes is not None and (not self.split_sizes or any(int(s) <= 0 for s in self.split_sizes)):
            raise ValueError(
                f"Invalid split_sizes={self.split_sizes!r}: must be None or a non-empty sequence of positive row counts"
            )

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
        if sum(self.split_sizes) != rows:
            raise ValueError(
                f"Invalid split_sizes={self.split_sizes}: they must sum to the {rows} rows of a "
                f"tensor of shape {tuple(shape)} under layout={self.kind!r}"
            )
        return [MatrixBlock(count, int(s), cols) for s in self.split_sizes]

    def to_matrices(self, t: Tensor) -> list[Tensor]:
        """Batches ``(count, rows, cols)``, one per block (views where possible)."""
        count, rows, cols = self.base_shape(t.shape)
        kind = self.resolved(t.ndim)
        base = t.mT if kind == "transposed" else t
        base = base.reshape(count, rows, cols)
        if self.split_sizes is None:
            return [base]
        return list(torch.split(base, list(self.split_sizes), dim=1))

    def from_matrices(self, mats: list[Tensor], shape: torch.Size | tuple[int, ...]) -> Tensor:
        """Inverse of :meth:`to_matrices`: a new tensor of ``shape``."""
        base = mats[0] if len(mats) == 1 else torch.cat(mats, dim=1)
        if self.resolved(len(shape)) == "transposed":
            return base.reshape(shape[1], shape[0]).mT.contiguous()
        return base.reshape(shape)
