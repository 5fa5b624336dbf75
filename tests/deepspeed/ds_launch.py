"""Start W ranks of a check module on CPU with gloo, and collect what each check reported.

One launch runs every check of a module in one process group (see :mod:`ds_worker`), so the
seconds spent starting Python, importing torch and DeepSpeed and forming the group are paid once
per module. Each rank writes ``results_rank{r}.json`` after every check and logs to
``rank{r}.log``; a failing check shows its traceback and the tail of the logs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(module: str, *, world_size: int, out_dir: Path, shared: Path, timeout: float = 300.0) -> dict:
    """Run ``module``'s checks on ``world_size`` ranks; returns ``{check: {rank: traceback or None}}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shared.mkdir(parents=True, exist_ok=True)
    src = str(HERE.parent.parent / "src")
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), src, os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    for rank in range(world_size):
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(HERE / "ds_worker.py"), str(out_dir), str(shared), module]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
        procs.append((subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=log), log))
    deadline = time.monotonic() + timeout
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    for proc, log in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        log.close()
    results: dict = {}
    for rank in range(world_size):
        path = out_dir / f"results_rank{rank}.json"
        for name, error in (json.loads(path.read_text()) if path.exists() else {}).items():
            results.setdefault(name, {})[rank] = error
    results["__logs__"] = {r: _tail(out_dir / f"rank{r}.log") for r in range(world_size)}
    return results


def report(results: dict, name: str, world_size: int) -> str | None:
    """None when every rank passed ``name``; else each rank's traceback (and log tails if it never reported)."""
    per_rank = results.get(name, {})
    problems = [
        f"rank {r}: {per_rank[r]}" if r in per_rank else f"rank {r} never reported; log tail:\n{results['__logs__'][r]}"
        for r in range(world_size)
        if per_rank.get(r, "missing") is not None
    ]
    return "\n".join(problems) or None


def _tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log)"]
    return "\n".join(text[-lines:])
