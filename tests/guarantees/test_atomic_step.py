"""step() is all or nothing: bad input raises before anything changes, and a non-finite Muon
update is never applied.

- Validation: a step that would fail on a later group (a layout that no longer fits, a param
  whose shape changed, a bad hyperparameter, a strategy that refuses the params) raises with
  params, states and ``skipped_steps`` bit-identical, also after an AdamW group came first; the
  step after the fix applies once (equal to a run that never failed).
- Non-finite updates (a Newton-Schulz schedule that overflows, its up-front refusal lifted, or
  an orthogonalization that returns inf for one chunk): under ``"skip"`` nothing changes and the warning names the update;
  ``"raise"`` raises before anything changes; ``"unchecked"`` applies it.
- The momentum the directions are computed from, out of place (``muon_update``), and the commit
  afterwards (``momentum_``) equal ``muon_momentum_`` bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import muonkit
from muonkit.distributed import SingleDeviceStrategy
from muonkit.functional import momentum_, muon_momentum_, muon_update
from muonkit.testing import as_on_an_accelerator

DIVERGING = [(10.0, 0.0, 0.0)] * 40  # X <- 10 X, 40 times: 1e40 overflows fp32 (and bf16)
CUSTOM = [(3.4, -4.7, 2.0)]  # near Keller's: bounded, but not a preset's schedule


@pytest.fixture
def diverging_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the growth limit that refuses DIVERGING when it is given (ns_coefficients are checked
    for overflow up front), so that the step really overflows and the skip is what is tested."""
    monkeypatch.setattr("muonkit.functional.coefficients.GROWTH_LIMIT", math.inf)


class Net(nn.Module):
    """AdamW params first (bias, gain), then two Muon groups: ``a`` and ``b`` (a fused QKV)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))
        self.gain = nn.Parameter(torch.randn(8))
        self.a1 = nn.Parameter(torch.randn(8, 12))
        self.a2 = nn.Parameter(torch.randn(12, 8))
        self.b = nn.Parameter(torch.randn(12, 8))


def _setup(nonfinite: str = "skip", **strategy: Any) -> tuple[Net, muonkit.HybridMuon]:
    torch.manual_seed(0)
    net = Net()
    groups = [
        {"params": [net.bias, net.gain], "algorithm": "adamw", "weight_decay": 0.1},
        {"params": [net.a1, net.a2], "algorithm": "muon", "ns_dtype": torch.float32, "weight_decay": 0.1},
        {"params": [net.b], "algorithm": "muon", "ns_dtype": torch.float32, "split_sizes": (4, 8)},
    ]
    chosen = SingleDeviceStrategy(**strategy) if strategy else None
    return net, muonkit.HybridMuon(groups, nonfinite=nonfinite, strategy=chosen)  # type: ignore[arg-type]


def _grads(net: Net, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _train(net: Net, opt: muonkit.HybridMuon, steps: range) -> None:
    for step in steps:
        _grads(net, step)
        opt.step()


def _snapshot(net: nn.Module, opt: muonkit.HybridMuon) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "state": copy.deepcopy(opt.state_dict()["state"]),
        "skipped": opt.skipped_steps,
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["skipped"] == b["skipped"]
    for n, p in a["params"].items():
        assert torch.equal(p, b["params"][n]), n
    assert a["state"].keys() == b["state"].keys()
    for pid, state in a["state"].items():
        assert state.keys() == b["state"][pid].keys(), pid
        for key, value in state.items():
            assert torch.equal(value, b["state"][pid][key]), (pid, key)


# ---------------------------------------------------------------- validation before any change


def _misfit_split(net: Net, opt: muonkit.HybridMuon) -> None:
    opt.param_groups[2]["split_sizes"] = (5, 8)  # 13 rows: does not fit b's 12


def _changed_shape(net: Net, opt: muonkit.HybridMuon) -> None:
    net.a2.data = torch.randn(16, 8)  # momentum_buffer is (12, 8)
    net.a2.grad = torch.randn(16, 8)


def _bad_lr(net: Net, opt: muonkit.HybridMuon) -> None:
    opt.param_groups[2]["lr"] = -1.0


BREAKS = {"misfit_split": _misfit_split, "changed_shape": _changed_shape, "bad_lr": _bad_lr}
MESSAGES = {
    "misfit_split": r"split_sizes.*in param group 2",
    "changed_shape": r"^A param of shape \(16, 8\) on cpu in param group 1 has a momentum_buffer of shape \(12, 8\)",
    "bad_lr": r"^Invalid lr=-1.0: must be >= 0 in param group 2$",
}


@pytest.mark.parametrize("nonfinite", ["skip", "unchecked"])
@pytest.mark.parametrize("fresh", [False, True], ids=["with_state", "first_step"])
@pytest.mark.parametrize("name", list(BREAKS))
def test_a_step_failing_on_a_later_group_changes_nothing(name: str, fresh: bool, nonfinite: str) -> None:
    if fresh and name == "changed_shape":
        pytest.skip("a param without state may change shape")
    net, opt = _setup(nonfinite, max_chunk_elements=1)  # every param its own chunk
    if not fresh:
        _train(net, opt, range(2))
    _grads(net, 7)
    BREAKS[name](net, opt)
    before = _snapshot(net, opt)
    with pytest.raises(ValueError, match=MESSAGES[name]):
        opt.step()
    _assert_same(before, _snapshot(net, opt))


def test_the_step_after_a_fix_applies_once() -> None:
    net, opt = _setup()
    twin, twin_opt = _setup()
    _train(net, opt, range(2))
    _train(twin, twin_opt, range(2))
    _grads(net, 2)
    opt.param_groups[2]["split_sizes"] = (5, 8)
    with pytest.raises(ValueError, match="split_sizes"):
        opt.step()
    opt.param_groups[2]["split_sizes"] = (4, 8)
    opt.step()  # the same gradients: the retried step
    _train(net, opt, range(3, 5))
    _train(twin, twin_opt, range(2, 5))
    _assert_same(_snapshot(twin, twin_opt), _snapshot(net, opt))


class _Refusing(SingleDeviceStrategy):
    def check_params(self, params: list[Tensor]) -> None:
        if any(p.shape == (12, 8) for p in params):
            raise RuntimeError("refused")


@pytest.mark.parametrize("nonfinite", ["skip", "unchecked"])
def test_a_strategy_refusing_params_raises_before_any_change(nonfinite: str) -> None:
    net, opt = _setup(nonfinite)
    _train(net, opt, range(1))
    opt.set_strategy(_Refusing())
    _grads(net, 1)
    before = _snapshot(net, opt)
    with pytest.raises(RuntimeError, match=r"^refused$"):
        opt.step()
    _assert_same(before, _snapshot(net, opt))


# ---------------------------------------------------------------- non-finite updates


def _poison_last_chunk(monkeypatch: pytest.MonkeyPatch, opt: muonkit.HybridMuon, value: float) -> list[int]:
    """The orthogonalization of the last chunk of the step returns ``value`` in one entry."""
    strategy = opt.strategy
    calls: list[int] = []
    original = strategy.directions

    def directions(params: list[Tensor], updates: list[Tensor], config: Any) -> list[Tensor]:
        out = original(params, updates, config)
        calls.append(len(params))
        if len(calls) == 3:  # a1, a2, b: one chunk each
            out[-1].view(-1)[5] = value
        return out

    monkeypatch.setattr(strategy, "directions", directions)
    return calls


def _custom(opt: muonkit.HybridMuon) -> None:
    """Give the Muon groups a custom (non-preset) schedule: steps hold every direction until the verdict."""
    for group in opt.param_groups[1:]:
        group["ns_coefficients"] = CUSTOM


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_skip_a_non_finite_update_in_the_last_chunk(
    value: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    net, opt = _setup("skip", max_chunk_elements=1)
    _custom(opt)
    _train(net, opt, range(2))
    _grads(net, 2)
    before = _snapshot(net, opt)
    calls = _poison_last_chunk(monkeypatch, opt, value)
    with caplog.at_level(logging.WARNING, logger="muonkit.optimizer"):
        opt.step()
    assert calls == [1, 1, 1]
    before["skipped"] = 1
    _assert_same(before, _snapshot(net, opt))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Skipping optimizer step: non-finite Muon update from finite gradients (skipped so far: 1)"]


def test_raise_on_a_non_finite_update_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    net, opt = _setup("raise", max_chunk_elements=1)
    _custom(opt)
    _train(net, opt, range(2))
    _grads(net, 2)
    before = _snapshot(net, opt)
    _poison_last_chunk(monkeypatch, opt, float("inf"))
    with pytest.raises(
        FloatingPointError, match=r"^non-finite Muon update from finite gradients \(inf or nan\); nothing was updated$"
    ):
        opt.step()
    _assert_same(before, _snapshot(net, opt))


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_non_finite_update_from_finite_gradients_is_never_applied_and_raises_when_streamed(
    nonfinite: str, accelerator: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a preset's schedule (bounded: a non-finite direction needs a non-finite momentum or a
    bug) each chunk is applied as it comes; a non-finite one is not applied (masked on the
    device, or checked on the host) and the step raises, naming it, after the others."""
    net, opt = _setup(nonfinite, max_chunk_elements=1)
    _train(net, opt, range(2))
    _grads(net, 2)
    before = _snapshot(net, opt)
    _poison_last_chunk(monkeypatch, opt, float("nan"))
    path = as_on_an_accelerator() if accelerator else contextlib.nullcontext()
    with (
        path,
        pytest.raises(RuntimeError, match=r"^A Muon direction was non-finite although every gradient was finite"),
    ):
        opt.step()
    state = opt.state_dict()["state"]
    names = [n for n, _ in net.named_parameters()]
    assert torch.equal(net.b, before["params"]["b"])  # the poisoned chunk (b)
    assert torch.equal(state[names.index("b")]["momentum_buffer"], before["state"][names.index("b")]["momentum_buffer"])
    assert not torch.equal(net.a1, before["params"]["a1"]) and torch.isfinite(net.a1).all()  # the others applied


def test_unchecked_applies_a_non_finite_update(monkeypatch: pytest.MonkeyPatch) -> None:
    net, opt = _setup("unchecked", max_chunk_elements=1)
    _grads(net, 0)
    _poison_last_chunk(monkeypatch, opt, float("inf"))
    opt.step()
    assert not torch.isfinite(net.b).all()
    assert torch.isfinite(net.a1).all() and torch.isfinite(net.bias).all()


@pytest.mark.parametrize("fresh", [False, True], ids=["with_state", "first_step"])
@pytest.mark.usefixtures("diverging_allowed")
def test_a_diverging_schedule_is_skipped_and_the_run_goes_on_as_if_it_never_happened(fresh: bool) -> None:
    """A real overflow (only the up-front growth check lifted): Newton-Schulz with 40 steps of
    X <- 10 X on group 2 only."""
    net, opt = _setup()
    twin, twin_opt = _setup()
    start = 0 if fresh else 2
    _train(net, opt, range(start))
    _train(twin, twin_opt, range(start))
    before = _snapshot(net, opt)
    opt.param_groups[2]["ns_coefficients"] = DIVERGING
    _grads(net, 99)
    opt.step()
    before["skipped"] = 1
    _assert_same(before, _snapshot(net, opt))
    assert not fresh or not opt.state  # a skipped first step creates no state
    opt.param_groups[2]["ns_coefficients"] = "polar_express"
    _train(net, opt, range(start, start + 2))
    _train(twin, twin_opt, range(start, start + 2))
    twin_opt.skipped_steps = 1
    _assert_same(_snapshot(twin, twin_opt), _snapshot(net, opt))


@pytest.mark.usefixtures("diverging_allowed")
def test_a_non_finite_gradient_is_named_before_a_non_finite_update(caplog: pytest.LogCaptureFixture) -> None:
    net, opt = _setup()
    opt.param_groups[2]["ns_coefficients"] = DIVERGING
    _grads(net, 0)
    assert net.bias.grad is not None
    net.bias.grad[0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="muonkit.optimizer"):
        opt.step()
    assert [r.getMessage() for r in caplog.records] == [
        "Skipping optimizer step: non-finite gradient (or one so large the step would overflow) (skipped so far: 1)"
    ]


def test_one_finiteness_verdict_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients and updates are judged in one agreement (one collective when distributed)."""
    net, opt = _setup(max_chunk_elements=1)
    _custom(opt)
    seen: list[Tensor] = []
    original = opt.strategy.guard.all_true

    def all_true(flags: Tensor) -> list[bool]:
        seen.append(flags.clone())
        return original(flags)

    monkeypatch.setattr(opt.strategy.guard, "all_true", all_true)
    _train(net, opt, range(3))
    assert [f.tolist() for f in seen] == [[True, True]] * 3


# ---------------------------------------------------------------- momentum in two halves


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize(
    ("buffer_dtype", "grad_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float64, torch.float64)],
    ids=str,
)
def test_muon_update_then_momentum_equal_muon_momentum_bitwise(
    nesterov: bool, buffer_dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 13), (64, 33), (3, 5, 9), (1, 1)]
    buffers = [torch.randn(s, generator=g, dtype=buffer_dtype) * 1e-3 for s in shapes]
    grads = [(torch.randn(s, generator=g) * 10.0 ** (i - 2)).to(grad_dtype) for i, s in enumerate(shapes)]
    expected_buffers = [b.clone() for b in buffers]
    expected = muon_momentum_(expected_buffers, grads, momentum=0.95, nesterov=nesterov)
    kept = [b.clone() for b in buffers]
    updates = muon_update(buffers, grads, momentum=0.95, nesterov=nesterov)
    for b, k in zip(buffers, kept, strict=True):
        assert torch.equal(b, k)  # untouched
    momentum_(buffers, grads, momentum=0.95)
    for u, e in zip(updates, expected, strict=True):
        assert u.dtype == e.dtype and torch.equal(u, e)
    for b, e in zip(buffers, expected_buffers, strict=True):
        assert torch.equal(b, e)


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
@pytest.mark.parametrize(
    ("nonfinite", "custom", "streams"),
    [
        ("skip", True, False),
        ("raise", True, False),
        ("skip", False, True),
        ("raise", False, True),
        ("unchecked", True, True),
    ],
)
def test_only_custom_schedules_hold_every_direction_until_the_verdict(
    nonfinite: str, custom: bool, streams: bool, accelerator: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked steps with a custom schedule hold every direction until the verdict; with a preset's
    (whose directions are finite wherever the gradients are) and unchecked, one chunk's."""
    net, opt = _setup(nonfinite, max_chunk_elements=1)
    if custom:
        _custom(opt)
    _grads(net, 0)
    first = net.a1.detach().clone()
    seen: list[bool] = []
    original = opt.strategy.directions

    def directions(params: list[Tensor], updates: list[Tensor], config: Any) -> list[Tensor]:
        seen.append(not torch.equal(net.a1, first))
        return original(params, updates, config)

    monkeypatch.setattr(opt.strategy, "directions", directions)
    with as_on_an_accelerator() if accelerator else contextlib.nullcontext():
        opt.step()
    assert seen == [False, streams, streams]
    assert not torch.equal(net.a1, first)
