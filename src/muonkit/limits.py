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
from collections.abc import Sequence

import torch

from muonkit.config import AdamWConfig, MuonConfig
from muonkit.functional import overflow
from muonkit.functional.coefficients import output_bound
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.quantize import work_dtype

__all__ = [
    "exp_avg_limit",
    "gradient_limit",
    "param_limit",
    "work_dtype",
]


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
