"""DCP checkpoints across meshes: HSDP 2x2 -> FSDP2 4 -> one device; FSDP2+TP 2x2 -> FSDP2 4; EP 2 -> EP 1.

A run on the first layout saves (``muonkit.distributed.checkpoint.save_checkpoint``) after
``SAVE_AT`` steps and goes on uninterrupted to ``STEPS``, recording its params and states. A
fresh model on the next layout (other initial values: everything must come from the checkpoint)
loads it, must hold the saved params and states bit for bit, takes the same steps on the same
injected gradients and is compared with the uninterrupted run: states bit for bit, Muon params
within the batched-products tolerance of :mod:`common` (each matrix orthogonalized from the same
fp32 values, batched with other matrices as this layout batches them). The state dict DCP
writes must be rank-symmetric: the same keys, shapes and dtypes on every rank. One param has no
gradient before the first save (so no state in the checkpoint: it must stay absent on load).

The 4-rank launch saves, and resumes at 4; the 1-rank launch resumes the chains that end on one
device (``ctx.shared`` survives between launches, as in scenario_checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import Context, check
from mesh_placements import Snapshot, algorithms, build, set_grads, snapshot_differences
from torch import nn

import muonkit
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint

SAVE_AT, MID, STEPS = 2, 4, 6
NO_GRAD = {"late.weight": (0, 1), "norm.bias": (0, 1)}  # no gradient, hence no state, before the first save


def _steps(model: nn.Module, opt: muonkit.HybridMuon, steps: range) -> None:
    for step in steps:
        set_grads(model, step, NO_GRAD)
        opt.step()


def asymmetries(model: nn.Module, opt: muonkit.HybridMuon) -> list[str]:
    """Where the state dict DCP saves differs between ranks: keys, global shapes, dtypes (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    entries = [(f"model.{k}", tuple(v.shape), str(v.dtype)) for k, v in sorted(model_state.items())]
    for name, state in sorted(optim_state["state"].items()):
        for key, value in sorted(state.items()):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
            entries.append((f"optimizer.{name}.{key}", shape, str(getattr(value, "dtype", type(value)))))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entries)
    problems = []
    for rank, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            diff = sorted(set(theirs) ^ set(gathered[0]))[:6]
            problems.append(f"rank {rank}'s state dict differs from rank 0's: {diff}")
    return problems


def _save_run(ctx: Context, layout: str, tag: str) -> dict[str, Any]:
    """The uninterrupted run on ``layout``, saving at ``SAVE_AT``; what a resumed run must match."""
    model, opt = build(layout, ctx.world_size)
    initial = Snapshot.of(model, opt)
    _steps(model, opt, range(SAVE_AT))
    saved = Snapshot.of(model, opt)
    problems = asymmetries(model, opt)
    save_checkpoint(ctx.shared / f"mesh_{tag}", model=model, optimizer=opt)
    _steps(model, opt, range(SAVE_AT, MID))
    mid = Snapshot.of(model, opt)
    _steps(model, opt, range(MID, STEPS))
    assert not problems, f"{layout} at W={ctx.world_size}:\n" + "\n".join(problems)
    return {
        "initial": initial,
        "saved": saved,
        "mid": mid,
        "final": Snapshot.of(model, opt),
        "algorithms": algorithms(opt),
    }


def _resume(ctx: Context, layout: str, path: str, run: dict[str, Any], *, at: int, save_as: str | None = None) -> dict:
    """Load ``path`` into a fresh ``layout``, check it, step ``at``..``STEPS`` and compare with the run."""
    model, opt = build(layout, ctx.world_size, seed=7)  # other initial values: must be loaded
    load_checkpoint(ctx.shared / path, model=model, optimizer=opt)
    where = f"{layout} at W={ctx.world_size} from {path}"
    loaded = Snapshot.of(model, opt)
    problems = [f"as loaded: {p}" for p in snapshot_differences(loaded, run["saved" if at == SAVE_AT else "resumed"])]
    tol = {"algorithms": run["algorithms"], "initial": run["initial"]}
    if at == SAVE_AT:
        _steps(model, opt, range(SAVE_AT, MID))
        problems += [f"step {MID}: {p}" for p in snapshot_differences(Snapshot.of(model, opt), run["mid"], **tol)]
    resumed = Snapshot.of(model, opt)
    if save_as is not None:
        save_checkpoint(ctx.shared / save_as, model=model, optimizer=opt)
    _steps(model, opt, range(MID, STEPS))
    problems += [f"step {STEPS}: {p}" for p in snapshot_differences(Snapshot.of(model, opt), run["final"], **tol)]
    problems += asymmetries(model, opt) if dist.get_world_size() > 1 else []
    assert not problems, f"{where}:\n" + "\n".join(problems)
    return {**run, "resumed": resumed}


def _keep(ctx: Context, run: dict[str, Any], name: str) -> None:
    if ctx.rank == 0:
        flat = {k: (v.tensors if isinstance(v, Snapshot) else v) for k, v in run.items()}
        torch.save(flat, ctx.shared / name)
    dist.barrier()


def _kept(ctx: Context, name: str) -> dict[str, Any]:
    flat = torch.load(ctx.shared / name)
    return {k: (Snapshot(v) if k != "algorithms" else v) for k, v in flat.items()}


@check(4)
def hsdp_2x2_saves_and_fsdp2_4_resumes(ctx: Context) -> None:
    run = _save_run(ctx, "hsdp", "hsdp")
    run = _resume(ctx, "fsdp", "mesh_hsdp", run, at=SAVE_AT, save_as="mesh_hsdp_fsdp4")
    _keep(ctx, run, "mesh_hsdp_fsdp4.pt")


@check(1)
def one_device_resumes_the_fsdp2_4_checkpoint_of_the_hsdp_run(ctx: Context) -> None:
    _resume(ctx, "single", "mesh_hsdp_fsdp4", _kept(ctx, "mesh_hsdp_fsdp4.pt"), at=MID)


@check(4)
def fsdp2_tp_2x2_saves_and_fsdp2_4_resumes(ctx: Context) -> None:
    run = _save_run(ctx, "fsdp_tp", "fsdp_tp")
    _resume(ctx, "fsdp", "mesh_fsdp_tp", run, at=SAVE_AT)


@check(4)
def ep_2_saves(ctx: Context) -> None:
    _keep(ctx, _save_run(ctx, "ep_fsdp", "ep"), "mesh_ep.pt")


@check(1)
def ep_1_resumes_the_ep_2_checkpoint(ctx: Context) -> None:
    _resume(ctx, "ep", "mesh_ep", _kept(ctx, "mesh_ep.pt"), at=SAVE_AT)
