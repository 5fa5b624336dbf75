"""NorMuon's neuron-wise normalization of an orthogonalized update (arXiv 2510.05491, Algorithm 1).

NorMuon (Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable") keeps
Muon's momentum and orthogonalization and adds, per matrix ``O = orthogonalize(U)`` of shape
``rows x cols`` (rows = output neurons), a second moment with one value per row::

    v  <- beta2 * v + (1 - beta2) * mean_cols(O * O)      # (rows,), fp32
    Ô  <- O / (sqrt(v) + eps)                             # each row by its own RMS
    Ô  <- Ô * ||O||_F / ||Ô||_F                           # the matrix keeps O's Frobenius norm

after which the Muon step applies ``Ô`` exactly as it applies ``O`` (lr shape scale, lr, decay).
Keeping ``||Ô||_F = ||O||_F`` is what the authors' code does (``normuon.py`` of the NorMuon
repository); the paper's Algorithm 1 writes the step as ``0.2 * lr * sqrt(rows*cols) / ||Ô||_F``,
which is this one under ``adjust_lr="match_adamw"`` wherever ``O`` is exactly orthogonal
(``||O||_F = sqrt(min(rows, cols))``). Either way the lr tuned for Muon carries over.

``v`` starts at zero, as in the paper (no bias correction): the first step divides each row by
``sqrt(1 - beta2)`` times its RMS, and the Frobenius rescale removes that common factor.

Rows are the rows of the matrices a :class:`~muonkit.functional.matrices.MatrixLayout` cuts a
tensor into (a transposed ``(in, out)`` tensor's rows are its columns; every expert of a stack
and every ``split_sizes`` block is its own matrix: its own rows and its own Frobenius norm).
The state of a tensor is one vector, :func:`normuon_rows` long: ``v.view(count, rows)`` holds row
``r`` of unsplit matrix ``k`` (``split_sizes`` blocks are consecutive row ranges of it).

Example::

    >>> import torch
    >>> o = torch.randn(3, 8, 16)                  # three 8 x 16 matrices
    >>> o_hat, v = normuon_normalize(o, torch.zeros(3, 8), beta2=0.95, eps=1e-8)
    >>> o_hat.shape, v.shape
    (torch.Size([3, 8, 16]), torch.Size([3, 8]))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from muonkit.functional.matrices import MatrixLayout

__all__ = ["normuon_normalize", "normuon_rows", "split_rows"]


def normuon_normalize(o: Tensor, v: Tensor, *, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """``(Ô, v_new)`` for matrices ``o`` (``(..., rows, cols)``) and row moments ``v`` (``(..., rows)``).

    Pure: neither input is modified. ``Ô`` has ``o``'s dtype, ``v_new`` ``v``'s; the statistic is
    computed in ``v``'s dtype (fp32, or fp64 for fp64 params). A matrix with no columns has a zero
    statistic; an all-zero matrix stays zero.
    """
    if o.shape[:-1] != v.shape:
        raise ValueError(f"normuon_normalize: v has shape {tuple(v.shape)}, the rows of o {tuple(o.shape[:-1])}")
    work = o.to(v.dtype)
    mean_sq = work.square().sum(dim=-1) / max(o.size(-1), 1)
    v_new = torch.lerp(v, mean_sq, 1.0 - beta2)
    normalized = work / (v_new.sqrt() + eps).unsqueeze(-1)
    before = torch.linalg.vector_norm(work, dim=(-2, -1), keepdim=True)
    after = torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True)
    normalized.mul_(before / after.clamp_min(torch.finfo(after.dtype).tiny))
    return normalized.to(o.dtype), v_new


def normuon_rows(shape: Sequence[int], layout: MatrixLayout) -> int:
    """Length of a tensor's NorMuon state: one value per row of each of its (unsplit) matrices."""
    count, rows, _ = layout.base_shape(tuple(shape))
    return count * rows


def split_rows(v: Tensor, shape: Sequence[int], layout: MatrixLayout) -> list[Tensor]:
    """``v`` (a tensor's state) as one ``(count, rows)`` view per block of ``layout.to_matrices``."""
    count, rows, _ = layout.base_shape(tuple(shape))
    base = v.view(count, rows)
    if layout.split_sizes is None:
        return [base]
    return list(torch.split(base, list(layout.split_sizes), dim=1))
