"""What :class:`muonkit.HybridMuon` checks about its param groups and params, with the messages.

At construction and :meth:`~muonkit.HybridMuon.add_param_group` (a group's ``params``, its
algorithm, the optimizer's keywords) and at every step, before anything changes (the params that
step, their gradients and their states' shapes): whatever is wrong raises here, naming the group,
what was wrong and what is allowed. The hyperparameters themselves are validated by
:func:`muonkit.config.group_config`.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from muonkit.config import AdamWConfig, MuonConfig, group_config, key_hint
from muonkit.distributed import Strategy
from muonkit.distributed.base import full_shape
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.quantize import SCALE_SUFFIX
from muonkit.functional.rules import WHOLE_STATES

SWAPPED_PARAMS = (
    ". add_param_group checked this group, so its params were replaced afterwards: DeepSpeed ZeRO hands "
    "step() flat 1-D partitions. Call muonkit.integrations.deepspeed.install(engine) right after "
    "deepspeed.initialize(optimizer=...), or build the engine with muonkit.integrations.deepspeed.initialize "
    "(the HF Trainer: muonkit.integrations.deepspeed.trainer_setup)"
)
"""Why a Muon group holds a < 2-D tensor at ``step()`` or ``load_state_dict()``."""


class GroupConfigs:
    """Each param group's validated config, validated again only when the group's values change.

    A steady step reads every group's config; validating unchanged values again was a seventh of
    a step's Python calls. A group's config is kept under a snapshot of its values (every key but
    ``params`` and ``param_names``, sequences element by element) and reused while the snapshot
    is equal: a value written since (a scheduler's new ``lr``, ``group["betas"][0] = ...`` in
    place) makes a new snapshot, validated before anything changes, and a bad one raises as
    :func:`group_config` does. Groups holding a value whose contents may change unseen (a tensor,
    a numpy array, an unknown object) are validated at every call.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, ...], MuonConfig | AdamWConfig] = {}

    def __call__(self, group: Mapping[str, Any], index: int) -> MuonConfig | AdamWConfig:
        """``group_config(group, index)``, from the snapshot of ``group``'s values if they were validated before.

        Kept by the values alone (a config is a function of them), not by the group's index:
        DeepSpeed ZeRO-1/2 steps one group at a time, each as ``param_groups[0]``.
        """
        values = snapshot(group)
        config = None if values is None else self._kept.get(values)
        if config is None:
            config = group_config(group, index)
            if values is not None:
                if len(self._kept) >= _KEPT:  # an lr scheduler makes new values every step
                    self._kept.clear()
                self._kept[values] = config
        return config


_KEPT = 256
"""Snapshots :class:`GroupConfigs` keeps before it starts afresh."""


_ATOMS = frozenset({int, bool, str, type(None), torch.dtype})
"""Immutable value types compared as they are (a float by its bits: ``-0.0`` and ``0.0`` differ)."""


def snapshot(group: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """``group``'s values (all keys but ``params`` and ``param_names``) as an immutable tuple that
    is equal exactly when every value is of the same type with the same bits; None when a value
    could change without a new snapshot seeing it (a tensor, an array, an unknown object)."""
    out: list[Any] = []
    for key, value in group.items():
        kind = type(value)
        if kind is float:
            out.append((key, value.hex()))
        elif kind in _ATOMS:
            out.append((key, kind, value))
        elif key != "params" and key != "param_names":
            frozen = _frozen(value)
            if frozen is None:
                return None
            out.append((key, frozen))
    return tuple(out)


def _frozen(value: Any) -> Any:
    """An immutable copy of a sequence of numbers or a numeric scalar, tagged by type; None if there is none."""
    kind = type(value)
    if kind is float:
        return value.hex()
    if kind in _ATOMS:
        return (kind, value)
    if kind is list or kind is tuple:
        items = [_frozen(v) for v in value]
        return None if None in items else (kind, tuple(items))
    if kind.__module__ in ("numpy", "decimal", "fractions") and isinstance(value, numbers.Number):
        return (kind, repr(value))  # numpy scalars, Decimal, Fraction: immutable (a 0-d array is no Number)
    return None


def check_keywords(owner: str, unknown: Mapping[str, Any], keywords: Sequence[str]) -> None:
    """Python's unexpected-keyword TypeError, with the hint a torch user needs (``adjust_lr_fn`` -> ``adjust_lr``)."""
    if unknown:
        key = next(iter(unknown))
        raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}{key_hint(key, keywords)}")


def tensors_and_names(params: Any, index: int) -> tuple[list[Tensor], list[str] | None]:
    """A group's ``params`` as a list of tensors, and their names if given as ``(name, tensor)`` pairs."""
    if isinstance(params, set):
        raise TypeError("Invalid params: a set has no stable order (state_dict would mismatch); use a list")
    if isinstance(params, Tensor):
        return [params], None
    try:
        items = list(params)
    except TypeError:
        raise TypeError(
            f"Invalid params in param group {index}: expected a tensor or an iterable of tensors, "
            f"got {type(params).__name__}"
        ) from None
    pairs = [isinstance(p, tuple) for p in items]
    if any(pairs) and not all(pairs):  # torch.optim's own message
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    names = None
    if items and all(pairs):
        if not all(len(p) == 2 and isinstance(p[0], str) for p in items):
            raise TypeError(f"Invalid params in param group {index}: named params must be (str, tensor) pairs")
        names, items = [p[0] for p in items], [p[1] for p in items]
    for p in items:
        if not isinstance(p, Tensor):
            raise TypeError(
                f"Invalid params in param group {index}: optimizer can only optimize Tensors, "
                f"but one of the params is {torch.typename(p)}"
            )
    return items, names


def default_algorithm(params: list[Tensor], index: int, *, advice: str) -> str:
    """A group without ``algorithm``: Muon if every tensor is >= 2D, else an error ending in ``advice``."""
    if all(len(full_shape(p)) >= 2 for p in params):
        return "muon"
    raise ValueError(f"Param group {index} has no 'algorithm' and contains tensors with < 2 dims: {advice}")


def check_muon_params(
    params: list[Tensor],
    config: MuonConfig,
    index: int,
    *,
    shapes: Sequence[tuple[int, ...]] | None = None,
    hint: str = "; put it in an algorithm='adamw' group",
) -> None:
    """The tensors of a group of an update rule (validated as ``config``) are matrices its layout can cut.

    ``shapes``: the whole tensors behind ``params`` when they differ (a strategy's ``whole_shapes``).
    ``hint``: the advice after a < 2-D tensor's error."""
    for shape in [full_shape(p) for p in params] if shapes is None else shapes:
        if len(shape) < 2:
            raise ValueError(
                f"Param group {index} (algorithm={config.algorithm!r}) has a tensor of shape {shape}: "
                f"Muon needs >= 2 dims{hint}"
            )
        try:
            _cuts(config.layout, tuple(shape))
        except ValueError as e:
            raise ValueError(f"{e} in param group {index}") from None
    check_ns_dtype(config, params, index)


@functools.lru_cache(maxsize=4096)
def _cuts(layout: MatrixLayout, shape: tuple[int, ...]) -> bool:
    """Whether ``layout`` cuts a tensor of ``shape`` (else its ValueError), worked out once per pair."""
    layout.blocks(shape)
    return True


def check_ns_dtype(config: MuonConfig, params: Sequence[Tensor], index: int) -> None:
    """fp16 on a CPU is a user error; catch it here, not halfway through a step."""
    if config.ns_dtype == torch.float16 and any(p.device.type == "cpu" for p in params):
        raise ValueError(
            f"Invalid ns_dtype=torch.float16 in param group {index}: fp16 matmul is ~1000x slower on CPU; "
            "use torch.bfloat16 or torch.float32"
        )


def checked_work(
    groups: Sequence[Mapping[str, Any]],
    configs: Sequence[Any],
    *,
    strategy: Strategy,
    state: Mapping[Tensor, Any],
) -> list[list[Tensor]]:
    """The params each group steps (those with a gradient), after every check a step could
    otherwise fail halfway: gradients, Muon tensors as the strategy sees them, state shapes."""
    work = [params_with_grad(g) for g in groups]
    for i, (config, group, params) in enumerate(zip(configs, groups, work, strict=True)):
        if isinstance(config, MuonConfig):
            if params:
                strategy.check_params(params)
            shapes = [s for p in group["params"] for s in strategy.whole_shapes(p)]
            check_muon_params(group["params"], config, i, shapes=shapes, hint=SWAPPED_PARAMS)
        for p in params:
            check_state_fits(state.get(p, {}), p, strategy.local, i)
    return work


def params_with_grad(group: Mapping[str, Any]) -> list[Tensor]:
    """The params of ``group`` that have a gradient; sparse and complex gradients raise."""
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        grad = cast(Tensor, p.grad)
        if grad.layout != torch.strided:  # COO, CSR, ...: all sparse layouts
            raise RuntimeError(
                "HybridMuon does not support sparse gradients; use torch.optim.SparseAdam for those params"
            )
        if p.is_complex() or grad.is_complex():
            raise RuntimeError("HybridMuon does not support complex params or gradients")
    return params


def check_state_fits(state: Mapping[str, Any], p: Tensor, local: Callable[[Tensor], Tensor], group: int) -> None:
    """A param whose shape or device changed after it got state (or whose grad does not fit it) raises."""
    shape, device = tuple(local(p).shape), p.device
    named = {"grad": cast(Tensor, p.grad)} | {
        k: v
        for k, v in state.items()
        if isinstance(v, Tensor) and v.ndim > 0 and k not in WHOLE_STATES and not k.endswith(SCALE_SUFFIX)
    }  # rows states are whole on every rank, 8-bit block scales shaped by their blocks: checked on load
    for key, value in named.items():
        if tuple(local(value).shape) != shape or value.device != device:
            raise ValueError(
                f"A param of shape {tuple(p.shape)} on {device} in param group {group} has a {key} of shape "
                f"{tuple(value.shape)} on {value.device}: a param's shape and device must not change once the "
                "optimizer has state for it (load a state_dict made for the new param, or build a new optimizer)"
            )


GRADIENTLESS_STEPS_ALLOWED = 3
"""Steps in a row in which no param has a gradient that :func:`check_gradients_arrive` lets pass
(with a warning) before it raises."""


def check_gradients_arrive(groups: Sequence[Mapping[str, Any]], *, run: int) -> None:
    """The ``run``-th step in a row in which none of the optimizer's params has a gradient: a
    warning for the first :data:`GRADIENTLESS_STEPS_ALLOWED` (:func:`warn_no_gradients`), then
    ``RuntimeError`` with the same message.

    One such step is allowed, as torch.optim allows it (a closure that skipped a batch, torch's
    own optimizer tests); a run of them is a training that trains nothing, whose warning scrolls by
    (TRL's ``SFTTrainer(peft_config=...)`` with a prebuilt optimizer went to its end).
    """
    if run <= GRADIENTLESS_STEPS_ALLOWED:
        warn_no_gradients(groups, stacklevel=3)
        return
    params = [p for g in groups for p in g["params"]]
    if params:
        raise RuntimeError(
            f"{_no_gradient_message(params)}. {run} steps in a row had no gradient: refusing to go on "
            "training nothing (a step that has a gradient resets the count; if the params are frozen on purpose "
            "for a while, skip this optimizer's step() until they train)"
        )


def warn_no_gradients(groups: Sequence[Mapping[str, Any]], *, stacklevel: int = 2) -> None:
    """A step in which none of the optimizer's params has a gradient trains nothing: say so, and why.

    A warning, not an error: torch.optim allows such a step (a closure that skipped a batch,
    torch's own optimizer tests); :func:`check_gradients_arrive` raises after a few in a row. The
    usual cause is a model wrapped after the optimizer was built (PEFT's ``get_peft_model``, TRL's
    ``SFTTrainer(peft_config=...)``): the optimizer holds the frozen base weights and the new
    adapter params it never sees.
    """
    params = [p for g in groups for p in g["params"]]
    if not params:
        return
    warnings.warn(_no_gradient_message(params), RuntimeWarning, stacklevel=stacklevel + 1)  # the optimizer's step


def _no_gradient_message(params: Sequence[Tensor]) -> str:
    frozen = sum(not p.requires_grad for p in params)
    return (
        f"HybridMuon.step() found no gradient on any of its {len(params)} params, so nothing was trained "
        f"({frozen} of them have requires_grad=False). Likely cause: the model was wrapped or frozen after "
        "the optimizer was built (PEFT get_peft_model, TRL SFTTrainer(peft_config=...) with an optimizer "
        "passed in optimizers=): the optimizer holds the frozen base weights, not the new trainable adapter "
        "params. Build the optimizer from the model that trains (after get_peft_model; with TRL, "
        "muonkit.integrations.transformers.MuonSFTTrainer builds it there), or call backward() before step()"
    )


def warn_one_cycle_max_lr(groups: Sequence[Mapping[str, Any]], configs: Sequence[MuonConfig | AdamWConfig]) -> None:
    """torch's ``OneCycleLR`` with a scalar ``max_lr`` drives every group to the same lr: Muon's and
    AdamW's, which differ by ~50x. Warn (once, at the first step: the scheduler is built before it)
    where a Muon group and an AdamW group hold the same ``max_lr`` (the key ``OneCycleLR`` writes
    into every group) and the Muon group does not scale its lr to AdamW's (``adjust_lr="match_adamw"``,
    where one lr for both is Moonlight's intent).
    """
    peaks = [
        (i, c, g["max_lr"])
        for i, (g, c) in enumerate(zip(groups, configs, strict=True))
        if isinstance(g.get("max_lr"), (int, float))
    ]
    adamw = {value: i for i, c, value in peaks if isinstance(c, AdamWConfig)}
    same = [
        (i, adamw[value], value)
        for i, c, value in peaks
        if isinstance(c, MuonConfig) and c.adjust_lr != "match_adamw" and value in adamw
    ]
    if same:
        i, j, value = same[0]
        warnings.warn(
            f"HybridMuon's Muon param group {i} and AdamW param group {j} have the same max_lr={value!r} (set by "
            "torch.optim.lr_scheduler.OneCycleLR from a scalar max_lr): the scheduler drives both to one lr, while "
            "Muon's lr is ~50x AdamW's. Pass one max_lr per param group, e.g. OneCycleLR(opt, "
            'max_lr=[g["lr"] for g in opt.param_groups], ...) (each group peaks at its own lr), or give the Muon '
            'groups adjust_lr="match_adamw" if one lr for both is meant',
            UserWarning,
            stacklevel=4,  # HybridMuon.step (torch.optim's wrappers above it vary)
        )
