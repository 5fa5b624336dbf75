"""Bad input: sparse and complex gradients, non-finite gradients, and p.grad never mutated.

The non-finite policy (HybridMuon's ``nonfinite=``):
- "skip" (default): the whole step is skipped (every group), weights, momentum and AdamW states
  stay bit-identical, a warning is logged and ``skipped_steps`` counts it.
- "raise": FloatingPointError, with nothing changed.
- "unchecked": no check (and no cost); a NaN then flows into momentum and weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import muonkit
from helpers import Tiny, tiny_loss
from muonkit.testing import as_on_an_accelerator


@pytest.fixture(params=["cpu", "accelerator"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both ways a checked step runs: the CPU's (the verdict read at once, where reads are free)
    and an accelerator's (every commit masked on the device, one read after the Muon work)."""
    with as_on_an_accelerator() if request.param == "accelerator" else contextlib.nullcontext():
        yield request.param


def _setup(nonfinite: str = "skip", dtype: torch.dtype = torch.float32) -> tuple[Tiny, muonkit.HybridMuon]:
    model = Tiny().to(dtype)
    opt = muonkit.HybridMuon(muonkit.param_groups(model), nonfinite=nonfinite)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        opt.zero_grad()
        tiny_loss(model, seed + i).backward()
        opt.step()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": copy.deepcopy({k: v for k, v in opt.state_dict()["state"].items()}),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        assert st.keys() == b["state"][pid].keys()
        for k, v in st.items():
            assert torch.equal(v, b["state"][pid][k]), (pid, k)


def _poison(model: Tiny, where: str, value: float) -> None:
    grad = {"muon": model.up.weight.grad, "adamw": model.norm.bias.grad}[where]
    assert grad is not None
    grad.view(-1)[3] = value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["muon", "adamw"])
def test_skip_leaves_everything_bit_identical_warns_and_counts(
    where: str, value: float, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    model, opt = _setup("skip")
    _train(model, opt, 2)
    before = _snapshot(model, opt)
    opt.zero_grad()
    tiny_loss(model, 5).backward()
    _poison(model, where, value)
    with caplog.at_level(logging.WARNING, logger="muonkit.optimizer"):
        opt.step()
    _assert_same(before, _snapshot(model, opt))
    assert opt.skipped_steps == 1
    assert any("non-finite gradient" in r.getMessage() for r in caplog.records)


def test_a_skipped_step_is_as_if_it_never_happened(path: str) -> None:
    """AdamW's step count does not advance either: the next steps equal a run without the bad one."""
    model, opt = _setup("skip")
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = muonkit.HybridMuon(muonkit.param_groups(twin))
    _train(model, opt, 2)
    _train(twin, twin_opt, 2)
    opt.zero_grad()
    tiny_loss(model, 9).backward()
    _poison(model, "adamw", float("nan"))
    opt.step()
    _train(model, opt, 2, seed=2)
    _train(twin, twin_opt, 2, seed=2)
    _assert_same(_snapshot(model, opt), _snapshot(twin, twin_opt))


@pytest.mark.parametrize("where", ["muon", "adamw"])
def test_raise_raises_with_nothing_changed(where: str, path: str) -> None:
    model, opt = _setup("raise")
    _train(model, opt, 1)
    before = _snapshot(model, opt)
    opt.zero_grad()
    tiny_loss(model, 3).backward()
    _poison(model, where, float("nan"))
    message = (
        "non-finite gradient (inf or nan, or finite but so large that the step would overflow its state or a "
        "param: above ~1.8e19 in an fp32 AdamW group, ~1e31 in an fp32 Muon group; muonkit.functional.overflow); "
        "nothing was updated"
    )
    with pytest.raises(FloatingPointError, match="^" + re.escape(message) + "$"):
        opt.step()
    _assert_same(before, _snapshot(model, opt))
    assert opt.skipped_steps == 0


@pytest.mark.parametrize("algorithm", ["muon", "normuon"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_checked_paths_step_exactly_as_unchecked_and_skip_a_first_step_without_state(
    algorithm: str, dtype: torch.dtype
) -> None:
    """The masked commits (an accelerator's) and the CPU's give their unchecked step's results bit
    for bit (NorMuon, cautious weight decay, bf16 params through fp32); a skipped first step
    leaves no state on either path."""
    results = []
    for nonfinite, accelerator in (("unchecked", False), ("skip", False), ("unchecked", True), ("skip", True)):
        torch.manual_seed(0)
        model = Tiny().to(dtype)
        groups = muonkit.param_groups(model, muon_algorithm=algorithm)
        opt = muonkit.HybridMuon(groups, nonfinite=nonfinite, weight_decay=0.1, cautious_wd=True)
        with as_on_an_accelerator() if accelerator else contextlib.nullcontext():
            if nonfinite == "skip":
                opt.zero_grad()
                tiny_loss(model, 7).backward()
                _poison(model, "muon", float("nan"))
                before = {n: p.detach().clone() for n, p in model.named_parameters()}
                opt.step()
                assert not opt.state and opt.skipped_steps == 1
                assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
            _train(model, opt, 3)
        results.append(_snapshot(model, opt))
    _assert_same(results[0], results[1])
    _assert_same(results[2], results[3])  # AdamW's bias corrections: on the host, or on the device


def test_unchecked_lets_nan_through() -> None:
    """Documented: no check and no cost, so a NaN poisons the weights (Newton-Schulz mixes it everywhere)."""
    model, opt = _setup("unchecked")
    opt.zero_grad()
    tiny_loss(model).backward()
    _poison(model, "muon", float("nan"))
    opt.step()
    assert torch.isnan(model.up.weight).all()
    assert torch.isfinite(model.down.weight).all()


def test_bf16_gradients_are_checked_too() -> None:
    model, opt = _setup("skip", dtype=torch.bfloat16)
    _train(model, opt, 1)
    before = _snapshot(model, opt)
    opt.zero_grad()
    tiny_loss(model, 4).backward()
    _poison(model, "muon", float("inf"))
    opt.step()
    _assert_same(before, _snapshot(model, opt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("where", "value"), [("muon", 1e30), ("adamw", 1e19)])
def test_huge_finite_gradient_is_not_mistaken_for_inf(dtype: torch.dtype, where: str, value: float) -> None:
    """A gradient whose squares overflow the fast L2 check (1e30 once, or 1e19 in every entry), but
    below its group's overflow limit (~1e31 for Muon's momentum, ~1.8e19 for AdamW's second
    moment): the exact re-check must let the step through. (An AdamW gradient of 1e30 is above
    its limit: its square would make exp_avg_sq inf; ``tests/numerics/test_overflow.py``.)"""
    model, opt = _setup("raise", dtype=dtype)
    opt.zero_grad()
    tiny_loss(model).backward()
    _poison(model, where, value)
    weight = {"muon": model.up.weight, "adamw": model.norm.bias}[where]
    if where == "adamw":
        weight.grad.fill_(value)  # type: ignore[union-attr]
    before = weight.detach().clone()
    opt.step()
    assert opt.skipped_steps == 0
    assert not torch.equal(before, weight) and torch.isfinite(weight).all()
    assert all(torch.isfinite(v).all() for state in opt.state.values() for v in state.values())


def test_invalid_nonfinite_policy() -> None:
    with pytest.raises(
        ValueError, match=r"^Invalid nonfinite='ignore': must be one of \('skip', 'raise', 'unchecked'\)$"
    ):
        muonkit.HybridMuon([torch.nn.Parameter(torch.randn(4, 4))], nonfinite="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
def test_sparse_gradients_raise_with_nothing_changed(algorithm: str) -> None:
    embed = nn.Embedding(10, 8, sparse=True)
    other = nn.Parameter(torch.randn(8, 8))
    opt = muonkit.HybridMuon(
        [{"params": [other], "algorithm": "muon"}, {"params": [embed.weight], "algorithm": algorithm}]
    )
    before = embed.weight.detach().clone(), other.detach().clone()
    embed(torch.tensor([1, 2, 3])).sum().backward()
    other.grad = torch.randn(8, 8)
    assert embed.weight.grad is not None and embed.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match=r"^HybridMuon does not support sparse gradients"):
        opt.step()
    assert torch.equal(embed.weight, before[0]) and torch.equal(other, before[1])
    assert not opt.state


def test_complex_params_raise() -> None:
    z = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^Param group 0 has a complex tensor: complex params are not supported$"):
        muonkit.HybridMuon([{"params": [z], "algorithm": "muon"}])
    with pytest.raises(ValueError, match=r"^Param group 0 has a complex tensor: complex params are not supported$"):
        muonkit.HybridMuon([{"params": [z], "algorithm": "adamw"}])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nesterov", [True, False])
def test_step_never_mutates_p_grad(nesterov: bool, dtype: torch.dtype) -> None:
    model = Tiny().to(dtype)
    opt = muonkit.HybridMuon(muonkit.param_groups(model, muon_options={"nesterov": nesterov}, adamw_weight_decay=0.1))
    for i in range(3):
        opt.zero_grad()
        tiny_loss(model, i).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, grads[n]), n
