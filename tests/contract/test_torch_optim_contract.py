"""torch.optim's generic optimizer contract, run against muonkit.Muon and HybridMuon.

torch describes each of its optimizers by an ``OptimizerInfo`` (``torch.testing._internal.
common_optimizers``: the constructor inputs to try, the inputs that must fail and how) and runs
one set of generic tests over all of them (``TestOptimRenewed`` in pytorch's ``test/test_optim.py``,
which is not shipped in the wheel). Here muonkit's optimizers get ``OptimizerInfo`` entries
modelled on torch's own Muon entry, and the generic checks that matter for a drop-in optimizer
are restated over them: the loss goes down (with and without lr schedulers, contiguous or not),
per-group lr and weight decay, tensor lr, errors, no-grad and zero-grad steps, deterministic
state_dict round trips with and without ``named_parameters()`` input, ``weights_only`` loading,
older state dicts, ``copy.deepcopy`` and pickling, hooks.

Like torch's tests for its Muon, the Muon entry optimizes a weight alone (2D only); the
HybridMuon entry adds the bias as an AdamW group.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau

import muonkit
from muonkit.distributed import Strategy

pytest.importorskip("expecttest", reason="torch.testing._internal imports expecttest (muonkit's [dev] extra)")
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    _get_optim_inputs_including_global_cliquey_kwargs,
    get_error_inputs_for_all_optims,
)

DEVICE, DTYPE = "cpu", torch.float32


def _muon_inputs(device: str, dtype: torch.dtype | None = None) -> list[OptimizerInput]:
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01}, desc="non-default lr"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.001)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.2}, desc="non-default weight_decay"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.0}, desc="no weight_decay"),
        OptimizerInput(params=None, kwargs={"momentum": 0.8, "nesterov": False}, desc="plain momentum"),
        OptimizerInput(params=None, kwargs={"ns_steps": 6}, desc="passing alternative ns_steps"),
        OptimizerInput(params=None, kwargs={"ns_coefficients": (3.4, -4.7, 2.0)}, desc="alternative ns_coefficients"),
        OptimizerInput(params=None, kwargs={"adjust_lr_fn": "match_rms_adamw", "lr": 0.01}, desc="RMS matching"),
        OptimizerInput(params=None, kwargs={"lr": np.float32(0.01), "momentum": Decimal("0.9")}, desc="numpy, Decimal"),
    ]


def _hybrid_inputs(device: str, dtype: torch.dtype | None = None) -> list[OptimizerInput]:
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01, "adamw_lr": 1e-3}, desc="non-default lrs"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.01)}, desc="Tensor lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1, "adamw_weight_decay": 0.01}, desc="weight decay"),
        OptimizerInput(params=None, kwargs={"betas": (0.8, 0.9), "adamw_eps": 1e-6}, desc="AdamW options"),
        OptimizerInput(params=None, kwargs={"ns_coefficients": "keller", "ns_method": "newton_schulz"}, desc="Keller"),
        OptimizerInput(params=None, kwargs={"adjust_lr": "match_adamw", "lr": 1e-3}, desc="AdamW's lr for Muon"),
        OptimizerInput(params=None, kwargs={"nonfinite": "raise", "nesterov": False}, desc="raise on inf"),
        OptimizerInput(
            params=None, kwargs={"lr": np.float64(0.01), "betas": (Decimal("0.9"), np.float32(0.5))}, desc="numpy"
        ),
    ]


def _errors_for_all(device: str, dtype: torch.dtype) -> list[ErrorOptimizerInput]:
    """torch's generic error inputs. muonkit validates hyperparameters per group, so the one
    given without params (a 2-element Tensor lr) gets a param to reach its check."""
    errors = get_error_inputs_for_all_optims(device, dtype)
    for error in errors:
        if error.optimizer_error_input.params is None:
            error.optimizer_error_input.params = [Parameter(torch.randn(2, 2, device=device, dtype=dtype))]
    return errors


def _error(params: Any, kwargs: dict[str, Any], error_type: type, regex: str, *, on_step: bool = False) -> Any:
    on = OptimizerErrorEnum.STEP_ERROR if on_step else OptimizerErrorEnum.CONSTRUCTION_ERROR
    return ErrorOptimizerInput(
        OptimizerInput(params, kwargs, desc=regex), error_on=on, error_type=error_type, error_regex=regex
    )


def _nan_grad() -> Parameter:
    p = Parameter(torch.randn(3, 3))
    p.grad = torch.full_like(p, float("nan"))
    return p


def _sparse_grad() -> Parameter:
    p = Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4).to_sparse()
    return p


def _shared_errors(device: str, dtype: torch.dtype) -> list[ErrorOptimizerInput]:
    return [
        *_errors_for_all(device, dtype),
        _error([], {}, ValueError, "optimizer got an empty parameter list"),
        _error(None, {}, TypeError, "'NoneType' object is not iterable"),
        _error([torch.rand(2, 3, dtype=torch.complex64)], {}, ValueError, "complex params are not supported"),
        _error([torch.rand(4)], {}, ValueError, "contains tensors with < 2 dims"),
        _error([{"params": [torch.rand(2, 3)], "ns_step": 3}], {}, ValueError, r"Unknown key 'ns_step' .*'ns_steps'"),
        _error([(1, torch.rand(2, 3))], {}, TypeError, r"named params must be \(str, tensor\) pairs"),
        _error([torch.rand(2, 3), "x"], {}, TypeError, "optimizer can only optimize Tensors"),
        _error({"params": [torch.rand(2, 3)]}, {}, TypeError, "but one of the params is str"),
        _error([torch.rand(2, 3)], {"lr": -1.0}, ValueError, r"Invalid lr=-1.0: must be >= 0"),
        _error([torch.rand(2, 3)], {"momentum": np.float32(1.0)}, ValueError, r"must be in \[0, 1\)"),
        _error([_sparse_grad()], {}, RuntimeError, "does not support sparse gradients", on_step=True),
    ]


def _muon_errors(device: str, dtype: torch.dtype) -> list[ErrorOptimizerInput]:
    return [
        *_shared_errors(device, dtype),
        _error([torch.rand(2, 3)], {"adjust_lr_fn": "arbitrary"}, ValueError, "Invalid adjust_lr='arbitrary'"),
        # torch.optim.Muon takes adjust_lr_fn in a group too: so does muonkit.Muon, with the same check
        _error([{"params": [torch.rand(2, 3)], "adjust_lr_fn": "arbitrary"}], {}, ValueError, "Invalid adjust_lr="),
        _error([{"params": [torch.rand(4)], "algorithm": "adamw"}], {}, ValueError, "takes Muon groups only"),
    ]


def _hybrid_errors(device: str, dtype: torch.dtype) -> list[ErrorOptimizerInput]:
    return [
        *_shared_errors(device, dtype),
        _error([torch.rand(2, 3)], {"nonfinite": "ignore"}, ValueError, "Invalid nonfinite='ignore'"),
        _error([{"params": [torch.rand(2, 3)], "adjust_lr_fn": "original"}], {}, ValueError, r"'adjust_lr'\?"),
        _error([{"params": [torch.rand(4)], "algorithm": "sgd"}], {}, ValueError, "Invalid algorithm='sgd'"),
        _error([_nan_grad()], {"nonfinite": "raise"}, FloatingPointError, "non-finite gradient", on_step=True),
    ]


COMMON = {"supported_impls": (), "not_og_supported_flags": (), "supports_complex": False}
MUON = OptimizerInfo(muonkit.Muon, optim_inputs_func=_muon_inputs, optim_error_inputs_func=_muon_errors, **COMMON)
HYBRID = OptimizerInfo(
    muonkit.HybridMuon, optim_inputs_func=_hybrid_inputs, optim_error_inputs_func=_hybrid_errors, **COMMON
)
OPTIM_DB = [MUON, HYBRID]
ids = pytest.mark.parametrize("info", OPTIM_DB, ids=lambda info: info.name)


def _inputs(info: OptimizerInfo) -> list[OptimizerInput]:
    return _get_optim_inputs_including_global_cliquey_kwargs(DEVICE, DTYPE, info, skip=("differentiable",))


def _hybrid(info: OptimizerInfo) -> bool:
    return info.optim_cls is muonkit.HybridMuon


def _params(info: OptimizerInfo, weight: Tensor, bias: Tensor, *, named: bool = False) -> list[Any]:
    """What the optimizer is given: the weight alone (Muon) or the weight and an AdamW bias group."""
    w: Any = ("weight", weight) if named else weight
    if not _hybrid(info):
        return [w]
    b: Any = ("bias", bias) if named else bias
    return [{"params": [w]}, {"params": [b], "algorithm": "adamw"}]


def _loss(info: OptimizerInfo, weight: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    out = weight.mv(x) + bias if _hybrid(info) else weight.mv(x)
    return out.pow(2).sum()


def _closure(opt: torch.optim.Optimizer, info: OptimizerInfo, weight: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    opt.zero_grad()
    loss = _loss(info, weight, bias, x)
    loss.backward()
    return loss


def _pair_closure(opt: torch.optim.Optimizer, weight: Tensor, second: Tensor, x: Tensor) -> Tensor:
    """``|W x + b|^2`` or ``|W x + W2 x|^2``: a second group, a bias (AdamW) or a second weight."""
    opt.zero_grad()
    loss = (weight.mv(x) + (second.mv(x) if second.ndim == 2 else second)).pow(2).sum()
    loss.backward()
    return loss


def _weight_bias(rows: int = 10, cols: int = 5, *, contiguous: bool = True) -> tuple[Parameter, Parameter]:
    if contiguous:
        return Parameter(torch.randn(rows, cols)), Parameter(torch.randn(rows))
    return Parameter(torch.randn(rows, cols, 2)[..., 0]), Parameter(torch.randn(rows, 2)[..., 0])


def _same(a: Any, b: Any) -> bool:
    """Nested equality with tensors compared exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _without_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(state_dict)
    for group in out["param_groups"]:
        group.pop("param_names", None)
    return out


CONSTRUCTOR_ONLY = {"adjust_lr_fn", "adamw_lr", "adamw_eps", "adamw_weight_decay", "nonfinite"}


def _group_kwargs(kwargs: dict[str, Any]) -> bool:
    """Whether a constructor input is also a valid param group (no constructor-only keyword)."""
    return not CONSTRUCTOR_ONLY & kwargs.keys()


def _muon_and_adamw(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A constructor input as group keys: the Muon group's, and ``betas`` for the AdamW group (a
    Muon group refuses it: it would never be read)."""
    return {k: v for k, v in kwargs.items() if k != "betas"}, {k: v for k, v in kwargs.items() if k == "betas"}


# ---------------------------------------------------------------------------------- errors


@ids
def test_errors(info: OptimizerInfo) -> None:
    cls = info.optim_cls
    for error in info.optim_error_inputs_func(device=DEVICE, dtype=DTYPE):
        given = error.optimizer_error_input
        raises: Callable[..., Any] = pytest.warns if issubclass(error.error_type, Warning) else pytest.raises
        if error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
            with raises(error.error_type, match=error.error_regex):
                cls(given.params, **given.kwargs)
        else:
            opt = cls(given.params, **given.kwargs)
            with raises(error.error_type, match=error.error_regex):
                opt.step()


# ---------------------------------------------------------------------------------- training


@pytest.mark.parametrize("with_lrsched", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
@ids
def test_goes_right_direction(info: OptimizerInfo, contiguous: bool, with_lrsched: bool) -> None:
    schedules: Sequence[Any] = info.scheduler_inputs if with_lrsched else [[]]
    for schedule in schedules:
        for optim_input in info.optim_inputs_func(device=DEVICE):  # fresh inputs: a Tensor lr is mutated
            weight, bias = _weight_bias(contiguous=contiguous)
            x = torch.randn(5)
            opt = info.optim_cls(_params(info, weight, bias), **optim_input.kwargs)
            schedulers = [make(opt) for make in schedule]
            initial = _closure(opt, info, weight, bias, x).item()
            for _ in range(20):
                loss = _closure(opt, info, weight, bias, x)
                opt.step()
                for s in schedulers:
                    s.step(loss.item()) if isinstance(s, ReduceLROnPlateau) else s.step()
            assert _closure(opt, info, weight, bias, x).item() < initial, optim_input.desc


@ids
def test_param_group_with_lrscheduler_goes_right_direction(info: OptimizerInfo) -> None:
    for schedule in info.scheduler_inputs:
        weight, weight2 = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5))
        x = torch.randn(5)
        opt = info.optim_cls([{"params": [weight]}, {"params": [weight2], "lr": 0.01}])
        schedulers = [make(opt) for make in schedule]
        closure = functools.partial(_pair_closure, opt, weight, weight2, x)
        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            for s in schedulers:
                s.step(loss.item()) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < initial


@pytest.mark.parametrize("num_dim", [0, 1, 2])
@ids
def test_tensor_lr_steps_like_a_float_lr(info: OptimizerInfo, num_dim: int) -> None:
    for optim_input in _inputs(info):
        kwargs = {**optim_input.kwargs, "lr": 1e-3}
        weight, bias = _weight_bias()
        weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
        x = torch.randn(5)
        opt = info.optim_cls(_params(info, weight, bias), **kwargs)
        opt_c = info.optim_cls(
            _params(info, weight_c, bias_c), **{**kwargs, "lr": torch.tensor(1e-3).reshape([1] * num_dim)}
        )
        for _ in range(5):
            _closure(opt, info, weight, bias, x)
            opt.step()
            _closure(opt_c, info, weight_c, bias_c, x)
            opt_c.step()
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), optim_input.desc


@ids
def test_param_groups_lr(info: OptimizerInfo) -> None:
    """An almost-zero default lr leaves its group alone while the other group, with its own lr, trains."""
    for optim_input in _inputs(info):
        if not _group_kwargs(optim_input.kwargs):
            continue
        kwargs, adamw = _muon_and_adamw({**optim_input.kwargs, "lr": optim_input.kwargs.get("lr") or 1e-3})
        weight, bias = _weight_bias()
        frozen = [Parameter(torch.randn(2, 3))] + ([Parameter(torch.randn(3))] if _hybrid(info) else [])
        before = [p.detach().clone() for p in frozen]
        x = torch.randn(5)
        groups = [{"params": [weight], **kwargs}, {"params": frozen[:1]}]
        outer: dict[str, Any] = {"lr": 1e-28}
        if _hybrid(info):
            groups += [
                {"params": [bias], "algorithm": "adamw", "lr": 1e-2, **adamw},
                {"params": frozen[1:], "algorithm": "adamw"},
            ]
            outer["adamw_lr"] = 1e-28
        opt = info.optim_cls(groups, **outer)
        initial = _loss(info, weight, bias, x).item()
        for _ in range(20):
            _closure(opt, info, weight, bias, x)
            for p in frozen:
                p.grad = torch.rand_like(p)
            opt.step()
        assert _loss(info, weight, bias, x).item() < initial, optim_input.desc
        assert all(torch.equal(p, b) for p, b in zip(frozen, before, strict=True)), optim_input.desc


@ids
def test_param_groups_weight_decay(info: OptimizerInfo) -> None:
    for optim_input in _inputs(info):
        if not _group_kwargs(optim_input.kwargs):
            continue
        weight, bias = _weight_bias()
        weight2 = Parameter(torch.randn(10, 5))
        x = torch.randn(5)
        muon, adamw = _muon_and_adamw(optim_input.kwargs)
        second: dict[str, Any] = (
            {"params": [bias], "algorithm": "adamw", **adamw} if _hybrid(info) else {"params": [weight2]}
        )
        opt = info.optim_cls([{"params": [weight], **muon}, {**second, "weight_decay": 0.0}])
        closure = functools.partial(_pair_closure, opt, weight, bias if _hybrid(info) else weight2, x)
        initial = closure().item()
        for _ in range(20):
            opt.step(closure)
        assert closure().item() < initial, optim_input.desc


@ids
def test_step_is_noop_when_params_have_no_grad(info: OptimizerInfo) -> None:
    for optim_input in _inputs(info):
        params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
        before = [p.clone() for p in params]
        opt = info.optim_cls(params, **optim_input.kwargs)
        loss = opt.step(lambda: torch.tensor([1.0]))
        assert torch.equal(loss, torch.tensor([1.0]))
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)) and not opt.state


@ids
def test_step_is_noop_for_zero_grads(info: OptimizerInfo) -> None:
    """Zero gradients and no weight decay: nothing moves (Muon's default weight decay is set to 0 here)."""
    for optim_input in _inputs(info):
        kwargs = {**optim_input.kwargs, "weight_decay": 0.0, **({"adamw_weight_decay": 0.0} if _hybrid(info) else {})}
        weight, bias = _weight_bias(5, 2)
        before = [weight.detach().clone(), bias.detach().clone()]
        opt = info.optim_cls(_params(info, weight, bias), **kwargs)
        weight.grad, bias.grad = torch.zeros_like(weight), torch.zeros_like(bias)
        opt.step()
        assert torch.equal(weight, before[0]) and torch.equal(bias, before[1]), optim_input.desc


@ids
def test_optimizer_can_be_printed(info: OptimizerInfo) -> None:
    for optim_input in _inputs(info):
        text = repr(info.optim_cls([Parameter(torch.randn(2, 3))], **optim_input.kwargs))
        assert text.startswith(info.name) and "Parameter Group 0" in text


# ---------------------------------------------------------------------------------- state_dict


def _primed(info: OptimizerInfo, kwargs: dict[str, Any], *, named: bool, steps: int = 5) -> tuple[Any, ...]:
    weight, bias = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
    x = torch.randn(3)
    opt = info.optim_cls(_params(info, weight, bias, named=named), **kwargs)
    for _ in range(steps):
        opt.step(functools.partial(_closure, opt, info, weight, bias, x))
    return opt, weight, bias, x


@pytest.mark.parametrize("named1", [False, True], ids=["plain1", "named1"])
@pytest.mark.parametrize("named0", [False, True], ids=["plain0", "named0"])
@ids
def test_state_dict_deterministic(info: OptimizerInfo, named0: bool, named1: bool) -> None:
    for optim_input in _inputs(info):
        opt, weight, bias, x = _primed(info, optim_input.kwargs, named=named0)
        weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
        opt_c = info.optim_cls(_params(info, weight_c, bias_c, named=named1), **optim_input.kwargs)
        saved = copy.deepcopy(opt.state_dict())
        opt_c.load_state_dict(saved)
        assert _same(saved, opt.state_dict())  # loading leaves the given state dict alone
        for _ in range(5):
            opt.step(functools.partial(_closure, opt, info, weight, bias, x))
            opt_c.step(functools.partial(_closure, opt_c, info, weight_c, bias_c, x))
            assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c), optim_input.desc
        assert _same(_without_names(opt.state_dict()), _without_names(opt_c.state_dict())), optim_input.desc
        # a repeated group packs to the same representation
        opt_c.param_groups.extend(opt_c.param_groups)
        last = _without_names(opt_c.state_dict())["param_groups"][-1]
        assert _same(_without_names(opt.state_dict())["param_groups"][-1], last), optim_input.desc


@pytest.mark.parametrize("named1", [False, True], ids=["plain1", "named1"])
@pytest.mark.parametrize("named0", [False, True], ids=["plain0", "named0"])
@ids
def test_can_load_from_to_named_state_dict(info: OptimizerInfo, named0: bool, named1: bool) -> None:
    for optim_input in _inputs(info):
        opt, weight, bias, x = _primed(info, optim_input.kwargs, named=named0, steps=3)
        opt2 = info.optim_cls(_params(info, weight, bias, named=named1), **optim_input.kwargs)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt2.step(functools.partial(_closure, opt2, info, weight, bias, x))
        names = [g.get("param_names") for g in opt2.state_dict()["param_groups"]]
        if named0 or named1:  # names kept from whichever side had them
            assert names == ([["weight"], ["bias"]] if _hybrid(info) else [["weight"]])
        else:
            assert names == [None] * len(names)


@pytest.mark.parametrize("named", [False, True])
@ids
def test_save_load_equality_with_weights_only(info: OptimizerInfo, named: bool) -> None:
    for optim_input in _inputs(info):
        opt, *_ = _primed(info, optim_input.kwargs, named=named, steps=3)
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        assert _same(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), sd), optim_input.desc


@ids
def test_load_nontensor_step(info: OptimizerInfo) -> None:
    for optim_input in _inputs(info):
        opt, weight, bias, x = _primed(info, optim_input.kwargs, named=False, steps=3)
        sd = copy.deepcopy(opt.state_dict())
        for st in sd["state"].values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].item()
        opt.load_state_dict(sd)
        opt.step(functools.partial(_closure, opt, info, weight, bias, x))
        assert all(torch.is_tensor(st["step"]) for st in opt.state_dict()["state"].values() if "step" in st)


@ids
def test_can_load_older_state_dict(info: OptimizerInfo) -> None:
    """A state dict saved before ``skipped_steps`` and ``ns_method`` existed loads and keeps the current values."""
    for optim_input in _inputs(info):
        opt, weight, bias, x = _primed(info, optim_input.kwargs, named=False, steps=3)
        opt.skipped_steps = 2
        old = copy.deepcopy(opt.state_dict())
        del old["skipped_steps"]
        for group in old["param_groups"]:
            del group["ns_method"]
        for group in opt.param_groups:
            group["ns_method"] = "newton_schulz"
        opt.load_state_dict(old)
        assert opt.skipped_steps == 2 and [g["ns_method"] for g in opt.param_groups] == ["newton_schulz"] * len(
            old["param_groups"]
        )
        opt.step(functools.partial(_closure, opt, info, weight, bias, x))


@ids
def test_skipped_steps_are_saved_and_loaded(info: OptimizerInfo) -> None:
    weight, bias = Parameter(torch.randn(4, 3)), Parameter(torch.randn(4))
    opt = info.optim_cls(_params(info, weight, bias))
    weight.grad, bias.grad = torch.full_like(weight, float("nan")), torch.ones_like(bias)
    opt.step()
    assert opt.skipped_steps == 1 and opt.state_dict()["skipped_steps"] == 1
    fresh = info.optim_cls(_params(info, weight, bias))
    fresh.load_state_dict(opt.state_dict())
    assert fresh.skipped_steps == 1
    with pytest.raises(ValueError, match=r"^Invalid optimizer state: skipped_steps=-1 must be an int >= 0$"):
        fresh.load_state_dict({**opt.state_dict(), "skipped_steps": -1})
    assert fresh.skipped_steps == 1


# ---------------------------------------------------------------------------------- copies


def _copy_by(how: str, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@ids
def test_copies_keep_all_public_attributes_and_step_like_the_original(info: OptimizerInfo, how: str) -> None:
    def public(obj: object) -> dict[str, Any]:
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}

    for optim_input in _inputs(info):
        kwargs = {**optim_input.kwargs, "nonfinite": "raise"} if _hybrid(info) else optim_input.kwargs
        opt, *_ = _primed(info, kwargs, named=True, steps=2)
        opt.skipped_steps = 3
        twin = _copy_by(how, opt)
        assert public(twin).keys() == public(opt).keys(), optim_input.desc
        assert (twin.nonfinite, twin.skipped_steps) == (opt.nonfinite, 3)
        assert type(twin.strategy) is type(opt.strategy) and twin._adamw_defaults == opt._adamw_defaults
        assert _same(twin.state_dict(), opt.state_dict())
        # the copy owns its params and states, and steps exactly like the original
        params, twin_params = (([p for g in o.param_groups for p in g["params"]]) for o in (opt, twin))
        assert all(a is not b and torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))
        for _ in range(2):
            for p, q in zip(params, twin_params, strict=True):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            opt.step()
            twin.step()
        assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True)), optim_input.desc
        assert _same(twin.state_dict(), opt.state_dict()), optim_input.desc


def test_copy_of_a_distributed_optimizer_is_refused_clearly() -> None:
    class Elsewhere(Strategy):  # a distributed strategy would hold a process group
        name = "elsewhere"

        def directions(self, params: list[Tensor], updates: list[Tensor], config: Any) -> list[Tensor]:
            raise NotImplementedError

    opt = muonkit.Muon([Parameter(torch.randn(3, 3))], strategy=Elsewhere())
    message = r"^Cannot copy or pickle a HybridMuon with strategy Elsewhere: only a single-device optimizer"
    with pytest.raises(TypeError, match=message):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match=message):
        pickle.dumps(opt)


@ids
def test_step_hooks_fire_and_a_copy_starts_without_them(info: OptimizerInfo) -> None:
    """As in torch.optim: hooks are not part of an optimizer's copy, but the copy takes new ones."""
    weight, bias = Parameter(torch.randn(3, 3)), Parameter(torch.randn(3))
    opt = info.optim_cls(_params(info, weight, bias))
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    opt.step()
    assert calls == ["pre", "post"]
    twin = copy.deepcopy(opt)
    twin.step()
    assert calls == ["pre", "post"]
    twin.register_step_post_hook(lambda *_: calls.append("twin post"))
    twin.step()
    assert calls == ["pre", "post", "twin post"]


# ---------------------------------------------------------------------------------- named_parameters


def test_named_parameters_input_as_torch_accepts_it() -> None:
    """The issue's reproduction, and torch.optim.Muon's state dict layout for the same input."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    twin = copy.deepcopy(model)
    ours = muonkit.Muon(model.named_parameters())
    theirs = torch.optim.Muon(twin.named_parameters())
    assert ours.param_groups[0]["param_names"] == theirs.param_groups[0]["param_names"] == ["weight"]
    assert ours.param_groups[0]["params"] == [model.weight]
    for m, o in ((model, ours), (twin, theirs)):
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd["param_groups"][0]["params"] == theirs_sd["param_groups"][0]["params"] == [0]
    assert ours_sd["state"].keys() == theirs_sd["state"].keys() and "momentum_buffer" in ours_sd["state"][0]


def test_named_parameters_in_hybrid_groups() -> None:
    model = torch.nn.Linear(4, 3)
    opt = muonkit.HybridMuon(
        [{"params": [("weight", model.weight)]}, {"params": [("bias", model.bias)], "algorithm": "adamw"}]
    )
    assert [g["param_names"] for g in opt.param_groups] == [["weight"], ["bias"]]
    with pytest.raises(ValueError, match="cannot add param group without names"):
        opt.add_param_group({"params": [Parameter(torch.randn(2, 2))]})
    opt.add_param_group(
        {"params": iter([("extra", Parameter(torch.randn(2, 2)))])}
    )  # a generator, like named_parameters()
    assert opt.param_groups[-1]["param_names"] == ["extra"] and len(opt.param_groups) == 3
