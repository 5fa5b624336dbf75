"""The plan simulator: the real jobs and the real plan of a model on a mesh, with no process group.

For each pipeline stage (one optimizer over the stage's ranks), each param group of the default
routing (one per matrix layout, as :func:`muonkit.param_groups` makes them) is laid out as the
torch APIs lay it out (:mod:`muonkit.simulator.meshes`), cut into jobs by the same functions the
strategies call (:func:`~muonkit.distributed.dtensor_placement.rank_boxes` and
:func:`~muonkit.distributed.dtensor_placement.tensor_jobs` as :class:`~muonkit.distributed.dtensor.DTensorStrategy`,
:func:`~muonkit.distributed.replicated.whole_jobs` under DDP) and planned by
:func:`~muonkit.distributed.planner.make_plan` with the executor's costs and exchange groups.
What each rank then computes, sends and receives is read off the plans; the host work of a step
is measured by running the executor itself for one rank (:mod:`muonkit.simulator.host`).

Cost model of the estimated overhead (``Estimate``): a training step costs ``6 * active * tokens``
FLOPs (:attr:`~muonkit.simulator.models.ModelShapes.active`; attention's quadratic term left out)
spread over all ranks at ``mfu`` of the peak; the optimizer's Newton-Schulz costs the busiest
rank's FLOPs at ``ns_efficiency`` of the peak, and its exchange the busiest rank's larger of bytes
sent and received over ``bandwidth``, counted in full (no overlap with Newton-Schulz: an upper
bound). Overhead = (Newton-Schulz + exchange) / training step.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from muonkit.config import DEFAULTS, MUON_KEYS, MuonConfig, group_config
from muonkit.distributed import dtensor_placement
from muonkit.distributed.dtensor_placement import rank_boxes, tensor_jobs
from muonkit.distributed.executor import group_keys
from muonkit.distributed.pieces import Box, Job, holders_of
from muonkit.distributed.planner import Plan, job_cost, make_plan, wire_dtype
from muonkit.distributed.replicated import whole_jobs
from muonkit.distributed.split_plan import SplitCost, SplitPolicy, split_traffic
from muonkit.simulator.meshes import MeshSpec
from muonkit.simulator.models import Matrix, ModelShapes

__all__ = [
    "Estimate", "GroupPlan", "Simulation", "StagePlan", "muon_config", "per_rank", "plan_stage", "retained_bytes", "simulate",
]  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """What the overhead estimate assumes (defaults: an H100 SXM, bf16 dense, a 4M-token batch)."""

    tokens: int = 4 * 1024 * 1024
    """Tokens per optimizer step (the global batch)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one device, TFLOP/s (H100 SXM: 989)."""
    mfu: float = 0.4
    """Fraction of the peak training reaches."""
    ns_efficiency: float = 0.4
    """Fraction of the peak Newton-Schulz reaches."""
    bandwidth: float = 50.0
    """Bytes per second one rank sends or receives, GB/s (400 Gb/s: 50)."""

    def __post_init__(self) -> None:
        for name in ("tokens", "peak_tflops", "mfu", "ns_efficiency", "bandwidth"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Invalid {name}={value!r}: must be > 0")


def muon_config(
    layout: str = "auto", split_sizes: tuple[int, ...] | None = None, split_along: str = "rows"
) -> MuonConfig:
    """The default Muon group (bf16 Newton-Schulz, as on a GPU) of one matrix layout."""
    group = {key: getattr(DEFAULTS, key) for key in MUON_KEYS if hasattr(DEFAULTS, key)} | {
        "algorithm": "muon",
        "layout": layout,
        "split_sizes": split_sizes,
        "split_along": split_along,
        "ns_dtype": torch.bfloat16,
    }
    config = group_config(group)
    assert isinstance(config, MuonConfig)
    return config


@dataclass
class GroupPlan:
    """One param group of one stage: its params, jobs and plan."""

    label: str
    matrices: list[Matrix]
    holders: list[Sequence[tuple[int, Box]] | None]
    """Per param: ``(rank, box)`` of every rank (None: whole on every rank, DDP)."""
    config: MuonConfig
    plan: Plan
    costs: list[float]
    split_cost: SplitCost
    """When the plan split a job's Newton-Schulz over a group of ranks (:attr:`Plan.splits`)."""


@dataclass
class StagePlan:
    """One pipeline stage: its groups' plans and what they cost to make."""

    stage: int
    world_size: int
    groups: list[GroupPlan]
    seconds: float
    """CPU seconds of building the jobs and planning (one core, from cold caches)."""
    memory: int
    """Bytes the jobs, the plans and the layout caches behind them keep (:func:`retained_bytes`)."""


@dataclass
class Simulation:
    """Everything :func:`simulate` measured, per rank where it differs."""

    model: ModelShapes
    mesh: MeshSpec
    estimate: Estimate
    jobs: int = 0
    pieces: int = 0
    plan_seconds: float = 0.0
    plan_memory: int = 0
    flops: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    work: list[int] = field(default_factory=list)
    """Pieces each rank sends, receives, assembles or writes per step (its share of host work)."""
    gradient_bytes: int = 0
    """One bf16 gradient of the Muon params of the largest stage (the unit of the byte ratios)."""
    host: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        w = len(self.flops)
        overhead = self.overhead()
        return {
            "model": self.model.name,
            "mesh": self.mesh.describe(),
            "world_size": w,
            "muon_params": self.model.muon_numel,
            "jobs": self.jobs,
            "pieces": self.pieces,
            "plan_seconds": self.plan_seconds,
            "plan_memory_bytes": self.plan_memory,
            "ns_flops_busiest": max(self.flops),
            "ns_flops_mean": sum(self.flops) / w,
            "ns_busiest_over_mean": max(self.flops) / (sum(self.flops) / w) if sum(self.flops) else 1.0,
            "sent_bytes_busiest": max(self.sent),
            "sent_bytes_mean": sum(self.sent) / w,
            "received_bytes_busiest": max(self.received),
            "received_bytes_mean": sum(self.received) / w,
            "bf16_gradient_bytes": self.gradient_bytes,
            "host": self.host,
            "estimate": {**vars(self.estimate), **overhead},
        }

    def overhead(self) -> dict[str, float]:
        """The cost model's times (seconds) and the overhead (fraction of a training step)."""
        e, w = self.estimate, len(self.flops)
        peak = e.peak_tflops * 1e12
        train = 6 * self.model.active * e.tokens / w / (peak * e.mfu)
        ns = max(self.flops) / (peak * e.ns_efficiency)
        exchange = max(max(self.sent), max(self.received)) / (e.bandwidth * 1e9)
        return {"train_step_s": train, "ns_s": ns, "exchange_s": exchange, "overhead": (ns + exchange) / train}


def simulate(
    model: ModelShapes,
    mesh: MeshSpec,
    *,
    estimate: Estimate | None = None,
    host: bool = True,
    split: SplitPolicy | None = None,
) -> Simulation:
    """Plan every stage of ``model`` on ``mesh`` and measure it (see the module docstring).

    ``host``: also run the executor's per-step bookkeeping for the busiest rank of the busiest
    stage (:func:`muonkit.simulator.host.host_step`). ``split``: when a job's Newton-Schulz runs
    over a group of ranks (the executor's default policy; ``SplitPolicy(threshold=math.inf)``: never).
    """
    from muonkit.simulator.host import host_step

    sim = Simulation(model, mesh, estimate or Estimate())
    w = mesh.stage_ranks
    busiest: tuple[int, int, int] = (-1, 0, 0)  # (pieces, stage, rank)
    for stage in range(mesh.pp):
        planned = plan_stage(model, mesh, stage, policy=split)
        sim.plan_seconds = max(sim.plan_seconds, planned.seconds)
        sim.plan_memory = max(sim.plan_memory, planned.memory)
        flops, sent, received, work = per_rank(planned, w)
        sim.flops += flops
        sim.sent += sent
        sim.received += received
        sim.work += work
        sim.jobs += sum(len(g.plan.jobs) for g in planned.groups)
        sim.pieces += sum(len(job.held) for g in planned.groups for job in g.plan.jobs)
        sim.gradient_bytes = max(sim.gradient_bytes, 2 * sum(m.numel for g in planned.groups for m in g.matrices))
        rank = max(range(w), key=lambda r: (work[r], -r))
        if host and work[rank] > busiest[0]:
            sim.host = {"stage": stage, "rank": rank, "pieces": work[rank], **host_step(planned, rank)}
            busiest = (work[rank], stage, rank)
        del planned
    return sim


def plan_stage(model: ModelShapes, mesh: MeshSpec, stage: int, *, policy: SplitPolicy | None = None) -> StagePlan:
    """The jobs and plans of one pipeline stage, timed from cold caches."""
    policy = SplitPolicy() if policy is None else policy
    dtensor_placement.clear_caches()
    start = time.process_time()
    groups: dict[tuple[str, tuple[int, ...] | None], list[Matrix]] = {}
    for matrix in _stage_matrices(model, mesh.pp, stage):
        groups.setdefault((matrix.layout, matrix.split_sizes), []).append(matrix)
    planned = [
        _plan_group(model, mesh, layout, split, matrices, policy) for (layout, split), matrices in groups.items()
    ]
    seconds = time.process_time() - start
    return StagePlan(
        stage, mesh.stage_ranks, planned, seconds, retained_bytes((planned, dtensor_placement.placement_caches()))
    )


def _plan_group(
    model: ModelShapes,
    mesh: MeshSpec,
    layout: str,
    split: tuple[int, ...] | None,
    matrices: list[Matrix],
    policy: SplitPolicy,
) -> GroupPlan:
    config = muon_config(layout, split)
    w = mesh.stage_ranks
    jobs: list[Job] = []
    holders: list[Sequence[tuple[int, Box]] | None] = []
    for i, matrix in enumerate(matrices):
        placed = mesh.placement(matrix, model.experts)
        if placed is None:  # DDP: ReplicatedStrategy's jobs
            holders.append(None)
            jobs += whole_jobs(i, matrix.shape, config.layout, range(w))
        else:  # DTensorStrategy's jobs
            boxes = rank_boxes(matrix.shape, *placed)
            holders.append(boxes)
            jobs += tensor_jobs(i, matrix.shape, config.layout, boxes)
    costs = [job_cost(job, config) for job in jobs]
    keys = group_keys(jobs, [torch.float32] * len(matrices))
    cost = SplitCost(steps=config.steps, method=config.ns_method, dtype=config.ns_dtype, policy=policy)
    plan = make_plan(jobs, costs=costs, world_size=w, keys=keys, split=cost)
    return GroupPlan(
        f"{layout}{'' if split is None else f' split {list(split)}'}", matrices, holders, config, plan, costs, cost
    )


def _stage_matrices(model: ModelShapes, stages: int, stage: int) -> list[Matrix]:
    """The matrices of ``stage``: blocks cut into contiguous runs (the first stages one longer),
    matrices outside the blocks on the first stage."""
    per, extra = divmod(model.layers, stages)
    first = stage * per + min(stage, extra)
    last = first + per + (stage < extra)
    return [
        m for m in model.matrices if (first <= m.layer < last if m.layer is not None else stage == 0)
    ]  # fmt: skip


def per_rank(planned: StagePlan, w: int) -> tuple[list[float], list[int], list[int], list[int]]:
    """Newton-Schulz FLOPs, bytes sent and received, and pieces handled per rank, read off the plans."""
    flops, sent, received, work = [0.0] * w, [0] * w, [0] * w, [0] * w
    like = torch.empty(0)  # fp32 updates
    for group in planned.groups:
        plan = group.plan
        wire = wire_dtype(group.config, like).itemsize
        for j, job in enumerate(plan.jobs):
            owner = plan.owners[j]
            if owner < 0:
                continue
            flops[owner] += group.costs[j]
            h = holders_of(plan.sources[j])
            for rank, n in zip(h.ranks, h.numels, strict=True):
                work[owner] += 1
                if rank != owner:
                    sent[rank] += 4 * n
                    received[owner] += 4 * n
                    work[rank] += 1
            h = holders_of(job.receivers)
            for rank, n in zip(h.ranks, h.numels, strict=True):
                work[owner] += 1
                if rank != owner:
                    sent[owner] += wire * n
                    received[rank] += wire * n
                    work[rank] += 1
        for split in plan.splits:  # a job's Newton-Schulz over a group of ranks
            for rank, f in zip(split.ranks, split.flops, strict=True):
                flops[rank] += f
                work[rank] += 1
            out, into = split_traffic(plan.jobs[split.job], split, group.split_cost, update_bytes=4, wire_bytes=wire)
            for rank, n in out.items():
                sent[rank] += n
            for rank, n in into.items():
                received[rank] += n
    return flops, sent, received, work


def retained_bytes(root: object) -> int:
    """Bytes of every Python object reachable from ``root``, each counted once (``sys.getsizeof``):
    what keeping it costs, whatever the process allocated before."""
    seen: set[int] = set()
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_flops(n: float) -> str:
    exponent = max(0, min(5, int(math.log10(max(n, 1)) // 3)))
    return f"{n / 10 ** (3 * exponent):.2f} {['', 'K', 'M', 'G', 'T', 'P'][exponent]}FLOP"
