"""DeepSpeed ZeRO-1/2/3: Muon on flat fp32 partitions, each matrix orthogonalized once.

Under ZeRO, DeepSpeed reduces, accumulates, unscales and clips the gradients itself, then calls
the client optimizer's ``step()`` with every param group holding one flat fp32 tensor: this
rank's partition (see :mod:`muonkit.distributed.zero_partition` for what lies where). Everything
elementwise (Muon momentum, decoupled weight decay, the whole of AdamW) runs on that flat tensor
as it is, so optimizer state stays partitioned exactly like DeepSpeed's master weights.

Only orthogonalization needs whole matrices. Each parameter of a flat partition is a
:class:`~muonkit.distributed.pieces.Job` whose pieces are :class:`~muonkit.distributed.pieces.Span` s
of its flattened elements at offsets (:class:`~muonkit.distributed.pieces.At`) of the ranks' flat
partitions; the planner (:mod:`muonkit.distributed.planner`) leaves a parameter stored whole on
one rank there and gives a split one (a ZeRO-1/2 partition boundary, every ZeRO-3 parameter) an
owner balanced by Newton-Schulz cost, preferring the ranks that hold a piece. Per flat partition
and step the executor (:mod:`muonkit.distributed.executor`) sends the pieces of split parameters
to their owners in one ``all_to_all``, orthogonalizes (same-shape matrices batched) and sends the
pieces of the directions back in a second one; a partition whose parameters all lie whole on one
rank needs neither. Padding and alignment gaps get zero directions.

Per rank and step that moves, for the split parameters only, each non-owned piece once to its
owner (fp32) and once back (the Newton-Schulz compute dtype when narrower, else fp32);
parameters inside one partition cost nothing. The directions equal those of
:class:`SingleDeviceStrategy` on the whole parameters. Zero-size parameters have no pieces, no
owner and nothing to compute. As under DDP and FSDP2, each ``step()`` also sends one tiny
all-reduce that checks all ranks hold the same settings (:mod:`muonkit.distributed.guard.ranks`;
DeepSpeed ZeRO-3 calls ``step()`` once per sub-group).

Example (what :func:`muonkit.integrations.deepspeed.initialize` does)::

    strategy = ZeroStrategy(process_group=dp_group)
    strategy.bind(flat_fp32_partition, contiguous_partition(...))
    optimizer.set_strategy(strategy)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.base import Held
from muonkit.distributed.executor import PlannedStrategy
from muonkit.distributed.pieces import At, Job, Piece, Span
from muonkit.distributed.planner import Plan
from muonkit.distributed.zero_partition import FlatPartition
from muonkit.functional.matrices import MatrixLayout

__all__ = ["ZeroStrategy", "partition_jobs"]


def partition_jobs(partition: FlatPartition, matrix_layout: MatrixLayout) -> list[Job]:
    """One job per param of ``partition`` (in order; a zero-size param has no pieces), ``tensor=0``."""
    return [
        Job(
            0,
            param.shape,
            matrix_layout,
            tuple(
                Piece(p.rank, Span(p.param_offset, p.param_offset + p.length), At(p.local_offset)) for p in param.pieces
            ),
        )
        for param in partition.params
    ]


class ZeroStrategy(PlannedStrategy):
    """Flat fp32 partitions (DeepSpeed ZeRO); bind each flat tensor to its :class:`FlatPartition`."""

    name = "zero"

    def __init__(self, *, process_group: Any = None) -> None:
        super().__init__(process_group)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self._partitions: dict[int, tuple[Tensor, FlatPartition]] = {}
        self._zero_plans: dict[tuple[int, MatrixLayout, int, str, torch.dtype | None], Plan] = {}

    def bind(self, flat: Tensor, partition: FlatPartition) -> None:
        """Declare that ``flat`` (a param of the optimizer) is this rank's part of ``partition``."""
        if partition.world_size != self.world_size:
            raise ValueError(f"layout is for {partition.world_size} ranks, the process group has {self.world_size}")
        if flat.ndim != 1 or flat.numel() != partition.numel:
            raise ValueError(f"flat partition has shape {tuple(flat.shape)}, the layout needs ({partition.numel},)")
        self._partitions[id(flat)] = (flat, partition)

    @property
    def partitions(self) -> list[Tensor]:
        """The bound flat partitions, in binding order."""
        return [flat for flat, _ in self._partitions.values()]

    def partition_of(self, flat: Tensor) -> FlatPartition:
        entry = self._partitions.get(id(flat))
        if entry is None or entry[0] is not flat:
            raise RuntimeError(
                f"HybridMuon got a tensor of shape {tuple(flat.shape)} that is not a ZeRO flat partition it knows: "
                "param groups changed after muonkit.integrations.deepspeed set up the optimizer"
            )
        return entry[1]

    def whole_shapes(self, param: Tensor) -> list[tuple[int, ...]]:
        entry = self._partitions.get(id(param))
        if entry is None or entry[0] is not param:
            return super().whole_shapes(param)
        return [p.shape for p in entry[1].params]

    def regions(self, param: Tensor) -> tuple[Held, ...]:
        """For a bound flat partition, every param of its :class:`FlatPartition` (as :meth:`whole_shapes`), named,
        with the :class:`~muonkit.distributed.pieces.Span` of its flattened elements this rank's partition
        holds at ``offset`` (an empty span where it holds none); any other tensor is whole and local."""
        entry = self._partitions.get(id(param))
        if entry is None or entry[0] is not param:
            return super().regions(param)
        held = []
        for flat_param in entry[1].params:
            piece = flat_param.piece_on(self.rank)
            if piece is None:
                held.append(Held(flat_param.shape, Span(0, 0), name=flat_param.name))
            else:
                span = Span(piece.param_offset, piece.param_offset + piece.length)
                held.append(Held(flat_param.shape, span, piece.local_offset, flat_param.name))
        return tuple(held)

    def plan(self, flat: Tensor, config: MuonConfig) -> Plan:
        """The (cached) plan of a bound flat partition under a group's matrix layout: one job per
        param of its :class:`FlatPartition`, in order, exchanged as one group (two ``all_to_all``)."""
        partition = self.partition_of(flat)
        key = (id(partition), config.layout, config.steps, config.ns_method, config.ns_dtype)  # what costs depend on
        if key not in self._zero_plans:
            jobs = partition_jobs(partition, config.layout)
            self._zero_plans[key] = self.plan_of(jobs, [flat], config, one_group=True)
        return self._zero_plans[key]

    def check_params(self, params: list[Tensor]) -> None:
        for flat in params:
            self.partition_of(flat)

    def jobs(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Job]:
        del updates
        (flat,) = params
        return partition_jobs(self.partition_of(flat), config.layout)

    def directions(
        self,
        params: list[Tensor],
        updates: list[Tensor],
        config: MuonConfig,
        *,
        states: list[list[Tensor]] | None = None,
    ) -> list[Tensor]:
        out = []
        for k, (flat, update) in enumerate(zip(params, updates, strict=True)):  # one exchange per partition
            directions = torch.zeros_like(update)  # padding and gaps between params: zero
            mine = None if states is None else [states[k]]  # every param of the layout's, in order
            self.run(self.plan(flat, config), [update], [directions], config, states=mine)
            out.append(directions)
        return out
