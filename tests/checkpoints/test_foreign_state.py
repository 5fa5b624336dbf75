"""State saved by other optimizers: torch.optim.AdamW into AdamW groups and torch.optim.Muon into
Muon groups load and continue exactly; anything else raises and changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import muonkit
from helpers import assert_unchanged, frozen_state

SHAPES = [(12, 8), (8,), ()]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seeds: range) -> None:
    for seed in seeds:
        g = torch.Generator().manual_seed(100 + seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_torch_adamw_state_continues_bit_for_bit_in_an_adamw_group() -> None:
    hp = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}
    theirs = _params()
    ref = torch.optim.AdamW(theirs, foreach=True, **hp)
    _steps(ref, theirs, range(3))
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt = muonkit.HybridMuon([{"params": ours, "algorithm": "adamw"}])  # muonkit's AdamW defaults
    opt.load_state_dict(ref.state_dict())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-2, (0.8, 0.99), 1e-6, 0.1)
    assert not {"amsgrad", "foreach", "fused", "maximize", "decoupled_weight_decay"} & group.keys()
    _steps(ref, theirs, range(3, 6))
    _steps(opt, ours, range(3, 6))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("torch_name", "ours"), [("match_rms_adamw", "match_adamw"), ("original", "keller")])
def test_torch_muon_state_loads_with_its_adjust_lr(torch_name: str, ours: str) -> None:
    g = torch.Generator().manual_seed(0)
    theirs = [torch.nn.Parameter(torch.randn(16, 24, generator=g))]
    ref = torch.optim.Muon(theirs, lr=0.02, adjust_lr_fn=torch_name, momentum=0.9)
    _steps(ref, theirs, range(2))
    mine = [torch.nn.Parameter(theirs[0].detach().clone())]
    other = "keller" if ours == "match_adamw" else "match_rms_adamw"
    opt = muonkit.Muon(mine, adjust_lr_fn=other)
    opt.load_state_dict(ref.state_dict())
    group = opt.param_groups[0]
    assert (group["adjust_lr"], group["lr"], group["momentum"]) == (ours, 0.02, 0.9)
    assert "adjust_lr_fn" not in group
    assert torch.equal(opt.state[mine[0]]["momentum_buffer"], ref.state[theirs[0]]["momentum_buffer"])


def _adamw_sd(**kw: Any) -> dict[str, Any]:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 4))], **kw).state_dict()


def _muon_sd(**kw: Any) -> dict[str, Any]:
    return torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kw).state_dict()


def _muon_group() -> muonkit.HybridMuon:
    return muonkit.HybridMuon([torch.nn.Parameter(torch.randn(4, 4))], lr=0.02)


def _adamw_group() -> muonkit.HybridMuon:
    return muonkit.HybridMuon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "algorithm": "adamw"}])


def _with(sd: dict[str, Any], **keys: Any) -> dict[str, Any]:
    sd["param_groups"][0].update(keys)
    return sd


# (what, the optimizer loading it, the foreign state dict, the start of the error message)
REFUSED: list[tuple[str, Callable[[], muonkit.HybridMuon], Callable[[], dict[str, Any]], str]] = [
    (
        "unstepped AdamW into a Muon group",
        _muon_group,
        lambda: _adamw_sd(lr=0.5),
        "Param group 0 is 'muon' here but the saved state is torch.optim.AdamW's: torch.optim.AdamW state "
        "loads only into algorithm='adamw' groups",
    ),
    (
        "torch Muon into an AdamW group",
        _adamw_group,
        _muon_sd,
        "Param group 0 is 'adamw' here but the saved state is torch.optim.Muon's",
    ),
    (
        "amsgrad",
        _adamw_group,
        lambda: _adamw_sd(amsgrad=True),
        "Param group 0 of the saved state is torch.optim.AdamW's with amsgrad=True: muonkit's AdamW has no amsgrad",
    ),
    (
        "maximize",
        _adamw_group,
        lambda: _adamw_sd(maximize=True),
        "Param group 0 of the saved state is torch.optim.AdamW's with maximize=True",
    ),
    (
        "Adam's L2 weight decay",
        _adamw_group,
        lambda: torch.optim.Adam([torch.nn.Parameter(torch.zeros(4, 4))], weight_decay=0.1).state_dict(),
        "Param group 0 of the saved state is torch.optim.Adam's with weight_decay=0.1 added to the gradient (L2)",
    ),
    (
        "SGD",
        _muon_group,
        lambda: torch.optim.SGD([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, momentum=0.9).state_dict(),
        "Param group 0 of the saved state is from another optimizer (no 'algorithm'; keys ['dampening',",
    ),
    (
        "an unknown key",
        _adamw_group,
        lambda: _with(_adamw_sd(), rho=0.5),
        "Param group 0 of the saved state looks like torch.optim.AdamW's but has keys torch.optim.AdamW does not: "
        "['rho']",
    ),
    (
        "a missing key",
        _muon_group,
        lambda: {"state": {}, "param_groups": [{"adjust_lr_fn": None, "params": [0]}]},
        "Param group 0 of the saved state looks like torch.optim.Muon's but lacks ['eps', 'lr', 'momentum',",
    ),
    (
        "unknown adjust_lr_fn",
        _muon_group,
        lambda: _with(_muon_sd(), adjust_lr_fn="spectral_norm"),
        "Param group 0 of the saved state is torch.optim.Muon's with adjust_lr_fn='spectral_norm': must be one of",
    ),
]


@pytest.mark.parametrize(("build", "saved", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_other_optimizers_state_is_refused_and_changes_nothing(
    build: Callable[[], muonkit.HybridMuon], saved: Callable[[], dict[str, Any]], message: str
) -> None:
    opt = build()
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    opt.step()
    before = frozen_state(opt)
    sd = saved()
    snapshot = copy.deepcopy(sd)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(sd)
    assert str(info.value).startswith(message), str(info.value)
    assert_unchanged(opt, before)
    assert sd["param_groups"] == snapshot["param_groups"]  # the caller's dict is not rewritten
