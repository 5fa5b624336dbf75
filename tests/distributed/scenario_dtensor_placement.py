"""The DTensor placement reader on real DTensors: every rank's ``to_local()`` is the box it is said to hold.

Layouts are built with plain torch APIs on 4 and 8 gloo ranks: ``distribute_tensor`` with every
combination of ``Replicate``, ``Shard`` and ``_StridedShard`` on 1-D, 2-D and 3-D meshes over
uneven, tiny and zero-size shapes; ``fully_shard`` (FSDP2, HSDP), ``parallelize_module`` (TP)
and both (FSDP2 + TP, HSDP + TP); expert stacks ``Shard(0)`` on an ``ep`` axis with ``fully_shard``
on their dim 1; pipeline stages on sub-meshes. For each param, each rank checks its local tensor
against ``Box.read`` of the whole, then the ranks exchange their local tensors and reassemble
every job (a whole tensor, or one expert) from its pieces alone.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from typing import Any

import torch
import torch.distributed as dist
from common import mismatch
from harness import Context, check
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import muonkit
from muonkit.distributed.base import local_part
from muonkit.distributed.dtensor import DTensorStrategy
from muonkit.distributed.dtensor_placement import mesh_group, rank_boxes, tensor_jobs
from muonkit.functional.matrices import MatrixLayout

SHAPES = [(0, 5), (1, 1), (3, 2), (5, 7), (10, 6), (13, 9), (3, 5, 4)]
OPTIONS = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]
TP_PLAN = {"qkv": ColwiseParallel(), "out": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def _readable(placements: tuple[Any, ...], mesh: Any) -> bool:
    """torch finds an order of the shardings (else it cannot gather the DTensor and the reader raises)."""
    return DTensorSpec._maybe_convert_StridedShard_to_shard_order(placements, mesh) is not None


def _whole(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + 1000 * seed


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _check_boxes(dtensors: list[DTensor], wholes: list[Tensor], *, label: str) -> int:
    """Each rank's local tensor is its box of the whole; every job reassembles from its pieces.

    Returns the number of jobs checked (the same on every rank).
    """
    spanned = mesh_group([t.device_mesh for t in dtensors])
    me = dist.get_rank(spanned.group)
    strategy = DTensorStrategy([t.device_mesh for t in dtensors])  # what QK-Clip asks: Strategy.regions
    held = []
    for t, whole in zip(dtensors, wholes, strict=True):
        boxes = spanned.boxes(t)
        held.append(boxes)
        box = dict(boxes)[me]
        local = t.to_local()
        what = f"{label}: {tuple(t.shape)} {t.placements} on {t.device_mesh!r}, group rank {me}"
        # FSDP2 on dim 1 of an empty expert stack stores (0, 0, c), not (0, r/W, c): both hold nothing
        same = tuple(local.shape) == box.shape or local.numel() == box.numel == 0
        assert same, f"{what}: local {tuple(local.shape)}, box {box.shape}"
        assert torch.equal(local.reshape(-1), box.read(whole)), what
        (region,) = strategy.regions(t)
        assert region.shape == tuple(t.shape) and region.region == box, f"{what}: regions() gives {region}"
        assert torch.equal(region.part_of(local).reshape(-1), box.read(whole)), what
    everyone: list[Any] = [None] * dist.get_world_size(spanned.group)
    dist.all_gather_object(everyone, [t.to_local() for t in dtensors], group=spanned.group)
    jobs = 0
    for i, (whole, boxes) in enumerate(zip(wholes, held, strict=True)):
        if whole.ndim < 2:  # biases: no Muon jobs, their boxes checked above
            continue
        for e, job in enumerate(tensor_jobs(i, whole.shape, MatrixLayout(), boxes)):
            expected = whole.reshape(-1, *whole.shape[-2:])[e] if whole.ndim == 3 else whole
            got = torch.full(job.shape, float("nan"))
            for piece in job.held:
                piece.region.write(got, local_part(everyone[piece.rank][i], piece).reshape(-1))
            assert torch.equal(got, expected), f"{label}: job {e} of {tuple(whole.shape)} {dtensors[i].placements}"
            jobs += 1
    return jobs


def _distributed_combos(mesh: Any, *, label: str) -> None:
    """Every placement combination over every shape, as ``distribute_tensor`` makes them."""
    wholes, dtensors = [], []
    for shape, placements in itertools.product(SHAPES, itertools.product(OPTIONS, repeat=mesh.ndim)):
        if any(getattr(p, "dim", 0) >= len(shape) for p in placements) or not _readable(placements, mesh):
            continue
        whole = _whole(shape, len(wholes))
        wholes.append(whole)
        dtensors.append(distribute_tensor(whole, mesh, list(placements), src_data_rank=None))
    jobs = _check_boxes(dtensors, wholes, label=label)
    assert jobs >= len(wholes) - sum(1 for w in wholes if not w.numel()), jobs


def _gathered_combos(mesh: Any) -> None:
    """torch's own gather of a DTensor built from the boxes gives back the whole.

    Uneven shapes only without ``_StridedShard``: torch 2.13's gather of an uneven
    ``_StridedShard`` DTensor sends mismatched sizes (gloo aborts), whatever the local tensors.
    """
    spanned = mesh_group([mesh])
    me = dist.get_rank(spanned.group)
    combos = list(itertools.product(OPTIONS, repeat=mesh.ndim))
    even = [p for p in combos if _readable(p, mesh)]
    cases = [
        (s, p) for s in [(5, 7), (3, 2), (10, 6)] for p in combos if not any(isinstance(x, _StridedShard) for x in p)
    ]
    for shape, placements in cases + [((8, 12), p) for p in even]:
        whole = _whole(shape)
        box = dict(rank_boxes(shape, placements, spanned.ranks[mesh]))[me]
        local = box.read(whole).view(box.shape)
        t = DTensor.from_local(local, mesh, list(placements), run_check=False, shape=whole.shape, stride=whole.stride())
        assert torch.equal(t.full_tensor(), whole), (shape, placements)


@check(4, 8)
def distribute_tensor_on_1d_2d_3d_meshes(ctx: Context) -> None:
    _distributed_combos(init_device_mesh("cpu", (ctx.world_size,)), label="1-D")
    _distributed_combos(_mesh((2, ctx.world_size // 2), ("a", "b")), label="2-D")
    if ctx.world_size == 8:
        _distributed_combos(_mesh((2, 2, 2), ("a", "b", "c")), label="3-D")


@check(4)
def full_tensor_of_the_boxes_is_the_whole(ctx: Context) -> None:
    del ctx
    _gathered_combos(_mesh((2, 2), ("a", "b")))


class Block(nn.Module):
    """Shapes that TP and FSDP cut unevenly, a matrix smaller than the mesh, and an expert stack."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(6, 12, bias=False)  # fused QKV: ColwiseParallel cuts Q, K and V rows
        self.out = nn.Linear(12, 6)
        self.up = nn.Linear(6, 7)  # TP: 4 + 3 rows (W=8: 2 + 2 + 2 + 1), then FSDP cuts those again
        self.down = nn.Linear(7, 5)
        self.tiny = nn.Linear(5, 3)  # fewer rows than ranks, not tensor parallel
        self.experts = nn.Parameter(
            torch.zeros(3, 6, 4)
        )  # 3 experts on 2 (W=8: 4) ep ranks; FSDP2 on dim 1 needs even rows

    @staticmethod
    def build() -> tuple[Block, dict[str, Tensor]]:
        block = Block()
        wholes = {}
        for i, (name, p) in enumerate(block.named_parameters()):
            wholes[name] = _whole(tuple(p.shape), i)
            with torch.no_grad():
                p.copy_(wholes[name])
        return block, wholes


def _check_module(module: nn.Module, wholes: dict[str, Tensor], *, label: str) -> None:
    named = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
    assert named, label
    _check_boxes([p for _, p in named], [wholes[n] for n, _ in named], label=label)  # type: ignore[misc]


def _experts_on(block: Block, mesh: Any) -> None:
    """Expert stacks sharded on dim 0 over ``mesh`` (expert parallel), the rest replicated."""
    block.experts = nn.Parameter(distribute_tensor(block.experts.detach(), mesh, [Shard(0)]))


@check(4, 8)
def fsdp2_and_hsdp(ctx: Context) -> None:
    block, wholes = Block.build()
    fully_shard(block, mesh=init_device_mesh("cpu", (ctx.world_size,)))
    _check_module(block, wholes, label="FSDP2")
    block, wholes = Block.build()
    fully_shard(block, mesh=_mesh((2, ctx.world_size // 2), ("replicate", "shard")))
    _check_module(block, wholes, label="HSDP")


@check(4, 8)
def tensor_parallel_alone_and_under_fsdp2(ctx: Context) -> None:
    block, wholes = Block.build()
    tp = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    parallelize_module(block, tp, TP_PLAN)
    _check_module(block, wholes, label="TP")
    block, wholes = Block.build()
    mesh = _mesh((2, ctx.world_size // 2), ("dp", "tp"))
    parallelize_module(block, mesh["tp"], TP_PLAN)
    fully_shard(block, mesh=mesh["dp"])
    _check_module(block, wholes, label="FSDP2+TP")


@check(8)
def hsdp_with_tensor_parallel(ctx: Context) -> None:
    del ctx
    block, wholes = Block.build()
    mesh = _mesh((2, 2, 2), ("replicate", "shard", "tp"))
    parallelize_module(block, mesh["tp"], TP_PLAN)
    fully_shard(block, mesh=mesh["replicate", "shard"])
    _check_module(block, wholes, label="HSDP+TP")


@check(4, 8)
def expert_parallel_with_fsdp2_on_dim_1(ctx: Context) -> None:
    mesh = _mesh((2, ctx.world_size // 2), ("dp", "ep"))
    block, wholes = Block.build()
    _experts_on(block, mesh["ep"])
    _check_module(block, wholes, label="EP alone")
    block, wholes = Block.build()
    _experts_on(block, mesh["ep"])
    fully_shard(block, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else Shard(0))
    _check_module(block, wholes, label="EP+FSDP2(dim 1)")


@check(8)
def pipeline_stages_on_sub_meshes(ctx: Context) -> None:
    root = _mesh((2, 2, 2), ("pp", "dp", "tp"))
    stage = root["dp", "tp"]  # this rank's stage: 4 of the 8 ranks
    spanned = mesh_group([stage])
    members = dist.get_process_group_ranks(spanned.group)
    first = 4 * (ctx.rank // 4)
    assert sorted(members) == list(range(first, first + 4)), members
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total, group=spanned.group)
    assert total.item() == sum(range(first, first + 4)), total
    block, wholes = Block.build()
    parallelize_module(block, stage["tp"], TP_PLAN)
    fully_shard(block, mesh=stage["dp"])
    _check_module(block, wholes, label="PP stage FSDP2+TP")


@check(4)
def params_on_several_meshes_of_the_same_ranks(ctx: Context) -> None:
    del ctx
    root = _mesh((2, 2), ("ep", "dp"))
    flat = root._flatten("ep_dp")
    dense = distribute_tensor(_whole((5, 3)), flat, [Shard(0)], src_data_rank=None)
    experts = distribute_tensor(_whole((3, 5, 4), 1), root, [Shard(0), Shard(1)], src_data_rank=None)
    _check_boxes([dense, experts], [_whole((5, 3)), _whole((3, 5, 4), 1)], label="dense + experts")
    spanned = mesh_group([root, flat])
    assert spanned.group is flat.get_group()
    dense = distribute_tensor(_whole((5, 3)), root["dp"], [Shard(0)], src_data_rank=None)  # replicated over ep
    experts = distribute_tensor(_whole((3, 5, 4), 1), root["ep"], [Shard(0)], src_data_rank=None)  # over dp
    _check_boxes([dense, experts], [_whole((5, 3)), _whole((3, 5, 4), 1)], label="dense on dp, experts on ep")
    other = _mesh((2, 2), ("x", "y"))  # another root: its sub-meshes cannot be joined with root's
    try:
        mesh_group([other["x"], root])
    except ValueError as e:
        assert "not sub-meshes of one root mesh" in str(e), e
    else:
        raise AssertionError("params on meshes over different ranks of different roots must raise")


# -- end to end: HybridMuon on N-D meshes equals one device ------------------------------------


def _gather_whole(t: Tensor, spanned: Any) -> Tensor:
    """The whole of DTensor ``t``, from every rank's local tensor and its box (collective).

    Not ``full_tensor()``: torch 2.13 cannot gather an uneven ``_StridedShard`` DTensor.
    """
    everyone: list[Any] = [None] * dist.get_world_size(spanned.group)
    dist.all_gather_object(everyone, t.to_local(), group=spanned.group)
    whole = torch.full(tuple(t.shape), float("nan"), dtype=t.dtype)
    for rank, box in spanned.boxes(t):
        if box.numel:
            box.write(whole, everyone[rank].reshape(-1))
    return whole


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """``muonkit.param_groups``, with the fused QKV cut into Q, K and V blocks (TP cuts K in half)."""
    groups = muonkit.param_groups(model)
    named = dict(model.named_parameters())
    for group in groups:
        if "qkv.weight" in group.get("param_names", []):
            keep = [i for i, n in enumerate(group["param_names"]) if n != "qkv.weight"]
            group["params"] = [group["params"][i] for i in keep]
            group["param_names"] = [group["param_names"][i] for i in keep]
            return [
                *groups,
                {**group, "params": [named["qkv.weight"]], "param_names": ["qkv.weight"], "split_sizes": (4, 4, 4)},
            ]
    raise AssertionError("no qkv.weight")


def _beside_single(shard: Any, *, label: str, steps: int = 3, group_size: int | None = None) -> None:
    """``steps`` of HybridMuon on the layout ``shard(model)`` makes and on one device, same gradients."""
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        model.experts.normal_()
    control = copy.deepcopy(model)
    shard(model)
    opt = muonkit.HybridMuon(_groups(model))
    ref = muonkit.HybridMuon(_groups(control), strategy=muonkit.distributed.SingleDeviceStrategy())
    names = [n for n, _ in control.named_parameters()]
    params, ref_params = dict(model.named_parameters()), dict(control.named_parameters())
    initial = {n: p.detach().clone() for n, p in ref_params.items()}
    for step in range(steps):
        for i, n in enumerate(names):
            g = torch.randn(ref_params[n].shape, generator=torch.Generator().manual_seed(100 * step + i))
            ref_params[n].grad = g * 10.0 ** (i % 3 - 1)
            p = params[n]
            p.grad = distribute_tensor(ref_params[n].grad, p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
        ref.step()
    spanned = opt.strategy.mesh_group
    problems = []
    for n in names:
        p, r = params[n], ref_params[n]
        muon = r.ndim >= 2
        why = mismatch(_gather_whole(p.detach(), spanned), r.detach(), initial=initial[n], tol=1e-4 if muon else None)
        problems += [] if why is None else [f"{n}: {why}"]
        for key, value in ref.state[r].items():
            mine = opt.state[p][key]
            why = mismatch(_gather_whole(mine, spanned) if isinstance(mine, DTensor) else mine, value)
            problems += [] if why is None else [f"{n} {key}: {why}"]
    assert not problems, f"{label}: " + "; ".join(problems)
    done = torch.tensor([opt.strategy.stats.matrices])
    dist.all_reduce(done, group=spanned.group)
    # each expert and each split block is one matrix; ranks together do the single device's work, once
    assert done.item() == ref.strategy.stats.matrices == steps * (3 + 4 + 3), (done.item(), ref.strategy.stats.matrices)
    expected = group_size or dist.get_world_size()
    assert opt.strategy.comm.world_size == expected, "one group over every rank of the mesh"


@check(4)
def hsdp_equals_one_device(ctx: Context) -> None:
    del ctx
    _beside_single(lambda m: fully_shard(m, mesh=_mesh((2, 2), ("replicate", "shard"))), label="HSDP 2x2")


@check(4)
def fsdp2_with_tensor_parallel_equals_one_device(ctx: Context) -> None:
    del ctx
    mesh = _mesh((2, 2), ("dp", "tp"))

    def shard(model: nn.Module) -> None:
        parallelize_module(model, mesh["tp"], TP_PLAN)
        fully_shard(model, mesh=mesh["dp"])  # tiny and the experts: on dp only, replicated over tp

    _beside_single(shard, label="FSDP2+TP 2x2")


@check(8)
def hsdp_with_tensor_parallel_and_pipeline_stages_equal_one_device(ctx: Context) -> None:
    del ctx
    mesh = _mesh((2, 2, 2), ("replicate", "shard", "tp"))

    def hsdp_tp(model: nn.Module) -> None:
        parallelize_module(model, mesh["tp"], TP_PLAN)
        fully_shard(model, mesh=mesh["replicate", "shard"])

    _beside_single(hsdp_tp, label="HSDP+TP 2x2x2")
    stage = _mesh((2, 2, 2), ("pp", "dp", "tp"))["dp", "tp"]  # this rank's stage: one optimizer over 4 ranks

    def fsdp_tp_stage(model: nn.Module) -> None:
        parallelize_module(model, stage["tp"], TP_PLAN)
        fully_shard(model, mesh=stage["dp"])

    _beside_single(fsdp_tp_stage, label="PP stage FSDP2+TP 2x2", group_size=4)


def _raises_before_step(param: Tensor, message: str) -> None:
    """HybridMuon over ``param`` raises ``message`` on its first step (on every rank), leaving it unchanged."""
    param = nn.Parameter(param)
    before = param.to_local().clone()
    opt = muonkit.HybridMuon([param])
    param.grad = DTensor.from_local(
        torch.ones_like(param.to_local()),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    try:
        opt.step()
    except ValueError as e:
        assert re.search(message, str(e)), e
    else:
        raise AssertionError(f"no error, expected {message}")
    assert torch.equal(param.to_local(), before) and not opt.state, "changed before raising"


@check(4)
def layouts_out_of_reach_raise_before_the_first_step(ctx: Context) -> None:
    mesh = _mesh((2, 2), ("a", "b"))
    local = torch.randn(2, 4)
    partial = DTensor.from_local(local, mesh, [Shard(0), Partial()], run_check=False)
    _raises_before_step(
        partial, r"Unsupported DTensor placement Partial\(sum\) on mesh dim 1 .* HybridMuon reads Shard\(d\)"
    )
    # its own uneven pieces: 1 row on every rank of an 8-row tensor, where torch.chunk gives 2
    uneven = DTensor.from_local(
        local[:1], init_device_mesh("cpu", (ctx.world_size,)), [Shard(0)], run_check=False, shape=(8, 4), stride=(4, 1)
    )
    _raises_before_step(uneven, r"its local tensor has shape \(1, 4\) where torch's sharding gives \(2, 4\)")
    # two strided shardings of one dim that no order of the mesh dims explains
    strided = [_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)]
    odd = distribute_tensor(_whole((8, 4)), mesh, strided, src_data_rank=None)
    _raises_before_step(odd, r"give no order in which the mesh dims shard dim 0")
