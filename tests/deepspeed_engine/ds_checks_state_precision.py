"""DeepSpeed ZeRO-1/2/3 on 2 CPU ranks with ``state_dtype="8bit"`` and ``"bf16"`` (issue 24).

- **Against one device** with the same ``state_dtype`` (the model and micro-batches of
  :mod:`ds_common`): ZeRO keeps each rank's flat partition, so an 8-bit state's blocks of 256 run
  along the partition (across parameter edges, cut at the partition's edge), not along each
  parameter's rows as on one device (here a row of 32 or 96 values: one block each). The two runs
  code their states in other blocks and differ by the code's error, which Newton-Schulz amplifies
  on this small model: 8-bit state on one device is itself 12% of an update away from fp32 state
  after 2 steps (0% after 1: the first step reads no stored state). bf16's rounding hashes each
  value's fp32 bits, so the same value rounds alike anywhere, but ZeRO sums gradients in another
  order (1e-7 apart, see ds_checks_train) and a value one fp32 ulp away rounds independently: bf16
  states then differ by bf16's own rounding noise (one device: 1.8% of an update from fp32 state
  after 2 steps). So each run is held to :data:`CODE_EFFECTS` times the distance between its
  state_dtype and fp32 state on one device, measured in the check, after 2 steps (a skipped step
  is 50% of an update at 2 steps, an update not orthogonalized ~100%).
- **Checkpoints**: ``engine.save_checkpoint`` after 2 steps, 2 more steps; a fresh engine loads it
  and resumes bit for bit (every rank's flat partition and stored state, 8-bit codes and scales
  compared as bytes), and so does the checkpoint ``muonkit convert-deepspeed`` rewrites for the
  same world size. The checkpoints stay in ``ctx.shared`` for ds_checks_state_precision_load (1 rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ds_checks_train import _initialize
from ds_common import config, full_params, gather_state, reference, train, update_errors
from ds_worker import Context, check

from muonkit.cli import main as muonkit_cli
from muonkit.functional.quantize import CODE_DTYPE, SCALE_SUFFIX

STEPS = 2
SAVE_AT = 2
CODE_EFFECTS = 2.0
"""ZeRO against one device with the same state_dtype, relative error of each tensor's total update: at
most this many times the largest such error between that state_dtype and fp32 state on one device
(the code's own effect on this run: measured 0.12 for 8-bit, 0.018 for bf16)."""


def _cfg(stage: int, state_dtype: str, **extra: Any) -> dict[str, Any]:
    cfg = config(stage, **extra)
    cfg["optimizer"]["params"]["state_dtype"] = state_dtype
    return cfg


def local_states(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's flat partitions and their stored states (8-bit codes as bytes), by partition and key."""
    hybrid = engine.optimizer.optimizer
    out = {}
    for i, flat in enumerate(hybrid.strategy.partitions):
        out[f"{i}:fp32"] = flat.detach().clone()
        for key, value in hybrid.state[flat].items():
            if isinstance(value, torch.Tensor):
                out[f"{i}:{key}"] = (value.view(torch.uint8) if value.dtype == CODE_DTYPE else value).clone()
    return out


def gather_decoded(engine: Any) -> dict[str, torch.Tensor]:
    """Every rank: whole per-parameter master weights and decoded (fp32) states, from the flat partitions."""
    return gather_state(engine, decoded=True)


def _stored_dtypes(engine: Any) -> set[str]:
    hybrid = engine.optimizer.optimizer
    return {
        str(v.dtype)
        for flat in hybrid.strategy.partitions
        for k, v in hybrid.state[flat].items()
        if isinstance(v, torch.Tensor) and v.ndim > 0 and k != "step" and not k.endswith(SCALE_SUFFIX)
    }


def _matches_single_device(stage: int, state_dtype: str) -> float:
    steps = STEPS
    engine, init = _initialize(_cfg(stage, state_dtype))
    train(engine, steps)
    stored = _stored_dtypes(engine)
    want_dtype = {"8bit": str(CODE_DTYPE), "bf16": str(torch.bfloat16)}[state_dtype]
    assert stored == {want_dtype}, f"ZeRO-{stage} {state_dtype}: states stored as {stored}"
    world = dist.get_world_size()
    want, _ = reference(init, steps, world=world, bf16=False, state_dtype=state_dtype)
    errors = update_errors(full_params(engine), want, init)
    worst = max(errors, key=errors.__getitem__)
    fp32, _ = reference(init, steps, world=world, bf16=False)
    effect = max(update_errors({n: p.detach() for n, p in want.named_parameters()}, fp32, init).values())
    assert 0 < effect < 0.25, f"{state_dtype} state on one device is {effect:.3e} of an update from fp32 state"
    tol = CODE_EFFECTS * effect
    print(f"ZeRO-{stage} state_dtype={state_dtype}: update error {errors[worst]:.3e} ({worst}), tolerance {tol:.3e}")
    assert errors[worst] <= tol, f"ZeRO-{stage} {state_dtype}: {worst}: update error {errors[worst]:.3e} > {tol:.3e}"
    return errors[worst]


@check
def zero_1_2_3_eight_bit_and_bf16_states_match_single_device(ctx: Context) -> None:
    worst = {}
    for stage in (1, 2, 3):
        for state_dtype in ("8bit", "bf16"):
            worst[f"zero{stage}/{state_dtype}"] = _matches_single_device(stage, state_dtype)
    if ctx.rank == 0:
        (ctx.out_dir / "ds_state_precision_errors.txt").write_text(repr(worst))


def _resume(ctx: Context, stage: int, state_dtype: str) -> None:
    name = f"prec_zero{stage}_{state_dtype}"
    cfg = _cfg(stage, state_dtype, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}})
    path = ctx.shared / name
    engine, _ = _initialize(cfg)
    train(engine, SAVE_AT)
    engine.save_checkpoint(str(path), tag="step2")
    saved = local_states(engine)
    decoded = gather_decoded(engine)
    if ctx.rank == 0:
        torch.save(decoded, ctx.shared / f"{name}.decoded.pt")
        assert muonkit_cli(["convert-deepspeed", str(path), "--world-size", "2", "--output", str(path) + "_w2"]) == 0
    dist.barrier()
    train(engine, 2, start=SAVE_AT)
    first = local_states(engine)
    problems = []
    for how, where in (("fresh", path), ("converted", path.with_name(name + "_w2"))):
        again, _ = _initialize(cfg)
        again.load_checkpoint(str(where), tag="step2")
        loaded = local_states(again)
        problems += [
            f"{how}: loaded {k} differs" for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k])
        ]
        train(again, 2, start=SAVE_AT)
        second = local_states(again)
        problems += [
            f"{how}: resumed {k} differs" for k in first if k not in second or not torch.equal(first[k], second[k])
        ]
    assert not problems, f"ZeRO-{stage} {state_dtype}:\n" + "\n".join(problems[:20])


@check
def zero_1_and_3_eight_bit_checkpoints_resume_bit_for_bit(ctx: Context) -> None:
    _resume(ctx, 1, "8bit")
    _resume(ctx, 3, "8bit")


@check
def zero_2_bf16_checkpoint_resumes_bit_for_bit(ctx: Context) -> None:
    _resume(ctx, 2, "bf16")
