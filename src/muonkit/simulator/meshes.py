"""Mesh descriptions for the plan simulator, and the DTensor placements the usual torch APIs give each param.

A description is comma-separated ``name=size`` entries (:func:`parse_mesh`):

=================  ===========================================================================
``fsdp=F``         FSDP2 (``fully_shard``) over F ranks: every param ``Shard(0)``
``hsdp=RxS``       HSDP: R replicas (outer mesh dim) of S-way FSDP2 (inner), like
                   ``init_device_mesh((R, S), ("replicate", "shard"))``: ``(Replicate(), Shard(0))``
``ddp=N``          DDP: every param whole on N ranks
``tp=T``           with ``fsdp=`` or ``hsdp=``: ``parallelize_module`` on an inner ``tp`` mesh dim
                   by the model's TP plan (``colwise``: ``Shard`` of the out features, ``rowwise``:
                   of the in features), then ``fully_shard`` on the data-parallel dims: a
                   TP-sharded dim 0 becomes ``_StridedShard(0, split_factor=T)`` there; params the
                   plan leaves whole are sharded over the data-parallel dims only
``ep=E``           with ``fsdp=F``: expert parallel (torchtitan's): the dense params FSDP2 over all
                   F*E ranks, each expert stack ``Shard(0)`` on an inner ``ep`` dim and FSDP2 on
                   the outer F: ``Shard(1)`` there when F*E exceeds the experts, else
                   ``_StridedShard(0, split_factor=E)``
``pp=P``           with any of the above: P pipeline stages, the transformer blocks cut into P
                   contiguous runs; each stage is its own optimizer over its own ranks
=================  ===========================================================================

The world size is the product of the sizes. Placements are given on the mesh the params are read
on (:class:`~muonkit.distributed.dtensor_placement.MeshGroup`: a param on a sub-mesh is replicated
over the dims it lacks), with the group rank at each coordinate, row-major.

Example::

    >>> spec = parse_mesh("tp=8,fsdp=512")
    >>> spec.world_size, spec.describe()
    (4096, 'tp=8,fsdp=512')
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from muonkit.simulator.models import Matrix

__all__ = ["MeshSpec", "parse_mesh"]

NAMES = ("fsdp", "hsdp", "ddp", "tp", "ep", "pp")
USAGE = "fsdp=F, hsdp=RxS or ddp=N, optionally with tp=T (not with ddp), ep=E (with fsdp) and pp=P"


@dataclass(frozen=True)
class MeshSpec:
    """One pipeline stage's mesh (``shard`` x ``replicate`` x ``tp`` x ``ep`` ranks) and the stages."""

    shard: int = 1
    """FSDP2 ranks (the inner data-parallel dim; under ``ep``, the outer F)."""
    replicate: int = 1
    """HSDP replicas (or DDP ranks when :attr:`ddp`)."""
    tp: int = 1
    ep: int = 1
    pp: int = 1
    ddp: bool = False

    @property
    def stage_ranks(self) -> int:
        return self.shard * self.replicate * self.tp * self.ep

    @property
    def world_size(self) -> int:
        return self.stage_ranks * self.pp

    def describe(self) -> str:
        parts = [f"pp={self.pp}"] if self.pp > 1 else []
        parts += [f"tp={self.tp}"] if self.tp > 1 else []
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        if self.ddp:
            parts.append(f"ddp={self.replicate}")
        elif self.replicate > 1:
            parts.append(f"hsdp={self.replicate}x{self.shard}")
        else:
            parts.append(f"fsdp={self.shard}")
        return ",".join(parts)

    def placement(self, matrix: Matrix, experts: int) -> tuple[tuple[Placement, ...], torch.Tensor] | None:
        """The placements of ``matrix`` and the group rank at each coordinate of the mesh it is
        read on; None under DDP (whole on every rank)."""
        if self.ddp:
            return None
        if self.ep > 1 and matrix.layout == "experts":
            fsdp: Placement = Shard(1) if self.shard * self.ep > experts else _StridedShard(0, split_factor=self.ep)
            return (fsdp, Shard(0)), _ranks((self.shard, self.ep))
        if self.ep > 1:
            return (Shard(0),), _ranks((self.shard * self.ep,))
        data: tuple[Placement, ...] = (Replicate(), Shard(0)) if self.replicate > 1 else (Shard(0),)
        sizes = (self.replicate, self.shard) if self.replicate > 1 else (self.shard,)
        if self.tp == 1:
            return data, _ranks(sizes)
        if matrix.tp_dim is None:
            return (*data, Replicate()), _ranks((*sizes, self.tp))
        if matrix.tp_dim == 0:  # fully_shard over a TP Shard(0): rows strided
            data = (*data[:-1], _StridedShard(0, split_factor=self.tp))
        return (*data, Shard(matrix.tp_dim)), _ranks((*sizes, self.tp))


@functools.lru_cache(maxsize=64)
def _ranks(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod())).view(shape)


def parse_mesh(text: str) -> MeshSpec:
    """A :class:`MeshSpec` from ``"fsdp=4096"``, ``"hsdp=512x8"``, ``"ep=64,fsdp=64"``, ``"tp=8,fsdp=512"``, ``"pp=4,..."``."""
    entries: dict[str, str] = {}
    for part in text.replace(" ", "").split(","):
        name, _, value = part.partition("=")
        if name not in NAMES or not value or name in entries:
            raise ValueError(f"Invalid mesh {text!r}: entry {part!r}; expected name=size entries: {USAGE}")
        entries[name] = value
    sizes = {k: _size(text, k, v) for k, v in entries.items() if k != "hsdp"}
    bases = [k for k in ("fsdp", "hsdp", "ddp") if k in entries]
    if len(bases) != 1:
        raise ValueError(f"Invalid mesh {text!r}: give exactly one of fsdp=, hsdp=, ddp= ({USAGE})")
    if ("ep" in entries and bases != ["fsdp"]) or ("tp" in entries and ("ddp" in entries or "ep" in entries)):
        raise ValueError(f"Invalid mesh {text!r}: supported: {USAGE}; tp and ep not together")
    replicate, shard = 1, sizes.get("fsdp", 1)
    if "hsdp" in entries:
        found = re.fullmatch(r"(\d+)x(\d+)", entries["hsdp"])
        if found is None or min(int(found[1]), int(found[2])) < 1:
            raise ValueError(f"Invalid mesh {text!r}: hsdp=RxS (R replicas of S-way sharding, e.g. hsdp=512x8)")
        replicate, shard = int(found[1]), int(found[2])
    if "ddp" in entries:
        replicate = sizes["ddp"]
    return MeshSpec(
        shard=shard,
        replicate=replicate,
        tp=sizes.get("tp", 1),
        ep=sizes.get("ep", 1),
        pp=sizes.get("pp", 1),
        ddp="ddp" in entries,
    )


def _size(text: str, name: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"Invalid mesh {text!r}: {name}={value!r} must be a positive integer")
    return int(value)
