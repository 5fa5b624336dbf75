"""Shared pieces of the low-precision state scenarios (issue 24): whole states of any layout, compared.

An 8-bit state ``K`` is stored as ``float8_e4m3fn`` codes (laid out like the param) and fp32
block scales ``K_scale`` (laid out by ``Strategy.new_state(blocks=)``: blocks along the last dim
of each rank's local tensor). gloo cannot move float8 tensors, so a DTensor of codes is
gathered as its uint8 bits (:func:`whole_bits`). A state is also compared *decoded*: each rank
decodes its local part (:func:`muonkit.state_precision.decode`, the step's own reading), and the
decoded local parts are assembled into the whole fp32 tensor (:func:`whole_decoded`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muonkit.functional.quantize import CODE_DTYPE, SCALE_SUFFIX
from muonkit.state_checks import NONNEGATIVE as UNSIGNED  # keys stored in the unsigned (second-moment) code
from muonkit.state_precision import decode


def _standard_local_shape(t: DTensor) -> torch.Size:
    from torch.distributed.tensor import distribute_tensor

    empty = torch.empty(t.shape, device="meta")
    return distribute_tensor(empty, t.device_mesh, t.placements, src_data_rank=None).to_local().shape


def _assemble(local: Tensor, like: DTensor, shape: torch.Size | None = None) -> Tensor:
    """The whole tensor of ``local`` parts laid out as ``like`` (collective); an FSDP2 empty shard
    of its own shape ((0, 0, c)) is replaced by DTensor's."""
    shape = like.shape if shape is None else shape
    stride = tuple(int(torch.Size(shape)[i + 1 :].numel()) for i in range(len(shape)))
    probe = DTensor.from_local(local, like.device_mesh, like.placements, shape=shape, stride=stride, run_check=False)
    expected = _standard_local_shape(probe)
    if local.shape != expected and local.numel() == 0:
        local = local.new_empty(expected)
    t = DTensor.from_local(local, like.device_mesh, like.placements, shape=shape, stride=stride, run_check=False)
    return t.full_tensor()


def whole_bits(t: Tensor) -> Tensor:
    """The whole of ``t`` (collective for a DTensor), float8 codes as their uint8 bits."""
    if isinstance(t, DTensor):
        local = t.to_local()
        local = local.view(torch.uint8) if local.dtype == CODE_DTYPE else local
        return _assemble(local, t, t.shape)
    return t.view(torch.uint8) if t.dtype == CODE_DTYPE else t


def local_of(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def whole_decoded(own: Mapping[str, Any], key: str, p: Tensor) -> Tensor:
    """State ``key`` of param ``p`` decoded to fp32, whole (collective where the state is a DTensor)."""
    value = own[key]
    local = decode(own, key, local_of, unsigned=key in UNSIGNED).float()
    if isinstance(value, DTensor):
        assert isinstance(p, DTensor)
        return _assemble(local.contiguous(), value, value.shape)
    return local


def state_keys(own: Mapping[str, Any]) -> list[str]:
    """The tensor states of a param, without the scale entries (they go with their codes)."""
    return sorted(k for k, v in own.items() if isinstance(v, Tensor) and not k.endswith(SCALE_SUFFIX))


def whole_states(own: Mapping[str, Any], p: Tensor) -> dict[str, Tensor]:
    """Every state entry of ``p`` whole, as stored (codes as uint8 bits, scales as laid out; collective)."""
    return {k: whole_bits(v).clone() for k, v in sorted(own.items()) if isinstance(v, Tensor)}


def rel_diff(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` (0 where both are zero)."""
    a, b = a.double(), b.double()
    den = torch.linalg.vector_norm(b).item()
    num = torch.linalg.vector_norm(a - b).item()
    return 0.0 if num == 0 else num / max(den, 1e-300)


def max_abs(a: Tensor, b: Tensor) -> float:
    return 0.0 if a.numel() == 0 else (a.double() - b.double()).abs().max().item()


def dtensors(params: Iterable[Tensor]) -> bool:
    return any(isinstance(p, DTensor) for p in params)
