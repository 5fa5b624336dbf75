"""DCP checkpoints: saved at world size 2, loaded at 1 and 4 (and across layouts), training continues.

The save run records its params and states when it saves and after 3 more steps. Every load
run must restore the saved ones bit for bit, then take the same 3 steps on the same injected
gradients: the same elementwise updates on whatever slice a rank holds, each matrix
orthogonalized from the same input, but batched with other matrices as this world size and
layout batch them. So states must match bit for bit and Muon params within the tolerance of
:mod:`common` (see scenario_optimizer). Saved and loaded under both default Newton-Schulz dtypes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from common import ZOO, ParamSpec, build_module, differences_to, group_dicts, set_grads, snapshot
from harness import Context, check

import muonkit
from crafted_checkpoints import (
    Craft,
    first_tensor_in,
    metadata_payload,
    piece_payload,
    previous_format_save,
    tensor_listed_as_pickled_value,
    truncated_values,
    values_payload,
)
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint
from muonkit.distributed.checkpoint_files import VALUES_FILE
from muonkit.safe_load import UntrustedCheckpointError

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


Save = Callable[[Path, torch.nn.Module, muonkit.HybridMuon], None]


def _save_run(ctx: Context, layout: str, name: str, save: Save) -> None:
    """Train, save as ``ckpt_{name}``, train on; record the snapshots at the save and at the end."""
    wrapped, module = build_module(layout, CKPT_ZOO)
    opt = _optimizer(layout, module)
    _steps(module, opt, range(SAVE_AT))
    saved = snapshot(list(module.parameters()), opt)
    save(ctx.shared / f"ckpt_{name}_{ctx.ns_default}", wrapped, opt)
    _steps(module, opt, range(SAVE_AT, STEPS))
    final = snapshot(list(module.parameters()), opt)
    if ctx.rank == 0:
        torch.save((saved, final), ctx.shared / f"snapshots_{name}_{ctx.ns_default}.pt")
    dist.barrier()


@check(2, both_ns_defaults=True)
def save_at_world_size_2(ctx: Context) -> None:
    for layout in ("ddp", "fsdp"):
        _save_run(ctx, layout, layout, lambda path, model, opt: save_checkpoint(path, model=model, optimizer=opt))


def _resume(ctx: Context, layout: str, saved_by: str, *, trusted: bool = False) -> None:
    wrapped, module = build_module(layout, CKPT_ZOO, seed_offset=7)  # different initial values: must be loaded
    opt = _optimizer(layout, module)
    load_checkpoint(ctx.shared / f"ckpt_{saved_by}_{ctx.ns_default}", model=wrapped, optimizer=opt, trusted=trusted)
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


# ---------------------------------------------------------------------------------------------
# Checkpoints that could run code: refused on every rank, nothing changed, nobody left waiting;
# the previous format (values pickled in .distcp, plain dcp.save) loads with trusted=True.


@check(2)
def save_previous_format_at_world_size_2(ctx: Context) -> None:
    _save_run(ctx, "fsdp", "fsdp_previous", previous_format_save)


def _resume_previous_format(ctx: Context) -> None:
    wrapped, module = build_module("fsdp", CKPT_ZOO, seed_offset=7)
    opt = _optimizer("fsdp", module)
    before = snapshot(list(module.parameters()), opt)
    try:
        load_checkpoint(ctx.shared / f"ckpt_fsdp_previous_{ctx.ns_default}", model=wrapped, optimizer=opt)
    except UntrustedCheckpointError as e:
        assert f"has no {VALUES_FILE}" in str(e) and "pass trusted=True" in str(e), e
    else:
        raise AssertionError("a checkpoint with pickled values loaded without trusted=True")
    problems = differences_to(snapshot(list(module.parameters()), opt), before)
    assert not problems, "refused, yet changed:\n" + "\n".join(problems)
    _resume(ctx, "fsdp", "fsdp_previous", trusted=True)


@check(4)
def resume_previous_format_at_4_only_when_trusted(ctx: Context) -> None:
    _resume_previous_format(ctx)


@check(1)
def resume_previous_format_at_1_only_when_trusted(ctx: Context) -> None:
    _resume_previous_format(ctx)


@check(2)
def a_crafted_file_is_refused_on_every_rank_before_its_payload_runs(ctx: Context) -> None:
    """A payload in each file of a 2-rank FSDP2 checkpoint (and two more crafts): every rank raises,
    naming the file, with its params and states unchanged and the payload not run."""
    wrapped, module = build_module("fsdp", CKPT_ZOO)
    opt = _optimizer("fsdp", module)
    _steps(module, opt, range(SAVE_AT))
    base = ctx.shared / "crafted_base"
    save_checkpoint(base, model=wrapped, optimizer=opt)
    files = sorted(os.listdir(base))
    distcp = [f for f in files if f.endswith(".distcp")]
    assert len(distcp) == 2, files
    crafts: dict[str, tuple[str, Craft]] = {
        ".metadata": (".metadata", metadata_payload),
        VALUES_FILE: (VALUES_FILE, values_payload),
        **{f: (f, piece_payload(first_tensor_in(base, f), file=f)) for f in distcp},
    }
    assert sorted(crafts) == files, (sorted(crafts), files)  # every file of the checkpoint
    crafts["truncated_values"] = (VALUES_FILE, truncated_values)
    crafts["listed_as_pickled"] = (".metadata", tensor_listed_as_pickled_value(first_tensor_in(base, distcp[1])))
    before = snapshot(list(module.parameters()), opt)
    for case, (named, craft) in crafts.items():
        ckpt, marker = ctx.shared / f"crafted_{case}", ctx.shared / f"payload_ran_{case}"
        if ctx.rank == 0:
            shutil.copytree(base, ckpt)
            craft(ckpt, marker)
        dist.barrier()
        try:
            load_checkpoint(ckpt, model=wrapped, optimizer=opt)
        except ValueError as e:
            assert named in str(e), f"{case}: {e}"
        else:
            raise AssertionError(f"{case}: loaded")
        assert not marker.exists(), f"{case}: the payload ran"
        problems = differences_to(snapshot(list(module.parameters()), opt), before)
        assert not problems, f"{case}: refused, yet changed:\n" + "\n".join(problems)
    dist.barrier()
