"""Checkpoints: resuming is bit-identical to never stopping; a state that does not fit raises a
clear ValueError and leaves the optimizer exactly as it was.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import muonkit
from helpers import Tiny, assert_unchanged, frozen_state, tiny_loss


def _build(dtype: torch.dtype, seed: int, **opt_kwargs: Any) -> tuple[Tiny, muonkit.HybridMuon, Any]:
    torch.manual_seed(seed)
    model = Tiny().to(dtype)
    opt = muonkit.HybridMuon(muonkit.param_groups(model, weight_decay=0.01, adamw_weight_decay=0.01), **opt_kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model: Tiny, opt: muonkit.HybridMuon, sched: Any, steps: range) -> None:
    for i in steps:
        opt.zero_grad()
        loss = tiny_loss(model, i)
        loss.backward()
        if i == 3:  # some params without a gradient on one step: AdamW step counts diverge
            model.head.bias.grad = None
            model.down.weight.grad = None
        opt.step()
        sched.step()


def _save(model: Tiny, opt: muonkit.HybridMuon, sched: Any) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    return buf.getvalue()


CONFIGS = {
    "default": (torch.float32, {}),
    "bf16_params": (torch.bfloat16, {}),
    "keller_fp32_ns": (torch.float32, {"ns_coefficients": "keller", "ns_dtype": torch.float32, "nesterov": False}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_resumed_training_is_bit_identical(config: str) -> None:
    dtype, kwargs = CONFIGS[config]
    model, opt, sched = _build(dtype, 0, **kwargs)
    _train(model, opt, sched, range(6))
    blob = _save(model, opt, sched)
    _train(model, opt, sched, range(6, 10))

    # A fresh process would build everything from scratch, with different initial weights.
    resumed, ropt, rsched = _build(dtype, 123, **kwargs)
    ckpt = torch.load(io.BytesIO(blob), weights_only=True)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    rsched.load_state_dict(ckpt["sched"])
    _train(resumed, ropt, rsched, range(6, 10))

    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b), name
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        sa, sb = opt.state[a], ropt.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
            assert key == "step" or sa[key].dtype == torch.float32
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ropt.param_groups]


def _trained() -> tuple[Tiny, muonkit.HybridMuon]:
    model, opt, sched = _build(torch.float32, 0)
    _train(model, opt, sched, range(2))
    return model, opt


Edit = Callable[[dict[str, Any]], None]


def _set(path: tuple[Any, ...], value: Any) -> Edit:
    def edit(sd: dict[str, Any]) -> None:
        target = sd
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(path: tuple[Any, ...]) -> Edit:
    def edit(sd: dict[str, Any]) -> None:
        target = sd
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return edit


def _muon_pid(sd: dict[str, Any]) -> int:
    return next(pid for g in sd["param_groups"] if g["algorithm"] == "muon" for pid in g["params"])


def _adamw_pid(sd: dict[str, Any]) -> int:
    return next(pid for g in sd["param_groups"] if g["algorithm"] == "adamw" for pid in g["params"])


def _muon_state(key: str, value: Any) -> Edit:
    return lambda sd: sd["state"][_muon_pid(sd)].__setitem__(key, value)


def _adamw_state_del(key: str) -> Edit:
    return lambda sd: sd["state"][_adamw_pid(sd)].__delitem__(key)


def _adamw_state(key: str, value: Any) -> Edit:
    return lambda sd: sd["state"][_adamw_pid(sd)].__setitem__(key, value)


def _poison(key: str, value: float) -> Edit:
    """One element of a trained state set to ``value`` (the rest stays plausible)."""

    def edit(sd: dict[str, Any]) -> None:
        pid = _muon_pid(sd) if key == "momentum_buffer" else _adamw_pid(sd)
        state = sd["state"][pid][key].clone()
        state.view(-1)[3] = value
        sd["state"][pid][key] = state

    return edit


# Tiny's groups from param_groups: 0 = AdamW (embedding, biases, norm, head: 7 params),
# 1 = Muon (up.weight (32, 16), down.weight (16, 32)): param 7 is the first Muon param.
# (what is wrong, how to break a good state dict, the start of the error message)
BAD_STATES: list[tuple[str, Edit, str]] = [
    ("not a dict", lambda sd: sd.clear(), "Invalid optimizer state: expected a dict with 'state' and 'param_groups'"),
    ("no state key", _delete(("state",)), "Invalid optimizer state: expected a dict with 'state' and 'param_groups'"),
    (
        "one group too many",
        lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0])),
        "Optimizer state has 3 param groups, this optimizer has 2",
    ),
    (
        "one group missing",
        lambda sd: sd["param_groups"].pop(),
        "Optimizer state has 1 param groups, this optimizer has 2",
    ),
    (
        "a param too many",
        lambda sd: sd["param_groups"][1]["params"].append(99),
        "Param group 1 has 2 params, the saved state has 3",
    ),
    (
        "group without params",
        _delete(("param_groups", 0, "params")),
        "Invalid optimizer state: param group 0 has no 'params' list",
    ),
    (
        "swapped algorithm",
        _set(("param_groups", 1, "algorithm"), "adamw"),
        "Param group 1 is 'muon' here but 'adamw' in the saved state",
    ),
    ("bad lr", _set(("param_groups", 1, "lr"), -1.0), "Invalid lr=-1.0: must be >= 0 in param group 1"),
    (
        "bad momentum",
        _set(("param_groups", 1, "momentum"), 1.5),
        "Invalid momentum=1.5: must be in [0, 1) in param group 1",
    ),
    (
        "bad betas",
        _set(("param_groups", 0, "betas"), (0.9,)),
        "Invalid betas=(0.9,): must be a pair (beta1, beta2), each in [0, 1) in param group 0",
    ),
    (
        "bad split",
        _set(("param_groups", 1, "split_sizes"), (1, 2)),
        "Invalid split_sizes=(1, 2): they must sum to the 32 rows",
    ),
    (
        "momentum of the wrong shape",
        _muon_state("momentum_buffer", torch.zeros(3, 3)),
        "Saved momentum_buffer of param 7 (group 1) has shape (3, 3), the param has (32, 16)",
    ),
    (
        "momentum not a tensor",
        _muon_state("momentum_buffer", [0.0]),
        "Saved momentum_buffer of param 7 (group 1) has shape list, the param has (32, 16)",
    ),
    (
        "integer momentum",
        _muon_state("momentum_buffer", torch.zeros(32, 16, dtype=torch.int64)),
        "Saved momentum_buffer of param 7 (group 1) has dtype torch.int64: must be floating point",
    ),
    (
        "missing exp_avg_sq",
        _adamw_state_del("exp_avg_sq"),
        "Saved state of param 0 (group 0, adamw) lacks ['exp_avg_sq']; has ['exp_avg', 'step']",
    ),
    (
        "bad step",
        _adamw_state("step", "three"),
        "Saved step of param 0 (group 0) is 'three': must be a number >= 0 or a one-element tensor",
    ),
    (
        "NaN exp_avg_sq",
        _poison("exp_avg_sq", float("nan")),
        "Saved exp_avg_sq of param 0 (group 0) has non-finite values (min nan, max nan): must be finite",
    ),
    (
        "negative exp_avg_sq",
        _poison("exp_avg_sq", -1e-6),
        "Saved exp_avg_sq of param 0 (group 0) has negative values (min -1e-06): must be >= 0",
    ),
    (
        "inf exp_avg",
        _poison("exp_avg", float("inf")),
        "Saved exp_avg of param 0 (group 0) has non-finite values (min -",
    ),
    (
        "-inf momentum",
        _poison("momentum_buffer", -float("inf")),
        "Saved momentum_buffer of param 7 (group 1) has non-finite values (min -inf, max ",
    ),
    (
        "AdamW state for a Muon param",
        _muon_state("exp_avg", torch.zeros(32, 16)),
        "Saved state of param 7 (group 1, muon) has keys a muon group does not keep: ['exp_avg']",
    ),
    (
        "negative step",
        _adamw_state("step", torch.tensor(-1.0)),
        "Saved step of param 0 (group 0) is tensor(-1.): must be a number >= 0 or a one-element tensor",
    ),
]


@pytest.mark.parametrize(("edit", "message"), [c[1:] for c in BAD_STATES], ids=[c[0] for c in BAD_STATES])
def test_a_state_that_does_not_fit_raises_and_changes_nothing(edit: Edit, message: str) -> None:
    _, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    _, target = _trained()
    before = frozen_state(target)
    with pytest.raises(ValueError) as info:
        target.load_state_dict(sd)
    assert str(info.value).startswith(message), str(info.value)
    assert_unchanged(target, before)


def test_param_ids_refer_to_the_param_groups() -> None:
    """A state for a param id that no group lists is ignored by torch; we keep that behaviour."""
    model, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1000] = {"momentum_buffer": torch.zeros(1)}
    opt.load_state_dict(sd)
    tiny_loss(model).backward()
    opt.step()


def test_missing_hyperparameters_keep_their_current_values() -> None:
    """A checkpoint written before a group key existed (say ns_method) still loads, and trains."""
    _, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        for key in ("ns_method", "adjust_lr", "eps"):
            group.pop(key, None)
    model, target = _trained()
    target.load_state_dict(sd)
    for group, current in zip(target.param_groups, opt.param_groups, strict=True):
        assert group.keys() == current.keys()
        assert all(group[k] == current[k] for k in ("ns_method", "adjust_lr", "eps") if k in current)
    target.zero_grad()
    tiny_loss(model).backward()
    target.step()


def test_loaded_state_does_not_alias_the_state_dict() -> None:
    """Training after a load must not write into the dict it was loaded from (steps included)."""
    _, opt = _trained()
    sd = opt.state_dict()
    snapshot = copy.deepcopy(sd)
    model2, opt2 = _trained()
    opt2.load_state_dict(sd)
    opt2.zero_grad()
    tiny_loss(model2, 7).backward()
    opt2.step()
    for pid, st in snapshot["state"].items():
        for key, value in st.items():
            assert torch.equal(sd["state"][pid][key], value), (pid, key)


def test_torch_load_weights_only_with_dtypes_in_the_groups() -> None:
    _, opt, _ = _build(torch.float32, 0, ns_dtype=torch.float32)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert loaded["param_groups"][0]["ns_dtype"] == torch.float32
    opt.load_state_dict(loaded)
