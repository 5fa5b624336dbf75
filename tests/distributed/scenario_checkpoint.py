"""DCP checkpoints: saved at world size 2, loaded at 1 and 4 (and across layouts), training continues.

The save run records its params and states when it saves and after 3 more steps. Every load
run must restore the saved ones bit for bit, then take the same 3 steps on the same injected
gradients: the same elementwise updates on whatever slice a rank holds, each matrix
orthogonalized from the same input, but batched with other matrices as this world size and
layout batch them. So states must match bit for bit and Muon params within the tolerance of
:mod:`common` (see scenario_optimizer). Saved and loaded under both default Newton-Schulz dtypes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import ZOO, ParamSpec, build_module, differences_to, group_dicts, set_grads, snapshot
from harness import Context, check

import muonkit
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint

# fully_shard needs one dtype; one param has no gradient (hence no state) before the save.
CKPT_ZOO = [s for s in ZOO if s.dtype == torch.float32] + [
    ParamSpec("muon", (6, 6), skip_steps=(0, 1, 2)),
    ParamSpec("adamw", (6,), skip_steps=(0, 1, 2)),
    ParamSpec("normuon", (7, 5)),  # row moments (one per row) through DCP, rows split unevenly
    ParamSpec("normuon", (3, 6, 4)),  # per expert
]
SAVE_AT, STEPS = 3, 6


def _optimizer(layout: str, module: torch.nn.Module) -> muonkit.HybridMuon:
    params = list(module.parameters())
    kwargs: dict = {}
    if layout == "ddp":
        kwargs["process_group"] = dist.group.WORLD
    elif layout == "single":
        kwargs["strategy"] = muonkit.distributed.SingleDeviceStrategy()
    return muonkit.HybridMuon(group_dicts(params, CKPT_ZOO), **kwargs)


def _steps(module: torch.nn.Module, opt: muonkit.HybridMuon, steps: range) -> None:
    params = list(module.parameters())
    for step in steps:
        set_grads(params, CKPT_ZOO, step)
        opt.step()


@check(2, both_ns_defaults=True)
def save_at_world_size_2(ctx: Context) -> None:
    for layout in ("ddp", "fsdp"):
        wrapped, module = build_module(layout, CKPT_ZOO)
        opt = _optimizer(layout, module)
        _steps(module, opt, range(SAVE_AT))
        saved = snapshot(list(module.parameters()), opt)
        save_checkpoint(ctx.shared / f"ckpt_{layout}_{ctx.ns_default}", model=wrapped, optimizer=opt)
        _steps(module, opt, range(SAVE_AT, STEPS))
        final = snapshot(list(module.parameters()), opt)
        if ctx.rank == 0:
            torch.save((saved, final), ctx.shared / f"snapshots_{layout}_{ctx.ns_default}.pt")
    dist.barrier()


def _resume(ctx: Context, layout: str, saved_by: str) -> None:
    wrapped, module = build_module(layout, CKPT_ZOO, seed_offset=7)  # different initial values: must be loaded
    opt = _optimizer(layout, module)
    load_checkpoint(ctx.shared / f"ckpt_{saved_by}_{ctx.ns_default}", model=wrapped, optimizer=opt)
    saved, final = torch.load(ctx.shared / f"snapshots_{saved_by}_{ctx.ns_default}.pt")
    where = f"{layout} at W={ctx.world_size} from the {saved_by} checkpoint"
    problems = differences_to(snapshot(list(module.parameters()), opt), saved)
    assert not problems, f"{where}, as loaded:\n" + "\n".join(problems)
    _steps(module, opt, range(SAVE_AT, STEPS))
    problems = differences_to(snapshot(list(module.parameters()), opt), final, CKPT_ZOO)
    assert not problems, f"{where}, 3 steps later:\n" + "\n".join(problems)


@check(4, both_ns_defaults=True)
def resume_ddp_at_4(ctx: Context) -> None:
    _resume(ctx, "ddp", "ddp")


@check(4, both_ns_defaults=True)
def resume_fsdp2_at_4(ctx: Context) -> None:
    _resume(ctx, "fsdp", "fsdp")


@check(4, both_ns_defaults=True)
def resume_fsdp2_at_4_from_ddp(ctx: Context) -> None:
    _resume(ctx, "fsdp", "ddp")


@check(1, both_ns_defaults=True)
def resume_ddp_at_1(ctx: Context) -> None:
    _resume(ctx, "ddp", "ddp")


@check(1, both_ns_defaults=True)
def resume_fsdp2_at_1(ctx: Context) -> None:
    _resume(ctx, "fsdp", "fsdp")


@check(1, both_ns_defaults=True)
def resume_single_device_from_fsdp2(ctx: Context) -> None:
    _resume(ctx, "single", "fsdp")


@check(1, both_ns_defaults=True)
def resume_single_device_from_ddp(ctx: Context) -> None:
    _resume(ctx, "single", "ddp")


@check(2)
def bf16_params_keep_fp32_states_through_a_checkpoint(ctx: Context) -> None:
    zoo = [ParamSpec("muon", (12, 8), dtype=torch.bfloat16), ParamSpec("adamw", (5,), dtype=torch.bfloat16)]

    def run(module: torch.nn.Module, opt: muonkit.HybridMuon, steps: range) -> None:
        for step in steps:
            set_grads(list(module.parameters()), zoo, step)
            opt.step()

    wrapped, module = build_module("ddp", zoo)
    opt = muonkit.HybridMuon(group_dicts(list(module.parameters()), zoo), process_group=dist.group.WORLD)
    run(module, opt, range(2))
    save_checkpoint(ctx.shared / "ckpt_bf16", model=wrapped, optimizer=opt)
    run(module, opt, range(2, 4))
    expected = snapshot(list(module.parameters()), opt)
    wrapped, module = build_module("ddp", zoo, seed_offset=3)
    opt = muonkit.HybridMuon(group_dicts(list(module.parameters()), zoo), process_group=dist.group.WORLD)
    load_checkpoint(ctx.shared / "ckpt_bf16", model=wrapped, optimizer=opt)
    dtypes = {k: v.dtype for p in module.parameters() for k, v in opt.state[p].items() if k != "step"}
    assert set(dtypes.values()) == {torch.float32}, dtypes
    run(module, opt, range(2, 4))
    problems = differences_to(snapshot(list(module.parameters()), opt), expected)
    assert not problems, "\n".join(problems)
