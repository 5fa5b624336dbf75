"""Optimizer state saved by ``torch.optim.AdamW`` or ``torch.optim.Muon``, read as muonkit's.

:meth:`muonkit.HybridMuon.load_state_dict` accepts another optimizer's state only where it maps
cleanly, i.e. the arithmetic after loading is the one the saved optimizer would have run:

- ``torch.optim.AdamW`` (or ``torch.optim.Adam`` without weight decay) into an
  ``algorithm="adamw"`` group: ``lr``, ``betas``, ``eps``, ``weight_decay`` and the states
  ``exp_avg``, ``exp_avg_sq``, ``step`` are muonkit's own. ``foreach``, ``fused``,
  ``capturable`` and ``differentiable`` choose an implementation of the same math and are dropped;
  ``amsgrad=True``, ``maximize=True`` and Adam's coupled (L2) weight decay are refused, muonkit
  does not implement them.
- ``torch.optim.Muon`` into an ``algorithm="muon"`` group (``muonkit.Muon`` or a HybridMuon Muon
  group): the same EMA ``momentum_buffer``; ``adjust_lr_fn`` becomes ``adjust_lr``
  (``None``/``"original"`` -> ``"keller"``, ``"match_rms_adamw"`` -> ``"match_adamw"``).

A group is muonkit's when it has ``"algorithm"``, torch.optim.AdamW's when it has ``betas`` and
``amsgrad``, torch.optim.Muon's when it has ``adjust_lr_fn``. Anything else (another optimizer,
a key none of these has, AdamW state for a Muon group or the reverse) raises ``ValueError``
naming the group and the reason. Keys that LR schedulers add (``initial_lr``, ...) and
``param_names`` pass through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from muonkit.config import TORCH_ONLY_KEYS

__all__ = ["muonkit_group"]

# Keys any torch.optim group may carry: torch's own and those of torch's LR schedulers.
_GENERIC = {"params", "param_names", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"}
_ADAMW_KEYS = {"lr", "betas", "eps", "weight_decay"}
_ADAMW_FLAGS = set(TORCH_ONLY_KEYS)
_MUON_KEYS = {"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps"}
_ADJUST_LR = {None: "keller", "original": "keller", "match_rms_adamw": "match_adamw"}


def muonkit_group(saved: Mapping[str, Any], algorithm: str, index: int) -> dict[str, Any]:
    """The saved param group ``index`` as a muonkit group of ``algorithm`` (a copy), or ``ValueError``."""
    if "algorithm" in saved:
        return dict(saved)
    if "adjust_lr_fn" in saved:
        source, group = "torch.optim.Muon", _from_muon(saved, index)
    elif "betas" in saved and "amsgrad" in saved:
        source, group = "torch.optim.AdamW", _from_adamw(saved, index)
    else:
        keys = sorted(k for k in saved if k != "params")
        raise ValueError(
            f"Param group {index} of the saved state is from another optimizer (no 'algorithm'; keys {keys}): "
            "only muonkit's, torch.optim.AdamW's and torch.optim.Muon's state can be loaded"
        )
    if group["algorithm"] != algorithm:
        raise ValueError(
            f"Param group {index} is {algorithm!r} here but the saved state is {source}'s: "
            f"{source} state loads only into algorithm={group['algorithm']!r} groups"
        )
    return group


def _from_adamw(saved: Mapping[str, Any], index: int) -> dict[str, Any]:
    _check_keys(saved, _ADAMW_KEYS, _ADAMW_FLAGS, "torch.optim.AdamW", index)
    for flag in ("amsgrad", "maximize"):
        if saved.get(flag):
            raise ValueError(
                f"Param group {index} of the saved state is torch.optim.AdamW's with {flag}=True: "
                f"muonkit's AdamW has no {flag}; only {flag}=False state can be loaded"
            )
    if saved.get("decoupled_weight_decay") is False and saved["weight_decay"] != 0:
        raise ValueError(
            f"Param group {index} of the saved state is torch.optim.Adam's with weight_decay={saved['weight_decay']!r} "
            "added to the gradient (L2); muonkit's AdamW decays the weights (decoupled): only "
            "torch.optim.AdamW state, or Adam state with weight_decay=0, can be loaded"
        )
    group = {k: v for k, v in saved.items() if k not in _ADAMW_FLAGS}
    group["algorithm"] = "adamw"
    return group


def _from_muon(saved: Mapping[str, Any], index: int) -> dict[str, Any]:
    _check_keys(saved, _MUON_KEYS, {"adjust_lr_fn"}, "torch.optim.Muon", index)
    name = saved["adjust_lr_fn"]
    if name not in _ADJUST_LR:
        raise ValueError(
            f"Param group {index} of the saved state is torch.optim.Muon's with adjust_lr_fn={name!r}: "
            f"must be one of {tuple(_ADJUST_LR)}"
        )
    group = {k: v for k, v in saved.items() if k != "adjust_lr_fn"}
    group["algorithm"], group["adjust_lr"] = "muon", _ADJUST_LR[name]
    return group


def _check_keys(saved: Mapping[str, Any], required: set[str], optional: set[str], source: str, index: int) -> None:
    missing = sorted(required - saved.keys())
    unknown = sorted(saved.keys() - required - optional - _GENERIC)
    if missing or unknown:
        what = f"lacks {missing}" if missing else f"has keys {source} does not: {unknown}"
        raise ValueError(
            f"Param group {index} of the saved state looks like {source}'s but {what}: "
            "only state that maps onto muonkit's hyperparameters can be loaded"
        )
