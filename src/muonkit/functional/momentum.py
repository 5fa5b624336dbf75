"""Muon's momentum: one fp32 buffer per parameter, EMA form.

M <- beta * M + (1 - beta) * G
U <- (1 - beta) * G + beta * M     if nesterov  (G.lerp(M, beta))
U <- M                             otherwise

:func:`muon_update` computes ``U`` without touching ``M`` and :func:`momentum_` then commits
``M``: the two halves of :func:`muon_momentum_`, bit for bit, for a step that decides whether to
apply only once every update is known.
"""

from __future__ import annotations

import torch
from torch import Tensor


def muon_momentum_(buffers: list[Tensor], grads: list[Tensor], *, momentum: float, nesterov: bool) -> list[Tensor]:
    """Update ``buffers`` in place and return the updates ``U`` (new fp32 tensors).

    ``grads`` are never modified. Buffers may be fp32 while grads are bf16.
    """
    if not buffers:
        return []
    grads32 = _like_buffers(grads, buffers)
    torch._foreach_lerp_(buffers, grads32, 1.0 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(grads32, buffers, momentum))
    return [b.clone() for b in buffers]


def muon_update(buffers: list[Tensor], grads: list[Tensor], *, momentum: float, nesterov: bool) -> list[Tensor]:
    """The updates ``U`` :func:`muon_momentum_` would return, as new tensors; ``buffers`` unchanged.

    One tensor at a time, so the scratch beyond the results is one tensor's new momentum.
    """
    updates = []
    for buffer, grad in zip(buffers, grads, strict=True):
        grads32 = _like_buffers([grad], [buffer])
        new = torch._foreach_lerp([buffer], grads32, 1.0 - momentum)  # what lerp_ writes, out of place
        updates.append(torch._foreach_lerp(grads32, new, momentum)[0] if nesterov else new[0])
    return updates


def momentum_(buffers: list[Tensor], grads: list[Tensor], *, momentum: float) -> None:
    """``M <- beta * M + (1 - beta) * G`` in place: the buffers :func:`muon_momentum_` leaves."""
    if buffers:
        torch._foreach_lerp_(buffers, _like_buffers(grads, buffers), 1.0 - momentum)


def _like_buffers(grads: list[Tensor], buffers: list[Tensor]) -> list[Tensor]:
    return [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, buffers, strict=True)]
