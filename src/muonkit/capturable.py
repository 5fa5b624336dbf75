"""``capturable=True``: each group's ``lr`` and ``weight_decay`` held as 0-dim device tensors.

So that ``step()`` reads nothing back from an accelerator and a compiled or CUDA-graph-captured
step reads the current values (an lr schedule recompiles nothing), as in
``torch.optim.Adam(capturable=True)``. What it needs is refused up front: ``nonfinite="unchecked"``
(the other policies read a verdict on the host) and one device (distributed strategies keep
host-side bookkeeping). The full contract: ``docs/optimizer.md``, "Capturable step".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.distributed import SingleDeviceStrategy, Strategy
from muonkit.functional.validation import nonneg

RATES = ("lr", "weight_decay")
"""The hyperparameters a capturable optimizer holds as device tensors (what schedules change)."""


def check_capturable(capturable: Any, nonfinite: str, process_group: Any, strategy: Strategy | None) -> None:
    """Refuse ``capturable=True`` where the step would need a host read or host-side collectives."""
    if not isinstance(capturable, bool):
        raise ValueError(f"Invalid capturable={capturable!r}: must be True or False")
    if not capturable:
        return
    if nonfinite != "unchecked":
        raise ValueError(
            f"capturable=True needs nonfinite='unchecked', got nonfinite={nonfinite!r}: 'skip' and 'raise' read "
            "a finiteness verdict on the host every step, which a CUDA graph cannot replay and torch.compile "
            "cannot trace. Check gradients before the step instead (e.g. torch.amp.GradScaler)"
        )
    if process_group is not None:
        raise ValueError("capturable=True runs on one device only: pass no process_group")
    if strategy is not None:
        check_capturable_strategy(strategy)


def check_capturable_strategy(strategy: Strategy) -> None:
    """A capturable step runs on one device: the strategy must be the single-device one."""
    if not isinstance(strategy, SingleDeviceStrategy):
        raise ValueError(
            f"capturable=True runs on one device only (SingleDeviceStrategy), but the strategy is "
            f"{type(strategy).__name__}: distributed steps issue collectives with host-side bookkeeping "
            "that a CUDA graph cannot capture. Use capturable=False"
        )


def check_one_device(params: Sequence[Tensor], index: int) -> None:
    """A capturable group holds its lr and weight decay on its params' device: there must be one."""
    devices = list(dict.fromkeys(p.device for p in params))
    if len(devices) > 1:
        raise ValueError(
            f"Param group {index} has params on {len(devices)} devices ({', '.join(map(str, devices))}): with "
            "capturable=True every group's params must be on one device (split the group by device)"
        )


def hold_rates(group: dict[str, Any], index: int, held: dict[str, Tensor], *, adopt: bool = True) -> None:
    """Make ``group``'s ``lr`` and ``weight_decay`` its persistent 0-dim device tensors (``held``).

    A tensor already on the params' device in the rate dtype is adopted as it is (torch's lr
    schedulers ``fill_`` it), unless ``adopt=False`` (a loaded state); any other value is
    checked, then copied in place into the tensor the group held before (the one a compiled or
    captured step reads), made at the first call.
    """
    if not group["params"]:
        return
    device = group["params"][0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    for key in RATES:
        value = group[key]
        fits = isinstance(value, Tensor) and value.ndim == 0 and value.device == device and value.dtype == dtype
        if isinstance(value, Tensor) and (value is held.get(key) or (adopt and fits)):
            held[key] = value
            continue
        number = nonneg(f"{key} (param group {index})", value)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"Param group {index}'s {key} is {value!r}, not the group's tensor, while a CUDA graph is captured: "
                f"the graph would keep this value forever. Write it in place (group[{key!r}].fill_(x), as torch's lr "
                "schedulers do) before capturing"
            )
        if key not in held or held[key].device != device or held[key].dtype != dtype:
            held[key] = torch.zeros((), dtype=dtype, device=device)
        held[key].fill_(number)
        group[key] = held[key]


def unread(group: dict[str, Any]) -> dict[str, Any]:
    """A capturable ``group`` for validation: placeholders for its rate tensors, which are never read."""
    return {**group, **dict.fromkeys(RATES, 0.0)}


def numbers_again(group: dict[str, Any], before: Mapping[str, Any]) -> None:
    """A capturable optimizer's rate tensors, loaded where ``before`` held numbers, as numbers."""
    for key in RATES:
        if isinstance(group[key], Tensor) and not isinstance(before[key], Tensor):
            group[key] = float(group[key])
