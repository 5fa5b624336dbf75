"""The rank side of the distributed tests: run registered checks in one process group.

``python harness.py OUT_DIR SHARED_DIR module...`` (started by :mod:`launcher`) initializes gloo
from the environment, imports each scenario module and runs its checks in order. A failing
check records its traceback and the run goes on; results are written after every check.
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
    shared: Path  # survives across launches (checkpoints saved at one world size, loaded at another)


Check = Callable[[Context], None]
REGISTRY: dict[str, list[tuple[str, tuple[int, ...], Check]]] = {}


def check(*world_sizes: int) -> Callable[[Check], Check]:
    """Register a check to run at these world sizes."""

    def register(fn: Check) -> Check:
        REGISTRY.setdefault(fn.__module__, []).append((fn.__name__, world_sizes, fn))
        return fn

    return register


def checks_of(module: str, world_size: int) -> list[str]:
    """Names ``module.function`` of the checks that run at ``world_size`` (for pytest ids)."""
    importlib.import_module(module)
    return [f"{module}.{name}" for name, sizes, _ in REGISTRY.get(module, []) if world_size in sizes]


def main(argv: list[str]) -> int:
    out_dir, shared, modules = Path(argv[0]), Path(argv[1]), argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ctx = Context(dist.get_rank(), dist.get_world_size(), out_dir, shared)
    results: dict[str, str | None] = {}
    path = out_dir / f"results_rank{ctx.rank}.json"
    for module in modules:
        importlib.import_module(module)
        for name, sizes, fn in REGISTRY.get(module, []):
            if ctx.world_size not in sizes:
                continue
            torch.manual_seed(0)
            try:
                fn(ctx)
                results[f"{module}.{name}"] = None
            except BaseException:  # DCP's CheckpointException is a BaseException
                results[f"{module}.{name}"] = traceback.format_exc()
            path.write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness  # the scenario modules register into the importable module, not __main__

    sys.exit(harness.main(sys.argv[1:]))
