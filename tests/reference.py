"""Deliberately simple float64 references for the tests (STYLE rule 6).

Everything here is written the plain way on purpose: one matrix at a time, Python loops, no
batching, no foreach, no in-place tricks, float64 throughout. Do not optimize it: its only job
is to be obviously right, so that the fast paths can be checked against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# Coefficients typed again from BRIEF section 1 (not imported from muonkit, to catch typos there).
KELLER = [(3.4445, -4.7750, 2.0315)] * 5
YOU = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
SCHEDULES = {"keller": (KELLER, 1.0), "you": (YOU, 1.0), "polar_express": (POLAR_EXPRESS, 1.02)}
"""preset name -> (steps, norm factor k in X = U / (k ||U||_F + eps))."""
F64 = torch.float64


def polar_factor(u: Tensor) -> Tensor:
    """The exact polar factor P Q^T of U = P S Q^T, by float64 SVD."""
    p, _, qt = torch.linalg.svd(u.to(F64), full_matrices=False)
    return p @ qt


def newton_schulz(u: Tensor, schedule: Sequence[tuple[float, float, float]], norm_factor: float, eps: float) -> Tensor:
    """One matrix, float64, the iteration as documented in muonkit.functional.orthogonalize.

    X = U / max|U|                  (scale only: keeps 1e+-300 inputs finite in float64)
    X = X / ((k + eps) * ||X||_F)   (scale-invariant; zero stays zero)
    repeat: A = X X^T;  X = a X + (b A + c A A) X      (on the short side)
    """
    x = u.to(F64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    peak = x.abs().max()
    if peak > 0:
        x = x / peak
        x = x / ((norm_factor + eps) * torch.linalg.norm(x))
    for a, b, c in schedule:
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.T
    return x


def lr_scale(adjust_lr: str | None, rows: int, cols: int) -> float:
    """BRIEF section 1's table, written out again."""
    if adjust_lr == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(rows / cols)
    assert adjust_lr is None
    return 1.0


def as_matrices(t: Tensor, layout: str) -> list[Tensor]:
    """The (out, in) matrices a tensor stands for, as separate float64 tensors."""
    if layout == "auto":
        layout = "matrix" if t.ndim == 2 else "experts" if t.ndim == 3 else "flatten"
    if layout == "matrix":
        return [t.to(F64)]
    if layout == "transposed":
        return [t.to(F64).T]
    if layout == "experts":
        flat = t.to(F64).reshape(-1, t.shape[-2], t.shape[-1])
        return [flat[e] for e in range(flat.shape[0])]
    assert layout == "flatten"
    return [t.to(F64).reshape(t.shape[0], -1)]


def from_matrices(mats: list[Tensor], shape: tuple[int, ...], layout: str) -> Tensor:
    """Inverse of :func:`as_matrices`."""
    if layout == "auto":
        layout = "matrix" if len(shape) == 2 else "experts" if len(shape) == 3 else "flatten"
    if layout == "transposed":
        return mats[0].T.clone()
    if layout == "experts":
        return torch.stack(mats).reshape(shape)
    return mats[0].reshape(shape).clone()


def muon_direction(
    u: Tensor,
    *,
    layout: str = "auto",
    split_sizes: Sequence[int] | None = None,
    split_along: str = "rows",
    schedule: Sequence[tuple[float, float, float]],
    norm_factor: float,
    eps: float,
    adjust_lr: str | None,
) -> Tensor:
    """scale(rows, cols) * NS(block) for every matrix block of one tensor, reassembled.

    Blocks: ``split_sizes`` rows each (``split_along="rows"``) or columns each (``"cols"``: the
    matrix transposed, cut into row blocks, each block transposed back)."""
    out = []
    for mat in as_matrices(u, layout):
        cols = split_along == "cols"
        work = mat.T if cols else mat
        sizes = [work.shape[0]] if split_sizes is None else list(split_sizes)
        blocks = []
        start = 0
        for rows in sizes:
            block = work[start : start + rows]
            start += rows
            block = block.T if cols else block  # in the matrix's own orientation
            o = newton_schulz(block, schedule, norm_factor, eps)
            o = lr_scale(adjust_lr, block.shape[0], block.shape[1]) * o
            blocks.append(o.T if cols else o)
        whole = torch.cat(blocks, dim=0)
        out.append(whole.T if cols else whole)
    return from_matrices(out, tuple(u.shape), layout)


@dataclass
class RefParam:
    """One parameter of the reference optimizer and everything it needs to be updated."""

    value: Tensor
    algorithm: str
    hp: dict
    state: dict = field(default_factory=dict)


class ReferenceHybridMuon:
    """Muon and AdamW, per parameter, in float64. ``hp`` keys follow HybridMuon's group keys.

    Muon:   M = mu*M + (1-mu)*G;  U = (1-mu)*G + mu*M (nesterov) or M
            W = W*(1 - lr*wd) - lr * scale * NS(U)
    AdamW:  m = b1*m + (1-b1)*G;  v = b2*v + (1-b2)*G^2
            W = W*(1 - lr*wd) - lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
    """

    def __init__(self, params: list[RefParam]) -> None:
        self.params = params

    def step(self, grads: list[Tensor | None]) -> None:
        for p, g in zip(self.params, grads, strict=True):
            if g is None:
                continue
            if p.algorithm == "muon":
                self._muon(p, g.to(F64))
            else:
                self._adamw(p, g.to(F64))

    def _muon(self, p: RefParam, g: Tensor) -> None:
        hp = p.hp
        mu = hp["momentum"]
        m = p.state.get("momentum_buffer", torch.zeros_like(g))
        m = mu * m + (1 - mu) * g
        p.state["momentum_buffer"] = m
        u = (1 - mu) * g + mu * m if hp["nesterov"] else m
        d = muon_direction(
            u,
            layout=hp.get("layout", "auto"),
            split_sizes=hp.get("split_sizes"),
            split_along=hp.get("split_along", "rows"),
            schedule=hp["schedule"],
            norm_factor=hp["norm_factor"],
            eps=hp["eps"],
            adjust_lr=hp["adjust_lr"],
        )
        p.value = p.value * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * d

    def _adamw(self, p: RefParam, g: Tensor) -> None:
        hp = p.hp
        b1, b2 = hp["betas"]
        t = p.state.get("step", 0) + 1
        m = b1 * p.state.get("exp_avg", torch.zeros_like(g)) + (1 - b1) * g
        v = b2 * p.state.get("exp_avg_sq", torch.zeros_like(g)) + (1 - b2) * g * g
        p.state.update(step=t, exp_avg=m, exp_avg_sq=v)
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        p.value = p.value * (1 - hp["lr"] * hp["weight_decay"]) - hp["lr"] * m_hat / (v_hat.sqrt() + hp["eps"])
