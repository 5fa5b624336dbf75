"""DCP checkpoints: saved at world size 2, loaded at 1 and 4 (and across layouts), training continues.

The save run continues after saving and records its final params and states; every load run
must reproduce them bit for bit. Gradients are injected (the same global gradient at every
world size), so the arithmetic after loading is the same as in the uninterrupted run: the same
elementwise updates on whatever slice a rank holds, each matrix orthogonalized from the same
input (see scenario_optimizer for why that is exact).
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


@check(2)
def save_at_world_size_2(ctx: Context) -> None:
    for layout in ("ddp", "fsdp"):
        wrapped, module = build_module(layout, CKPT_ZOO)
        opt = _optimizer(layout, module)
        _steps(module, opt, range(SAVE_AT))
        save_checkpoint(ctx.shared / f"ckpt_{layout}", model=wrapped, optimizer=opt)
        _steps(module, opt, range(SAVE_AT, STEPS))
        final = snapshot(list(module.parameters()), opt)
        if ctx.rank == 0:
            torch.save(final, ctx.shared / f"final_{layout}.pt")
    dist.barrier()


def _resume(ctx: Context, layout: str, saved_by: str) -> None:
    wrapped, module = build_module(layout, CKPT_ZOO, seed_offset=7)  # different initial values: must be loaded
    opt = _optimizer(layout, module)
    load_checkpoint(ctx.shared / f"ckpt_{saved_by}", model=wrapped, optimizer=opt)
    _steps(module, opt, range(SAVE_AT, STEPS))
    expected = torch.load(ctx.shared / f"final_{saved_by}.pt")
    problems = differences_to(snapshot(list(module.parameters()), opt), expected)
    assert not problems, f"{layout} at W={ctx.world_size} from the {saved_by} checkpoint:\n" + "\n".join(problems)


@check(4)
def resume_ddp_at_4(ctx: Context) -> None:
    _resume(ctx, "ddp", "ddp")


@check(4)
def resume_fsdp2_at_4(ctx: Context) -> None:
    _resume(ctx, "fsdp", "fsdp")


@check(4)
def resume_fsdp2_at_4_from_ddp(ctx: Context) -> None:
    _resume(ctx, "fsdp", "ddp")


@check(1)
def resume_ddp_at_1(ctx: Context) -> None:
    _resume(ctx, "ddp", "ddp")


@check(1)
def resume_fsdp2_at_1(ctx: Context) -> None:
    _resume(ctx, "fsdp", "fsdp")


@check(1)
def resume_single_device_from_fsdp2(ctx: Context) -> None:
    _resume(ctx, "single", "fsdp")


@check(1)
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
