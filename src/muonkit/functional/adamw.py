"""Decoupled AdamW (Loshchilov & Hutter) with bias correction, on lists of local tensors.

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Identical to ``torch.optim.AdamW`` (foreach path). States are fp32; low-precision params are
updated through an fp32 copy so small steps and decays are not rounded away before they land.
"""

from __future__ import annotations

import torch
from torch import Tensor

from muonkit.functional.muon import cautious_decay_


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
    cautious_wd: bool = False,
) -> None:
    """One AdamW step, in place on ``params`` and the states. ``grads`` are not modified.

    ``cautious_wd``: decay only where the step ``m_hat / (sqrt(v_hat) + eps)`` (the sign of the new
    ``exp_avg``) and the param agree in sign (:func:`~muonkit.functional.muon.cautious_decay_`).
    """
    if not params:
        return
    torch._foreach_add_(steps, 1)
    work = [p if p.dtype == m.dtype else p.to(m.dtype) for p, m in zip(params, exp_avgs, strict=True)]
    g32 = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(grads, exp_avgs, strict=True)]
    if weight_decay != 0 and not cautious_wd:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, g32, 1.0 - beta1)
    if weight_decay != 0 and cautious_wd:  # the mask needs this step's exp_avg; the decay reads W before it
        cautious_decay_(work, exp_avgs, lr=lr, weight_decay=weight_decay)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1.0 - beta2)
    # Per-param bias corrections as scalar lists (params added later have fewer steps), as in
    # torch.optim.AdamW's foreach path; steps live on the CPU, so reading them costs no sync.
    ts = [s.item() for s in steps]
    step_sizes = [-lr / (1.0 - beta1**t) for t in ts]
    bias2_sqrts = [(1.0 - beta2**t) ** 0.5 for t in ts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrts)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, step_sizes)
    for p, w in zip(params, work, strict=True):
        if w is not p:
            p.copy_(w)
