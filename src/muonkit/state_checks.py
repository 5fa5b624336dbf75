"""What :meth:`muonkit.HybridMuon.load_state_dict` checks before it changes anything.

A state dict must fit the optimizer's groups (same count, same params per group, same algorithm),
each param's state must hold exactly its algorithm's keys (:data:`STATE_KEYS`) in the param's
shape, and every value must be one a checked step could have written: finite, non-negative
second moments, within what the state's dtype (or the next step) can hold. State saved by
``torch.optim.AdamW`` or ``torch.optim.Muon`` is renamed first (:mod:`muonkit.foreign_state`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig, group_config
from muonkit.foreign_state import muonkit_group
from muonkit.functional.rules import RULES
from muonkit.functional.update_rule import StateSpec
from muonkit.group_checks import SWAPPED_PARAMS, check_muon_params
from muonkit.limits import exp_avg_limit, work_dtype
from muonkit.state_precision import SCALE_SUFFIX, check_stored

STATE_KEYS = {
    **{name: tuple(s.key for s in rule.states) for name, rule in RULES.items()},
    "adamw": ("exp_avg", "exp_avg_sq", "step"),
}
"""The state each algorithm keeps per param, and nothing else."""

_LOW_PRECISION_KEYS = {
    algorithm: frozenset([*(k + SCALE_SUFFIX for k in keys if k != "step"), *(["step"] if algorithm in RULES else [])])
    for algorithm, keys in STATE_KEYS.items()
}
"""The entries a state may hold beside :data:`STATE_KEYS` (:mod:`muonkit.state_precision`): an 8-bit
state's block scales, and the step count salting a Muon-family param's bf16 rounding."""

STEP_MAX = torch.finfo(torch.float32).max
"""The largest step count a state may hold: AdamW keeps it in float32 (a step at this count stays finite)."""


def check_state_dict(
    state_dict: Mapping[str, Any],
    groups: Sequence[Mapping[str, Any]],
    *,
    whole_shapes: Callable[[Tensor], list[tuple[int, ...]]],
    local: Callable[[Tensor], Tensor],
) -> dict[str, Any]:
    """Validate ``state_dict`` against the optimizer's ``groups``; returns it with muonkit's group keys.

    ``whole_shapes`` and ``local``: how the strategy reads a param (its whole tensors, the part
    this rank holds), where the shapes and values are checked.
    """
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), Sequence)
    ):
        raise ValueError("Invalid optimizer state: expected a dict with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"Optimizer state has {len(saved_groups)} param groups, this optimizer has {len(groups)}")
    index = 0
    checked: list[dict[str, Any]] = []
    for gi, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), Sequence):
            raise ValueError(f"Invalid optimizer state: param group {gi} has no 'params' list")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"Param group {gi} has {len(group['params'])} params, the saved state has {len(saved['params'])}"
            )
        saved = muonkit_group(saved, group["algorithm"], gi)
        checked.append(saved)
        algorithm = saved["algorithm"]
        if algorithm != group["algorithm"]:
            raise ValueError(f"Param group {gi} is {group['algorithm']!r} here but {algorithm!r} in the saved state")
        merged = {**group, **{k: v for k, v in saved.items() if k != "params"}}  # as load_state_dict will
        config = group_config(merged, gi)
        rows = None
        if isinstance(config, MuonConfig):
            shapes = [s for p in group["params"] for s in whole_shapes(p)]
            check_muon_params(group["params"], config, gi, shapes=shapes, hint=SWAPPED_PARAMS)
            rows = functools.partial(row_count, whole_shapes=whole_shapes, layout=config.layout)
        for p, pid in zip(group["params"], saved["params"], strict=True):
            state = state_dict["state"].get(pid)
            check_param_state(state, p, algorithm, gi, index, local=local, rows=rows, config=config)
            index += 1
    return {**state_dict, "param_groups": checked}


def saved_skipped_steps(state_dict: Mapping[str, Any], *, default: int) -> int:
    """``skipped_steps`` of a state dict; one saved before it was kept has none: the current count stays."""
    value = state_dict.get("skipped_steps", default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid optimizer state: skipped_steps={value!r} must be an int >= 0")
    return value


def check_param_state(
    state: Mapping[str, Any] | None,
    p: Tensor,
    algorithm: str,
    group: int,
    index: int,
    *,
    local: Callable[[Tensor], Tensor],
    rows: Callable[[Tensor, StateSpec], int | None] | None = None,
    config: MuonConfig | AdamWConfig | None = None,
) -> None:
    """``local``: the part of a (sharded) state this rank holds, where its values are checked;
    ``rows``: the length of a param's ``"rows"`` state (:class:`StateSpec`); ``config``: the group's settings, which
    bound what a step writes (:func:`state_bound`)."""
    if not state:
        return
    expected = STATE_KEYS[algorithm]
    missing = [k for k in expected if k not in state]
    unexpected = sorted(k for k in state if k not in expected and k not in _LOW_PRECISION_KEYS[algorithm])
    if missing or unexpected:
        what = f"lacks {missing}" if missing else f"has keys a {algorithm} group does not keep: {unexpected}"
        raise ValueError(f"Saved state of param {index} (group {group}, {algorithm}) {what}; has {sorted(state)}")
    specs = {s.key: s for s in RULES[algorithm].rows_states} if algorithm in RULES else {}
    for key in expected:
        value = state[key]
        spec = specs.get(key)
        if key == "step":
            check_step(value, group, index)
            continue
        if key.endswith(SCALE_SUFFIX):
            continue  # checked with its codes (check_stored)
        count = rows(p, spec) if spec is not None and rows is not None else None
        want = tuple(p.shape) if spec is None else (count,) if count is not None else None
        if not isinstance(value, Tensor) or (tuple(value.shape) != want if want is not None else value.ndim != 1):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            what = f"needs {want} (one value per matrix row)" if spec is not None else f"has {tuple(p.shape)}"
            raise ValueError(f"Saved {key} of param {index} (group {group}) has shape {shape}, the param {what}")
        if not value.is_floating_point():
            raise ValueError(
                f"Saved {key} of param {index} (group {group}) has dtype {value.dtype}: must be floating point"
            )
        try:
            values = check_stored(state, key, p, local, unsigned=key in NONNEGATIVE, rows=spec is not None)
        except ValueError as e:
            raise ValueError(f"Saved state of param {index} (group {group}): {e}") from None
        bound = state_bound(key, p, config)
        check_state_values(values, key, group, index, bound=bound)
    if algorithm in RULES and "step" in state:  # the count salting a bf16 state's rounding
        check_step(state["step"], group, index)


def row_count(
    p: Tensor, spec: StateSpec, *, whole_shapes: Callable[[Tensor], list[tuple[int, ...]]], layout: Any
) -> int | None:
    """The length of ``p``'s ``"rows"`` state ``spec``; None while the whole tensors are not known yet."""
    shapes = whole_shapes(p)
    return sum(spec.length(s, layout) for s in shapes) if shapes else None


def state_bound(key: str, p: Tensor, config: MuonConfig | AdamWConfig | None) -> tuple[float, str]:
    """The largest magnitude a state ``key`` of ``p`` may hold, and why: what a checked step
    writes (:mod:`muonkit.functional.overflow`), so that every state such a step writes loads."""
    dtype = work_dtype(p.dtype)
    if key == "exp_avg" and isinstance(config, AdamWConfig):
        return exp_avg_limit(config, dtype), (
            f"the largest a step writes with eps={config.eps:g} in {dtype} (beyond it the update may overflow)"
        )
    return torch.finfo(dtype).max, f"the largest {dtype} (the state's dtype)"


def check_state_values(
    value: Tensor, key: str, group: int, index: int, *, bound: tuple[float, str] = (math.inf, "")
) -> None:
    """Non-finite momentum or moments, or a negative second moment, would turn the next step's
    update into NaN (and the params with it); refuse them at load time, and values beyond
    ``bound`` (the largest magnitude allowed, and why), which the state's dtype cannot hold or
    the next step could overflow on."""
    if value.numel() == 0:
        return
    low, high = (float(x) for x in torch.aminmax(value.detach()))  # NaN propagates to both
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(
            f"Saved {key} of param {index} (group {group}) has non-finite values (min {low:.4g}, max {high:.4g}): "
            "must be finite"
        )
    limit, why = bound
    if max(-low, high) > limit:
        raise ValueError(
            f"Saved {key} of param {index} (group {group}) has values up to {max(-low, high):.4g} in magnitude: "
            f"must be within {limit:.4g}, {why}"
        )
    if key in NONNEGATIVE and low < 0:
        raise ValueError(
            f"Saved {key} of param {index} (group {group}) has negative values (min {low:.4g}): must be >= 0"
        )


NONNEGATIVE = frozenset(["exp_avg_sq", *(s.key for rule in RULES.values() for s in rule.states if s.nonnegative)])
"""The state keys of second moments (never negative)."""


def check_step(value: Any, group: int, index: int) -> None:
    """AdamW's ``step``: a number >= 0 (or a one-element tensor holding one) that float32 holds."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        number: Any = value.item()
    else:
        number = value
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= STEP_MAX:
        raise ValueError(
            f"Saved step of param {index} (group {group}) is {value!r}: must be a number >= 0 or a one-element tensor, "
            f"at most {STEP_MAX:.8g} (the largest float32: the step counter's dtype)"
        )
