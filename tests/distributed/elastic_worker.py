"""A run under ``torchrun --max-restarts=1`` in which one rank raises inside ``step()``.

``python elastic_worker.py OUT_DIR`` (started by ``test_elastic_restart.py`` through torchrun):
a small model trains ``STEPS`` steps on the same deterministic gradients on every rank (as DDP
leaves them), saving a checkpoint every ``SAVE_EVERY`` steps with ``muonkit.distributed.checkpoint``.
At the first attempt the last rank raises inside Newton-Schulz at step ``FAIL_AT``: every rank
must raise (the others ``RankFailedError``) and end, torchrun starts them again, and the second
attempt resumes from the last checkpoint and trains to the end. It then trains an uninterrupted
run from scratch in the same process group and compares the two, bit for bit.

Each rank writes ``attempt{A}_rank{R}.json``: where it started, what it raised (and how long its
failing step took), and whether the resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import muonkit
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint

STEPS = 6
SAVE_EVERY = 2
FAIL_AT = 3
INJECTED = "injected out-of-memory in Newton-Schulz"
STEP_BEGAN = [0.0]  # when the latest step began (time.monotonic)


def build() -> tuple[nn.Module, muonkit.HybridMuon]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.Linear(12, 4))
    return model, muonkit.HybridMuon(muonkit.param_groups(model), process_group=dist.group.WORLD)


def set_grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def train(model: nn.Module, opt: muonkit.HybridMuon, start: int, *, out: Path | None, fail_at: int | None) -> None:
    for step in range(start, STEPS):
        set_grads(model, step)
        STEP_BEGAN[0] = time.monotonic()
        if step == fail_at and dist.get_rank() == dist.get_world_size() - 1:

            def out_of_memory(*_: Any, **__: Any) -> Any:
                raise torch.OutOfMemoryError(INJECTED)

            opt.strategy.compute = out_of_memory  # type: ignore[method-assign]
        opt.step()
        if out is not None and (step + 1) % SAVE_EVERY == 0:
            save_checkpoint(out / f"step_{step + 1}", model=model, optimizer=opt)
            if dist.get_rank() == 0:
                (out / "latest.tmp").write_text(str(step + 1))
                os.replace(out / "latest.tmp", out / "latest")
            dist.barrier()


def main(out: Path) -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    report: dict[str, Any] = {"attempt": attempt}
    model, opt = build()
    start = int((out / "latest").read_text()) if (out / "latest").exists() else 0
    if start:
        load_checkpoint(out / f"step_{start}", model=model, optimizer=opt)
    report["start"] = start
    path = out / f"attempt{attempt}_rank{rank}.json"
    try:
        train(model, opt, start, out=out, fail_at=FAIL_AT if attempt == 0 else None)
    except Exception as e:
        report.update(error=type(e).__name__, message=str(e), step_seconds=time.monotonic() - STEP_BEGAN[0])
        path.write_text(json.dumps(report))
        raise
    ref_model, ref_opt = build()
    train(ref_model, ref_opt, 0, out=None, fail_at=None)
    same_params = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
    mine, ref = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    same_state = mine.keys() == ref.keys() and all(
        all(torch.equal(torch.as_tensor(mine[k][n]), torch.as_tensor(v)) for n, v in ref[k].items()) for k in ref
    )
    report.update(same_params=same_params, same_state=same_state, states=len(mine))
    path.write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
