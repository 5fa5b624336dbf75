"""Fuzzing what users hand the optimizer: constructor keywords and param groups of any value and type.

The contract, for every input: either the constructor (or ``add_param_group``) raises ValueError
or TypeError with a message and changes nothing, or it accepts, and then every hyperparameter it
stored is in range and of a plain type, no unknown key was kept, and a step on finite gradients
(with moderate settings) leaves finite weights. Any other exception fails. Bounded: a few hundred
examples, derandomized (the ``ci`` profile in conftest.py; ``HYPOTHESIS_PROFILE=deep`` runs 20x more).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import muonkit
from muonkit.config import READ_KEYS

EXAMPLES = settings().max_examples * 6  # 150 under the ci profile

finite = st.floats(-2.0, 2.0, allow_nan=False)
number = st.one_of(
    st.floats(),  # nan, inf, huge, subnormal, -0.0
    st.integers(-3, 300),
    st.just(10**400),
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.floats().map(np.array),  # 0-d arrays
    st.integers(-3, 200).map(np.int64),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.fractions(),
    st.booleans(),
    st.just(np.bool_(True)),
    st.floats(width=32).map(torch.tensor),
    st.just(torch.tensor([0.1, 0.2])),
    st.complex_numbers(max_magnitude=2),
)
junk = st.one_of(
    st.none(), st.text(max_size=4), st.just(object()), st.just(torch.float16), st.lists(number, max_size=3)
)
anything = st.one_of(number, junk)


def _or_anything(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(plausible, plausible, plausible, anything)  # mostly plausible, so that many are accepted


def _pair(element: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.tuples(element, element), st.lists(element, max_size=3), anything)


unit = st.one_of(st.floats(0.0, 0.999), st.floats(0.0, 0.999).map(np.float32), st.just(Decimal("0.9")))
small = st.one_of(st.floats(0.0, 0.1), st.floats(0.0, 0.1).map(np.float64), st.fractions(0, 1, max_denominator=100))
GROUP_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "lr": _or_anything(small),
    "momentum": _or_anything(unit),
    "nesterov": _or_anything(st.booleans()),
    "ns_coefficients": _or_anything(
        st.sampled_from(["polar_express", "keller", "you", (3.4, -4.7, 2.0), "newton"])
        | st.lists(st.tuples(finite, finite, number), max_size=2)
    ),
    "ns_steps": _or_anything(st.sampled_from([None, 5, np.int32(3), 7, 0, -1, 101])),
    "eps": _or_anything(st.floats(1e-12, 1e-3) | st.sampled_from([1e-8, Decimal("1e-7"), 0.0])),
    "weight_decay": _or_anything(small),
    "adjust_lr": _or_anything(st.sampled_from(["keller", "match_adamw", "spectral", None, "original", "rms_norm"])),
    "layout": _or_anything(st.sampled_from(["auto", "matrix", "transposed", "experts", "flatten", "diag"])),
    "split_sizes": _or_anything(st.none() | st.lists(st.integers(-1, 4), max_size=3).map(tuple)),
    "ns_dtype": _or_anything(st.sampled_from([None, torch.float32, torch.float64, torch.float16, torch.int32])),
    "ns_method": _or_anything(st.sampled_from(["gram", "newton_schulz", "svd"])),
    "betas": _pair(unit),
    "cautious_wd": _or_anything(st.booleans()),
    "ns_compile": _or_anything(st.booleans()),
    "state_dtype": _or_anything(st.sampled_from(["fp32", "bf16", "8bit", "fp16", "int8"])),
    "algorithm": st.sampled_from(["muon", "muon", "adamw", None, "sgd", 3, "normuon"]),
}
UNKNOWN_KEYS = ["ns_step", "adjust_lr_fn", "momentun", "foreach", "maximize", "beta1", "color", "LR"]
KNOWN = {"params", "param_names", "algorithm", "beta2", *GROUP_VALUES}  # beta2: NorMuon's, from normuon_beta2
CONSTRUCTOR_VALUES = {
    **{k: v for k, v in GROUP_VALUES.items() if k not in ("algorithm", "layout", "split_sizes")},
    "normuon_beta2": _or_anything(unit),
    "normuon_eps": _or_anything(st.floats(1e-12, 1e-3)),
    "adamw_lr": _or_anything(small),
    "adamw_eps": _or_anything(st.floats(1e-12, 1e-3)),
    "adamw_weight_decay": _or_anything(small),
    "nonfinite": st.sampled_from(["skip", "raise", "unchecked", "ignore", None]),
    "capturable": _or_anything(st.booleans()),
}


@st.composite
def group_dicts(draw: Callable[..., Any], *, params: list[nn.Parameter], algorithm: Any = None) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(GROUP_VALUES)), max_size=3, unique=True))
    group: dict[str, Any] = {"params": params, **{k: draw(GROUP_VALUES[k]) for k in keys}}
    if algorithm is not None:
        group["algorithm"] = algorithm
    chosen = group.get("algorithm") or ("muon" if all(p.ndim >= 2 for p in params) else "adamw")
    reads = READ_KEYS.get(chosen) if isinstance(chosen, str) else None
    if reads is not None and draw(st.sampled_from([True] * 4 + [False])):  # mostly keys its algorithm reads
        group = {k: v for k, v in group.items() if k in (*reads, "params", "algorithm")}
    if draw(st.sampled_from([False] * 9 + [True])):  # hypothesis favours the first choice
        group[draw(st.sampled_from(UNKNOWN_KEYS))] = draw(anything)
    return group


def _params() -> tuple[nn.Parameter, nn.Parameter]:
    return nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))


def _real(value: Any) -> float:
    """The test's own reading of a stored number: plain Python numbers or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        assert value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool
        return float(value.item())
    assert type(value) in (int, float), f"stored {value!r} of type {type(value).__name__}, not a Python number"
    return float(value)


def _check_stored(group: dict[str, Any]) -> None:
    """What an accepted group holds is in range, whatever the validation code says."""
    assert set(group) <= KNOWN, set(group) - KNOWN
    lr, eps, wd = _real(group["lr"]), _real(group["eps"]), _real(group["weight_decay"])
    assert math.isfinite(lr) and lr >= 0 and math.isfinite(eps) and eps > 0 and math.isfinite(wd) and wd >= 0
    assert type(group["cautious_wd"]) is bool
    assert group["state_dtype"] in ("fp32", "bf16", "8bit")
    assert ("beta2" in group) == (group["algorithm"] == "normuon")
    if group["algorithm"] == "normuon":
        assert 0 <= _real(group["beta2"]) < 1
    if group["algorithm"] in ("muon", "normuon"):
        assert 0 <= _real(group["momentum"]) < 1 and type(group["nesterov"]) is bool
        assert type(group["ns_compile"]) is bool
        steps = group["ns_steps"]
        assert steps is None or (type(steps) is int and 1 <= steps <= 100)
    else:
        assert group["algorithm"] == "adamw" and len(group["betas"]) == 2
        assert all(0 <= _real(b) < 1 for b in group["betas"])


def _moderate(group: dict[str, Any]) -> bool:
    """Settings under which a step on finite gradients must stay finite (a huge lr or a made-up
    Newton-Schulz polynomial may legitimately overflow)."""
    return (
        _real(group["lr"]) <= 1.0 and _real(group["weight_decay"]) <= 1.0 and isinstance(group["ns_coefficients"], str)
    )


def _step_stays_finite(opt: muonkit.HybridMuon) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    if all(_moderate(g) for g in opt.param_groups):
        assert all(torch.isfinite(p).all() for p in params)


def _refused_clearly(error: Exception) -> None:
    assert isinstance(error, (ValueError, TypeError)) and len(str(error)) > 10, repr(error)


def test_fuzzed_constructor_and_groups() -> None:
    outcomes: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        matrix, vector = _params()
        groups = [
            data.draw(group_dicts(params=[matrix]), label="muon group"),
            data.draw(group_dicts(params=[vector], algorithm="adamw"), label="adamw group"),
        ]
        keys = data.draw(st.lists(st.sampled_from(sorted(CONSTRUCTOR_VALUES)), max_size=3, unique=True))
        kwargs = {k: data.draw(CONSTRUCTOR_VALUES[k], label=k) for k in keys}
        try:
            opt = muonkit.HybridMuon(groups, **kwargs)
        except (ValueError, TypeError) as e:
            _refused_clearly(e)
            outcomes["refused"] += 1
            return
        outcomes["accepted"] += 1
        for group in opt.param_groups:
            _check_stored(group)
        _step_stays_finite(opt)

    run()
    assert outcomes["accepted"] >= 10 and outcomes["refused"] >= 10, outcomes  # both branches exercised


def test_fuzzed_add_param_group_changes_nothing_when_refused() -> None:
    outcomes: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES // 2)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        matrix, vector = _params()
        opt = muonkit.HybridMuon([{"params": [matrix]}])
        before = [dict(g) for g in opt.param_groups]
        group = data.draw(group_dicts(params=[vector if data.draw(st.booleans()) else nn.Parameter(torch.randn(3, 5))]))
        try:
            opt.add_param_group(group)
        except (ValueError, TypeError) as e:
            _refused_clearly(e)
            assert opt.param_groups == before
            outcomes["refused"] += 1
            return
        outcomes["accepted"] += 1
        _check_stored(opt.param_groups[-1])
        _step_stays_finite(opt)

    run()
    assert outcomes["accepted"] >= 5 and outcomes["refused"] >= 5, outcomes


def test_the_ci_hypothesis_profile_is_the_one_loaded() -> None:
    """torch.testing._internal loads its own profile on import (tests/conftest.py imports it first)."""
    import os

    pytest.importorskip("expecttest", reason="torch.testing._internal imports expecttest (muonkit's [dev] extra)")
    import torch.testing._internal.common_utils  # noqa: F401

    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        assert settings().max_examples == 25 and settings().derandomize, settings()
