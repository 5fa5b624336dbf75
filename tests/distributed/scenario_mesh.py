"""HybridMuon on N-D device meshes (HSDP, FSDP2 + TP, TP alone, EP, pipeline stages) against one device.

Every layout is built with plain torch APIs and ``HybridMuon(param_groups(model))`` (see
:mod:`mesh_placements`), stepped on injected gradients beside the single-device control:

- **exact**: states and AdamW params bit for bit, Muon params within the batched-products
  tolerance of :mod:`common` (each matrix orthogonalized from the same fp32 values; only which
  matrices share a batched matmul differs), replicas bit-identical; with a fused QKV whose split
  blocks TP cuts, uneven rows and columns, empty shards, a matrix smaller than the mesh, expert
  stacks, grads None on a step, and an inf on one rank's gradient (every rank skips, nothing
  changes);
- **exactly once**: the matrices orthogonalized over all ranks of a mesh add up to the control's,
  and each rank spends at most ``1.15/W`` of the control's Newton-Schulz FLOPs plus one largest
  matrix, by the strategy's count and by the bench's dispatch-mode counter.

4 ranks: 2x2 meshes (and TP over 4); 8 ranks: 2x2x2 (dp_replicate x dp_shard x tp, ep x dp x tp).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import pytest
import torch
import torch.distributed as dist
from harness import Context, check
from mesh_placements import (
    EXPECTED_PLACEMENTS,
    PARTS,
    MeshNet,
    Snapshot,
    algorithms,
    all_gather_ints,
    apply_placement,
    build,
    counted_step,
    matrix_flops,
    placements_of,
    replica_differences,
    set_grads,
    snapshot_differences,
)
from torch import nn
from torch.distributed.tensor import DTensor

import muonkit
from muonkit.testing import count_ops, step_tensors

STEPS = 4
INF_STEP = 2  # an inf in one rank's gradient: every rank must skip the step
POISONED = "mlp.up.weight"
SLACK = 1.15  # per-rank Newton-Schulz work <= SLACK/W of one device's, plus one largest matrix


def _poison(model: nn.Module, ref: nn.Module, name: str | None, group: object = None) -> None:
    """inf in ``name``'s gradient on one rank only (the last that holds a part of it); the control everywhere."""
    params = dict(model.named_parameters())
    mine = name is not None and params[name].grad is not None
    local = params[name].grad.to_local() if mine and isinstance(params[name].grad, DTensor) else None
    can = int(mine and (local is None or local.numel() > 0))
    flags = [f[0] for f in all_gather_ints([can], group)]
    target = max(r for r, f in enumerate(flags) if f) if any(flags) else -1
    if name is None:
        return
    ref_grad = dict(ref.named_parameters())[name].grad
    ref_grad.view(-1)[0] = float("inf")
    if dist.get_rank(group) == target:
        (local if local is not None else params[name].grad).view(-1)[0] = float("inf")


def _beside_single(
    ctx: Context, layout: str, *, parts: Sequence[str] = PARTS, poisoned: str | None = POISONED, group: object = None
) -> tuple[nn.Module, muonkit.HybridMuon, list[str]]:
    """``STEPS`` steps of ``layout`` and of the control on the same gradients; what differs."""
    model, opt = build(layout, ctx.world_size, parts=parts)
    ref, ref_opt = build("single", ctx.world_size, parts=parts)
    initial = Snapshot.of(ref, ref_opt)
    problems = []
    for step in range(STEPS):
        set_grads(model, step)
        set_grads(ref, step)
        if step == INF_STEP:
            _poison(model, ref, poisoned, group)
            before = Snapshot.of(model, opt)
        opt.step()
        ref_opt.step()
        if step == INF_STEP and poisoned is not None:
            problems += [
                f"changed by the skipped step: {p}" for p in snapshot_differences(Snapshot.of(model, opt), before)
            ]
    skips = 1 if poisoned is not None else 0
    if not opt.skipped_steps == ref_opt.skipped_steps == skips:
        problems.append(f"skipped {opt.skipped_steps} steps, the control {ref_opt.skipped_steps}, expected {skips}")
    mine, expected = Snapshot.of(model, opt), Snapshot.of(ref, ref_opt)
    problems += snapshot_differences(mine, expected, algorithms=algorithms(ref_opt), initial=initial)
    problems += replica_differences(model)
    return model, opt, problems


def _matches(ctx: Context, layout: str) -> None:
    _, _, problems = _beside_single(ctx, layout)
    assert not problems, f"{layout} at W={ctx.world_size}:\n" + "\n".join(problems)


def _exactly_once(ctx: Context, layout: str, *, parts: Sequence[str] = PARTS, group: object = None) -> None:
    """One step with every gradient: the work of each rank against one device's (see the module docstring)."""
    model, opt = build(layout, ctx.world_size, parts=parts)
    ref, ref_opt = build("single", ctx.world_size, parts=parts)
    set_grads(model, 0)
    set_grads(ref, 0)
    matrices, flops, matmul = counted_step(opt)
    ref_matrices, ref_flops, ref_matmul = counted_step(ref_opt)
    largest_flops, largest_matmul = matrix_flops(ref_opt)
    width = dist.get_world_size(group)
    per_rank = all_gather_ints([matrices, flops, matmul], group)
    problems = []
    total = sum(r[0] for r in per_rank)
    if total != ref_matrices:
        problems.append(
            f"{total} matrices orthogonalized over the {width} ranks (per rank {[r[0] for r in per_rank]}), one device: {ref_matrices}"
        )
    for what, k, ref_total, largest in (
        ("strategy FLOPs", 1, ref_flops, largest_flops),
        ("dispatch-counted matmul FLOPs", 2, ref_matmul, largest_matmul),
    ):
        bound = SLACK * ref_total / width + largest
        worst = max(r[k] for r in per_rank)
        if worst > bound:
            problems.append(
                f"{what}: a rank spent {worst} > {SLACK}/{width} of one device's {ref_total} + one largest matrix {largest} "
                f"= {bound:.0f} (per rank {[r[k] for r in per_rank]})"
            )
    assert ref_matrices > 0 and ref_flops > 0 and ref_matmul > 0, (
        "the control did no work: the check would prove nothing"
    )
    assert not problems, f"{layout} at W={ctx.world_size}:\n" + "\n".join(problems)


# ------------------------------------------------------------------ placements (catches a torch change)


def _placements(ctx: Context, layouts: Sequence[str]) -> None:
    problems = []
    for layout in layouts:
        found = placements_of(apply_placement(MeshNet(), layout, ctx.world_size))
        for name, expected in EXPECTED_PLACEMENTS[layout].items():
            if found.get(name) != expected:
                problems.append(f"{layout} {name}: {found.get(name)}, expected {expected}")
        plain = [n for n, _ in MeshNet().named_parameters() if n not in found]
        if plain:
            problems.append(f"{layout}: plain (not DTensor) params {plain}")
    assert not problems, "torch lays the models out differently than these scenarios assume:\n" + "\n".join(problems)


@check(4)
def layouts_have_the_expected_placements_at_4(ctx: Context) -> None:
    _placements(ctx, ("hsdp", "fsdp_tp", "tp", "ep", "ep_fsdp"))


@check(8)
def layouts_have_the_expected_placements_at_8(ctx: Context) -> None:
    _placements(ctx, ("hsdp_tp", "ep_tp"))


# ------------------------------------------------------------------ 4 ranks


@check(4, both_ns_defaults=True)
def hsdp_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "hsdp")


@check(4, both_ns_defaults=True)
def fsdp2_tp_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "fsdp_tp")


@check(4, both_ns_defaults=True)
def tp_alone_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "tp")


@check(4)
def tp_with_plain_params_left_over_matches_single_device(ctx: Context) -> None:
    """TP alone with the params it does not parallelize left plain: read as whole copies on every rank."""
    model, _ = build("tp_plain", ctx.world_size)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain and len(plain) < len(list(model.parameters())), plain  # both kinds, or the check proves nothing
    _matches(ctx, "tp_plain")
    _exactly_once(ctx, "tp_plain")


@check(4)
def plain_params_with_different_gradients_on_some_rank_raise_on_every_rank(ctx: Context) -> None:
    """A plain param whose gradient nobody averaged (left out of data parallelism) is caught, not stepped."""
    model, opt = build("tp_plain", ctx.world_size)
    set_grads(model, 0)
    plain = next(p for p in model.parameters() if not isinstance(p, DTensor) and p.grad is not None)
    if ctx.rank == 1:
        plain.grad.view(-1)[0] += 1.0
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="gradients of the plain params replicated beside the DTensors"):
        opt.step()  # checked with the non-finite verdict: the step's one read, before anything changes
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
    # Unchecked (no verdict, no read), the fingerprint is checked one step late from a host copy:
    # the differing step is applied, the next one raises on every rank before changing anything.
    model, opt = build("tp_plain", ctx.world_size)
    opt.nonfinite = "unchecked"
    plain = next(p for p in model.parameters() if not isinstance(p, DTensor))
    set_grads(model, 0)
    opt.step()
    for step in (1, 2):
        set_grads(model, step)
        if ctx.rank == 1 and step == 2:
            cast(torch.Tensor, plain.grad).view(-1)[0] += 1.0
        counts = count_ops(opt.step, host=functools.partial(step_tensors, opt))
        assert counts.reads == 0, counts.reads_by_op
    set_grads(model, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="replicated beside the DTensors differ across ranks at the previous step"):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))


@check(4)
def tp_with_plain_params_reads_the_device_once_per_step_and_unchecked_never(ctx: Context) -> None:
    """The agreement is reduced on the host; the plain params' fingerprint rides with the verdict."""
    for nonfinite, reads in (("skip", 1), ("unchecked", 0)):
        model, opt = build("tp_plain", ctx.world_size)
        opt.nonfinite = nonfinite
        for step in range(3):
            set_grads(model, step)
            if step == 0:  # index arithmetic on CPU tensors (see scenario_agreement): not counted
                opt.step()
                continue
            counts = count_ops(opt.step, host=functools.partial(step_tensors, opt))
            assert counts.reads == reads, (nonfinite, step, counts.reads_by_op)


@check(4, both_ns_defaults=True)
def ep_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "ep")


@check(4, both_ns_defaults=True)
def ep_with_fsdp_on_expert_dim1_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "ep_fsdp")


STAGES = (("embed", "attn", "experts", "router"), ("mlp", "late", "norm", "head"))


def _stage(ctx: Context) -> tuple[int, object]:
    """This rank's pipeline stage (2 stages of W/2 ranks) and the stage's process group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("pp", "dp"))
    return int(mesh.get_coordinate()[0]), mesh["dp"].get_group()


@check(4, both_ns_defaults=True)
def pipeline_stages_match_single_device(ctx: Context) -> None:
    """Each stage its own HybridMuon on its sub-mesh; an inf in stage 0 skips stage 0 only."""
    stage, group = _stage(ctx)
    poisoned = "attn.proj.weight" if stage == 0 else None
    _, _, problems = _beside_single(ctx, f"pp{stage}", parts=STAGES[stage], poisoned=poisoned, group=group)
    assert not problems, f"stage {stage} at W={ctx.world_size}:\n" + "\n".join(problems)


@check(4)
def hsdp_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "hsdp")


@check(4)
def fsdp2_tp_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "fsdp_tp")


@check(4)
def tp_alone_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "tp")


@check(4)
def ep_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "ep")


@check(4)
def ep_fsdp_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "ep_fsdp")


@check(4)
def pipeline_stages_orthogonalize_each_matrix_once(ctx: Context) -> None:
    stage, group = _stage(ctx)
    _exactly_once(ctx, f"pp{stage}", parts=STAGES[stage], group=group)


# ------------------------------------------------------------------ 8 ranks (slow)


@check(8)
def hsdp_tp_2x2x2_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "hsdp_tp")


@check(8)
def ep_dp_tp_2x2x2_matches_single_device(ctx: Context) -> None:
    _matches(ctx, "ep_tp")


@check(8)
def hsdp_tp_2x2x2_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "hsdp_tp")


@check(8)
def ep_dp_tp_2x2x2_orthogonalizes_each_matrix_once(ctx: Context) -> None:
    _exactly_once(ctx, "ep_tp")


# ------------------------------------------------------------------ per-head attention under tensor parallelism


class _Attention(nn.Module):
    """Q, K, V, O of 4 heads of 4 (read by ``param_groups(per_head=True)`` from ``num_heads``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.num_heads = 4
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(16, 16, bias=False)


def _tp_attention(ctx: Context, per_head: bool, algorithm: str = "muon") -> tuple[list[str], int]:
    """3 steps of per-head (or whole-matrix) Muon on Q/K/V colwise and O rowwise over a 4-rank TP mesh
    beside one device: what differs, and how many jobs the plans move (gather to an owner or return)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel()}
    model = parallelize_module(_Attention(), mesh, {**plan, "o_proj": RowwiseParallel()})
    ref = _Attention()
    opt = muonkit.HybridMuon(muonkit.param_groups(model, per_head=per_head, muon_algorithm=algorithm))
    ref_opt = muonkit.HybridMuon(
        muonkit.param_groups(ref, per_head=per_head, muon_algorithm=algorithm),
        strategy=muonkit.distributed.SingleDeviceStrategy(),
    )
    initial = Snapshot.of(ref, ref_opt)
    for step in range(3):
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            g = torch.randn(r.shape, generator=torch.Generator().manual_seed(100 * step + len(name)))
            r.grad = g.clone()
            p.grad = distribute_tensor(g, mesh, p.placements, src_data_rank=None)
        opt.step()
        ref_opt.step()
    problems = snapshot_differences(
        Snapshot.of(model, opt), Snapshot.of(ref, ref_opt), algorithms=algorithms(ref_opt), initial=initial
    )
    plans = list(opt.strategy._plans.values())  # the planned exchange (the guard's own flags travel too)
    assert plans, "no plan was made: the check would prove nothing"
    moved = [j for plan in plans for g in plan.groups if plan.gathers(g) or plan.returns(g) for j in g]
    moved += [s.job for plan in plans for s in plan.splits]
    return problems, len(moved)


@check(4)
def tp_per_head_attention_moves_nothing_and_matches_single_device(ctx: Context) -> None:
    """Colwise Q/K/V (rows by head) and rowwise O (columns by head): each rank holds whole heads, so
    every per-head job is orthogonalized where it lies and nothing travels; whole matrices must travel."""
    problems, moved = _tp_attention(ctx, per_head=True)
    assert not problems, "per head under TP:\n" + "\n".join(problems)
    whole_problems, whole_moved = _tp_attention(ctx, per_head=False)
    assert not whole_problems, "whole matrices under TP:\n" + "\n".join(whole_problems)
    assert moved == 0, f"{moved} per-head jobs travel under TP"
    normuon_problems, normuon_moved = _tp_attention(ctx, per_head=True, algorithm="normuon")  # row moments per head
    assert not normuon_problems and normuon_moved == 0, "NorMuon per head under TP:\n" + "\n".join(normuon_problems)
    assert whole_moved == 4, f"{whole_moved} whole matrices travel, expected Q, K, V and O"
