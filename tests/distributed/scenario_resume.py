"""The resume-fidelity matrix (:mod:`resume_matrix`) on every distributed layout.

2 ranks, DDP: every path x gradients at load time (None, zero, set) x fresh or used optimizer,
and every corrupted checkpoint through ``state_dict`` and ``save_checkpoint``. 2 ranks, FSDP2,
and 4 ranks, HSDP 2x2, FSDP2 + TP 2x2 and TP 4: every path that applies (the per-rank
``state_dict`` files and ``save_checkpoint``; the recipe by hand is torch's, its outcome set by
the optimizer's states, not by the layout, and pinned on one device and DDP) in the two cells
that differ from the old working one (gradients set into a fresh optimizer, zero gradients in a
used one), and one corrupted checkpoint of each kind, with the bad value in one shard, through
``save_checkpoint`` (per-rank files are each loaded alone: a rank that does not hold the bad
value cannot refuse it). One uninterrupted run per layout saves every checkpoint its checks load.
"""

from __future__ import annotations

from pathlib import Path

from harness import Context, check
from resume_matrix import (
    CELLS,
    CORRUPTIONS,
    SHARDED_CORRUPTIONS,
    Run,
    matrix,
    refusals,
    save_before_the_first_step,
    uninterrupted,
)

SHARDED_CELLS = (("set", "fresh"), ("zero", "used"))
_RUNS: dict[str, tuple[Path, Run]] = {}


def _run(ctx: Context, layout: str) -> tuple[Path, Run]:
    if layout not in _RUNS:
        root = ctx.shared / "resume" / layout
        corruptions = tuple(CORRUPTIONS) if layout == "ddp" else SHARDED_CORRUPTIONS
        _RUNS[layout] = root, uninterrupted(layout, ctx.world_size, root, corruptions)
    return _RUNS[layout]


def _check(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


@check(2)
def ddp_resumes_bit_identically_through_every_path(ctx: Context) -> None:
    root, run = _run(ctx, "ddp")
    _check(matrix(run, "ddp", ctx.world_size, root, ("state_dict", "save_checkpoint", "dcp"), CELLS))


@check(2)
def ddp_refuses_corrupted_checkpoints(ctx: Context) -> None:
    _check(refusals("ddp", ctx.world_size, _run(ctx, "ddp")[0]))


@check(2)
def ddp_and_fsdp2_save_before_the_first_step(ctx: Context) -> None:
    problems = []
    for layout in ("ddp", "fsdp"):
        root = ctx.shared / "resume" / f"{layout}_first"
        problems += [f"{layout}: {p}" for p in save_before_the_first_step(layout, ctx.world_size, root)]
    _check(problems)


def _sharded(ctx: Context, layout: str) -> None:
    root, run = _run(ctx, layout)
    problems = matrix(run, layout, ctx.world_size, root, ("state_dict", "save_checkpoint"), SHARDED_CELLS)
    _check(problems + refusals(layout, ctx.world_size, root, ("save_checkpoint",), SHARDED_CORRUPTIONS))


@check(2)
def fsdp2_resumes_bit_identically_and_refuses_corrupted_checkpoints(ctx: Context) -> None:
    _sharded(ctx, "fsdp")


@check(4)
def hsdp_resumes_bit_identically_and_refuses_corrupted_checkpoints(ctx: Context) -> None:
    _sharded(ctx, "hsdp")


@check(4)
def fsdp2_tp_resumes_bit_identically_and_refuses_corrupted_checkpoints(ctx: Context) -> None:
    _sharded(ctx, "fsdp_tp")


@check(4)
def tp_resumes_bit_identically_and_refuses_corrupted_checkpoints(ctx: Context) -> None:
    _sharded(ctx, "tp")
