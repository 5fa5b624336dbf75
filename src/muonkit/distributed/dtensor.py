"""DTensor params sharded on dim 0 (FSDP2 ``fully_shard``): whole matrices assembled on owners.

``fully_shard`` stores each parameter, its gradient and (here) its optimizer state as a DTensor
sharded on dim 0 over a 1-D mesh, in ``torch.chunk`` pieces: rank r holds rows
``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / W)``; trailing ranks may hold nothing. Momentum
and AdamW are elementwise and run on those local pieces. For orthogonalization a Muon tensor is
one of three cases:

- **local**: every matrix already lies whole on one rank: 3D+ expert tensors (dim 0 counts
  experts, so each rank holds whole experts) and tensors all of whose rows sit on one rank.
  The holder orthogonalizes them; nothing is sent.
- **assembled**: the rows of its matrices are spread over ranks. :func:`assign_owners` picks an
  owner per tensor (largest first, counting the local work each rank already has); for each
  tensor shape one ``all_to_all`` brings every owned tensor's row pieces to its owner, which
  orthogonalizes all its tensors of that shape in one batched call, and a second ``all_to_all``
  sends each rank its rows of the result.

All gathers are started at once, local matrices are computed while they travel, and each shape's
return transfer overlaps the next shape's Newton-Schulz. Row pieces travel to owners in the
update dtype (fp32, exact); results come back in the Newton-Schulz compute dtype (bf16 by
default, lossless because ``orthogonalize`` computes in it) and are scaled on arrival, so the
result matches :class:`SingleDeviceStrategy` as :mod:`muonkit.distributed.replicated` says:
states bit for bit, params too where batched products are batch-size independent.

Example (under ``torchrun``)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = muonkit.HybridMuon(muonkit.param_groups(model))  # picks this strategy from the DTensors
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from muonkit.config import MuonConfig
from muonkit.distributed.agreement import Setting
from muonkit.distributed.base import Strategy
from muonkit.distributed.collectives import Collectives, Pending
from muonkit.distributed.ownership import assign_owners
from muonkit.distributed.replicated import wire_dtype
from muonkit.functional.lr_scaling import lr_scale
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_directions

__all__ = ["DTensorStrategy", "dim0_sizes"]


def dim0_sizes(n: int, world_size: int) -> list[int]:
    """Rows of a ``Shard(0)`` tensor on each rank (``torch.chunk`` rule), e.g. 5 rows on 4 ranks: 2, 2, 1, 0."""
    chunk = -(-n // world_size)
    return [max(0, min(chunk, n - r * chunk)) for r in range(world_size)]


def block_scale(
    layout: MatrixLayout,
    shape: Sequence[int],
    adjust_lr: str | None,
    *,
    start: int,
    stop: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> float | Tensor:
    """The lr shape scale of each element of ``t[start:stop]`` for a whole tensor of ``shape``.

    A float when the tensor is one matrix shape; with ``split_sizes`` a tensor that broadcasts
    against the slice (blocks have different row counts, hence different scales).
    """
    blocks = layout.blocks(tuple(shape))
    if len(blocks) == 1:
        return lr_scale(adjust_lr, blocks[0].rows, blocks[0].cols)
    per_row = torch.cat(
        [torch.full((b.rows,), lr_scale(adjust_lr, b.rows, b.cols), dtype=dtype, device=device) for b in blocks]
    )
    kind = layout.resolved(len(shape))
    dim = {"matrix": 0, "flatten": 0, "transposed": 1, "experts": len(shape) - 2}[kind]
    if dim == 0:
        per_row = per_row[start:stop]
    view = [1] * len(shape)
    view[dim] = -1
    return per_row.view(view)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where one Muon tensor lives and who orthogonalizes it."""

    shape: tuple[int, ...]
    sizes: list[int]  # dim-0 rows per rank
    cost: int
    local: bool  # every matrix whole on its holder: no communication

    @property
    def inner(self) -> int:
        return math.prod(self.shape[1:])

    def start(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def rank_loads(self) -> list[float]:
        """Work this tensor puts on each rank if it is local (experts split like their rows)."""
        if not self.local or not self.cost:
            return [0.0] * len(self.sizes)
        return [self.cost * n / self.shape[0] for n in self.sizes]


class DTensorStrategy(Strategy):
    """Params, grads and states sharded on dim 0 over a 1-D device mesh (FSDP2)."""

    name = "fsdp2"

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"HybridMuon supports DTensor params on a 1-D device mesh (FSDP2 fully_shard); got a {mesh.ndim}-D mesh "
                f"{mesh!r} (HSDP and tensor parallelism are not supported yet)"
            )
        self.mesh = mesh
        self.comm = Collectives(mesh.get_group(), self.stats)

    def local(self, t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def new_state(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        return torch.zeros_like(param, dtype=dtype)  # a DTensor with the param's mesh and placements

    def all_true(self, flags: Tensor) -> list[bool]:
        return self.comm.all_ranks_true(flags)

    def check_participation(self, has_grad: Sequence[bool], settings: Callable[[], Sequence[Setting]] = list) -> None:
        self.comm.check_agreement([*settings(), Setting("strategy", self.name)], has_grad)

    def muon_directions(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Tensor]:
        plans = [self._plan(p, u, config) for p, u in zip(params, updates, strict=True)]
        split = [i for i, plan in enumerate(plans) if not plan.local]
        loads = [sum(col) for col in zip(*(plan.rank_loads() for plan in plans), strict=True)] if plans else None
        owner = dict(
            zip(split, assign_owners([plans[i].cost for i in split], self.comm.world_size, loads=loads), strict=True)
        )
        buckets: dict[Any, list[int]] = {}
        for i in sorted(split, key=lambda i: (-plans[i].cost, i)):
            buckets.setdefault((plans[i].shape, updates[i].dtype), []).append(i)
        members = [sorted(ids) for ids in buckets.values()]
        options = dataclasses.replace(config.ns_options, adjust_lr=None)  # scaled on arrival
        hook = functools.partial(self.count_batch, config=config)
        gathers: list[Any] = [self._gather(ids, plans, updates, owner) for ids in members]
        out = updates  # scratch (see Strategy): every read of them below happens before any write
        local = [i for i, plan in enumerate(plans) if plan.local and updates[i].numel() > 0]
        if local:  # computed while the gathers travel
            found = muon_directions([updates[i] for i in local], [config.layout] * len(local), options, on_batch=hook)
            for i, d in zip(local, found, strict=True):
                out[i].copy_(d)
        returns = []
        for k, ids in enumerate(members):
            whole = self._assemble(ids, plans, owner, gathers[k])
            gathers[k] = None  # free the received pieces now, not at the end of the step
            found = muon_directions(whole, [config.layout] * len(whole), options, on_batch=hook) if whole else []
            returns.append(self._send_back(ids, plans, owner, found, like=updates[ids[0]], config=config))
        for ids, (work, pieces) in zip(members, returns, strict=True):
            work.wait()
            for i, piece in zip(ids, pieces, strict=True):
                out[i].copy_(piece.view(out[i].shape))
        for i, plan in enumerate(plans):
            if not out[i].numel():  # nothing held here (or a zero-size param): nothing to scale
                continue
            start = plan.start(self.comm.rank)
            stop = start + out[i].size(0)
            scale = block_scale(
                config.layout,
                plan.shape,
                config.adjust_lr,
                start=start,
                stop=stop,
                dtype=out[i].dtype,
                device=out[i].device,
            )
            out[i].mul_(scale)
        return out

    def check_params(self, params: list[Tensor]) -> None:
        for param in params:
            if not isinstance(param, DTensor):
                raise ValueError(
                    f"{type(self).__name__} needs DTensor params; got a plain tensor of shape {tuple(param.shape)}"
                )
            if param.device_mesh != self.mesh or tuple(param.placements) != (Shard(0),):
                raise ValueError(
                    f"Invalid DTensor param of shape {tuple(param.shape)}: placements {param.placements} on "
                    f"{param.device_mesh!r}; HybridMuon needs (Shard(0),) on {self.mesh!r} (FSDP2's default)"
                )

    def _plan(self, param: Tensor, update: Tensor, config: MuonConfig) -> _Plan:
        self.check_params([param])
        shape = tuple(param.shape)
        sizes = dim0_sizes(shape[0], self.comm.world_size)
        if math.prod(shape) == 0:  # empty directions, nothing to send (FSDP2 shards it as (0, 0) everywhere)
            return _Plan(shape, sizes, 0, local=True)
        if update.size(0) != sizes[self.comm.rank]:
            raise RuntimeError(f"Local shard of a {shape} param has {update.size(0)} rows; expected {sizes}")
        cost = config.tensor_flops(shape)
        experts = config.layout.resolved(len(shape)) == "experts"
        return _Plan(shape, sizes, cost, local=experts or sum(n > 0 for n in sizes) <= 1)

    def _gather(
        self, ids: list[int], plans: list[_Plan], updates: list[Tensor], owner: dict[int, int]
    ) -> tuple[Pending, Tensor]:
        """Start sending this rank's rows of each tensor to its owner (one all_to_all per shape)."""
        world, rank, plan = self.comm.world_size, self.comm.rank, plans[ids[0]]
        order = sorted(ids, key=lambda i: (owner[i], i))
        send = torch.cat([updates[i].reshape(-1) for i in order]) if order else updates[ids[0]].new_empty(0)
        counts = [sum(owner[i] == j for i in ids) for j in range(world)]
        mine = counts[rank]
        received = send.new_empty(mine * plan.shape[0] * plan.inner)
        work = self.comm.all_to_all_single(
            received,
            send,
            output_splits=[mine * n * plan.inner for n in plan.sizes],
            input_splits=[counts[j] * plan.sizes[rank] * plan.inner for j in range(world)],
        )
        return work, received

    def _assemble(self, ids: list[int], plans: list[_Plan], owner: dict[int, int], gather: Any) -> list[Tensor]:
        """The whole tensors this rank owns among ``ids``, from the received row pieces."""
        work, received = gather
        work.wait()
        plan = plans[ids[0]]
        mine = sum(owner[i] == self.comm.rank for i in ids)
        if not mine:
            return []
        pieces = torch.split(received, [mine * n * plan.inner for n in plan.sizes])
        by_source = [p.view(mine, n, *plan.shape[1:]) for p, n in zip(pieces, plan.sizes, strict=True)]
        return [torch.cat([src[k] for src in by_source]) for k in range(mine)]

    def _send_back(
        self,
        ids: list[int],
        plans: list[_Plan],
        owner: dict[int, int],
        found: list[Tensor],
        *,
        like: Tensor,
        config: MuonConfig,
    ) -> tuple[Pending, list[Tensor]]:
        """Start sending each rank its rows of the directions this rank computed (``like``: a local update of the shape)."""
        world, rank, plan = self.comm.world_size, self.comm.rank, plans[ids[0]]
        wire = wire_dtype(config, like)
        starts = [plan.start(j) for j in range(world)]
        send = [d[starts[j] : starts[j] + plan.sizes[j]].to(wire).reshape(-1) for j in range(world) for d in found]
        send_buf = torch.cat(send) if send else like.new_empty(0, dtype=wire)  # on the data's device
        counts = [sum(owner[i] == j for i in ids) for j in range(world)]
        received = send_buf.new_empty(len(ids) * plan.sizes[rank] * plan.inner)
        work = self.comm.all_to_all_single(
            received,
            send_buf,
            output_splits=[counts[j] * plan.sizes[rank] * plan.inner for j in range(world)],
            input_splits=[len(found) * n * plan.inner for n in plan.sizes],
        )
        order = sorted(ids, key=lambda i: (owner[i], i))
        pieces = dict(zip(order, torch.split(received, [plan.sizes[rank] * plan.inner] * len(order)), strict=True))
        return work, [pieces[i] for i in ids]
