"""What a checked step compares before it applies: every gradient, and where a group's settings
could overflow a param, every param of it, against the largest magnitude for which the step
writes only finite values (:mod:`muonkit.functional.overflow`, where the limits are derived).

A magnitude above its limit (or an inf or NaN) makes the step's verdict "non-finite": the step
is skipped or raises exactly as for an inf in a gradient. The comparison is the max-abs pass
that found infs and NaNs before, with the same number of calls and reads: on accelerators one
``_foreach_norm(ord=inf)`` per list and device, compared on the device (:func:`within_flags`);
on the CPU, where reads are free, a fused 2-norm per tensor read at once, and only where that
norm is near a limit, the exact range (:func:`within_on_host`).

Example::

    >>> import torch
    >>> within_on_host([torch.tensor([1e20, 0.0])], [1.8e19]), within_on_host([torch.ones(3)], [1.8e19])
    (False, True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.functional import overflow
from muonkit.functional.coefficients import output_bound
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.orthogonalize import host_read_waits

__all__ = [
    "GroupLimits",
    "exp_avg_limit",
    "gradient_limit",
    "param_limit",
    "within_flags",
    "within_on_host",
    "work_dtype",
]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a param's update is computed in (and its states are kept in): fp32 for bf16 and
    fp16 params, else the param's."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def gradient_limit(config: MuonConfig | AdamWConfig, *, state_dtype: torch.dtype, grad_dtype: torch.dtype) -> float:
    """The largest ``|g|`` of a gradient in ``grad_dtype`` a step of this group applies: a value of
    both dtypes (a gradient cast to the state's dtype stays within it)."""
    return _gradient_limit(config, state_dtype, grad_dtype)


@functools.lru_cache(maxsize=4096)
def _gradient_limit(config: MuonConfig | AdamWConfig, state_dtype: torch.dtype, grad_dtype: torch.dtype) -> float:
    if isinstance(config, AdamWConfig):
        limit = overflow.adamw_gradient_limit(beta2=config.beta2, eps=config.eps, state_dtype=state_dtype)
    else:
        limit = overflow.momentum_limit(state_dtype)
    return overflow.round_down(limit, grad_dtype)


def exp_avg_limit(config: AdamWConfig, state_dtype: torch.dtype) -> float:
    """The largest ``|exp_avg|`` an AdamW step of this group writes, and a checkpoint may hold."""
    return overflow.adamw_exp_avg_limit(eps=config.eps, state_dtype=state_dtype)


def param_limit(
    config: MuonConfig | AdamWConfig, *, shapes: Sequence[tuple[int, ...]], param_dtype: torch.dtype
) -> float | None:
    """The largest ``|W|`` a step of this group may update (None: any finite ``W``): ``shapes``
    are the whole tensors the param stands for (its matrices' lr shape scale)."""
    return _param_limit(config, tuple(shapes), param_dtype)


@functools.lru_cache(maxsize=4096)
def _param_limit(
    config: MuonConfig | AdamWConfig, shapes: tuple[tuple[int, ...], ...], param_dtype: torch.dtype
) -> float | None:
    work = work_dtype(param_dtype)
    if isinstance(config, AdamWConfig):
        update = overflow.adamw_update_bound(lr=config.lr, beta1=config.beta1, eps=config.eps, state_dtype=work)
    else:
        top = output_bound(config.ns_coefficients, steps=config.ns_steps)
        factor = config.rule.direction_factor  # the update rule's, beyond an orthogonalized matrix
        blocks = [b for shape in shapes for b in config.layout.blocks(shape) if b.rows and b.cols]  # empty: no update
        update = max(
            (
                overflow.muon_update_bound(
                    lr=config.lr,
                    top=top,
                    scale=lr_scale(config.adjust_lr, b.rows, b.cols),
                    factor=1.0 if factor is None else factor(b.rows, b.cols),
                )
                for b in blocks
            ),
            default=0.0,
        )
    return overflow.param_limit(
        lr=config.lr, weight_decay=config.weight_decay, update=update, param_dtype=param_dtype, work_dtype=work
    )


class GroupLimits:
    """One group's limits for one step: :func:`gradient_limit` and :func:`param_limit` computed once
    per dtype (and whole shapes), so that a step's cost per param is a dict lookup."""

    def __init__(self, config: MuonConfig | AdamWConfig) -> None:
        self.config = config
        self._memo: dict[tuple[Any, ...], float | None] = {}

    def gradient(self, *, state_dtype: torch.dtype, grad_dtype: torch.dtype) -> float:
        key = (state_dtype, grad_dtype)
        if key not in self._memo:
            self._memo[key] = gradient_limit(self.config, state_dtype=state_dtype, grad_dtype=grad_dtype)
        return cast(float, self._memo[key])

    def param(self, *, shapes: Sequence[tuple[int, ...]], param_dtype: torch.dtype) -> float | None:
        key = (tuple(shapes) if isinstance(self.config, MuonConfig) else (), param_dtype)  # AdamW: no shapes
        if key not in self._memo:
            self._memo[key] = param_limit(self.config, shapes=key[0], param_dtype=param_dtype)
        return self._memo[key]


def within_flags(lists: Sequence[Sequence[Tensor]], limits: Sequence[Sequence[float]]) -> Tensor:
    """For each list of tensors, whether every element is finite and within its tensor's limit
    (``limits[i][j]`` for ``lists[i][j]``, a value of that tensor's dtype): a bool vector.

    On accelerators (:func:`~muonkit.functional.orthogonalize.host_read_waits`) it is computed on
    the device and nothing is read: per list and device one max-abs (``_foreach_norm(ord=inf)``,
    exact), compared with the limit (one comparison where a list shares one limit; else each
    max-abs less its limit, ``_foreach_sub``, whose sign is exact); the vector lives on the first
    such device. On the CPU, where reads are free, :func:`within_on_host`. Empty tensors (a
    rank's empty FSDP2 shards) pass.
    """
    flags: list[bool | list[Tensor]] = []
    for ts, ls in zip(lists, limits, strict=True):
        by_device: dict[torch.device, tuple[list[Tensor], list[float]]] = {}
        for t, limit in zip(ts, ls, strict=True):
            if t.numel() > 0:
                xs, ys = by_device.setdefault(t.device, ([], []))
                xs.append(t)
                ys.append(limit)
        host = [pair for device, pair in by_device.items() if not host_read_waits(device)]
        if not all(within_on_host(xs, ys) for xs, ys in host):
            flags.append(False)
            continue
        flags.append([_within_on_device(xs, ys) for device, (xs, ys) in by_device.items() if host_read_waits(device)])
    devices = [f[0].device for f in flags if isinstance(f, list) and f]
    if not devices:
        return torch.tensor([f is not False for f in flags])
    parts = [
        torch.tensor(f, device=devices[0])
        if isinstance(f, bool)
        else torch.stack([x.to(devices[0]) for x in f]).all()
        if f
        else torch.tensor(True, device=devices[0])
        for f in flags
    ]
    return torch.stack(parts)


def _within_on_device(xs: list[Tensor], limits: list[float]) -> Tensor:
    """A 0-dim bool on the device: every max-abs of ``xs`` within its limit (NaN: False)."""
    peaks = torch._foreach_norm(xs, math.inf)
    if len(set(limits)) == 1:
        return torch.stack(peaks).max().le(limits[0])
    return torch.stack(torch._foreach_sub(peaks, limits)).max().le(0)


_NORM_MARGIN = 1 + 2.0**-7
"""A computed 2-norm is at least the largest magnitude less its own last rounding (the sum of
squares, accumulated in fp32 or wider, never drops below its largest term; bf16 and fp16 norms
are rounded once more, by at most 2^-9): a norm this far below the limit proves the tensor within."""


def within_on_host(ts: Sequence[Tensor], limits: Sequence[float]) -> bool:
    """Whether every element is finite and ``|x| <= limit`` of its tensor, with host reads (free
    on the CPU): one fused 2-norm per tensor and one read; only for a tensor whose norm does not
    prove it within (a norm above ``limit / (1 + 2^-7)``, inf or NaN), its exact range (min and
    max), so a finite tensor whose sum of squares overflows (values above ~1e19) is judged by its
    values. ``_foreach_norm(ord=inf)`` would be exact in one pass but is several times slower on
    CPU (BENCHMARKS.md)."""
    norms = torch.stack(torch._foreach_norm(list(ts))).tolist()
    for t, norm, limit in zip(ts, norms, limits, strict=True):
        if not norm * _NORM_MARGIN <= limit:  # NaN and inf too
            low, high = (float(x) for x in torch.aminmax(t))
            if not max(-low, high) <= limit:
                return False
    return True
