"""1 rank loads the 8-bit and bf16 ZeRO checkpoints ds_checks_state_precision saved at 2 ranks.

``muonkit convert-deepspeed --world-size 1`` rewrites them: the master weights exactly, bf16
states exactly (their values are the same whatever the partition), 8-bit states decoded with the
saving ranks' blocks and coded again in the new partition's (within one more rounding of the
code: :data:`STATE_TOL` of each state's norm, :data:`SECOND_MOMENT_TOL` for second moments). The converted checkpoint loads and trains on.
"""

from __future__ import annotations

import torch
from ds_checks_state_precision import _cfg, gather_decoded
from ds_checks_train import _initialize
from ds_common import train
from ds_worker import Context, check

from muonkit.cli import main as muonkit_cli

STATE_TOL = 0.0625
"""Recoded 8-bit states against the saved ones, ``||loaded - saved|| / ||saved||``: one more rounding
to an e4m3 code in other blocks, <= 2^-4 of each value (3 mantissa bits, to nearest)."""
SECOND_MOMENT_TOL = 0.125
"""The same for second moments (``exp_avg_sq``), coded as their square roots: 2^-4 of the root is
2^-3 of the value (measured 6.8e-2 on a bias)."""


def _load_converted(ctx: Context, stage: int, state_dtype: str) -> None:
    name = f"prec_zero{stage}_{state_dtype}"
    cfg = _cfg(stage, state_dtype, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}})
    converted = ctx.shared / f"{name}_w1"
    assert (
        muonkit_cli(["convert-deepspeed", str(ctx.shared / name), "--world-size", "1", "--output", str(converted)]) == 0
    )
    engine, _ = _initialize(cfg)
    engine.load_checkpoint(str(converted))
    saved = torch.load(ctx.shared / f"{name}.decoded.pt")
    loaded = gather_decoded(engine)
    assert saved.keys() == loaded.keys(), (sorted(saved), sorted(loaded))
    problems = []
    for key, want in saved.items():
        got = loaded[key]
        if key.endswith(":fp32") or state_dtype == "bf16":
            if not torch.equal(got, want):
                problems.append(f"{key}: not bit-identical")
            continue
        drift = (got - want).norm() / want.norm().clamp_min(1e-30)
        tol = SECOND_MOMENT_TOL if key.endswith("_sq") else STATE_TOL
        if drift > tol:
            problems.append(f"{key}: {drift:.3e} of its norm from the saved state (> {tol})")
    assert not problems, f"ZeRO-{stage} {state_dtype}:\n" + "\n".join(problems)
    train(engine, 1, start=2)
    assert all(torch.isfinite(v).all() for v in gather_decoded(engine).values())


@check
def zero1_eight_bit_checkpoint_loads_at_one_rank_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 1, "8bit")


@check
def zero3_eight_bit_checkpoint_loads_at_one_rank_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 3, "8bit")


@check
def zero2_bf16_checkpoint_loads_at_one_rank_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 2, "bf16")
