"""Decoupled AdamW (Loshchilov & Hutter) with bias correction, on lists of local tensors.

    p <- p * (1 - lr * wd)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Identical to ``torch.optim.AdamW`` (foreach path). States are fp32; low-precision params are
updated through an fp32 copy so small steps and decays are not rounded away before they land.

``lr`` and ``weight_decay`` may be 0-dim tensors on the params' device, and ``steps`` device
tensors (a capturable step): the bias corrections are then computed on the device, with no host
read, and on CPU the results are the same as with Python numbers, bit for bit.
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
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float | Tensor,
    cautious_wd: bool = False,
) -> None:
    """One AdamW step, in place on ``params`` and the states. ``grads`` are not modified.

    ``cautious_wd``: decay only where the step ``m_hat / (sqrt(v_hat) + eps)`` (the sign of the new
    ``exp_avg``) and the param agree in sign (:func:`~muonkit.functional.muon.cautious_decay_`).
    """
    if not params:
        return
    if isinstance(lr, Tensor) or isinstance(weight_decay, Tensor):
        # A 0-dim tensor computes with a 0-dim rate tensor in float64 (two 0-dim operands promote);
        # as a 1-element view it computes in its own dtype, as with the plain step's numbers.
        params, grads, exp_avgs, exp_avg_sqs = (
            [t.view(1) if t.dim() == 0 else t for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)
        )
    torch._foreach_add_(steps, 1)
    work = [p if p.dtype == m.dtype else p.to(m.dtype) for p, m in zip(params, exp_avgs, strict=True)]
    g32 = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(grads, exp_avgs, strict=True)]
    decays = isinstance(lr, Tensor) or isinstance(weight_decay, Tensor) or weight_decay != 0
    if decays and not cautious_wd:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)  # x1 for a tensor wd of 0: no branch on its value
    torch._foreach_lerp_(exp_avgs, g32, 1.0 - beta1)
    if decays and cautious_wd:  # the mask needs this step's exp_avg; the decay reads W before it
        cautious_decay_(work, exp_avgs, lr=lr, weight_decay=weight_decay)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g32, g32, 1.0 - beta2)
    if isinstance(lr, Tensor):
        _update_on_device_(work, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    else:
        _update_(work, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    for p, w in zip(params, work, strict=True):
        if w is not p:
            p.copy_(w)


def _update_(
    work: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """``p <- p - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)``, ``t`` read from ``steps``."""
    # Per-param bias corrections as scalar lists (params added later have fewer steps), as in
    # torch.optim.AdamW's foreach path; steps live on the CPU, so reading them costs no sync.
    ts = [s.item() for s in steps]
    step_sizes = [-lr / (1.0 - beta1**t) for t in ts]
    bias2_sqrts = [(1.0 - beta2**t) ** 0.5 for t in ts]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2_sqrts)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, step_sizes)


def _update_on_device_(
    work: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """:func:`_update_` with the bias corrections computed on the device from ``steps`` and ``lr``.

    Each operation rounds as its counterpart in :func:`_update_` does: the corrections in ``lr``'s
    dtype (fp64) from the same powers (0-dim ``pow`` is the C library's, as Python's ``**``; a
    tensor exponent keeps ``** 0.5`` from becoming ``sqrt``, which rounds differently), and
    ``(m * step_size) / denom`` then ``+``, the order of ``addcdiv``'s kernel. One param at a
    time: the scratch is two tensors of the largest param.
    """
    half = torch.full((), 0.5, dtype=lr.dtype, device=lr.device)  # a fill, not a host-to-device copy
    for w, m, v, s in zip(work, exp_avgs, exp_avg_sqs, steps, strict=True):
        t = s.to(lr.dtype)
        step_size = -lr / (1.0 - beta1**t)
        denom = v.sqrt().div_(torch.pow(1.0 - beta2**t, half)).add_(eps)
        w.add_(m.mul(step_size).div_(denom))
