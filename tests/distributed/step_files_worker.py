"""One rank of ``test_step_files``: which muonkit files a steady ``step()`` enters (FSDP2 or DDP).

``python step_files_worker.py OUT_DIR MODE``: three steps, then a fourth under ``sys.setprofile``
that records every muonkit code object entered; rank 0 writes ``OUT_DIR/files_MODE.json`` and every
rank ``results_rank{r}.json`` (``{MODE: traceback or None}``, see ``tests/ranks.py``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

import muonkit


def entered(mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    )
    forward: torch.nn.Module = model
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02)
    else:
        forward = torch.nn.parallel.DistributedDataParallel(model)
        opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, process_group=dist.group.WORLD)
    root = os.path.dirname(muonkit.__file__)
    files: dict[str, int] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        del arg
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root):
            files[os.path.relpath(name, root)] = files.get(os.path.relpath(name, root), 0) + 1

    for i in range(4):
        forward(torch.randn(8, 32)).square().mean().backward()
        if i == 3:
            sys.setprofile(profile)
        opt.step()
        sys.setprofile(None)
        opt.zero_grad()
    lines = sum(len(Path(root, f).read_text().splitlines()) for f in files)
    return {"files": sorted(files), "lines": lines, "calls": sum(files.values())}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    error = None
    try:
        found = entered(mode)
        if rank == 0:
            (out / f"files_{mode}.json").write_text(json.dumps(found))
    except Exception:
        error = traceback.format_exc()
    (out / f"results_rank{rank}.json").write_text(json.dumps({mode: error}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
