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

``v`` is ``lerp(v, mean(O*O), 1 - beta2)`` of finite non-negative values: finite whenever ``O`` is
(:mod:`muonkit.functional.overflow`); each entry of ``Ô`` is at most ``sqrt(min(rows, cols))``
times the largest singular value of ``O`` (:meth:`NorMuon.direction_factor`).

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import BatchHook, NSOptions, rule_directions
from muonkit.functional.update_rule import Hyperparameter, Reduce, RuleSettings, StateSpec, UpdateRule

__all__ = [
    "NORMUON",
    "ROWS",
    "NorMuon",
    "normuon_directions",
    "normuon_normalize",
    "normuon_normalize_shard",
    "normuon_rows",
    "split_rows",
]

ROWS = "row_exp_avg_sq"
"""NorMuon's state key: one value per matrix row of the whole param (``v`` above)."""


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
    return _ROWS_STATE.length(shape, layout)


def split_rows(v: Tensor, shape: Sequence[int], layout: MatrixLayout) -> list[Tensor]:
    """``v`` (a tensor's state) as one ``(count, rows)`` view per block of ``layout.to_matrices``."""
    return StateSpec.split(v, shape, layout)


def normuon_normalize_shard(
    o: Tensor, v: Tensor, *, rows_cut: bool, cols: int, reduce: Reduce, beta2: float, eps: float
) -> tuple[Tensor, Tensor]:
    """NorMuon's ``(Ô, v_new)`` (:func:`~muonkit.functional.normuon.normuon_normalize`) on a shard.

    ``o``: ``(..., rows, cols_i)`` the shard of the orthogonalized matrices, in the matrices' own
    orientation (rows = output neurons); ``v``: ``(..., rows)`` the moments of the rows it holds.
    ``rows_cut``: the shards cut every row (a block of columns each), so each row's sum of squares
    is summed over the shards; else each shard holds whole rows. ``cols``: the whole's columns.
    One ``reduce`` either way: the row sums (rows cut) or the two Frobenius norms (whole rows);
    ``||Ô||_F`` follows from the row sums, ``sum_r ||o_r||^2 / (sqrt(v_r) + eps)^2``.
    """
    if o.shape[:-1] != v.shape:
        raise ValueError(f"normuon_normalize_shard: v has shape {tuple(v.shape)}, the rows of o {tuple(o.shape[:-1])}")
    work = o.to(v.dtype)
    row_sq = work.square().sum(dim=-1, dtype=torch.float64)
    if rows_cut:
        row_sq = reduce(row_sq)
    v_new = torch.lerp(v, (row_sq / max(cols, 1)).to(v.dtype), 1.0 - beta2)
    divisor = v_new.sqrt() + eps
    norms = torch.stack([row_sq.sum(dim=-1), (row_sq / divisor.double().square()).sum(dim=-1)], dim=-1)
    if not rows_cut:
        norms = reduce(norms)
    before, after = norms.sqrt().unbind(-1)
    ratio = (before / after.clamp_min(torch.finfo(v.dtype).tiny)).to(v.dtype)
    normalized = work / divisor.unsqueeze(-1)
    normalized.mul_(ratio.unsqueeze(-1).unsqueeze(-1))
    return normalized.to(o.dtype), v_new


_ROWS_STATE = StateSpec(ROWS, "rows", nonnegative=True)


class NorMuon(UpdateRule):
    """NorMuon as an update rule: Muon's momentum and orthogonalization, then each row normalized
    by its second moment (:func:`normuon_normalize`; on a shard, :func:`normuon_normalize_shard`).

    Its groups have ``beta2`` (optimizer-wide: ``normuon_beta2``) and their own default ``eps``
    (``normuon_eps``), which is also their Newton-Schulz margin.
    """

    name = "normuon"
    title = "NorMuon"
    hyperparameters = (
        Hyperparameter(
            "beta2",
            "normuon_beta2",
            0.95,
            what="NorMuon's row second-moment decay",
            why="NorMuon groups' row second-moment decay (the paper's); section \"What large models train with\"",
        ),
        Hyperparameter(
            "eps",
            "normuon_eps",
            1e-8,
            what="NorMuon's eps (its groups' eps, also for Newton-Schulz)",
            why="NorMuon groups' eps (also their Newton-Schulz margin), the paper's",
            shared=True,
        ),
    )
    states = (*UpdateRule.states, _ROWS_STATE)

    @staticmethod
    def direction_factor(rows: int, cols: int) -> float:
        """A row-normalized matrix rescaled to the Frobenius norm of one with ``min(rows, cols)``
        singular values ``<= top``: its entries are at most ``sqrt(min(rows, cols)) * top``."""
        return math.sqrt(min(rows, cols))

    def after(self, o: Tensor, olds: Sequence[Tensor], settings: RuleSettings) -> tuple[Tensor, list[Tensor]]:
        out, v_new = normuon_normalize(o, olds[0], beta2=settings.setting("beta2"), eps=settings.eps)
        return out, [v_new]

    def after_shard(
        self, o: Tensor, olds: Sequence[Tensor], *, rows_cut: bool, cols: int, reduce: Reduce, settings: RuleSettings
    ) -> tuple[Tensor, list[Tensor]]:
        out, v_new = normuon_normalize_shard(
            o, olds[0], rows_cut=rows_cut, cols=cols, reduce=reduce, beta2=settings.setting("beta2"), eps=settings.eps
        )
        return out, [v_new]


NORMUON = NorMuon()
"""The NorMuon rule (registered in :mod:`muonkit.functional.rules` as ``"normuon"``)."""


@dataclass(frozen=True)
class _Settings:
    eps: float
    beta2: float
    momentum: float = 0.0  # not read after the orthogonalization
    nesterov: bool = False

    def setting(self, key: str) -> Any:
        return getattr(self, key)


def normuon_directions(
    updates: Sequence[Tensor],
    rows: Sequence[Tensor],
    layouts: Sequence[MatrixLayout],
    options: NSOptions,
    *,
    beta2: float,
    eps: float,
    on_batch: BatchHook | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """NorMuon's directions and new row moments for whole tensors (:func:`~muonkit.functional.muon.rule_directions`
    of :data:`NORMUON`): ``rows[i]``, the row moments of ``updates[i]`` (:func:`normuon_rows` long),
    are not modified::

        O = normuon_normalize(orthogonalize(U), v)    # the update multiplies it by the lr shape scale
    """
    directions, states = rule_directions(
        updates, layouts, options, rule=NORMUON, settings=_Settings(eps, beta2), states=[[v] for v in rows],
        on_batch=on_batch,
    )  # fmt: skip
    return directions, [s[0] for s in states]
