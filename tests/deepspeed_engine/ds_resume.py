"""DeepSpeed's rows of the resume-fidelity matrix (``tests/distributed/resume_matrix.py``), used by
ds_checks_train at 2 ranks: ZeRO-1, ZeRO-2 (bf16), ZeRO-3 and the BF16 optimizer.

- ``engine.save_checkpoint`` after 2 steps, 2 more steps; ``engine.load_checkpoint`` into a fresh
  engine and into a used one (it trained on other batches: its states, step counts and lr
  schedule must all be replaced), 2 more steps: both equal the uninterrupted run bit for bit;
- ``muonkit convert-deepspeed`` to the same world size: the converted checkpoint resumes the same
  run bit for bit (to 1 rank: ds_checks_load);
- a checkpoint with one state entry removed or corrupted in every rank's file is refused by every
  rank with a ValueError naming the entry, leaving muonkit's states as they were (DeepSpeed loads
  the module's weights before the optimizer state, so those it has already replaced).

Gradients at load time are not an axis here: DeepSpeed's load ends in ``HybridMuon.load_state_dict``,
which reads no gradient (the ``state_dict`` column of the matrix shows it with None, zero and set
gradients), and DeepSpeed keeps gradients in its own buffers.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ds_common import config, gather_state, train

from muonkit.cli import main as muonkit_cli

SAVE_AT = 2


def resume_bit_identically(ctx: Any, stage: int, name: str, initialize: Callable[..., Any], **cfg_kw: Any) -> None:
    """Save after 2 steps, train 2 more; fresh, used and converted resumes must match bit for bit.

    Also leaves the checkpoint and its gathered state in ``ctx.shared`` for the 1-rank load checks.
    """
    cfg = config(stage, **cfg_kw, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}})
    path = ctx.shared / name
    engine, _ = initialize(cfg)
    train(engine, SAVE_AT)
    engine.save_checkpoint(str(path), tag="step2")
    saved = gather_state(engine)
    if ctx.rank == 0:
        torch.save(saved, ctx.shared / f"{name}.state.pt")
        assert muonkit_cli(["convert-deepspeed", str(path), "--world-size", "2", "--output", str(path) + "_w2"]) == 0
    dist.barrier()
    train(engine, 2, start=SAVE_AT)
    first = gather_state(engine)
    problems = []
    for how, where, used in (
        ("fresh", path, False),
        ("used", path, True),
        ("converted", Path(str(path) + "_w2"), False),
    ):
        again, _ = initialize(cfg)
        if used:
            train(again, 1, start=50)
        again.load_checkpoint(str(where), tag="step2")
        loaded = gather_state(again)
        problems += [
            f"{how}: loaded {k} differs" for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k])
        ]
        train(again, 2, start=SAVE_AT)
        second = gather_state(again)
        if first.keys() != second.keys():
            problems.append(f"{how}: entries {sorted(first.keys() ^ second.keys())}")
        problems += [
            f"{how}: resumed run differs in {k}" for k in first if k in second and not torch.equal(first[k], second[k])
        ]
    assert not problems, "\n".join(problems[:20])


def _poison(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(t: torch.Tensor) -> torch.Tensor:
        bad = t.clone()
        bad.view(-1)[0] = value
        return bad

    return edit


# name: (algorithm of the group, state key, edit; None removes the entry). A Muon state's only entry
# is not removed: a state without entries is that of a param before its first gradient.
CORRUPTIONS: dict[str, tuple[str, str, Callable[[torch.Tensor], torch.Tensor] | None]] = {
    "exp_avg_sq removed": ("adamw", "exp_avg_sq", None),
    "step removed": ("adamw", "step", None),
    "momentum NaN": ("muon", "momentum_buffer", _poison(math.nan)),
    "exp_avg inf": ("adamw", "exp_avg", _poison(math.inf)),
    "exp_avg_sq negative": ("adamw", "exp_avg_sq", _poison(-1e-3)),
    "momentum wrong shape": ("muon", "momentum_buffer", lambda t: torch.zeros(3, 3)),
}


def _optimizer_states(saved: dict[str, Any]) -> dict[str, Any]:
    """muonkit's state dict inside a rank's ZeRO file (ZeRO-1/2, BF16 optimizer or ZeRO-3)."""
    inner = saved["optimizer_state_dict"]
    return inner["base_optimizer_state"] if "base_optimizer_state" in inner else inner["optimizer_state_dict"]


def _corrupt(ctx: Any, good: Path, bad: Path, name: str) -> None:
    """``bad``: a copy of the checkpoint ``good`` with ``name`` applied in every rank's file."""
    algorithm, key, edit = CORRUPTIONS[name]
    if ctx.rank == 0:
        shutil.copytree(good, bad)
    dist.barrier()
    file = next(bad.glob(f"step2/*zero_pp_rank_{ctx.rank}_mp_rank_00_optim_states.pt"))
    saved = torch.load(file, weights_only=False)
    states = _optimizer_states(saved)
    for group in states["param_groups"]:
        if group["algorithm"] == algorithm and group["params"][0] in states["state"]:
            entry = states["state"][group["params"][0]]
            good_value = entry.pop(key)
            if edit is not None:
                entry[key] = edit(good_value)
            break
    else:
        raise AssertionError(f"no {algorithm} group with state in {file}")
    torch.save(saved, file)
    dist.barrier()


def _muonkit_states(engine: Any) -> list[tuple[str, torch.Tensor]]:
    hybrid = engine.optimizer.optimizer
    return [(k, v.detach().clone()) for state in hybrid.state.values() for k, v in sorted(state.items())]


def refuses_corrupted_checkpoints(
    ctx: Any, stage: int, name: str, initialize: Callable[..., Any], **cfg_kw: Any
) -> None:
    """Every corruption of the checkpoint :func:`resume_bit_identically` saved, into a fresh and a used engine."""
    cfg = config(stage, **cfg_kw, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}})
    problems = []
    for used in (False, True):
        engine, _ = initialize(cfg)
        if used:
            train(engine, 1, start=50)
        before = _muonkit_states(engine)
        for i, (corruption, (_, key, _)) in enumerate(CORRUPTIONS.items()):
            bad = ctx.shared / f"{name}_bad{i}_{int(used)}"
            _corrupt(ctx, ctx.shared / name, bad, corruption)
            cell = f"{'used' if used else 'fresh'} engine, {corruption}:"
            try:
                engine.load_checkpoint(str(bad), tag="step2")
                problems.append(f"{cell} accepted")
            except ValueError as e:
                if key not in str(e):
                    problems.append(f"{cell} the error does not name {key!r}: {e}")
            dist.barrier()  # every rank has read the files (DeepSpeed reads every rank's at ZeRO-1/2)
            after = _muonkit_states(engine)
            if len(after) != len(before) or any(
                a[0] != b[0] or not torch.equal(a[1], b[1]) for a, b in zip(after, before, strict=False)
            ):
                problems.append(f"{cell} changed muonkit's states")
    assert not problems, "\n".join(problems)
