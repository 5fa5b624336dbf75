"""The distribution-strategy interface: the only layer that knows where tensors live.

The optimizer computes momentum and AdamW elementwise on *local* tensors (whatever slice of a
parameter this rank stores). Orthogonalization needs *whole* matrices; a strategy assembles them
wherever they are, has each one orthogonalized exactly once across all ranks, and hands every
rank back the direction for its own local slice. Strategies are the only place that issues
collectives.

Also here: how a rank reads the pieces it holds (:func:`local_part`, and :class:`Cuts`: many
pieces of flat tensors as views, one ``split`` per tensor), :class:`Compute`, the math a strategy runs on this rank, counted in its
:class:`StrategyStats` (an attribute, ``strategy.compute``, so the simulator replaces it to time
the work that stands in for it), and :func:`full_shape`, the shape of a whole parameter wherever
its data lives (a ZeRO-3 placeholder keeps it in ``ds_shape``; a parameter FSDP1 flattened has
none left, and is refused with a pointer to FSDP2).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.guard import Guard
from muonkit.distributed.pieces import Box, Expert, Piece, Region
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions, rule_directions
from muonkit.functional.orthogonalize import default_compute_dtype, orthogonalization_flops
from muonkit.functional.quantize import block_shape
from muonkit.functional.sharded import Reduce, orthogonalize_shard

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


@dataclass
class StrategyStats:
    """Cumulative counters of the work a strategy did on this rank (for tests and benchmarks)."""

    matrices: int = 0
    """Matrices orthogonalized on this rank."""
    flops: int = 0
    """Newton-Schulz FLOPs spent on this rank."""
    bytes_sent: int = 0
    """Bytes this rank sent through collectives issued by the optimizer."""
    collectives: int = 0
    """Collective calls issued by the optimizer on this rank."""

    def reset(self) -> None:
        self.matrices = self.flops = self.bytes_sent = self.collectives = 0


class Compute:
    """Directions of whole tensors and of shards on this rank, counted in ``stats``."""

    def __init__(self, stats: StrategyStats) -> None:
        self.stats = stats

    def __call__(
        self,
        wholes: Sequence[Tensor],
        layouts: Sequence[MatrixLayout],
        config: MuonConfig,
        *,
        options: NSOptions | None = None,
        states: Sequence[Sequence[Tensor]] | None = None,
    ) -> tuple[list[Tensor], list[list[Tensor]]]:
        """Directions of whole tensors (counted) and the new ``"rows"`` states of the group's rule.

        ``options``: the orthogonalization (default ``config.ns_options``); ``states``: per whole
        tensor, its ``"rows"`` states (one vector per entry of ``config.rule.rows_states``),
        required where the rule has any (and not modified).
        """
        options = config.ns_options if options is None else options
        # Not counted in a compiled step: torch.compile would guard on the counters' values (Python
        # ints), which change every step, and recompile every step.
        device = wholes[0].device if wholes else None
        hook = (
            None if torch.compiler.is_compiling() else lambda c, r, k: self.count(c, r, k, config=config, device=device)
        )
        rule = config.rule
        if rule.rows_states and states is None:
            raise ValueError(f"{rule.title} directions need the rows states (states=)")
        return rule_directions(wholes, layouts, options, rule=rule, settings=config, states=states, on_batch=hook)

    def count(
        self, count: int, rows: int, cols: int, *, config: MuonConfig, device: torch.device | None = None
    ) -> None:
        """Record one batched orthogonalization on this rank (FLOPs of the dtype it runs in on ``device``)."""
        dtype = config.ns_dtype if config.ns_dtype is not None or device is None else default_compute_dtype(device)
        self.stats.matrices += count
        self.stats.flops += count * orthogonalization_flops(rows, cols, config.steps, config.ns_method, dtype)

    def shard(self, shard: Tensor, **options: Any) -> Tensor:
        """:func:`~muonkit.functional.sharded.orthogonalize_shard` of one member's shard."""
        return orthogonalize_shard(shard, **options)

    def after_shard(
        self, config: MuonConfig, o: Tensor, olds: Sequence[Tensor], *, rows_cut: bool, cols: int, reduce: Reduce
    ) -> tuple[Tensor, list[Tensor]]:
        """The group's rule after the iteration on one shard (:meth:`UpdateRule.after_shard`)."""
        return config.rule.after_shard(o, olds, rows_cut=rows_cut, cols=cols, reduce=reduce, settings=config)


def local_part(local: Tensor, piece: Piece) -> Tensor:
    """The view of ``local`` (a rank's local tensor) holding ``piece``'s region in storage order.

    Its ``reshape(-1)`` is what ``piece.region.read(whole)`` returns on the owner.
    """
    where = piece.where
    if where is None:
        return local
    if isinstance(where, Expert):
        return local.reshape(-1, *local.shape[-2:])[where.index]
    return local.reshape(-1).narrow(0, where.offset, piece.region.numel)


@dataclass(frozen=True)
class Cuts:
    """Where a list of pieces lies in some flat tensors: each piece one or a few contiguous ranges.

    Pieces of a rank's local tensors (the whole local tensor, expert ``k`` of a stack, a range at
    ``At``: one range each) or of an owner's results (row blocks: one range; the strided row sets
    of FSDP2 over tensor parallel: one per run). A step gets all their views with one ``split`` per
    tensor (gaps between the ranges are split off and left), or none where a piece is the whole
    tensor.

    >>> cuts = Cuts.of([(0, ((0, 6),)), (1, ((5, 8),)), (1, ((0, 2), (3, 4)))])
    >>> [v.tolist() for v in cuts.pieces([torch.arange(6.0), torch.arange(8.0)])]
    [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 6.0, 7.0], [0.0, 1.0, 3.0]]
    """

    tensors: tuple[Hashable, ...]
    """The tensors the pieces lie in (indices or keys of what :meth:`views` is given)."""
    sizes: tuple[tuple[int, ...], ...]
    """Per tensor: the sizes its flat view is split into (its ranges and the gaps between them),
    up to the end of its last range."""
    slots: tuple[tuple[int, int], ...]
    """Per range, pieces in order: (position in :attr:`tensors`, index of its part in that tensor's split)."""
    counts: tuple[int, ...]
    """Ranges per piece."""

    @staticmethod
    def of(pieces: Sequence[tuple[Hashable, Sequence[tuple[int, int]]]]) -> Cuts:
        """From ``(tensor, ranges)`` per piece; the ranges of one tensor must not overlap."""
        by_tensor: dict[Hashable, set[tuple[int, int]]] = {}
        for t, ranges in pieces:
            by_tensor.setdefault(t, set()).update(ranges)
        tensors = tuple(by_tensor)
        sizes, index = [], {}
        for t in tensors:
            cut: list[int] = []
            end = 0
            for a, b in sorted(by_tensor[t]):
                if a < end:
                    raise ValueError(f"overlapping ranges of tensor {t!r}: {sorted(by_tensor[t])}")
                if a > end:
                    cut.append(a - end)  # a gap: split off, not used
                index[(t, (a, b))] = len(cut)
                cut.append(b - a)
                end = b
            sizes.append(tuple(cut))
        position = {t: i for i, t in enumerate(tensors)}
        slots = tuple((position[t], index[(t, span)]) for t, ranges in pieces for span in ranges)
        return Cuts(tensors, tuple(sizes), slots, tuple(len(ranges) for _, ranges in pieces))

    def views(self, tensors: Any) -> list[Tensor] | None:
        """The flat view of each range in ``tensors`` (``tensors[t]``), pieces in order; None when one
        of them is not contiguous (its storage order is not its flat order: read it piece by piece)."""
        parts: list[Sequence[Tensor]] = []
        for t, sizes in zip(self.tensors, self.sizes, strict=True):
            tensor = tensors[t]
            if not tensor.is_contiguous():
                return None
            flat = tensor.view(-1)
            rest = flat.numel() - sum(sizes)
            if len(sizes) == 1 and not rest:
                parts.append((flat,))
            else:
                parts.append(torch.split(flat, [*sizes, rest] if rest else list(sizes)))
        return [parts[i][k] for i, k in self.slots]

    def pieces(self, tensors: Any) -> list[Tensor] | None:
        """Each piece's data, flat: a view, or its ranges concatenated (see :meth:`views`)."""
        views = self.views(tensors)
        if views is None or len(views) == len(self.counts):
            return views
        out, k = [], 0
        for n in self.counts:
            out.append(views[k] if n == 1 else torch.cat(views[k : k + n]))
            k += n
        return out


@dataclass(frozen=True)
class Held:
    """A part of one whole tensor, held in this rank's local tensor of a param (see :meth:`Strategy.regions`).

    ``shape``: the whole tensor's shape. ``region``: which part of it: a
    :class:`~muonkit.distributed.pieces.Box` (index runs per dimension, in local storage order: a
    whole tensor, row or column shards, strided row sets, their products) or a
    :class:`~muonkit.distributed.pieces.Span` (a range of its row-major flattened elements: a
    piece of a ZeRO flat partition). ``offset``: where that part starts in the flattened local
    tensor. ``name``: None where the param is itself the tensor (or a DTensor of it); where the
    param stands for several tensors of the model (a DeepSpeed flat partition), the tensor's name
    in the model DeepSpeed was given.

    Example: rank 1 of ``Shard(0)`` over 2 ranks of a (5, 3) DTensor holds
    ``Held((5, 3), Box((((3, 5),), ((0, 3),))))``: rows 3 and 4, its whole local tensor.
    """

    shape: tuple[int, ...]
    region: Region
    offset: int = 0
    name: str | None = None

    def part_of(self, local: Tensor) -> Tensor:
        """The view of ``local`` (the param's local tensor) that holds :attr:`region`, in storage order:
        shaped like a Box region (``region.shape``), flat for a Span. ``region.read(whole)`` equals its
        ``reshape(-1)``; writing into it writes the local tensor."""
        region = self.region
        if isinstance(region, Box) and self.offset == 0 and tuple(local.shape) == region.shape:
            return local
        part = local.view(-1)[self.offset : self.offset + region.numel]
        return part.view(region.shape) if isinstance(region, Box) else part


class Strategy(ABC):
    """How the optimizer's local tensors relate to whole matrices across ranks."""

    name: str = "abstract"

    def __init__(self) -> None:
        self.stats = StrategyStats()
        self.compute = Compute(self.stats)
        """The math this rank runs on whole matrices and shards, counted in :attr:`stats`."""

    def local(self, t: Tensor) -> Tensor:
        """The part of ``t`` stored on this rank, as a plain tensor."""
        return t

    def new_state(self, param: Tensor, dtype: torch.dtype, *, blocks: int | None = None) -> Tensor:
        """A zero state buffer laid out like ``param`` (sharded the same way), in ``dtype``.

        ``blocks=B``: instead one value per block of at most ``B`` consecutive values along the
        last dimension of the local tensor (each row cut from its start): the scales of a
        blockwise code (:mod:`muonkit.state_precision`), laid out like ``param`` on its other
        dimensions; a 0-dim param has one block."""
        if blocks is None:
            return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        return torch.zeros(block_shape(tuple(param.shape), blocks), dtype=dtype, device=param.device)

    def whole_shapes(self, param: Tensor) -> list[tuple[int, ...]]:
        """Shapes of the whole tensors a param of the optimizer stands for (for validation).

        One for most strategies (a DTensor or a ZeRO-3 placeholder reports its full shape); a
        DeepSpeed ZeRO flat partition stands for every parameter in it; an empty list means
        "not known yet" (nothing to check).
        """
        return [full_shape(param)]

    def regions(self, param: Tensor) -> tuple[Held, ...]:
        """Which part of which whole tensor this rank holds in ``param``'s local tensor (:meth:`local`).

        One :class:`Held` per whole tensor of :meth:`whole_shapes` (same order, same shapes), each
        with the part of it this rank stores (an empty region where it stores none) and where
        that part lies in the local tensor. Listed in local storage order; the parts of non-empty
        regions tile the local tensor (a ZeRO partition's padding and alignment gaps aside). What
        QK-Clip rescales, and what a checkpoint would read or write, on every layout:

        ============================  ==========================================================
        strategy                      ``regions(param)``
        ============================  ==========================================================
        single device, replicated     the whole tensor: ``Box.full(shape)``
        DTensor (any mesh)            this rank's box of the mesh (:mod:`.dtensor_placement`)
        ZeRO flat partition           per param of the partition, its ``Span`` here, named
        ============================  ==========================================================

        Default (a tensor whole and local on every rank): ``Box.full`` of its shape; a ZeRO-3
        placeholder (empty, its shape in ``ds_shape``) holds an empty box.

        Example (one device)::

            >>> SingleDeviceStrategy().regions(torch.zeros(4, 3))
            (Held(shape=(4, 3), region=Box(runs=(((0, 4),), ((0, 3),))), offset=0, name=None),)
        """
        shape = full_shape(param)
        whole = tuple(param.shape) == shape
        return (Held(shape, Box.full(shape) if whole else Box(tuple(() for _ in shape))),)

    @functools.cached_property
    def guard(self) -> Guard:
        """Whether a step applies (:mod:`muonkit.distributed.guard`): the ranks' agreement, the
        non-finite verdict, the late checks and the failure channel, made by the strategy at its
        first use. Default: one device's :class:`~muonkit.distributed.guard.Guard`."""
        return Guard()

    def check_params(self, params: list[Tensor]) -> None:
        """Raise on Muon params this strategy cannot step, before ``step()`` changes anything.

        Everything :meth:`muon_chunks` and :meth:`directions` would reject must be rejected
        here (the optimizer checks each matrix layout against :meth:`whole_shapes` itself).
        """
        del params

    def muon_chunks(self, params: list[Tensor], config: MuonConfig) -> list[list[int]]:
        """Indices of the params to step together, chunk after chunk.

        The optimizer computes momentum updates, directions and the weight update one chunk at a
        time, so a step's scratch memory is that of its largest chunk. Default: a single chunk,
        for strategies whose collectives span every param of the group.
        """
        del config
        return [list(range(len(params)))]

    @abstractmethod
    def directions(
        self,
        params: list[Tensor],
        updates: list[Tensor],
        config: MuonConfig,
        *,
        states: list[list[Tensor]] | None = None,
    ) -> list[Tensor]:
        """Local slices of ``orthogonalize(U)`` for each param (unscaled: the optimizer applies the lr
        shape scale when the step commits, :func:`muonkit.stages.local_scale`).

        ``updates[i]`` is the local slice of the momentum update of ``params[i]``; the result
        has the same local shape. Each whole matrix is orthogonalized exactly once across ranks.
        ``updates`` are fresh scratch tensors (:func:`muon_update` returns new ones), so a
        strategy may write the directions into them and return them, to save memory.

        Groups whose update rule keeps ``"rows"`` states (``config.rule.rows_states``) also pass
        ``states``: per param, a fresh copy of each such state, whole on every rank
        (:meth:`~muonkit.functional.update_rule.StateSpec.length` per whole tensor of
        :meth:`whole_shapes`, concatenated); the rule's hooks run on the rank that orthogonalizes
        the whole matrix (:attr:`compute`) and the strategy overwrites ``states`` with the new
        values, the same on every rank.
        """
