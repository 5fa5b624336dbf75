"""1 rank loads the checkpoints ds_checks_train saved at 2 ranks.

Loading directly fails with :class:`CheckpointWorldSizeError` naming ``muonkit
convert-deepspeed``; after that conversion the checkpoint loads, every master weight and
optimizer state equals the saved one exactly, and training continues.
"""

from __future__ import annotations

import torch
from ds_checks_train import _initialize
from ds_common import config, gather_state, train
from ds_worker import Context, check

from muonkit.cli import main as muonkit_cli


def _load_converted(ctx: Context, stage: int, name: str, **cfg_kw: object) -> None:
    from muonkit.integrations.deepspeed_checkpoint import CheckpointWorldSizeError

    cfg = config(stage, **cfg_kw, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}})
    path = ctx.shared / name
    engine, _ = _initialize(cfg)
    try:
        engine.load_checkpoint(str(path), tag="step2")
    except CheckpointWorldSizeError as e:
        assert "muonkit convert-deepspeed" in str(e) and "--world-size 1" in str(e), e
    else:
        raise AssertionError("loading a 2-rank checkpoint at 1 rank must fail with the conversion command")
    converted = ctx.shared / f"{name}_w1"
    assert muonkit_cli(["convert-deepspeed", str(path), "--world-size", "1", "--output", str(converted)]) == 0
    engine.load_checkpoint(str(converted))
    saved = torch.load(ctx.shared / f"{name}.state.pt")
    loaded = gather_state(engine)
    assert saved.keys() == loaded.keys(), (sorted(saved), sorted(loaded))
    different = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert not different, f"converted checkpoint differs in {different[:5]}"
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    train(engine, 1, start=2)
    assert all(torch.isfinite(v).all() for v in gather_state(engine).values())
    assert len(set(lrs)) == 2, lrs


@check
def zero1_two_rank_checkpoint_loads_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 1, "zero1")


@check
def zero2_bf16_two_rank_checkpoint_loads_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 2, "zero2_bf16", bf16=True)


@check
def bf16_optimizer_two_rank_checkpoint_loads_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 1, "bf16_optimizer", bf16=True, fp32_accumulation=True)


@check
def zero3_two_rank_checkpoint_loads_after_conversion(ctx: Context) -> None:
    _load_converted(ctx, 3, "zero3")
