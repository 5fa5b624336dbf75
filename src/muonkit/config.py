"""Typed, validated hyperparameters of one param group.

A param group stays a plain dict (that is what ``torch.optim`` and its lr schedulers use); the
optimizer reads it through :func:`group_config`, which validates every value and returns a frozen
dataclass. Every error names the key, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from muonkit.functional.coefficients import as_schedule, resolve_preset
from muonkit.functional.lr_scaling import ADJUST_LR_CHOICES
from muonkit.functional.matrices import LAYOUT_KINDS, MatrixLayout
from muonkit.functional.muon import NSOptions
from muonkit.functional.orthogonalize import METHODS, orthogonalization_flops
from muonkit.functional.validation import flag as _bool
from muonkit.functional.validation import nonneg as _nonneg
from muonkit.functional.validation import ns_dtype as _ns_dtype
from muonkit.functional.validation import ns_steps as _ns_steps
from muonkit.functional.validation import positive as _positive
from muonkit.functional.validation import positive_int as _positive_int
from muonkit.functional.validation import unit as _unit

Algorithm = Literal["muon", "adamw"]
ALGORITHMS: tuple[str, ...] = ("muon", "adamw")
MUON_KEYS = (
    "lr", "momentum", "nesterov", "ns_coefficients", "ns_steps", "eps", "weight_decay",
    "adjust_lr", "layout", "split_sizes", "ns_dtype", "ns_method",
)  # fmt: skip
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class MuonConfig:
    """Hyperparameters of a Muon group (see :class:`muonkit.HybridMuon` for their meaning)."""

    lr: float
    momentum: float
    nesterov: bool
    ns_coefficients: str | tuple[tuple[float, float, float], ...]
    ns_steps: int | None
    eps: float
    weight_decay: float
    adjust_lr: str | None
    layout: MatrixLayout
    ns_dtype: torch.dtype | None
    ns_method: str = "gram"

    @property
    def ns_options(self) -> NSOptions:
        return NSOptions(self.ns_coefficients, self.ns_steps, self.eps, self.ns_dtype, self.adjust_lr, self.ns_method)

    def flops(self, rows: int, cols: int) -> int:
        """Matrix-product FLOPs of orthogonalizing one ``rows x cols`` matrix with these settings."""
        return orthogonalization_flops(rows, cols, self.steps, self.ns_method, self.ns_dtype)

    def tensor_flops(self, shape: Sequence[int]) -> int:
        """FLOPs of orthogonalizing every matrix of a tensor of this (whole) shape under ``layout``."""
        return sum(b.count * self.flops(b.rows, b.cols) for b in self.layout.blocks(tuple(shape)))

    @property
    def steps(self) -> int:
        """The number of Newton-Schulz steps actually run."""
        return len(resolve_preset(self.ns_coefficients, steps=self.ns_steps)[0])


@dataclass(frozen=True)
class AdamWConfig:
    """Hyperparameters of an AdamW group."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def group_config(group: Mapping[str, Any], index: int | None = None) -> MuonConfig | AdamWConfig:
    """Validate a param group and return its typed configuration."""
    where = "" if index is None else f" in param group {index}"
    algorithm = group.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm={algorithm!r}{where}: must be one of {ALGORITHMS}")
    try:
        return _muon_config(group) if algorithm == "muon" else _adamw_config(group)
    except ValueError as e:
        raise ValueError(f"{e}{where}") from None


def _muon_config(g: Mapping[str, Any]) -> MuonConfig:
    ns_coefficients = g["ns_coefficients"]
    ns_steps = _ns_steps("ns_steps", g["ns_steps"])
    resolve_preset(ns_coefficients, steps=ns_steps)  # raises on a bad preset
    if not isinstance(ns_coefficients, str):
        ns_coefficients = as_schedule(ns_coefficients)
    adjust_lr = g["adjust_lr"]
    if adjust_lr not in ADJUST_LR_CHOICES:
        raise ValueError(f"Invalid adjust_lr={adjust_lr!r}: must be one of {ADJUST_LR_CHOICES}")
    layout = g["layout"]
    if layout not in LAYOUT_KINDS:
        raise ValueError(f"Invalid layout={layout!r}: must be one of {LAYOUT_KINDS}")
    split = g["split_sizes"]
    if split is not None and (isinstance(split, str) or not isinstance(split, Sequence)):
        raise ValueError(f"Invalid split_sizes={split!r}: must be None or a non-empty sequence of positive row counts")
    split_sizes = None if split is None else tuple(_positive_int("split_sizes", s) for s in split)
    ns_dtype = _ns_dtype("ns_dtype", g["ns_dtype"])
    ns_method = g.get("ns_method", "gram")
    if ns_method not in METHODS:
        raise ValueError(f"Invalid ns_method={ns_method!r}: must be one of {METHODS}")
    return MuonConfig(
        lr=_nonneg("lr", g["lr"]),
        momentum=_unit("momentum", g["momentum"]),
        nesterov=_bool("nesterov", g["nesterov"]),
        ns_coefficients=ns_coefficients,
        ns_steps=ns_steps,
        eps=_positive("eps", g["eps"]),
        weight_decay=_nonneg("weight_decay", g["weight_decay"]),
        adjust_lr=adjust_lr,
        layout=MatrixLayout(layout, split_sizes),
        ns_dtype=ns_dtype,
        ns_method=ns_method,
    )


def _adamw_config(g: Mapping[str, Any]) -> AdamWConfig:
    betas = g["betas"]
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"Invalid betas={betas!r}: must be a pair (beta1, beta2), each in [0, 1)")
    return AdamWConfig(
        lr=_nonneg("lr", g["lr"]),
        beta1=_unit("betas[0]", betas[0]),
        beta2=_unit("betas[1]", betas[1]),
        eps=_positive("eps", g["eps"]),
        weight_decay=_nonneg("weight_decay", g["weight_decay"]),
    )
