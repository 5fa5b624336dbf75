"""The generic optimizer contract (STYLE rule 8), table-driven over several configurations:
state_dict round trip, add_param_group, closure, zero_grad, None grads, bf16 params, lr
schedulers, and every bad hyperparameter with its exact error message.
"""

from __future__ import annotations

import copy
import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import muonkit
from helpers import Tiny, tiny_loss

Factory = Callable[[nn.Module], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "hybrid_defaults": lambda m: muonkit.HybridMuon(muonkit.param_groups(m)),
    "hybrid_options": lambda m: muonkit.HybridMuon(
        muonkit.param_groups(
            m,
            weight_decay=0.1,
            adamw_weight_decay=0.01,
            muon_options={"ns_coefficients": "keller", "nesterov": False, "adjust_lr": "match_adamw"},
            adamw_options={"betas": (0.8, 0.9)},
        )
    ),
    "muon_torch_signature": lambda m: muonkit.Muon([p for p in m.parameters() if p.ndim >= 2], lr=0.02),
    "adamw_only": lambda m: muonkit.HybridMuon([{"params": list(m.parameters()), "algorithm": "adamw"}]),
}
KINDS = list(OPTIMIZERS)


def _make(kind: str, dtype: torch.dtype = torch.float32) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    return model, OPTIMIZERS[kind](model)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    tiny_loss(model, seed).backward()
    opt.step()


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(kind: str) -> None:
    model, opt = _make(kind)
    for i in range(2):
        _step(model, opt, i)
    sd = opt.state_dict()
    twin = copy.deepcopy(model)
    twin_opt = OPTIMIZERS[kind](twin)
    twin_opt.load_state_dict(copy.deepcopy(sd))
    sd2 = twin_opt.state_dict()
    assert sd2["param_groups"] == sd["param_groups"]
    assert sd2["state"].keys() == sd["state"].keys()
    for pid, st in sd["state"].items():
        assert st.keys() == sd2["state"][pid].keys()
        assert all(torch.equal(v, sd2["state"][pid][k]) for k, v in st.items())
    _step(model, opt, 5)
    _step(twin, twin_opt, 5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_closure_returns_the_loss_and_equals_a_manual_step(kind: str) -> None:
    model, opt = _make(kind)
    twin = copy.deepcopy(model)
    twin_opt = OPTIMIZERS[kind](twin)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = tiny_loss(model, 3)
        loss.backward()
        return loss

    loss = opt.step(closure)
    _step(twin, twin_opt, 3)
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss) and loss.grad_fn is not None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_zero_grad(kind: str, set_to_none: bool) -> None:
    model, opt = _make(kind)
    tiny_loss(model).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in _params(opt):
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("kind", KINDS)
def test_params_without_grad_are_untouched_and_get_no_state(kind: str) -> None:
    model, opt = _make(kind)
    tiny_loss(model).backward()
    skipped = [model.down.weight, model.head.bias, model.norm.weight]
    for p in skipped:
        p.grad = None
    before = [p.detach().clone() for p in skipped]
    opt.step()
    for p, b in zip(skipped, before, strict=True):
        assert torch.equal(p, b)
        assert p not in opt.state or not opt.state[p]
    stepped = [p for p in _params(opt) if p.grad is not None]
    assert stepped and all(opt.state[p] for p in stepped)
    # zero grads are not None grads: the step happens (momentum and moments are created)
    for p in _params(opt):
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(opt.state[p] for p in _params(opt))


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_params_keep_fp32_state_through_save_and_load(kind: str) -> None:
    model, opt = _make(kind, torch.bfloat16)
    for i in range(2):
        _step(model, opt, i)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    states = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert states and all(v.dtype == torch.float32 for v in states)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    fresh = OPTIMIZERS[kind](model)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for p in _params(opt):
        for key, value in opt.state[p].items():
            assert fresh.state[p][key].dtype == value.dtype and torch.equal(fresh.state[p][key], value), key
    _step(model, fresh, 2)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_lr_schedulers_keep_each_groups_own_base_lr(kind: str) -> None:
    model, opt = _make(kind)
    base = [g["lr"] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for i in range(3):
        _step(model, opt, i)
        sched.step()
    assert [g["initial_lr"] for g in opt.param_groups] == base
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([b * 0.125 for b in base])
    # the scheduled lr is the one used: a factor of 0 freezes every weight
    frozen = torch.optim.lr_scheduler.LambdaLR(OPTIMIZERS[kind](model), lambda s: 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, frozen.optimizer, 9)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_cosine_schedule_on_hybrid_groups() -> None:
    model, opt = _make("hybrid_defaults")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    for i in range(4):
        _step(model, opt, i)
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0] * len(opt.param_groups), abs=1e-12)


@pytest.mark.parametrize("kind", ["hybrid_defaults", "muon_torch_signature"])
def test_add_param_group_later(kind: str) -> None:
    model, opt = _make(kind)
    extra = nn.Linear(16, 8)
    # torch.optim wants names in every group or in none; param_groups() names its groups.
    named = "param_names" in opt.param_groups[0]

    def names(name: str) -> dict[str, Any]:
        return {"param_names": [name]} if named else {}

    opt.add_param_group({"params": [extra.weight], "lr": 0.01, **names("extra.weight")})  # no algorithm, >= 2D: Muon
    if isinstance(opt, muonkit.Muon):  # Muon groups only (test_first_mistakes): the bias stays untrained
        extra.bias.requires_grad_(False)
    else:
        opt.add_param_group({"params": extra.bias, "algorithm": "adamw", **names("extra.bias")})
        assert opt.param_groups[-1]["algorithm"] == "adamw" and opt.param_groups[-1]["lr"] == 3e-4
    muon = next(g for g in opt.param_groups if any(p is extra.weight for p in g["params"]))
    assert muon["algorithm"] == "muon" and muon["lr"] == 0.01
    (tiny_loss(model) + extra(torch.ones(16)).sum()).backward()
    opt.step()
    assert opt.state[extra.weight]["momentum_buffer"].shape == (8, 16)
    if not isinstance(opt, muonkit.Muon):
        assert opt.state[extra.bias]["step"].item() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_group_added_later_changes_nothing(kind: str) -> None:
    _, opt = _make(kind)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(
        ValueError, match=rf"^Invalid momentum=2.0: must be in \[0, 1\) in param group {len(groups_before)}$"
    ):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "algorithm": "muon", "momentum": 2.0})
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before


# ---------------------------------------------------------------------------- bad hyperparameters

MUON_BAD: list[tuple[str, Any, str]] = [
    ("lr", -1.0, "Invalid lr=-1.0: must be >= 0"),
    ("lr", float("nan"), "Invalid lr=nan: must be a finite number"),
    ("lr", "0.1", "Invalid lr='0.1': must be a finite number"),
    ("momentum", 1.0, "Invalid momentum=1.0: must be in [0, 1)"),
    ("momentum", -0.1, "Invalid momentum=-0.1: must be in [0, 1)"),
    ("nesterov", 1, "Invalid nesterov=1: must be True or False"),
    (
        "ns_coefficients",
        "newton",
        "Invalid ns_coefficients='newton': must be one of ['keller', 'polar_express', 'you'] or a sequence of (a, b, c) tuples",
    ),
    (
        "ns_coefficients",
        5,
        "Invalid ns_coefficients=5: must be one of ['keller', 'polar_express', 'you'] or a sequence of (a, b, c) tuples",
    ),
    (
        "ns_coefficients",
        [(1.0, 2.0)],
        "Invalid ns_coefficients=[(1.0, 2.0)]: each step must be an (a, b, c) triple of finite floats",
    ),
    (
        "ns_coefficients",
        [(3.0, float("inf"), 1.0)],
        "Invalid ns_coefficients=[(3.0, inf, 1.0)]: each step must be an (a, b, c) triple of finite floats",
    ),
    ("ns_coefficients", [], "Invalid ns_coefficients=[]: need at least one (a, b, c) triple"),
    (
        "ns_coefficients",
        [(1.0, 1.0, 3.4e38)],
        "Invalid ns_coefficients=[(1.0, 1.0, 3.4e+38)]: every coefficient must be within [-1000, 1000] "
        "(the published presets' largest is 22.5), got (1.0, 1.0, 3.4e+38)",
    ),
    (
        "ns_coefficients",
        [(1.0, 0.0, 2.0)] * 3,
        "Invalid ns_coefficients=[(1.0, 0.0, 2.0), (1.0, 0.0, 2.0), (1.0, 0.0, 2.0)] with 3 steps: step 3 can map "
        "a singular value in [0, 1] to 5.59e+13, above the allowed 1000 (the presets stay below 2): the iteration "
        "diverges and would overflow or give a useless update",
    ),
    ("ns_steps", 0, "Invalid ns_steps=0: must be None or an int in [1, 100]"),
    ("ns_steps", 2.5, "Invalid ns_steps=2.5: must be None or an int in [1, 100]"),
    ("eps", 0.0, "Invalid eps=0.0: must be > 0"),
    ("weight_decay", -0.1, "Invalid weight_decay=-0.1: must be >= 0"),
    (
        "adjust_lr",
        "original",
        "Invalid adjust_lr='original': must be one of ('keller', 'match_adamw', 'spectral', None) "
        "(torch.optim.Muon's 'original' is 'keller' here)",
    ),
    ("layout", "diag", "Invalid layout='diag': must be one of ('auto', 'matrix', 'transposed', 'experts', 'flatten')"),
    ("layout", "transposed", "Invalid layout='transposed' for a tensor with ndim=3: it needs a 2D tensor"),
    (
        "split_sizes",
        (2, 3),
        "Invalid split_sizes=(2, 3): they must sum to the 8 rows of a tensor of shape (2, 8, 6) under layout='auto'",
    ),
    ("split_sizes", 4, "Invalid split_sizes=4: must be None or a non-empty sequence of positive row counts"),
    ("split_sizes", (4, 0, 4), "Invalid split_sizes entry 0: must be a positive int"),
    (
        "ns_dtype",
        torch.int32,
        "Invalid ns_dtype=torch.int32: must be None, torch.float32, torch.bfloat16, torch.float64 or (GPU only) torch.float16",
    ),
    ("ns_method", "svd", "Invalid ns_method='svd': must be one of ('newton_schulz', 'gram')"),
]
ADAMW_BAD: list[tuple[str, Any, str]] = [
    ("lr", -1e-3, "Invalid lr=-0.001: must be >= 0"),
    ("betas", (0.9,), "Invalid betas=(0.9,): must be a pair (beta1, beta2), each in [0, 1)"),
    ("betas", 0.9, "Invalid betas=0.9: must be a pair (beta1, beta2), each in [0, 1)"),
    ("betas", (1.0, 0.95), "Invalid betas[0]=1.0: must be in [0, 1)"),
    ("betas", (0.9, float("nan")), "Invalid betas[1]=nan: must be a finite number"),
    ("eps", 0.0, "Invalid eps=0.0: must be > 0"),
    ("weight_decay", -0.01, "Invalid weight_decay=-0.01: must be >= 0"),
]
CASES = [("muon", *c) for c in MUON_BAD] + [("adamw", *c) for c in ADAMW_BAD]
IDS = [f"{a}-{k}={v!r}" for a, k, v, _ in CASES]


def _group(algorithm: str, **hp: Any) -> dict[str, Any]:
    param = nn.Parameter(torch.randn(2, 8, 6) if algorithm == "muon" else torch.randn(6))
    return {"params": [param], "algorithm": algorithm, **hp}


def _exact(message: str, index: int) -> str:
    return "^" + re.escape(f"{message} in param group {index}") + "$"


@pytest.mark.parametrize(("algorithm", "key", "value", "message"), CASES, ids=IDS)
def test_bad_hyperparameter_at_construction(algorithm: str, key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=_exact(message, 0)):
        muonkit.HybridMuon([_group(algorithm, **{key: value})])


@pytest.mark.parametrize(("algorithm", "key", "value", "message"), CASES, ids=IDS)
def test_bad_hyperparameter_in_a_group_added_later(algorithm: str, key: str, value: Any, message: str) -> None:
    opt = muonkit.HybridMuon([_group("muon"), _group("adamw")])
    with pytest.raises(ValueError, match=_exact(message, 2)):
        opt.add_param_group(_group(algorithm, **{key: value}))
    assert len(opt.param_groups) == 2


# Whether a layout or split fits the tensors is checked when a group is added or loaded, not
# again at every step: the step re-validates the values alone.
STEP_CASES = [c for c in CASES if "for a tensor" not in c[3] and "must sum to" not in c[3]]


@pytest.mark.parametrize(
    ("algorithm", "key", "value", "message"), STEP_CASES, ids=[f"{a}-{k}={v!r}" for a, k, v, _ in STEP_CASES]
)
def test_bad_hyperparameter_set_after_construction_fails_the_step(
    algorithm: str, key: str, value: Any, message: str
) -> None:
    opt = muonkit.HybridMuon([_group("muon"), _group("adamw")])
    index = 0 if algorithm == "muon" else 1
    params = _params(opt)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.param_groups[index][key] = value
    with pytest.raises(ValueError, match=_exact(message, index)):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)) and not opt.state


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid lr=-1.0: must be >= 0 in param group 0"),
        ({"momentum": 1.5}, "Invalid momentum=1.5: must be in [0, 1) in param group 0"),
        ({"adamw_lr": -1.0}, "Invalid lr=-1.0: must be >= 0 in param group 1"),
        ({"betas": (0.9, 1.0)}, "Invalid betas[1]=1.0: must be in [0, 1) in param group 1"),
        ({"adamw_eps": 0.0}, "Invalid eps=0.0: must be > 0 in param group 1"),
        ({"adamw_weight_decay": -1.0}, "Invalid weight_decay=-1.0: must be >= 0 in param group 1"),
        ({"nonfinite": "ignore"}, "Invalid nonfinite='ignore': must be one of ('skip', 'raise', 'unchecked')"),
    ],
)
def test_bad_constructor_defaults(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 4))]}, _group("adamw")], **kwargs)


def test_float16_newton_schulz_on_cpu_params() -> None:
    message = (
        "Invalid ns_dtype=torch.float16 in param group 0: fp16 matmul is ~1000x slower on CPU; "
        "use torch.bfloat16 or torch.float32"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        muonkit.HybridMuon([_group("muon", ns_dtype=torch.float16)])


def test_muon_group_with_a_1d_tensor() -> None:
    message = (
        "Param group 0 (algorithm='muon') has a tensor of shape (6,): Muon needs >= 2 dims; "
        "put it in an algorithm='adamw' group"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(6))], "algorithm": "muon"}])


def test_group_without_algorithm_containing_a_1d_tensor() -> None:
    message = (
        "Param group 1 has no 'algorithm' and contains tensors with < 2 dims: give it algorithm='adamw', "
        "or pass muonkit.param_groups(model)"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        muonkit.HybridMuon(
            [_group("muon"), {"params": [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]}]
        )


def test_unknown_algorithm() -> None:
    with pytest.raises(
        ValueError, match=r"^Invalid algorithm='sgd' in param group 0: must be one of \('muon', 'normuon', 'adamw'\)$"
    ):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 4))], "algorithm": "sgd"}])
