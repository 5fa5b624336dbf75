"""``muonkit.Muon``: pure Muon with ``torch.optim.Muon``'s signature, defaults and names.

A thin subclass of :class:`muonkit.HybridMuon` that speaks torch's language: ``adjust_lr_fn``
(as keyword and as group key) with torch's values (:data:`muonkit.config.TORCH_ADJUST_LR`),
torch's defaults (:data:`muonkit.config.TORCH_MUON_DEFAULTS`), Muon groups only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from muonkit.config import TORCH_ADJUST_LR
from muonkit.defaults import TORCH_MUON_DEFAULTS
from muonkit.optimizer import HybridMuon


class Muon(HybridMuon):
    """Pure Muon with ``torch.optim.Muon``'s signature and defaults, also for >= 3D tensors.

    ``adjust_lr_fn`` accepts torch's names (``"original"`` = ``"keller"``, ``"match_rms_adamw"``
    = ``"match_adamw"``) and ours. 3D tensors are batches of matrices (MoE experts), >= 4D are
    flattened to ``(out, in*k...)`` (convs). Like torch's, it takes only tensors with >= 2 dims:
    for a whole model, give it the Muon groups of :func:`muonkit.param_groups` and train the rest
    with an AdamW, or use :class:`HybridMuon`, which does both::

        opt = muonkit.Muon([g for g in muonkit.param_groups(model) if g["algorithm"] == "muon"])
    """

    _for_a_model = (
        "only the >= 2D hidden matrices, e.g. muonkit.Muon([g for g in muonkit.param_groups(model) if "
        "g['algorithm'] == 'muon']) with an AdamW for the rest, or use muonkit.HybridMuon(muonkit.param_groups(model))"
    )

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = TORCH_MUON_DEFAULTS.lr,
        weight_decay: float = TORCH_MUON_DEFAULTS.weight_decay,
        momentum: float = TORCH_MUON_DEFAULTS.momentum,
        nesterov: bool = TORCH_MUON_DEFAULTS.nesterov,
        ns_coefficients: str | Sequence[Sequence[float]] | tuple[float, float, float] = (
            TORCH_MUON_DEFAULTS.ns_coefficients
        ),
        eps: float = TORCH_MUON_DEFAULTS.eps,
        ns_steps: int | None = TORCH_MUON_DEFAULTS.ns_steps,
        adjust_lr_fn: str | None = None,
        **kwargs: Any,
    ) -> None:
        if "adjust_lr" in kwargs:  # HybridMuon's name for it: accepted here too, once
            if adjust_lr_fn is not None:
                raise TypeError(
                    "muonkit.Muon got both adjust_lr_fn and adjust_lr; they are the same setting "
                    "(torch's name and muonkit's): pass one"
                )
            adjust_lr_fn = kwargs.pop("adjust_lr")
        if isinstance(adjust_lr_fn, str | None):
            adjust_lr_fn = TORCH_ADJUST_LR.get(adjust_lr_fn, adjust_lr_fn)
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=cast(Sequence[Sequence[float]], ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr=adjust_lr_fn,
            **kwargs,
        )

    def _mixed_group_advice(self) -> str:
        return f"muonkit.Muon takes {self._for_a_model}"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`HybridMuon.add_param_group`, for Muon groups only; as in torch.optim.Muon, a
        group may set ``adjust_lr_fn`` (torch's names or ours; muonkit's ``adjust_lr``)."""
        algorithm = param_group.get("algorithm") if isinstance(param_group, Mapping) else None
        if algorithm not in (None, "muon"):
            raise ValueError(
                f"muonkit.Muon takes Muon groups only; param group {len(self.param_groups)} is {algorithm!r}: "
                f"it takes {self._for_a_model}"
            )
        if isinstance(param_group, Mapping) and "adjust_lr_fn" in param_group:
            param_group = _torch_adjust_lr(param_group, len(self.param_groups))
        super().add_param_group(param_group)


def _torch_adjust_lr(group: Mapping[str, Any], index: int) -> dict[str, Any]:
    """``group`` with torch.optim.Muon's ``adjust_lr_fn`` as muonkit's ``adjust_lr`` (:data:`TORCH_ADJUST_LR`)."""
    group = dict(group)
    value = group.pop("adjust_lr_fn")
    if "adjust_lr" in group:
        raise ValueError(
            f"Param group {index} has both adjust_lr_fn and adjust_lr; they are the same setting "
            "(torch's name and muonkit's): give one"
        )
    group["adjust_lr"] = TORCH_ADJUST_LR.get(value, value) if isinstance(value, str | None) else value
    return group


__all__ = ["Muon"]
