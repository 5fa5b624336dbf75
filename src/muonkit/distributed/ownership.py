"""Which rank orthogonalizes which matrix: a pure, deterministic load balancer.

Every rank calls :func:`assign_owners` with the same costs and gets the same answer, so no
communication is needed to agree on owners. The rule is the classic "longest processing time
first" greedy (Graham's LPT): sort the jobs by cost, largest first, and give each to the rank
with the least load so far. Its makespan is at most ``4/3 - 1/(3W)`` times the optimum.

Example::

    >>> assign_owners([9.0, 4.0, 4.0, 1.0], world_size=2)
    [0, 1, 1, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_owners"]


def assign_owners(costs: Sequence[float], world_size: int, *, loads: Sequence[float] | None = None) -> list[int]:
    """The owner rank of each job, balancing the summed cost per rank (LPT greedy).

    Args:
        costs: the cost of each job (e.g. Newton-Schulz FLOPs of a matrix), all >= 0.
        world_size: number of ranks, >= 1.
        loads: work each rank already has (default: none), e.g. matrices it must orthogonalize
            itself because only it holds them.

    Ties are broken by job index (equal costs keep their order) and by the lowest rank, so the
    result depends on nothing but the arguments.
    """
    if world_size < 1:
        raise ValueError(f"Invalid world_size={world_size!r}: must be >= 1")
    if any(c < 0 for c in costs):
        raise ValueError(f"Invalid costs={list(costs)!r}: must all be >= 0")
    load = [0.0] * world_size if loads is None else [float(x) for x in loads]
    if len(load) != world_size:
        raise ValueError(f"Invalid loads={list(load)!r}: must have world_size={world_size} entries")
    owners = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[job] = rank
        load[rank] += costs[job]
    return owners
