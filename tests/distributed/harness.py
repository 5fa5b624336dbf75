"""The rank side of the distributed tests: run registered checks in one process group.

``python harness.py OUT_DIR SHARED_DIR module...`` (started by :mod:`launcher`) initializes gloo
from the environment, imports each scenario module and runs its checks in order. A failing
check records its traceback and the run goes on; results are written after every check.

The default Newton-Schulz dtype (``ns_dtype=None``) is bf16 on CPUs with fast bf16 and fp32 on the
others. So that no outcome depends on the CPU, every check runs with the default forced: to fp32,
or, for checks registered with ``both_ns_defaults=True``, once under each (``name[fp32]``,
``name[bf16]``), whatever this CPU supports.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    out_dir: Path
    shared: Path  # survives across launches (checkpoints saved at one world size, loaded at another)
    ns_default: str = "fp32"  # the default Newton-Schulz dtype this check runs under (forced)


Check = Callable[[Context], None]
NS_DEFAULTS = ("fp32", "bf16")
REGISTRY: dict[str, list[tuple[str, tuple[int, ...], Check, tuple[str, ...]]]] = {}
PENDING: dict[str, str] = {}
"""``module.function`` of checks registered with ``pending=reason``: written ahead of a feature,
reported skipped with that reason and not run, unless ``MUONKIT_RUN_PENDING=1``."""


def run_pending() -> bool:
    return os.environ.get("MUONKIT_RUN_PENDING") == "1"


def check(*world_sizes: int, both_ns_defaults: bool = False, pending: str | None = None) -> Callable[[Check], Check]:
    """Register a check to run at these world sizes (under both default NS dtypes if asked)."""

    def register(fn: Check) -> Check:
        variants = NS_DEFAULTS if both_ns_defaults else NS_DEFAULTS[:1]
        REGISTRY.setdefault(fn.__module__, []).append((fn.__name__, world_sizes, fn, variants))
        if pending is not None:
            PENDING[f"{fn.__module__}.{fn.__name__}"] = pending
        return fn

    return register


def _name(module: str, name: str, variants: tuple[str, ...], variant: str) -> str:
    return f"{module}.{name}" if len(variants) == 1 else f"{module}.{name}[{variant}]"


def checks_of(module: str, world_size: int) -> list[str]:
    """Names ``module.function`` (``[fp32]``/``[bf16]`` appended if both) that run at ``world_size``."""
    importlib.import_module(module)
    return [
        _name(module, name, variants, v)
        for name, sizes, _, variants in REGISTRY.get(module, [])
        if world_size in sizes
        for v in variants
    ]


@contextmanager
def ns_default(variant: str) -> Iterator[None]:
    """Force the CPU's default Newton-Schulz dtype: ``"bf16"`` (as with fast bf16) or ``"fp32"``."""
    module = importlib.import_module("muonkit.functional.orthogonalize")  # the module, not the function
    detected = module._cpu_has_fast_bf16
    module._cpu_has_fast_bf16 = lambda: variant == "bf16"
    try:
        yield
    finally:
        module._cpu_has_fast_bf16 = detected


def main(argv: list[str]) -> int:
    out_dir, shared, modules = Path(argv[0]), Path(argv[1]), argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ctx = Context(dist.get_rank(), dist.get_world_size(), out_dir, shared)
    results: dict[str, str | None] = {}
    path = out_dir / f"results_rank{ctx.rank}.json"
    for module in modules:
        importlib.import_module(module)
        for name, sizes, fn, variants in REGISTRY.get(module, []):
            if ctx.world_size not in sizes or (f"{module}.{name}" in PENDING and not run_pending()):
                continue
            for variant in variants:
                torch.manual_seed(0)
                key = _name(module, name, variants, variant)
                try:
                    with ns_default(variant):
                        fn(replace(ctx, ns_default=variant))
                    results[key] = None
                except BaseException:  # DCP's CheckpointException is a BaseException
                    results[key] = traceback.format_exc()
                path.write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness  # the scenario modules register into the importable module, not __main__

    sys.exit(harness.main(sys.argv[1:]))
