"""Launch W ranks of a DeepSpeed check module (``ds_worker.py``) on CPU with gloo (see ``tests/ranks.py``)."""

from __future__ import annotations

from pathlib import Path

from ranks import failure_report, launch_ranks

HERE = Path(__file__).resolve().parent


def launch(module: str, *, world_size: int, out_dir: Path, shared: Path, timeout: float = 300.0) -> dict:
    """Run ``module``'s checks on ``world_size`` ranks; returns ``{check: {rank: traceback or None}}``."""
    shared.mkdir(parents=True, exist_ok=True)
    args = [str(out_dir), str(shared), module]
    return launch_ranks(HERE / "ds_worker.py", args, world_size=world_size, out_dir=out_dir, timeout=timeout)


def report(results: dict, name: str, world_size: int) -> str | None:
    """None when every rank passed ``name``; else each rank's traceback and the launch's log tails."""
    return failure_report(results, name, world_size)
