"""Start W local ranks of a test worker script on CPU with gloo, and collect what each check reported.

Used by the distributed suite (``tests/distributed``) and the DeepSpeed suite (``tests/deepspeed_engine``):
one launch runs many checks in one process group, so starting Python, importing torch and forming
the group are paid once. Each rank writes ``results_rank{r}.json`` (``{check: traceback or None}``)
after every check and logs to ``rank{r}.log``, whose tail is shown when something fails.
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

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def free_port() -> int:
    """A TCP port nobody listens on right now (other jobs run torchrun on this machine too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(script: Path, args: list[str], *, world_size: int, out_dir: Path, timeout: float) -> dict:
    """Run ``python script *args`` on ``world_size`` ranks; returns ``{check: {rank: error or None}}``
    plus ``"__logs__"`` (each rank's log tail) and ``"__launch__"`` (exit codes) when a rank failed
    or timed out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "TORCH_COMPILE_DISABLE": "1",
        # the worker's folder, then tests/ (helpers shared with the one-process tests), then the library
        "PYTHONPATH": os.pathsep.join([str(script.parent), str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    for rank in range(world_size):
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(script), *args]
        proc = subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=log)
        procs.append((proc, log))
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc, log in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        log.close()
    results = _collect(out_dir, world_size)
    results["__logs__"] = {r: _tail(out_dir, r) for r in range(world_size)}
    failed_ranks = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if timed_out or failed_ranks:
        results["__launch__"] = {
            r: f"rank {r} exit code {procs[r][0].returncode}{' (timed out)' if timed_out else ''}"
            for r in failed_ranks or range(world_size)
        }
    return results


def _collect(out_dir: Path, world_size: int) -> dict:
    results: dict = {}
    for rank in range(world_size):
        path = out_dir / f"results_rank{rank}.json"
        if path.exists():
            for name, error in json.loads(path.read_text()).items():
                results.setdefault(name, {})[rank] = error
    return results


def _tail(out_dir: Path, rank: int, lines: int = 40) -> str:
    path = out_dir / f"rank{rank}.log"
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log)"]
    return "\n".join(text[-lines:])


def failure_report(results: dict, name: str, world_size: int) -> str | None:
    """None if every rank passed check ``name``; else what each rank said."""
    per_rank = results.get(name, {})
    problems = []
    for rank in range(world_size):
        if rank not in per_rank:
            problems.append(
                f"rank {rank}: did not report (crashed or hung earlier); log tail:\n{results['__logs__'][rank]}"
            )
        elif per_rank[rank] is not None:
            problems.append(f"rank {rank}:\n{per_rank[rank]}")
    if problems and "__launch__" in results:
        problems += [f"launch: {text.splitlines()[0]}" for text in results["__launch__"].values()]
    return "\n".join(problems) or None
