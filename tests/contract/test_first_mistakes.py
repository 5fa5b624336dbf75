"""The first mistakes a torch user makes get an answer that leads somewhere that works.

- a model instead of param groups, to HybridMuon and to Muon;
- torch's keywords (``adjust_lr_fn=``, ``foreach=``) and misspellings on HybridMuon;
- a momentum-cycling torch lr scheduler (OneCycleLR, CyclicLR) on Muon groups;
- an AdamW-sized ``lr`` to ``param_groups`` and ``OneCycleLR`` with one ``max_lr`` for Muon and AdamW: warned;
- ``RoutingReport`` counts elements with ``numel`` and lists tensors with ``names``.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import muonkit
from muonkit.config import group_config


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.arange(6).reshape(2, 3)).square().mean()


def _train(opt: torch.optim.Optimizer, model: nn.Module, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()


def test_hybrid_muon_given_a_model_says_to_route_it() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"not a model \(Sequential\): pass muonkit\.param_groups\(model\)$"):
        muonkit.HybridMuon(model)
    before = [p.detach().clone() for p in model.parameters()]
    _train(muonkit.HybridMuon(muonkit.param_groups(model)), model)  # the advice works
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("given", ["model", "parameters", "param_groups"])
def test_muon_given_a_whole_model_gives_advice_that_works(given: str) -> None:
    model = _model()
    params = {"model": model, "parameters": model.parameters(), "param_groups": muonkit.param_groups(model)}[given]
    with pytest.raises((TypeError, ValueError)) as info:
        muonkit.Muon(params)
    message = str(info.value)
    assert "muonkit.HybridMuon(muonkit.param_groups(model))" in message
    code = re.search(r"muonkit\.Muon\(\[.*?\]\)", message)
    assert code is not None, message
    opt = eval(code.group(0), {"muonkit": muonkit, "model": model})  # the code the message suggests
    assert {n for g in opt.param_groups for n in g["param_names"]} == {"1.weight", "3.weight"}
    assert {(g["lr"], g["weight_decay"]) for g in opt.param_groups} == {(1e-3, 0.1)}  # torch.optim.Muon's
    before = model[1].weight.detach().clone()
    _train(opt, model)
    assert not torch.equal(before, model[1].weight)


def test_muon_refuses_an_adamw_group_added_later() -> None:
    model = _model()
    opt = muonkit.Muon([model[1].weight])
    with pytest.raises(ValueError, match=r"^muonkit.Muon takes Muon groups only; param group 1 is 'adamw'"):
        opt.add_param_group({"params": [model[2].weight], "algorithm": "adamw"})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("keyword", "hint"),
    [
        ("adjust_lr_fn", "did you mean 'adjust_lr'?"),
        ("foreach", "torch.optim's foreach option is not supported"),
        ("ns_step", "did you mean 'ns_steps'?"),
        ("beta1", "did you mean 'betas'?"),
    ],
)
def test_torch_keywords_on_hybrid_muon_get_a_hint(keyword: str, hint: str) -> None:
    model = _model()
    message = f"HybridMuon() got an unexpected keyword argument '{keyword}' ({hint})"
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        muonkit.HybridMuon(muonkit.param_groups(model), **{keyword: "original"})


def test_unknown_keyword_on_muon_names_muon() -> None:
    with pytest.raises(TypeError, match=r"^Muon\(\) got an unexpected keyword argument 'amsgrad'"):
        muonkit.Muon([nn.Parameter(torch.randn(4, 4))], amsgrad=True)


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_momentum_cycling_scheduler_cycles_muons_momentum(scheduler: str) -> None:
    """torch's schedulers write ``betas[0]`` of every group; Muon groups step with it as their momentum.

    The control sets ``momentum`` (and ``lr``) of a scheduler-free twin to the values the
    scheduler wrote before each step: both must end bit-identical.
    """
    model = _model()
    twin = copy.deepcopy(model)
    opt = muonkit.HybridMuon(muonkit.param_groups(model))
    control = muonkit.HybridMuon(muonkit.param_groups(twin))
    if scheduler == "OneCycleLR":
        sched: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[0.02, 3e-4], total_steps=8, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95
        )
    else:
        sched = torch.optim.lr_scheduler.CyclicLR(
            opt, base_lr=[0.01, 1e-4], max_lr=[0.02, 3e-4], step_size_up=3, base_momentum=0.8, max_momentum=0.95
        )
    used = []
    for _ in range(6):
        for g, c in zip(opt.param_groups, control.param_groups, strict=True):
            c["lr"] = g["lr"]
            c["momentum" if g["algorithm"] == "muon" else "betas"] = (
                g["betas"][0] if g["algorithm"] == "muon" else g["betas"]
            )
        muon = next(g for g in opt.param_groups if g["algorithm"] == "muon")
        used.append(group_config(muon).momentum)
        _train(opt, model, steps=1)
        _train(control, twin, steps=1)
        sched.step()
    assert min(used) < 0.9 < max(used)  # it did cycle
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_an_adamw_sized_lr_to_param_groups_warns() -> None:
    model = _model()
    with pytest.warns(UserWarning, match=r"param_groups\(model, lr=0.0003\): lr= is the Muon groups' lr.*adamw_lr="):
        groups = muonkit.param_groups(model, lr=3e-4)
    assert {g["lr"] for g in groups if g["algorithm"] == "muon"} == {3e-4}  # still what was asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        muonkit.param_groups(model)
        muonkit.param_groups(model, lr=0.02)
        muonkit.param_groups(model, lr=3e-4, adamw_lr=3e-4)  # both said: the caller tells them apart
        muonkit.param_groups(model, lr=3e-4, muon_options={"adjust_lr": "match_adamw"})  # Moonlight's, on purpose


def test_one_cycle_lr_with_one_max_lr_for_muon_and_adamw_warns_at_the_first_step() -> None:
    model = _model()
    opt = muonkit.HybridMuon(muonkit.param_groups(model))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=8)
    with pytest.warns(UserWarning, match=r"Muon param group \d and AdamW param group \d have the same max_lr=0.01.*"
                      r"max_lr=\[g\[\"lr\"\] for g in opt.param_groups\]"):  # fmt: skip
        _train(opt, model, steps=1)
    sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(opt, model, steps=1)  # once
        for muon_options in ({}, {"adjust_lr": "match_adamw"}):  # per-group peaks; one lr on purpose
            opt = muonkit.HybridMuon(muonkit.param_groups(model, muon_options=muon_options))
            max_lr = [g["lr"] for g in opt.param_groups] if not muon_options else 1e-3
            torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=8)
            _train(opt, model, steps=1)


def test_routing_report_counts_and_names() -> None:
    report = muonkit.explain(_model())
    assert report.names("muon") == ["1.weight", "3.weight"]
    assert report.numel("muon") == 8 * 16 + 16 * 8
    assert report.numel("adamw") + report.numel("muon") == report.total_params


def test_muon_takes_hybrid_muons_adjust_lr_name_too() -> None:
    """``muonkit.Muon`` speaks torch's ``adjust_lr_fn``; muonkit's ``adjust_lr`` means the same, once."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    opt = muonkit.Muon([w], adjust_lr="match_adamw")
    assert muonkit.Muon([w], adjust_lr_fn="match_rms_adamw").param_groups[0]["adjust_lr"] == "match_adamw"
    assert opt.param_groups[0]["adjust_lr"] == "match_adamw"
    with pytest.raises(TypeError, match="both adjust_lr_fn and adjust_lr"):
        muonkit.Muon([w], adjust_lr_fn="original", adjust_lr="keller")
