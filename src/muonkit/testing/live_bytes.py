"""Peak bytes of the tensors a block of code allocates and holds, on any device (CPU included).

CPU has no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), so
:class:`LiveBytes` counts storages itself: a ``TorchDispatchMode`` sees every aten op's outputs;
an output whose storage belongs to none of the op's inputs and is not counted yet is a new
allocation (its ``nbytes``), and a finalizer on the storage (torch keeps one Python object per
live storage) subtracts it when the last tensor using it dies. Storages that existed before the
block (weights, gradients, optimizer state) are never counted, nor is a kernel's internal
workspace: the figure is the optimizer step's scratch above weights, gradients and state.

Example::

    with LiveBytes() as live:
        opt.step()
    live.peak          # bytes
    live.at_peak       # what was alive at the peak: (op, shape, dtype, bytes) each
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``peak``: the most bytes of storages allocated in the block alive at once; ``live``: now."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.at_peak: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        self._counted: dict[int, tuple[str, tuple[int, ...], torch.dtype, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (key := _key(t)) not in inputs and key not in self._counted:
                storage = t.untyped_storage()
                self._counted[key] = (str(func), tuple(t.shape), t.dtype, storage.nbytes())
                self.live += storage.nbytes()
                weakref.finalize(storage, self._release, key)
                if self.live > self.peak:
                    self.peak = self.live
                    self.at_peak = list(self._counted.values())
        return out

    def _release(self, key: int) -> None:
        self.live -= self._counted.pop(key)[3]


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)
