"""DeepSpeed ZeRO-1/2/3: Muon on flat fp32 partitions, each matrix orthogonalized once.

Under ZeRO, DeepSpeed reduces, accumulates, unscales and clips the gradients itself, then calls
the client optimizer's ``step()`` with every param group holding one flat fp32 tensor: this
rank's partition (see :mod:`muonkit.distributed.zero_layout` for what lies where). Everything
elementwise (Muon momentum, decoupled weight decay, the whole of AdamW) runs on that flat tensor
as it is, so optimizer state stays partitioned exactly like DeepSpeed's master weights.

Only orthogonalization needs whole matrices. For each flat partition, in one step:

1. every parameter gets one owner rank: a parameter stored whole on one rank is orthogonalized
   by that rank; one split across ranks (a ZeRO-1/2 partition boundary, every ZeRO-3 parameter)
   goes to one of the ranks holding a piece, chosen by Newton-Schulz cost, largest first, least
   loaded first (the same answer on every rank, no communication);
2. one ``all_to_all`` sends the momentum-update pieces of split parameters to their owners;
3. each rank orthogonalizes what it owns, same-shape matrices batched, and scales it;
4. one ``all_to_all`` sends the pieces of the directions back to the ranks that hold them.

Per rank and step that moves, for the split parameters only, each non-owned piece once to its
owner and once back (fp32); parameters inside one partition cost nothing. The directions equal
those of :class:`SingleDeviceStrategy` on the whole parameters. Zero-size parameters have no
pieces, no owner and nothing to compute. As under DDP and FSDP2, each ``step()`` also sends one
tiny all-reduce that checks all ranks hold the same settings (:mod:`muonkit.distributed.agreement`;
DeepSpeed ZeRO-3 calls ``step()`` once per sub-group).

Example (what :func:`muonkit.integrations.deepspeed.initialize` does)::

    strategy = ZeroStrategy(process_group=dp_group)
    strategy.bind(flat_fp32_partition, contiguous_layout(...))
    optimizer.set_strategy(strategy)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.agreement import Setting
from muonkit.distributed.base import Strategy
from muonkit.distributed.collectives import Collectives
from muonkit.distributed.zero_layout import FlatLayout, Piece
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_directions

__all__ = ["ExchangePlan", "ZeroStrategy", "plan_exchange"]

Route = tuple[tuple[tuple[int, Piece], ...], ...]
"""Per peer rank: ``(param index, piece)`` in param order."""


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Who orthogonalizes which param of a :class:`FlatLayout`, seen from one rank."""

    owners: tuple[int, ...]
    """Owner rank of each param (the same tuple on every rank); -1 for a zero-size param (no work)."""
    computed: tuple[int, ...]
    """Indices of the params this rank orthogonalizes."""
    gather: Route
    """Per owner rank: my pieces of its params, sent there before orthogonalization."""
    scatter: Route
    """Per holder rank: its pieces of my params, received before and sent back after."""
    needs_exchange: bool
    """Whether any param is split across ranks (the same on every rank)."""


def plan_exchange(layout: FlatLayout, costs: Sequence[float], rank: int) -> ExchangePlan:
    """Owners (cost-balanced among each param's holders) and the two ``all_to_all`` routes of ``rank``."""
    world = layout.world_size
    load = [0.0] * world
    owners = [-1] * len(layout.params)
    split = []
    for i, param in enumerate(layout.params):
        if len(param.pieces) == 1:
            owners[i] = param.pieces[0].rank
            load[owners[i]] += costs[i]
        elif param.pieces:
            split.append(i)  # zero-size params have no pieces, no owner and nothing to compute
    for i in sorted(split, key=lambda i: (-costs[i], i)):
        pieces = layout.params[i].pieces  # largest piece wins a tie: fewer bytes to move
        owner = min(pieces, key=lambda p: (load[p.rank], -p.length, p.rank)).rank
        owners[i] = owner
        load[owner] += costs[i]
    gather: list[list[tuple[int, Piece]]] = [[] for _ in range(world)]
    scatter: list[list[tuple[int, Piece]]] = [[] for _ in range(world)]
    for i, param in enumerate(layout.params):
        for piece in param.pieces:
            if piece.rank == rank and owners[i] != rank:
                gather[owners[i]].append((i, piece))
            elif owners[i] == rank and piece.rank != rank:
                scatter[piece.rank].append((i, piece))
    return ExchangePlan(
        owners=tuple(owners),
        computed=tuple(i for i, o in enumerate(owners) if o == rank),
        gather=tuple(tuple(r) for r in gather),
        scatter=tuple(tuple(r) for r in scatter),
        needs_exchange=bool(split),
    )


class ZeroStrategy(Strategy):
    """Flat fp32 partitions (DeepSpeed ZeRO); bind each flat tensor to its :class:`FlatLayout`."""

    name = "zero"

    def __init__(self, *, process_group: Any = None) -> None:
        super().__init__()
        self.comm = Collectives(process_group, self.stats)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self._layouts: dict[int, tuple[Tensor, FlatLayout]] = {}
        self._plans: dict[tuple[int, MatrixLayout, int, str], ExchangePlan] = {}

    def bind(self, flat: Tensor, layout: FlatLayout) -> None:
        """Declare that ``flat`` (a param of the optimizer) is this rank's partition of ``layout``."""
        if layout.world_size != self.world_size:
            raise ValueError(f"layout is for {layout.world_size} ranks, the process group has {self.world_size}")
        if flat.ndim != 1 or flat.numel() != layout.numel:
            raise ValueError(f"flat partition has shape {tuple(flat.shape)}, the layout needs ({layout.numel},)")
        self._layouts[id(flat)] = (flat, layout)

    @property
    def partitions(self) -> list[Tensor]:
        """The bound flat partitions, in binding order."""
        return [flat for flat, _ in self._layouts.values()]

    def layout_of(self, flat: Tensor) -> FlatLayout:
        entry = self._layouts.get(id(flat))
        if entry is None or entry[0] is not flat:
            raise RuntimeError(
                f"HybridMuon got a tensor of shape {tuple(flat.shape)} that is not a ZeRO flat partition it knows: "
                "param groups changed after muonkit.integrations.deepspeed set up the optimizer"
            )
        return entry[1]

    def whole_shapes(self, param: Tensor) -> list[tuple[int, ...]]:
        entry = self._layouts.get(id(param))
        if entry is None or entry[0] is not param:
            return super().whole_shapes(param)
        return [p.shape for p in entry[1].params]

    def plan(self, flat: Tensor, config: MuonConfig) -> ExchangePlan:
        """The (cached) exchange plan of a bound flat partition under a group's matrix layout."""
        layout = self.layout_of(flat)
        key = (id(layout), config.layout, config.steps, config.ns_method)  # everything the costs depend on
        if key not in self._plans:
            costs = [float(config.tensor_flops(p.shape)) for p in layout.params]
            self._plans[key] = plan_exchange(layout, costs, self.rank)
        return self._plans[key]

    def check_params(self, params: list[Tensor]) -> None:
        for flat in params:
            self.layout_of(flat)

    def all_true(self, flags: Tensor) -> list[bool]:
        return self.comm.all_ranks_true(flags)

    def check_participation(self, has_grad: Sequence[bool], settings: Callable[[], Sequence[Setting]] = list) -> None:
        self.comm.check_agreement([*settings(), Setting("strategy", self.name)], has_grad)

    def muon_directions(self, params: list[Tensor], updates: list[Tensor], config: MuonConfig) -> list[Tensor]:
        return [self._directions(p, u, config) for p, u in zip(params, updates, strict=True)]

    def _directions(self, flat: Tensor, update: Tensor, config: MuonConfig) -> Tensor:
        layout, plan = self.layout_of(flat), self.plan(flat, config)
        received = self._exchange(update, plan.gather, plan.scatter, plan.needs_exchange)
        wholes = [self._whole(layout, i, update, received) for i in plan.computed]
        hook = functools.partial(self.count_batch, config=config)
        directions = muon_directions(wholes, [config.layout] * len(wholes), config.ns_options, on_batch=hook)
        out = torch.zeros_like(update)
        by_param = {i: d.reshape(-1) for i, d in zip(plan.computed, directions, strict=True)}
        mine = [(i, p) for i in plan.computed for p in layout.params[i].pieces if p.rank == self.rank]
        for i, piece in mine:
            _local(out, piece).copy_(_of_param(by_param[i], piece))
        back = self._send(
            [[_of_param(by_param[i], p) for i, p in route] for route in plan.scatter],
            [[p.length for _, p in route] for route in plan.gather],
            update,
            plan.needs_exchange,
        )
        for route, pieces in zip(plan.gather, back, strict=True):
            for (_, piece), values in zip(route, pieces, strict=True):
                _local(out, piece).copy_(values)
        return out

    def _exchange(self, update: Tensor, gather: Route, scatter: Route, needed: bool) -> dict[tuple[int, int], Tensor]:
        """Send my pieces of others' params to their owners; receive the pieces of mine."""
        got = self._send(
            [[_local(update, p) for _, p in route] for route in gather],
            [[p.length for _, p in route] for route in scatter],
            update,
            needed,
        )
        return {
            (i, p.rank): t for route, ts in zip(scatter, got, strict=True) for (i, p), t in zip(route, ts, strict=True)
        }

    def _whole(self, layout: FlatLayout, index: int, update: Tensor, received: dict[tuple[int, int], Tensor]) -> Tensor:
        param = layout.params[index]
        if len(param.pieces) == 1:  # whole on this rank: a view, no copy
            return _local(update, param.pieces[0]).view(param.shape)
        whole = update.new_empty(param.numel)
        for piece in param.pieces:
            src = _local(update, piece) if piece.rank == self.rank else received[(index, piece.rank)]
            _of_param(whole, piece).copy_(src)
        return whole.view(param.shape)

    def _send(
        self, outgoing: list[list[Tensor]], incoming: list[list[int]], like: Tensor, needed: bool
    ) -> list[list[Tensor]]:
        """One ``all_to_all``: ``outgoing[r]`` goes to rank r; ``incoming[r]`` are the lengths from rank r."""
        if not needed:
            return [[] for _ in range(self.world_size)]
        send_sizes = [sum(t.numel() for t in ts) for ts in outgoing]
        recv_sizes = [sum(n) for n in incoming]
        flat = [t for ts in outgoing for t in ts]
        send = torch.cat(flat) if flat else like.new_empty(0)
        recv = like.new_empty(sum(recv_sizes))
        self.comm.all_to_all_single(recv, send, output_splits=recv_sizes, input_splits=send_sizes).wait()
        chunks = torch.split(recv, recv_sizes)
        return [list(torch.split(chunk, n)) if n else [] for chunk, n in zip(chunks, incoming, strict=True)]


def _local(flat: Tensor, piece: Piece) -> Tensor:
    return flat.narrow(0, piece.local_offset, piece.length)


def _of_param(flat_param: Tensor, piece: Piece) -> Tensor:
    return flat_param.narrow(0, piece.param_offset, piece.length)
