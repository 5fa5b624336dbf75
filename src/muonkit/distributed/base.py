"""The distribution-strategy interface: the only layer that knows where tensors live.

The optimizer computes momentum and AdamW elementwise on *local* tensors (whatever slice of a
parameter this rank stores). Orthogonalization needs *whole* matrices; a strategy assembles them
wherever they are, has each one orthogonalized exactly once across all ranks, and hands every
rank back the direction for its own local slice. Strategies are the only place that issues
collectives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.distributed.agreement import Setting
from muonkit.distributed.compute import Compute, StrategyStats
from muonkit.distributed.pieces import Box, Region
from muonkit.shapes import full_shape


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

    def new_state(self, param: Tensor, dtype: torch.dtype) -> Tensor:
        """A zero state buffer laid out like ``param`` (sharded the same way), in ``dtype``."""
        return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)

    def all_true(self, flags: Tensor) -> list[bool]:
        """Each of this rank's few verdicts (a bool tensor) AND-ed over every rank, in one collective."""
        return [bool(f) for f in flags.reshape(-1).tolist()]

    def reduce_flags(self, flags: Tensor) -> Tensor:
        """This rank's few verdicts (a bool vector) AND-ed over every rank, without a read: a bool
        vector where ``flags`` live (where the backend reduces), with one more flag at the end:
        whether the device values every rank must share agree (strategies with replicated
        params, see :meth:`values_error`; always true here)."""
        return torch.cat([flags.reshape(-1).bool(), torch.ones(1, dtype=torch.bool, device=flags.device)])

    def values_error(self) -> Exception:
        """The error for a false last flag of :meth:`reduce_flags`."""
        return RuntimeError("no device values to compare on one device")

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

    def check_participation(self, has_grad: Sequence[bool], settings: Callable[[], Sequence[Setting]] = list) -> None:
        """Check that all ranks step the same params with the same settings.

        ``has_grad``: whether each param has a gradient, every param in group order;
        ``settings``: what else ranks must share (see :func:`muonkit.distributed.agreement.settings_of`),
        called only by strategies that communicate. Those raise on every rank when ranks disagree,
        which would otherwise hang a collective, mix different tensors in it or let the replicas
        drift apart; they check it in one small all-reduce on the host (no device read). One
        device: nothing to do.
        """
        del has_grad, settings

    def end_step(self) -> None:
        """Called at the end of every ``step()`` that applied or skipped its updates (not after an error).

        Communicating strategies start there the late checks of a step without a verdict
        (:meth:`~muonkit.distributed.collectives.Collectives.end_step`). Default: nothing.
        """
        return None

    def step_failed(self, error: BaseException, *, applied: bool) -> None:
        """Called when ``step()`` raises ``error`` on this rank; ``applied``: whether the step had changed
        any param or state before it. Never raises.

        Communicating strategies tell the other ranks (they would wait for this one until the
        process group's timeout) and stop stepping where the group is left out of step
        (:mod:`muonkit.distributed.failure`). Default: nothing.
        """
        del error, applied

    def host_tensors(self) -> list[Tensor]:
        """The tensors of this strategy's latest checks that live in host memory on any device.

        Reading them makes the host wait for no device work (for counting reads in a CPU run that
        stands in for a device run: :mod:`muonkit.testing.op_counts`). Default: none.
        """
        return []

    def align_grads(self, params: Sequence[Tensor]) -> None:
        """Lay out each param's gradient like the param, where an engine left it otherwise.

        Called by ``step()`` on every param with a gradient, the same params on every rank, before
        anything is checked. Default: nothing (plain tensors).
        """
        del params

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
