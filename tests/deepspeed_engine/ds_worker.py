"""One rank of a DeepSpeed test launch: ``python ds_worker.py OUT_DIR SHARED_DIR MODULE``.

Forms the gloo group from the environment, runs the checks ``MODULE`` registered with
:func:`check` in order, and writes ``results_rank{r}.json`` after each one. A failed check
records its traceback and the run goes on.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    out_dir: Path
    shared: Path  # kept between launches: checkpoints saved at 2 ranks, loaded at 1


Check = Callable[[Context], None]
CHECKS: dict[str, list[tuple[str, Check]]] = {}


def check(fn: Check) -> Check:
    """Register ``fn`` as a check of its module (run in definition order)."""
    CHECKS.setdefault(fn.__module__, []).append((fn.__name__, fn))
    return fn


def names(module: str) -> list[str]:
    importlib.import_module(module)
    return [name for name, _ in CHECKS.get(module, [])]


def quiet_deepspeed() -> None:
    """Skip DeepSpeed's shared-memory comm op: a JIT C++ build (20 s to minutes on a fresh machine)
    that only speeds up DeepSpeed's own CPU all-reduce; gloo serves every collective here."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main(argv: list[str]) -> int:
    out_dir, shared, module = Path(argv[0]), Path(argv[1]), argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ctx = Context(dist.get_rank(), dist.get_world_size(), out_dir, shared)
    importlib.import_module(module)
    results: dict[str, str | None] = {}
    for name, fn in CHECKS.get(module, []):
        torch.manual_seed(0)
        try:
            fn(ctx)
            results[name] = None
        except BaseException:
            results[name] = traceback.format_exc()
        (out_dir / f"results_rank{ctx.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ds_worker  # checks register into the importable module, not __main__

    sys.exit(ds_worker.main(sys.argv[1:]))
