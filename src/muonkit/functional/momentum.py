"""Muon's momentum: one fp32 buffer per parameter, EMA form.

M <- beta * M + (1 - beta) * G
U <- (1 - beta) * G + beta * M     if nesterov  (G.lerp(M, beta))
U <- M                             otherwise
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
    grads32 = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, buffers, strict=True)]
    torch._foreach_lerp_(buffers, grads32, 1.0 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(grads32, buffers, momentum))
    return [b.clone() for b in buffers]
