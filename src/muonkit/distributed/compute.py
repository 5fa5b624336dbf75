"""The math a strategy runs on this rank, counted: :class:`Compute`, held by every strategy.

A strategy decides where matrices are orthogonalized; :class:`Compute` does it: the directions
of whole tensors (same-shape matrices batched, the group's update rule around the iteration,
:func:`~muonkit.functional.update_rule.rule_directions`) and the Newton-Schulz iteration and rule of
one shard of a matrix split among ranks (:mod:`muonkit.distributed.split_run`), each counted in
the strategy's :class:`StrategyStats`. It is an attribute (``strategy.compute``), so the
simulator replaces it to time the work that stands in for it.

:class:`RowStates` carries a rule's ``"rows"`` states through one run of the executor: whole
on every rank, each job's part handed to its owner, the new values shared in one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from muonkit.config import MuonConfig
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions
from muonkit.functional.sharded import orthogonalize_shard
from muonkit.functional.update_rule import Reduce, rule_directions

__all__ = ["Compute", "RowStates", "StrategyStats"]


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
        self.stats.matrices += count
        self.stats.flops += count * config.flops(rows, cols, device=device)

    def shard(self, shard: Tensor, **options: Any) -> Tensor:
        """:func:`~muonkit.functional.sharded.orthogonalize_shard` of one member's shard."""
        return orthogonalize_shard(shard, **options)

    def after_shard(
        self, config: MuonConfig, o: Tensor, olds: Sequence[Tensor], *, rows_cut: bool, cols: int, reduce: Reduce
    ) -> tuple[Tensor, list[Tensor]]:
        """The group's rule after the iteration on one shard (:meth:`UpdateRule.after_shard`)."""
        return config.rule.after_shard(o, olds, rows_cut=rows_cut, cols=cols, reduce=reduce, settings=config)


class RowStates:
    """A rule's ``"rows"`` states during one run of the executor: old ones in, new ones out, on every rank.

    Each rank keeps every tensor's states whole (one value per matrix row: tiny). The jobs of a
    tensor come in the order of its rows (each expert, and in it each ``split_sizes`` block), so
    job ``j`` owns the next ``spec.length(job)`` values of its tensor's vectors. The owner of a
    job computes its new values from the whole direction; every rank writes those it computed
    into zero vectors and one ``all_reduce(SUM)`` of all of them gives every rank every new value
    exactly (each value has one non-zero contributor). Values of no job with an owner (empty
    matrices) keep the old ones, as on one device.

    ``describe()``: ``(jobs, owned)``, each job of the plan as ``(tensor, shape, layout)`` in plan
    order and the jobs someone computes, called once per plan: ``memo`` is the plan's memo (the
    spans are the same every step).
    """

    def __init__(
        self,
        config: MuonConfig,
        states: Sequence[Sequence[Tensor]],
        describe: Callable[[], tuple[list[tuple[int, tuple[int, ...], MatrixLayout]], list[int]]],
        memo: dict[Any, Any],
    ) -> None:
        self.states = states
        specs = config.rule.rows_states
        key = ("rows spans", specs)
        if key not in memo:
            jobs, owned = describe()
            spans: list[list[tuple[int, int, int]]] = []  # per job, per spec: (tensor, start, stop)
            ends = [[0] * len(specs) for _ in states]
            for tensor, shape, layout in jobs:
                mine = []
                for s, spec in enumerate(specs):
                    count = spec.length(shape, layout)
                    mine.append((tensor, ends[tensor][s], ends[tensor][s] + count))
                    ends[tensor][s] += count
                spans.append(mine)
            memo[key] = (spans, owned)
        self.spans, self.owned = memo[key]
        self.sums = [[torch.zeros_like(v) for v in vs] for vs in states]

    def old(self, j: int) -> list[Tensor]:
        """Job ``j``'s part of each state."""
        return [self.states[t][s][start:stop] for s, (t, start, stop) in enumerate(self.spans[j])]

    def computed(self, j: int, new: Sequence[Tensor]) -> None:
        for s, ((t, start, stop), value) in enumerate(zip(self.spans[j], new, strict=True)):
            self.sums[t][s][start:stop] = value

    def computed_part(self, j: int, offset: int, new: Sequence[Tensor]) -> None:
        """New values of a split job's rows from ``offset`` on (each member's rows)."""
        for s, ((t, start, _), value) in enumerate(zip(self.spans[j], new, strict=True)):
            self.sums[t][s][start + offset : start + offset + value.numel()] = value

    def share(self, all_reduce: Any) -> None:
        """The one all-reduce (``all_reduce(flat, op=...)``); then ``states`` hold the new values."""
        sums = [v for vs in self.sums for v in vs]
        if not sums:
            return
        flat = torch.cat([s.reshape(-1) for s in sums])
        all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        parts = iter(torch.split(flat, [s.numel() for s in sums]))
        shared = [[next(parts) for _ in vs] for vs in self.sums]
        for j in self.owned:
            for s, (t, start, stop) in enumerate(self.spans[j]):
                self.states[t][s][start:stop] = shared[t][s][start:stop]
