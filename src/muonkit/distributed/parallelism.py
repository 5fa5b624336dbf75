"""The name of a DTensor strategy's parallelism, read from its params' device meshes.

Each mesh dim plays one role, told by its name (torch, torchtitan, accelerate and Lightning name
them): ``replicate`` (the HSDP replica axis: ``replicate``, ``dp_replicate``), data-parallel
sharding (``dp``, ``shard``, ``dp_shard``, ``fsdp``, ``data_parallel``, ``dp_shard_cp``...), ``tp``
(``tp``, ``tensor_parallel``), ``ep`` (``ep``, ``expert_parallel``), ``cp`` (``cp``, ``context``)
or ``pp`` (``pp``, ``pipeline``); a dim of size 1 plays none. The name joins the roles present,
experts first:

=====================================  ==================
mesh dims of the params                name
=====================================  ==================
``("dp",)``, or one unnamed dim        ``fsdp2``
``("replicate", "shard")``, or two     ``hsdp``
unnamed dims (``fully_shard``'s HSDP)
``("tp",)``                            ``tp``
``("dp", "tp")``                       ``fsdp2+tp``
``("dp_replicate", "dp_shard", "tp")`` ``hsdp+tp``
``("ep",)`` and ``("dp",)``            ``ep+fsdp2``
=====================================  ==================

The name labels logs, benchmarks and the ranks' agreement check; nothing branches on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["parallelism_name"]

_ROLES = (  # first match wins: "dp_shard_cp" shards data (over the cp ranks too)
    ("replicate", {"replicate"}),
    ("shard", {"dp", "shard", "fsdp", "data"}),
    ("tp", {"tp", "tensor"}),
    ("ep", {"ep", "expert", "experts"}),
    ("cp", {"cp", "context"}),
    ("pp", {"pp", "pipeline"}),
)


def _role(dim_name: str) -> str:
    words = set(dim_name.lower().replace("-", "_").split("_"))
    return next((role for role, names in _ROLES if words & names), "shard")


def parallelism_name(meshes: Sequence[Any]) -> str:
    """``"fsdp2"``, ``"hsdp"``, ``"tp"``, ``"fsdp2+tp"``, ``"ep+fsdp2"``...: the roles of the dims of
    ``meshes`` (``DeviceMesh`` s; see the module docstring) over more than one rank, ``"fsdp2"`` for none."""
    roles: set[str] = set()
    for mesh in meshes:
        shape = tuple(mesh.shape)
        unnamed = ("replicate", "shard") if len(shape) == 2 else ("shard",) * len(shape)  # as fully_shard reads it
        names = mesh.mesh_dim_names or unnamed
        roles |= {_role(name) for name, size in zip(names, shape, strict=True) if size > 1}  # size 1: no role
    if {"replicate", "shard"} <= roles:
        data = "hsdp"
    else:
        data = "fsdp2" if "shard" in roles else "replicate" if "replicate" in roles else ""
    parts = ["ep" if "ep" in roles else "", data, *(r for r in ("tp", "cp", "pp") if r in roles)]
    return "+".join(p for p in parts if p) or "fsdp2"
