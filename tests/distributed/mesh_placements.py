"""N-D device-mesh layouts built the way users build them, and their comparison with one device.

A tiny model (:class:`MeshNet`) holds every case the mesh scenarios need: a fused QKV with split
blocks that tensor parallelism cuts in the middle of a block, uneven rows and columns, a matrix
smaller than the mesh (empty shards), three expert stacks (even, uneven, one expert), a router,
norms, an embedding and a head (AdamW). :func:`build` lays it out with plain torch APIs only
(``init_device_mesh``, ``fully_shard``, ``parallelize_module``, ``distribute_tensor``) and builds
``muonkit.HybridMuon(muonkit.param_groups(model, ...))`` on it, with no muonkit-specific setup.

Gradients are injected (no forward pass): every rank is handed its part of the same global
gradient, as the engines leave it, so the control (one device, the same model unsharded, the same
gradients) sees identical inputs. How runs are compared (see :mod:`common`):

- momentum, AdamW params and every state: **bit-identical** (elementwise fp32 on the same values,
  whatever part of a tensor a rank holds);
- Muon params: within :data:`common.MUON_REL_TOL` of the distance they travelled: each matrix is
  orthogonalized from the same fp32 values, but the batched matrix products may round a matrix
  differently depending on which other matrices share its batch, and a mesh's owners batch
  matrices differently from one device;
- every rank's local part equals the assembled tensor's (replicas agree bit for bit).

``MUONKIT_MESH_NAIVE=1`` builds every optimizer with :class:`naive_mesh.NaiveMeshStrategy`
instead of the default selection: the debug mode that checks the scenarios themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import MUON_REL_TOL, mismatch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import muonkit
from muonkit.config import MuonConfig, group_config
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import muon_directions
from muonkit.functional.orthogonalize import default_compute_dtype
from muonkit.testing import StepCounter

NAIVE = os.environ.get("MUONKIT_MESH_NAIVE") == "1"
QKV_SPLIT = (4, 8)  # Q rows 0-3, KV rows 4-11: TP over 2 cuts at row 6, inside the second block
HEADS_SPLIT = (4, 4, 4)  # attn.proj per head: 3 heads of 4 columns; rowwise TP over 2 cuts head 1, over 4 every head
RULES = [
    muonkit.Rule(r"attn\.qkv\.weight$", "muon", split_sizes=QKV_SPLIT, reason="fused QKV"),
    muonkit.Rule(r"attn\.proj\.weight$", "muon", split_sizes=HEADS_SPLIT, reason="per head", split_along="cols"),
]
TP_PLAN_KEYS = {
    "attn.qkv": "col",
    "attn.proj": "row",
    "mlp.up": "col",
    "mlp.down": "row",
    "mlp.tiny": "col",
    "late": "col",
}
PARTS = ("embed", "attn", "mlp", "late", "experts", "router", "norm", "head")


class MeshNet(nn.Module):
    """Only holds params (gradients are injected). ``parts`` picks the submodules (pipeline stages)."""

    def __init__(self, seed: int = 0, parts: Sequence[str] = PARTS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        if "embed" in parts:
            self.embed = nn.Embedding(11, 8)  # adamw, 11 rows: uneven over 2 and 4
        if "attn" in parts:
            self.attn = nn.Module()
            self.attn.qkv = nn.Linear(8, 12)  # muon, split (4, 8); bias adamw
            self.attn.proj = nn.Linear(12, 8, bias=False)  # row-parallel: cols 12, per head (HEADS_SPLIT)
        if "mlp" in parts:
            self.mlp = nn.Module()
            self.mlp.up = nn.Linear(8, 7, bias=False)  # 7 rows: uneven over 2 and 4
            self.mlp.down = nn.Linear(7, 8, bias=False)  # row-parallel: 7 cols, uneven
            self.mlp.tiny = nn.Linear(3, 1, bias=False)  # one row: smaller than any mesh, empty shards
        if "late" in parts:
            self.late = nn.Linear(8, 5, bias=False)  # 5 rows: TP 4 leaves a rank empty; no grad on some steps
        if "experts" in parts:
            self.experts = nn.Module()
            self.experts.w_even = nn.Parameter(torch.randn(4, 6, 8) * 0.3)  # 4 experts: 2 per EP rank
            self.experts.w_uneven = nn.Parameter(torch.randn(3, 6, 8) * 0.3)  # 3 experts: 2 and 1 per EP rank
            self.experts.w_one = nn.Parameter(torch.randn(1, 4, 6) * 0.3)  # 1 expert: an EP rank holds none
        if "router" in parts:
            self.router = nn.Linear(8, 4, bias=False)  # MoE router: adamw
        if "norm" in parts:
            self.norm = nn.LayerNorm(8)  # adamw; bias without grad on some steps
        if "head" in parts:
            self.head = nn.Linear(8, 11, bias=False)  # output head: adamw


NO_GRAD: dict[str, tuple[int, ...]] = {"late.weight": (1,), "norm.bias": (1,)}  # name -> steps without gradient


def gradient(
    index: int, name: str, shape: Sequence[int], step: int, no_grad: dict[str, tuple[int, ...]]
) -> Tensor | None:
    """The global (already averaged) gradient of a param: the same on every rank, by name."""
    if step in no_grad.get(name, ()):
        return None
    g = torch.Generator().manual_seed(1000 * step + index)
    scale = 10.0 ** ((index % 5) - 2)  # magnitudes from 1e-2 to 1e2
    return torch.randn(tuple(shape), generator=g) * scale


def set_grads(model: nn.Module, step: int, no_grad: dict[str, tuple[int, ...]] = NO_GRAD) -> None:
    """Each rank's part of the global gradient of every param (no communication)."""
    for name, p in model.named_parameters():
        g = gradient(_index(name), name, p.shape, step, no_grad)
        if g is None:
            p.grad = None
        elif isinstance(p, DTensor):
            p.grad = distribute_tensor(g.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            local = p.detach().to_local()
            if p.grad.to_local().shape != local.shape:  # FSDP2 shapes some empty shards its own way: (0, 0, 6)
                assert local.numel() == p.grad.to_local().numel() == 0, (name, local.shape, p.grad.to_local().shape)
                p.grad = DTensor.from_local(
                    torch.zeros_like(local), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
        else:
            p.grad = g.to(p.dtype)


def _index(name: str) -> int:
    """A stable number per param name (the same in every model that has that param)."""
    return sum((k + 1) * ord(c) for k, c in enumerate(name)) % 9973


# ------------------------------------------------------------------ layouts


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN_KEYS.items()}


def _dense_children(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_children() if name != "experts"]


def _experts_over(model: nn.Module, ep_mesh: Any) -> None:
    """Expert stacks ``Shard(0)`` over the ``ep`` axis (what expert parallelism does to them)."""
    for name, p in list(model.experts.named_parameters()):
        setattr(model.experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))


def apply_placement(model: nn.Module, layout: str, world_size: int) -> nn.Module:
    """Lay ``model`` out in place over ``world_size`` ranks; returns it.

    ======== ====== ==========================================================================
    layout   ranks  what it is
    ======== ====== ==========================================================================
    fsdp     any    ``fully_shard`` on a 1-D mesh (the checkpoints' target)
    hsdp     4      ``fully_shard`` on a 2x2 ("replicate", "shard") mesh
    fsdp_tp  4      TP (colwise/rowwise) on "tp", then ``fully_shard`` on "dp": ``_StridedShard``
    tp       4      TP alone on a 4-rank "tp" mesh, every other param replicated on it
    ep       4, 1   dense params HSDP on ("ep", "dp"); expert stacks ``Shard(0)`` over "ep"
    ep_fsdp  4      as ep, and ``fully_shard`` of the experts on "dp" along their dim 1
    pp0/pp1  4      pipeline stage 0 or 1 of ("pp", "dp"): ``fully_shard`` on the stage's "dp"
    hsdp_tp  8      TP on "tp", then ``fully_shard`` on ("dp_replicate", "dp_shard")
    ep_tp    8      dense: TP on "tp", HSDP on ("ep", "dp"); experts ``Shard(0)`` "ep", ``Shard(1)`` "dp"
    ======== ====== ==========================================================================
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    half = 2 if world_size >= 4 else 1
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)))
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")))
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan())
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "tp":
        from torch.distributed.tensor import distribute_module

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, _tp_plan())
        distribute_module(model, mesh)  # everything not parallelized: Replicate() on the tp mesh
    elif layout == "tp_plain":  # TP alone, the other params left plain (as transformers' tp_plan leaves norms)
        parallelize_module(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)), _tp_plan())
    elif layout in ("ep", "ep_fsdp"):
        mesh = init_device_mesh("cpu", (half, world_size // half), mesh_dim_names=("ep", "dp"))
        _experts_over(model, mesh["ep"])
        for child in _dense_children(model):
            fully_shard(child, mesh=mesh)
        if layout == "ep_fsdp":
            fully_shard(model.experts, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
    elif layout in ("pp0", "pp1"):  # this rank's pipeline stage: fully_shard over the stage's ranks
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "hsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan())
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    elif layout == "ep_tp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("ep", "dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan())
        _experts_over(model, mesh["ep"])
        for child in _dense_children(model):
            fully_shard(child, mesh=mesh["ep", "dp"])
        fully_shard(model.experts, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1))
    elif layout != "single":
        raise ValueError(f"unknown layout {layout!r}")
    return model


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """What a user writes: routed by name, the fused QKV split by a rule; Muon and AdamW groups mixed."""
    return muonkit.param_groups(model, weight_decay=0.01, adamw_lr=1e-2, adamw_weight_decay=0.1, rules=RULES)


def optimizer(model: nn.Module, layout: str) -> muonkit.HybridMuon:
    """The default selection (``HybridMuon(param_groups(model))``), or the naive strategy in debug mode."""
    kwargs: dict[str, Any] = {}
    params = list(model.parameters())
    if layout == "single":
        kwargs["strategy"] = muonkit.distributed.SingleDeviceStrategy()
    elif NAIVE and any(isinstance(p, DTensor) for p in params):
        from naive_mesh import NaiveMeshStrategy

        kwargs["strategy"] = NaiveMeshStrategy(params)
    return muonkit.HybridMuon(groups(model), **kwargs)


def build(
    layout: str, world_size: int, *, seed: int = 0, parts: Sequence[str] = PARTS
) -> tuple[nn.Module, muonkit.HybridMuon]:
    model = apply_placement(MeshNet(seed, parts), layout, world_size)
    return model, optimizer(model, layout)


# What torch 2.13 gives (checked by the placements check and test_mesh_placements.py): the
# scenarios rely on it, so a torch change shows up there first.
S0, S1, R = Shard(0), Shard(1), Replicate()
STRIDED = _StridedShard(0, split_factor=2)  # FSDP2's dp shard of a tensor TP already sharded on dim 0
EXPECTED_PLACEMENTS: dict[str, dict[str, tuple[tuple[str, ...], tuple]]] = {
    "hsdp": {"attn.qkv.weight": (("replicate", "shard"), (R, S0)), "experts.w_one": (("replicate", "shard"), (R, S0))},
    "fsdp_tp": {
        "attn.qkv.weight": (("dp", "tp"), (STRIDED, S0)),
        "attn.proj.weight": (("dp", "tp"), (S0, S1)),
        "mlp.tiny.weight": (("dp", "tp"), (STRIDED, S0)),
        "norm.weight": (("dp",), (S0,)),
        "experts.w_even": (("dp",), (S0,)),
    },
    "tp": {
        "attn.qkv.weight": (("tp",), (S0,)),
        "attn.proj.weight": (("tp",), (S1,)),
        "embed.weight": (("tp",), (R,)),
        "experts.w_even": (("tp",), (R,)),
    },
    "ep": {"experts.w_uneven": (("ep",), (S0,)), "attn.qkv.weight": (("ep", "dp"), (R, S0))},
    "ep_fsdp": {"experts.w_uneven": (("dp", "ep"), (S1, S0)), "head.weight": (("ep", "dp"), (R, S0))},
    "hsdp_tp": {
        "attn.qkv.weight": (("dp_replicate", "dp_shard", "tp"), (R, STRIDED, S0)),
        "attn.proj.weight": (("dp_replicate", "dp_shard", "tp"), (R, S0, S1)),
        "experts.w_even": (("dp_replicate", "dp_shard"), (R, S0)),
    },
    "ep_tp": {
        "attn.qkv.weight": (("ep", "dp", "tp"), (R, STRIDED, S0)),
        "attn.proj.weight": (("ep", "dp", "tp"), (R, S0, S1)),
        "norm.weight": (("ep", "dp"), (R, S0)),
        "experts.w_even": (("dp", "ep"), (S1, S0)),
    },
}


# ------------------------------------------------------------------ comparisons


def full(t: Tensor) -> Tensor:
    """The whole tensor (collective for a DTensor; see :func:`naive_mesh.whole` for FSDP2's empty shards)."""
    from naive_mesh import whole

    return whole(t)


def algorithms(opt: muonkit.HybridMuon) -> dict[str, str]:
    return {n: g["algorithm"] for g in opt.param_groups for n in g["param_names"]}


def muon_tolerance(algorithm: str) -> float | None:
    """Muon params: the batched-products tolerance of :mod:`common` (fp32 params); others bit-exact."""
    return MUON_REL_TOL[default_compute_dtype("cpu")] if algorithm == "muon" else None


@dataclass
class Snapshot:
    """Whole params and states by name (collective for DTensors: every rank calls it in the same order)."""

    tensors: dict[str, Tensor]

    @classmethod
    def of(cls, model: nn.Module, opt: muonkit.HybridMuon) -> Snapshot:
        out: dict[str, Tensor] = {}
        for name, p in model.named_parameters():
            out[f"{name}:param"] = full(p.detach()).clone()
            for key, value in sorted(opt.state.get(p, {}).items()):
                out[f"{name}:{key}"] = full(value).clone() if isinstance(value, Tensor) else torch.tensor(value)
        return cls(out)


def snapshot_differences(
    mine: Snapshot, expected: Snapshot, *, algorithms: dict[str, str] | None = None, initial: Snapshot | None = None
) -> list[str]:
    """Entries that differ: bit for bit, or (given the ``algorithms`` and the ``initial`` params) Muon
    params within :func:`muon_tolerance` of the distance travelled from ``initial``."""
    problems = []
    if sorted(mine.tensors) != sorted(expected.tensors):
        missing = sorted(set(expected.tensors) ^ set(mine.tensors))
        problems.append(f"entries differ: {missing}")
    for key, value in expected.tensors.items():
        if key not in mine.tensors:
            continue
        name, what = key.split(":")
        tol = muon_tolerance(algorithms[name]) if algorithms and initial and what == "param" else None
        start = initial.tensors[key] if initial and tol is not None else None
        why = mismatch(mine.tensors[key], value, initial=start, tol=tol)
        problems += [] if why is None else [f"{key}: {why}"]
    return problems


def replica_differences(model: nn.Module) -> list[str]:
    """Params assembled differently on some rank than on its mesh's first rank (``full_tensor()``
    gathers the sharded dims and keeps each rank's own replica): replicas must agree bit for bit
    (collective over every rank)."""
    wholes = {n: full(p.detach()) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, wholes)
    problems = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            first = int(p.device_mesh.mesh.flatten()[0])
            if not torch.equal(wholes[name], gathered[first][name]):
                problems.append(f"{name}: rank {dist.get_rank()} holds another replica than rank {first}")
    return problems


def placements_of(model: nn.Module) -> dict[str, tuple[tuple[str, ...], tuple[Placement, ...]]]:
    return {
        n: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.placements))
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }


# ------------------------------------------------------------------ work counts


def matrix_flops(opt: muonkit.HybridMuon) -> tuple[int, int]:
    """(strategy FLOPs, dispatch-counted matmul FLOPs) of the largest single matrix of ``opt``'s Muon groups."""
    best = (0, 0)
    for i, group in enumerate(opt.param_groups):
        config = group_config(group, i)
        if not isinstance(config, MuonConfig):
            continue
        for p in group["params"]:
            for block in config.layout.blocks(tuple(p.shape)):
                x = torch.randn(1, block.rows, block.cols)
                with StepCounter() as counter:
                    muon_directions([x], [MatrixLayout("experts")], config.ns_options)
                best = max(best, (config.flops(block.rows, block.cols), counter.counts.matmul_flops))
    return best


def counted_step(opt: muonkit.HybridMuon) -> tuple[int, int, int]:
    """One step: (matrices, strategy FLOPs, dispatch-counted matmul FLOPs) it spent on this rank."""
    before = (opt.strategy.stats.matrices, opt.strategy.stats.flops)
    with StepCounter() as counter:
        opt.step()
    return (
        opt.strategy.stats.matrices - before[0],
        opt.strategy.stats.flops - before[1],
        counter.counts.matmul_flops,
    )


def all_gather_ints(values: Sequence[int], group: Any = None) -> list[list[int]]:
    t = torch.tensor(list(values), dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.tolist() for o in out]
