"""The shape of a whole parameter, wherever its data lives.

DeepSpeed ZeRO-3 partitions every parameter (under ``deepspeed.zero.Init``, or when
``deepspeed.initialize`` wraps the model): the tensor itself becomes an empty placeholder of
shape ``(0,)`` and the layer's shape is kept in ``ds_shape``. Routing and validation must look at
that shape, or every matrix would look like a 1-D tensor and silently go to AdamW. (FSDP2
DTensors already report their global shape.)

FSDP1 (``FullyShardedDataParallel``) flattens every wrapped module's parameters into one 1-D
``FlatParameter`` and marks it and the originals ``_fsdp_flattened``; with
``use_orig_params=True`` the originals become 1-D views of the flat shard. No matrix shape is
left to route or orthogonalize by, so :func:`full_shape` refuses such a parameter and names
FSDP2, whose DTensors keep their shapes.

Example::

    >>> import torch
    >>> p = torch.nn.Parameter(torch.empty(0))
    >>> p.ds_shape = torch.Size([64, 32])
    >>> full_shape(p)
    (64, 32)
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["full_shape"]

FSDP1_FLATTENED = "_fsdp_flattened"
"""The attribute torch's FSDP1 sets on its ``FlatParameter`` and on every parameter flattened into one."""


def full_shape(p: Tensor) -> tuple[int, ...]:
    """``p.ds_shape`` for a ZeRO-3 partitioned parameter, else ``p.shape``, as a tuple.

    Raises ValueError for a parameter FSDP1 flattened (its shape is gone).
    """
    if getattr(p, FSDP1_FLATTENED, False):
        raise ValueError(
            f"A parameter of shape {tuple(p.shape)} was flattened by FSDP1 (FullyShardedDataParallel; Lightning "
            "strategy='fsdp', accelerate/HF fsdp_version=1): its matrix shape is gone, so every matrix would go to "
            "AdamW. muonkit supports FSDP2: torch.distributed.fsdp.fully_shard (Lightning: "
            "strategy=ModelParallelStrategy(); accelerate/HF: fsdp_version=2), or DDP"
        )
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if ds_shape is None else tuple(ds_shape)
