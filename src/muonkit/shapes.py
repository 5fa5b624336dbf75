"""The shape of a whole parameter, wherever its data lives.

DeepSpeed ZeRO-3 partitions every parameter (under ``deepspeed.zero.Init``, or when
``deepspeed.initialize`` wraps the model): the tensor itself becomes an empty placeholder of
shape ``(0,)`` and the layer's shape is kept in ``ds_shape``. Routing and validation must look at
that shape, or every matrix would look like a 1-D tensor and silently go to AdamW. (FSDP2
DTensors already report their global shape.)

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


def full_shape(p: Tensor) -> tuple[int, ...]:
    """``p.ds_shape`` for a ZeRO-3 partitioned parameter, else ``p.shape``, as a tuple."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if ds_shape is None else tuple(ds_shape)
