"""Parity with torch.optim.Muon and torch.optim.AdamW configured the same way.

Both Muons run Keller's coefficients in bf16, but not the same bf16 arithmetic: torch rounds U
to bf16 and then normalizes in bf16, muonkit normalizes in fp32 and then rounds. One step's
directions differ by ~1% per entry. The weights are compared after 8 steps of the same
gradients (open loop), relative to the distance travelled: tolerance 3% (measured 0.7-1.1%).
AdamW runs the same foreach arithmetic as torch.optim.AdamW: equal bits in fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import muonkit

STEPS = 8
SHAPES = [(32, 32), (16, 48), (48, 16), (24, 40)]


def _params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(shapes: list[tuple[int, ...]]) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(STEPS)]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()


def _rel(ours: list[torch.Tensor], theirs: list[torch.Tensor], init: list[torch.Tensor]) -> float:
    return max(
        (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b - i)).item()
        for a, b, i in zip(ours, theirs, init, strict=True)
    )


CASES: list[dict[str, Any]] = [
    {},  # torch's defaults: lr 1e-3, weight_decay 0.1, adjust_lr_fn None ("original")
    {"lr": 0.02, "weight_decay": 0.0, "adjust_lr_fn": "original"},
    {"lr": 3e-3, "weight_decay": 0.05, "adjust_lr_fn": "match_rms_adamw"},
    {"lr": 0.02, "momentum": 0.9, "nesterov": False},
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_muonkit_muon_matches_torch_muon(kwargs: dict[str, Any]) -> None:
    grads = _grads(SHAPES)
    ours, theirs = _params(SHAPES), _params(SHAPES)
    init = [p.detach().clone() for p in ours]
    opt = muonkit.Muon(ours, **kwargs)
    _train(opt, ours, grads)
    torch_opt = torch.optim.Muon(theirs, **kwargs)
    _train(torch_opt, theirs, grads)
    assert _rel([p.detach() for p in ours], [p.detach() for p in theirs], init) <= 0.03
    # Momentum is linear in the gradients and kept in fp32 by both: equal to fp32 rounding.
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(opt.state[a]["momentum_buffer"], torch_opt.state[b]["momentum_buffer"])


def test_hybrid_muon_configured_like_torch_muon() -> None:
    grads = _grads(SHAPES)
    ours, theirs = _params(SHAPES), _params(SHAPES)
    init = [p.detach().clone() for p in ours]
    opt = muonkit.HybridMuon(
        ours,
        lr=0.02,
        weight_decay=0.1,
        ns_coefficients="keller",
        ns_steps=5,
        adjust_lr="keller",
        ns_dtype=torch.bfloat16,
    )
    _train(opt, ours, grads)
    _train(torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1), theirs, grads)
    assert _rel([p.detach() for p in ours], [p.detach() for p in theirs], init) <= 0.03


def test_muon_defaults_match_torch_signature() -> None:
    import inspect

    ours = inspect.signature(muonkit.Muon.__init__).parameters
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    for name, p in theirs.items():
        if name in ("self", "params"):
            continue
        assert name in ours, name
        assert ours[name].default == p.default, name


def test_muon_accepts_experts_and_convs_as_batches_of_matrices() -> None:
    """A 3D tensor is E matrices: the same as E separate 2D params in torch.optim.Muon."""
    experts = torch.nn.Parameter(torch.randn(3, 16, 24))
    conv = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    slices = [torch.nn.Parameter(experts.detach()[e].clone()) for e in range(3)]
    flat_conv = torch.nn.Parameter(conv.detach().reshape(8, 36).clone())
    init = [s.detach().clone() for s in [*slices, flat_conv]]
    ours = muonkit.Muon([experts, conv], lr=0.02)
    theirs = torch.optim.Muon([*slices, flat_conv], lr=0.02)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        ge, gc = torch.randn(3, 16, 24, generator=g), torch.randn(8, 4, 3, 3, generator=g)
        experts.grad, conv.grad = ge, gc
        for e, s in enumerate(slices):
            s.grad = ge[e].clone()
        flat_conv.grad = gc.reshape(8, 36).clone()
        ours.step()
        theirs.step()
    mine = [*experts.detach().unbind(0), conv.detach().reshape(8, 36)]
    assert _rel(mine, [s.detach() for s in [*slices, flat_conv]], init) <= 0.03


def test_muon_rejects_adamw_groups() -> None:
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=r"^muonkit.Muon takes Muon groups only; param group 1 is 'adamw'"):
        muonkit.Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw"}])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_groups_match_torch_adamw_bit_for_bit(weight_decay: float) -> None:
    """Same foreach arithmetic as torch.optim.AdamW, so equal bits; the third param gets no
    gradient for 5 steps, so one call mixes step counts."""
    shapes = [(40,), (30, 16), (), (3, 4, 5)]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    hp = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    opt = muonkit.HybridMuon([{"params": ours, "algorithm": "adamw", **hp}])
    ref = torch.optim.AdamW(theirs, foreach=True, **hp)
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for i, (a, b, gr) in enumerate(zip(ours, theirs, grads, strict=True)):
            a.grad, b.grad = (None, None) if i == 2 and step < 5 else (gr.clone(), gr.clone())
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], ref.state[b][key])
    assert opt.state[ours[2]]["step"].item() == 15
