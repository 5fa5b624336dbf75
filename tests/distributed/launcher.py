"""Launch W ranks of the distributed scenarios (``harness.py``) on CPU with gloo (see ``tests/ranks.py``)."""

from __future__ import annotations

from pathlib import Path

from ranks import failure_report, launch_ranks

HERE = Path(__file__).resolve().parent
__all__ = ["failure_report", "launch"]


def launch(modules: list[str], *, world_size: int, out_dir: Path, shared: Path, timeout: float = 240.0) -> dict:
    """Run the checks of ``modules`` on ``world_size`` ranks; returns ``{check: {rank: error or None}}``."""
    args = [str(out_dir), str(shared), *modules]
    return launch_ranks(HERE / "harness.py", args, world_size=world_size, out_dir=out_dir, timeout=timeout)
