"""Count what an optimizer step really does on this rank: collectives, bytes sent, matmul FLOPs.

:class:`StepCounter` is a ``TorchDispatchMode``: every aten and c10d op of the step passes
through it. DTensor ops are first let through (``NotImplemented``), so DTensor turns them into
the local ops and the collectives of its implicit redistributions, and those are what we count:
the explicit collectives an optimizer issues (``torch.distributed.*`` -> ``c10d`` ops) and the
implicit ones (functional collectives of DTensor) alike. Nested ops are not seen twice: a mode
is switched off while it handles an op.

Bytes follow the rule of :mod:`muonkit.distributed.collectives` (what this rank must deliver to
the other ranks of the op's group, ``W`` its size: a sub-group of a mesh axis counts its own ranks): all_to_all its parts for other ranks, all_gather ``(W-1) * input``, all_reduce
``2 (W-1)/W * size``, reduce_scatter ``(W-1)/W * input``, broadcast ``(W-1) * size`` at the root.
FLOPs are ``2 m n k`` per product of the matmul family (``mm``, ``bmm``, ``addmm``, ``baddbmm``),
which in an optimizer step is Newton-Schulz.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StepCounter", "StepCounts"]


@dataclass
class StepCounts:
    collectives: int = 0
    bytes_sent: int = 0
    matmul_flops: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _alltoall_base(args: tuple[Any, ...], rank: int, world: int) -> int:
    # c10d.alltoall_base_(output, input, pg, output_split_sizes, input_split_sizes, timeout)
    inp, splits = args[1], list(args[4])
    return _split_bytes(inp, splits, rank, world)


def _funcol_alltoall(args: tuple[Any, ...], rank: int, world: int) -> int:
    # _c10d_functional.all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
    return _split_bytes(args[0], list(args[2]), rank, world)


def _group(namespace: str, args: tuple[Any, ...]) -> tuple[int, int]:
    """``(size, this rank's index)`` of the group a collective runs on: a sub-group of a device mesh
    (one axis of HSDP, TP, ...) has fewer ranks than the world, which changes the bytes."""
    if namespace == "c10d":  # c10d ops take the ProcessGroup itself, boxed as a ScriptObject
        for arg in args:
            if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
                group = dist.ProcessGroup.unbox(arg)
                return group.size(), group.rank()
    if namespace != "c10d" and args and isinstance(args[-1], str):  # functional ones its name, last
        name: Any = args[-1]
        group = dist.distributed_c10d._resolve_process_group(name)
        return group.size(), group.rank()
    return dist.get_world_size(), dist.get_rank()


def _split_bytes(inp: torch.Tensor, splits: list[int], rank: int, world: int) -> int:
    if not splits:
        splits = [inp.size(0) // world] * world
    row = _nbytes(inp) // max(1, inp.size(0)) if inp.dim() else _nbytes(inp)
    return sum(n for j, n in enumerate(splits) if j != rank) * row


def _bytes(name: str, args: tuple[Any, ...], *, world: int, rank: int) -> int | None:
    """Bytes this rank (``rank`` of a group of ``world``) sends for a collective op, None if the op is
    not a collective."""
    ring = (world - 1) / world
    rules: dict[str, Any] = {
        "allreduce_": lambda: 2 * ring * _nbytes(args[0]),
        "allreduce_coalesced_": lambda: 2 * ring * _nbytes(args[0]),
        "all_reduce": lambda: 2 * ring * _nbytes(args[0]),
        "all_reduce_coalesced": lambda: 2 * ring * _nbytes(args[0]),
        "_allgather_base_": lambda: (world - 1) * _nbytes(args[1]),
        "allgather_": lambda: (world - 1) * _nbytes(args[1]),
        "allgather_into_tensor_coalesced_": lambda: (world - 1) * _nbytes(args[1]),
        "all_gather_into_tensor": lambda: (world - 1) * _nbytes(args[0]),
        "all_gather_into_tensor_coalesced": lambda: (world - 1) * _nbytes(args[0]),
        "_reduce_scatter_base_": lambda: ring * _nbytes(args[1]),
        "reduce_scatter_": lambda: ring * _nbytes(args[1]),
        "reduce_scatter_tensor_coalesced_": lambda: ring * _nbytes(args[1]),
        "reduce_scatter_tensor": lambda: ring * _nbytes(args[0]),
        "reduce_scatter_tensor_coalesced": lambda: ring * _nbytes(args[0]),
        "alltoall_base_": lambda: _alltoall_base(args, rank, world),
        "alltoall_": lambda: sum(_nbytes(t) for j, t in enumerate(args[1]) if j != rank),
        "all_to_all_single": lambda: _funcol_alltoall(args, rank, world),
        # c10d.broadcast_(tensors, process_group, root_rank, root_tensor, ...): root_rank in the group
        "broadcast_": lambda: (world - 1) * _nbytes(args[0]) if _root(args, 2) == rank else 0,
        "broadcast": lambda: (world - 1) * _nbytes(args[0]) if args[1] == rank else 0,
    }
    rule = rules.get(name)
    return None if rule is None else round(rule())


def _root(args: tuple[Any, ...], index: int) -> int:
    return int(args[index]) if len(args) > index and isinstance(args[index], int) else 0


_MATMUL = {"mm", "bmm", "addmm", "baddbmm"}


def _matmul_flops(name: str, args: tuple[Any, ...]) -> int:
    a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
    batch = math.prod(a.shape[:-2]) if a.dim() > 2 else 1
    return 2 * batch * a.size(-2) * a.size(-1) * b.size(-1)


class StepCounter(TorchDispatchMode):
    """``with StepCounter() as c: opt.step()`` then read ``c.counts`` (this rank only)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = StepCounts()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower it to local ops and collectives first
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            world, rank = _group(namespace, args)
            sent = _bytes(name, args, world=world, rank=rank)
            if sent is not None:
                self.counts.collectives += 1
                self.counts.bytes_sent += sent
                self.counts.by_op[name] = self.counts.by_op.get(name, 0) + 1
        elif name in _MATMUL:
            self.counts.matmul_flops += _matmul_flops(name, args)
        return func(*args, **kwargs)
