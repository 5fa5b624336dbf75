"""What a param group may hold: number types of hyperparameters, and only keys the optimizer knows.

- Finite real numbers of any common type (Python, numpy scalars and 0-d arrays, ``Decimal``,
  ``Fraction``, one-element tensors) are accepted and stored as Python numbers (tensors as given),
  so ``state_dict()`` loads with ``weights_only=True``; integer settings take integers only.
- A key the optimizer does not know is an error, with a hint for torch's names and misspellings,
  in the constructor, ``add_param_group``, ``param_groups(muon_options=...)`` and
  ``make_optimizer``; keys torch's schedulers write are fine, before and after construction.
"""

from __future__ import annotations

import io
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import muonkit
import muonkit.group_checks
from helpers import Tiny, tiny_loss
from muonkit.integrations.transformers import make_optimizer

FLOAT_TYPES: dict[str, Any] = {
    "np.float16": np.float16,
    "np.float32": np.float32,
    "np.float64": np.float64,
    "np.longdouble": np.longdouble,
    "0-d array": lambda v: np.array(v, dtype=np.float32),
    "Decimal": lambda v: Decimal(str(v)),
    "Fraction": lambda v: Fraction(str(v)),
    "tensor": lambda v: torch.tensor(v, dtype=torch.float64),
}
INT_TYPES: dict[str, Any] = {
    "np.int64": np.int64,
    "np.uint8": np.uint8,
    "0-d array": np.array,
    "int tensor": torch.tensor,
}
# key -> (algorithm, Python value); exact in binary, so every type above converts to the same float
FLOAT_KEYS = {
    "lr": ("muon", 0.03125),
    "momentum": ("muon", 0.875),
    "eps": ("muon", 2.0**-20),
    "weight_decay": ("muon", 0.25),
    "adamw lr": ("adamw", 0.0625),
    "adamw eps": ("adamw", 2.0**-24),
    "betas[0]": ("adamw", 0.75),
    "betas[1]": ("adamw", 0.9375),
}


def _group(algorithm: str, key: str, value: Any) -> dict[str, Any]:
    group: dict[str, Any] = {"algorithm": algorithm}
    if key.startswith("betas"):
        betas: list[Any] = [0.5, 0.5]
        betas[int(key[-2])] = value
        group["betas"] = tuple(betas)
    else:
        group[key.split()[-1]] = value
    return group


def _run(groups: list[dict[str, Any]]) -> tuple[muonkit.HybridMuon, list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4)) for _ in groups]
    opt = muonkit.HybridMuon([{"params": [p], **g} for p, g in zip(params, groups, strict=True)])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt, params


def _weights_only_round_trip(opt: torch.optim.Optimizer) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


@pytest.mark.parametrize("kind", list(FLOAT_TYPES))
@pytest.mark.parametrize("key", list(FLOAT_KEYS))
def test_float_hyperparameters_of_any_real_type(key: str, kind: str) -> None:
    algorithm, value = FLOAT_KEYS[key]
    converted = FLOAT_TYPES[kind](value)
    opt, params = _run([_group(algorithm, key, converted)])
    reference_opt, reference = _run([_group(algorithm, key, value)])
    assert torch.equal(params[0], reference[0])  # the same step as with the Python float
    stored = opt.param_groups[0]
    name = key.split()[-1] if not key.startswith("betas") else "betas"
    plain = stored[name] if name != "betas" else stored[name][int(key[-2])]
    if kind == "tensor":
        assert plain is converted  # a tensor stays the caller's (a scheduler may update it in place)
        return
    assert stored[name] == reference_opt.param_groups[0][name]
    assert type(plain) is float
    assert _weights_only_round_trip(opt)["param_groups"][0][name] == stored[name]


@pytest.mark.parametrize("kind", list(INT_TYPES))
def test_integer_hyperparameters_of_any_integer_type(kind: str) -> None:
    make = INT_TYPES[kind]
    opt, params = _run([{"algorithm": "muon", "ns_steps": make(3), "split_sizes": (make(2), make(4))}])
    _, reference = _run([{"algorithm": "muon", "ns_steps": 3, "split_sizes": (2, 4)}])
    assert torch.equal(params[0], reference[0])
    if kind != "int tensor":
        group = opt.param_groups[0]
        assert type(group["ns_steps"]) is int and [type(s) for s in group["split_sizes"]] == [int, int]
        assert _weights_only_round_trip(opt)["param_groups"][0]["ns_steps"] == 3


def test_constructor_defaults_and_coefficients_of_numpy_type_are_stored_plain() -> None:
    p, v = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6))
    opt = muonkit.HybridMuon(
        [{"params": [p]}, {"params": [v], "algorithm": "adamw"}],
        lr=np.float32(0.03125),
        ns_steps=np.int32(4),
        ns_coefficients=[(np.float32(3.0), Decimal("-3.0"), np.array(1.0))],
        adamw_lr=Decimal("0.001"),
        betas=(np.float64(0.75), np.float32(0.5)),
    )
    sd = _weights_only_round_trip(opt)
    muon, adamw = sd["param_groups"]
    assert (muon["lr"], muon["ns_steps"], muon["ns_coefficients"]) == (0.03125, 4, [(3.0, -3.0, 1.0)])
    assert (adamw["lr"], adamw["betas"]) == (0.001, (0.75, 0.5))


BAD_NUMBERS: list[tuple[str, Any, str]] = [
    ("lr", np.float32("nan"), "Invalid lr=np.float32(nan): must be a finite number"),
    ("lr", np.float64("inf"), "Invalid lr=np.float64(inf): must be a finite number"),
    ("lr", Decimal("NaN"), "Invalid lr=Decimal('NaN'): must be a finite number"),
    ("lr", Decimal("sNaN"), "Invalid lr=Decimal('sNaN'): must be a finite number"),
    ("lr", 10**400, f"Invalid lr={10**400}: must be a finite number"),
    ("lr", np.bool_(True), "Invalid lr=np.True_: must be a finite number"),
    ("lr", np.complex64(1), "Invalid lr=np.complex64(1+0j): must be a finite number"),
    ("lr", np.float32(-0.5), "Invalid lr=np.float32(-0.5): must be >= 0"),
    ("lr", Fraction(-1, 2), "Invalid lr=Fraction(-1, 2): must be >= 0"),
    ("lr", torch.tensor([0.1, 0.1]), "Invalid lr=tensor([0.1000, 0.1000]): Tensor lr must be 1-element"),
    ("lr", torch.tensor(True), "Invalid lr=tensor(True): must be a finite number"),
    ("momentum", Decimal("1"), "Invalid momentum=Decimal('1'): must be in [0, 1)"),
    ("eps", np.float16(0), "Invalid eps=np.float16(0.0): must be > 0"),
    ("ns_steps", np.float64(5.0), "Invalid ns_steps=np.float64(5.0): must be None or an int in [1, 100]"),
    ("ns_steps", Decimal(5), "Invalid ns_steps=Decimal('5'): must be None or an int in [1, 100]"),
    ("ns_steps", np.int64(0), "Invalid ns_steps=np.int64(0): must be None or an int in [1, 100]"),
    ("ns_steps", np.bool_(True), "Invalid ns_steps=np.True_: must be None or an int in [1, 100]"),
    ("split_sizes", (np.float32(2), 4), "Invalid split_sizes entry np.float32(2.0): must be a positive int"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_NUMBERS, ids=[f"{k}={v!r}" for k, v, _ in BAD_NUMBERS])
def test_bad_numbers_of_any_type_are_refused(key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(f"{message} in param group 0") + "$"):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(6, 4))], "algorithm": "muon", key: value}])


# ---------------------------------------------------------------------------- unknown keys

MUON_LIST = "('lr', 'momentum', 'nesterov', 'ns_coefficients', 'ns_steps', 'eps', 'weight_decay', 'adjust_lr', 'layout', 'split_sizes', 'split_along', 'ns_dtype', 'ns_method', 'cautious_wd', 'ns_compile', 'state_dtype')"
ALLOWED = (
    f": Muon groups take {MUON_LIST}, NorMuon groups also 'beta2', "
    "AdamW groups ('lr', 'betas', 'eps', 'weight_decay', 'cautious_wd', 'state_dtype')"
)
UNKNOWN: list[tuple[str, Any, str]] = [
    ("ns_step", 3, " (did you mean 'ns_steps'?)"),
    ("adjust_lr_fn", "original", " (did you mean 'adjust_lr'?)"),
    ("momentun", 0.9, " (did you mean 'momentum'?)"),
    (
        "adamw_lr",
        1e-3,
        " (adamw_lr is HybridMuon's default for 'adamw' groups, not a group key: a group with algorithm='adamw' "
        "sets it as 'lr'; 'lr' in a 'muon' group would set that group's own lr)",
    ),
    ("beta1", 0.9, " (did you mean 'betas'?)"),
    ("maximize", True, " (torch.optim's maximize option is not supported)"),
    ("foreach", False, " (torch.optim's foreach option is not supported)"),
    ("color", "red", ""),
]
UNKNOWN_IDS = [k for k, _, _ in UNKNOWN]


def _unknown(key: str, where: str, hint: str) -> str:
    return "^" + re.escape(f"Unknown key {key!r}{where}{hint}{ALLOWED}") + "$"


@pytest.mark.parametrize(("key", "value", "hint"), UNKNOWN, ids=UNKNOWN_IDS)
def test_unknown_group_key_at_construction(key: str, value: Any, hint: str) -> None:
    with pytest.raises(ValueError, match=_unknown(key, " in param group 1", hint)):
        muonkit.HybridMuon(
            [{"params": [nn.Parameter(torch.randn(4, 4))]}, {"params": [nn.Parameter(torch.randn(4, 4))], key: value}]
        )


@pytest.mark.parametrize(("key", "value", "hint"), UNKNOWN, ids=UNKNOWN_IDS)
def test_unknown_group_key_added_later_changes_nothing(key: str, value: Any, hint: str) -> None:
    # muonkit.Muon takes torch.optim.Muon's adjust_lr_fn in a group (test_group_keys.py); HybridMuon does not
    opt = (muonkit.HybridMuon if key == "adjust_lr_fn" else muonkit.Muon)([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match=_unknown(key, " in param group 1", hint)):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], key: value})
    assert len(opt.param_groups) == 1


def test_unknown_keys_in_param_groups_options() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match=_unknown("ns_step", " in muon_options", " (did you mean 'ns_steps'?)")):
        muonkit.param_groups(model, muon_options={"ns_step": 3})
    with pytest.raises(ValueError, match=_unknown("adjust_lr_fn", " in muon_options", " (did you mean 'adjust_lr'?)")):
        muonkit.param_groups(model, muon_options={"adjust_lr_fn": "match_rms_adamw"})
    # a setting of the other algorithm would be ignored by these groups: refused too
    with pytest.raises(ValueError, match=_unknown("momentum", " in adamw_options", " ('momentum' is a Muon setting)")):
        muonkit.param_groups(model, adamw_options={"momentum": 0.9})
    with pytest.raises(ValueError, match=_unknown("betas", " in muon_options", " ('betas' is an AdamW setting)")):
        muonkit.param_groups(model, muon_options={"betas": (0.9, 0.99)})


@pytest.mark.parametrize(
    ("options", "key", "hint"),
    [
        ({"ns_step": 3}, "ns_step", " (did you mean 'ns_steps'?)"),
        ({"adjust_lr_fn": "x"}, "adjust_lr_fn", " (did you mean 'adjust_lr'?)"),
    ],
)
def test_unknown_keys_in_make_optimizer(options: dict[str, Any], key: str, hint: str) -> None:
    with pytest.raises(ValueError, match=_unknown(key, " among make_optimizer's Muon options", hint)):
        make_optimizer(Tiny(), None, **options)


@pytest.mark.parametrize(
    ("value", "ours", "who"),
    [
        ("match_rms_adamw", "match_adamw", "torch.optim.Muon"),
        ("original", "keller", "torch.optim.Muon"),
        ("rms_norm", "match_adamw", "dion"),
    ],
)
def test_adjust_lr_names_of_other_libraries_get_a_hint(value: str, ours: str, who: str) -> None:
    message = (
        f"Invalid adjust_lr={value!r}: must be one of ('keller', 'match_adamw', 'spectral', None) "
        f"({who}'s {value!r} is {ours!r} here) in param group 0"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(4, 4))], "adjust_lr": value}])


def test_scheduler_keys_are_accepted_before_and_after_construction() -> None:
    model = Tiny()
    opt = muonkit.HybridMuon(muonkit.param_groups(model))
    max_lr = [g["lr"] for g in opt.param_groups]  # one per group: a scalar is warned (test_first_mistakes)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=10)  # writes initial_lr, max_lr, momenta...
    opt.param_groups[0]["note"] = "anything"  # keys written after construction are the writer's business
    tiny_loss(model).backward()
    opt.step()
    # groups copied from a scheduled optimizer carry the scheduler's keys: a new optimizer takes them
    copied = [dict(g) for g in opt.param_groups]
    del copied[0]["note"]
    assert {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"} <= set(copied[0])
    muonkit.HybridMuon(copied).step()


ADAMW_READS = "('lr', 'betas', 'eps', 'weight_decay', 'cautious_wd', 'state_dtype')"
UNREAD = [  # (algorithm, key, value): a key the group's algorithm never reads
    ("adamw", "ns_steps", 3),
    ("adamw", "momentum", 0.9),
    ("adamw", "nesterov", False),
    ("adamw", "ns_method", "newton_schulz"),
    ("adamw", "ns_coefficients", "keller"),
    ("adamw", "layout", "matrix"),
    ("adamw", "ns_compile", True),
    ("muon", "betas", (0.9, 0.99)),
    ("normuon", "betas", (0.9, 0.99)),
]


def _unread_message(algorithm: str, key: str, index: int) -> str:
    reads = ADAMW_READS if algorithm == "adamw" else str(muonkit.config.READ_KEYS[algorithm])
    return (
        f"Invalid key {key!r} in param group {index}: {algorithm!r} groups never read it, so it would be "
        f"ignored; {algorithm!r} groups read {reads}"
    )


@pytest.mark.parametrize(("algorithm", "key", "value"), UNREAD, ids=[f"{a}-{k}" for a, k, _ in UNREAD])
def test_a_key_the_group_algorithm_never_reads_is_refused(algorithm: str, key: str, value: Any) -> None:
    shape = (6,) if algorithm == "adamw" else (6, 4)
    group = {"params": [nn.Parameter(torch.randn(shape))], "algorithm": algorithm, key: value}
    with pytest.raises(ValueError, match="^" + re.escape(_unread_message(algorithm, key, 0)) + "$"):
        muonkit.HybridMuon([group])
    opt = muonkit.HybridMuon([{"params": [nn.Parameter(torch.randn(6, 4))]}])
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="^" + re.escape(_unread_message(algorithm, key, 1)) + "$"):
        opt.add_param_group(group)
    assert [dict(g) for g in opt.param_groups] == before and not opt.state


def test_adamw_keys_in_a_muon_optimizer_group_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape(_unread_message("muon", "betas", 0))):
        muonkit.Muon([{"params": [nn.Parameter(torch.randn(6, 4))], "betas": (0.9, 0.99)}])


def test_constructor_defaults_of_the_other_algorithm_still_apply_to_every_group() -> None:
    model = Tiny()
    opt = muonkit.HybridMuon(muonkit.param_groups(model), ns_steps=3, momentum=0.9, betas=(0.8, 0.9), nesterov=False)
    assert {g["algorithm"] for g in opt.param_groups} == {"muon", "adamw"}
    tiny_loss(model).backward()
    opt.step()
    back = muonkit.HybridMuon(muonkit.param_groups(model), ns_steps=3, momentum=0.9, betas=(0.8, 0.9))
    back.load_state_dict(opt.state_dict())  # saved groups hold every key: they load
    assert [g["nesterov"] for g in back.param_groups] == [False] * len(back.param_groups)


def test_a_copied_group_passes_at_the_defaults_and_an_edited_unread_key_is_refused() -> None:
    opt = muonkit.HybridMuon(muonkit.param_groups(Tiny()))
    adamw = next(g for g in opt.param_groups if g["algorithm"] == "adamw")
    muon = next(g for g in opt.param_groups if g["algorithm"] == "muon")
    opt.add_param_group({**adamw, "params": [nn.Parameter(torch.randn(6))], "param_names": ["b"]})
    opt.add_param_group({**muon, "params": [nn.Parameter(torch.randn(6, 4))], "param_names": ["w"]})
    n = len(opt.param_groups)
    message = _unread_message("adamw", "ns_steps", n).replace(
        "ignored;", "ignored (a group copied from param_groups may keep it only at the optimizer's default);"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        opt.add_param_group({**adamw, "params": [nn.Parameter(torch.randn(6))], "param_names": ["c"], "ns_steps": 3})
    with pytest.raises(ValueError, match="^" + re.escape(_unread_message("adamw", "momentum", n)) + "$"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(6))], "algorithm": "adamw", "momentum": 0.95})
    assert len(opt.param_groups) == n


# ---------------------------------------------------------------- values written between steps
# A steady step reuses each group's validated config while the group's values stay the same
# (muonkit.group_checks.GroupConfigs); whatever is written since, by assignment or in place, is
# validated before anything changes.


def _stepped(**muon: Any) -> tuple[list[nn.Parameter], muonkit.HybridMuon]:
    """A Muon group (one 6x4 matrix, ``muon`` its keys) and an AdamW group (a list ``betas``), after one step."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))]
    groups = [
        {"params": params[:1], "algorithm": "muon", **muon},
        {"params": params[1:], "algorithm": "adamw", "betas": [0.9, 0.95]},
    ]
    opt = muonkit.HybridMuon(groups)
    for seed in (0, 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        if seed == 0:
            opt.step()
    return params, opt


def _refused_and_unchanged(params: list[nn.Parameter], opt: muonkit.HybridMuon, message: str) -> None:
    weights = [p.detach().clone() for p in params]
    state = {k: v.clone() for p in params for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    assert all(torch.equal(v, state[k]) for p in params for k, v in opt.state[p].items())


@pytest.mark.parametrize(("key", "value", "message"), BAD_NUMBERS, ids=[f"{k}={v!r}" for k, v, _ in BAD_NUMBERS])
def test_a_bad_number_a_scheduler_writes_is_refused_before_anything_changes(key: str, value: Any, message: str) -> None:
    params, opt = _stepped(split_sizes=(2, 4))
    opt.param_groups[0][key] = value
    _refused_and_unchanged(params, opt, f"{message} in param group 0")


IN_PLACE: list[tuple[str, dict[str, Any], Any, str]] = [
    (
        "betas[1] of a list",
        {},
        lambda groups: groups[1]["betas"].__setitem__(1, 1.0),
        "Invalid betas[1]=1.0: must be in [0, 1) in param group 1",
    ),
    (
        "split_sizes of a list",
        {"split_sizes": [2, 4]},
        lambda groups: groups[0]["split_sizes"].__setitem__(0, 3),
        "Invalid split_sizes=(3, 4): they must sum to the 6 rows of a tensor of shape (6, 4) under layout='auto' "
        "in param group 0",
    ),
    (
        "ns_coefficients of nested lists",
        {"ns_coefficients": [[3.4445, -4.775, 2.0315]]},
        lambda groups: groups[0]["ns_coefficients"][0].__setitem__(0, float("nan")),
        "Invalid ns_coefficients=[[nan, -4.775, 2.0315]]: each step must be an (a, b, c) triple of finite floats "
        "in param group 0",
    ),
    (
        "a tensor lr",
        {"lr": torch.tensor(0.02)},
        lambda groups: groups[0]["lr"].fill_(-1.0),
        "Invalid lr=tensor(-1.): must be >= 0 in param group 0",
    ),
    (
        "a numpy lr replaced by another",
        {"lr": np.float64(0.02)},
        lambda groups: groups[0].__setitem__("lr", np.float64(-0.02)),
        "Invalid lr=np.float64(-0.02): must be >= 0 in param group 0",
    ),
]


@pytest.mark.parametrize(("muon", "change", "message"), [c[1:] for c in IN_PLACE], ids=[c[0] for c in IN_PLACE])
def test_a_value_changed_in_place_between_steps_is_validated_again(
    muon: dict[str, Any], change: Any, message: str
) -> None:
    params, opt = _stepped(**muon)
    change(opt.param_groups)
    _refused_and_unchanged(params, opt, message)


def test_a_steady_step_validates_only_the_groups_whose_values_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    _, opt = _stepped(split_sizes=[2, 4])
    validated: list[int | None] = []
    group_config = muonkit.group_checks.group_config  # what GroupConfigs validates with
    monkeypatch.setattr(
        muonkit.group_checks, "group_config", lambda g, i=None: validated.append(i) or group_config(g, i)
    )
    opt.step()
    assert validated == []
    opt.param_groups[1]["betas"][0] = 0.8  # in place: the same list
    opt.step()
    opt.param_groups[0]["lr"] = -0.0  # equal to 0.0, but not the same bits
    opt.step()
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    assert validated == [1, 0, 0]


def test_a_valid_value_changed_in_place_takes_effect() -> None:
    """Changed in place or replaced, a new ``betas`` and ``split_sizes`` step alike (and unlike the old)."""
    runs = []
    for how in ("in place", "replaced", "unchanged"):
        params, opt = _stepped(split_sizes=[2, 4])
        muon, adamw = opt.param_groups
        if how == "in place":
            adamw["betas"][0], muon["split_sizes"][:] = 0.5, [3, 3]
        elif how == "replaced":
            adamw["betas"], muon["split_sizes"] = [0.5, 0.95], [3, 3]
        opt.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    assert not any(torch.equal(a, c) for a, c in zip(runs[0], runs[2], strict=True))
