"""Decoupled AdamW (Loshchilov & Hutter) with bias correction, on lists of local tensors.

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Identical to ``torch.optim.AdamW`` (foreach path). States are fp32; low-precision params are
updated through an fp32 copy so small steps and decays are not rounded away before they land.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step, in place on ``params`` and the states. ``grads`` are not modified."""
    if not params:
        return
    torch._foreach_add_(steps, 1)
    work = [p if p.dtype == m.dtype else p.to(m.dtype) for p, m in zip(params, exp_avgs, strict=True)]
    g32 = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(grads, exp_avgs, strict=True)]
    if weight_decay != 0:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g32, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1.0 - beta2)
    for group in _by_step(steps):
        t = group[0][0]
        bias1 = 1.0 - beta1**t
        bias2_sqrt = math.sqrt(1.0 - beta2**t)
        idx = [i for _, i in group]
        denom = torch._foreach_sqrt([exp_avg_sqs[i] for i in idx])
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_([work[i] for i in idx], [exp_avgs[i] for i in idx], denom, -lr / bias1)
    for p, w in zip(params, work, strict=True):
        if w is not p:
            p.copy_(w)


def _by_step(steps: list[Tensor]) -> list[list[tuple[int, int]]]:
    """Indices grouped by their step count (all equal unless params were added later)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, s in enumerate(steps):
        t = int(s.item())
        groups.setdefault(t, []).append((t, i))
    return list(groups.values())
