"""The torchrun benchmarks (``bench dist``, ``bench deepspeed``): shared flags, and running a
subcommand's worker under torchrun on this machine and reading its result."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def add_worker_arguments(parser: argparse.ArgumentParser, *, batch_help: str) -> None:
    """The benchmark GPT's sizes, tokens per rank, and the hidden flags of the torchrun worker."""
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help=batch_help)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def write_report(out_dir: str, name: str, report: dict[str, Any], text: str) -> None:
    """Write ``report`` to ``OUT_DIR/NAME.json`` and print its table ``text``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(text)
    print(f"\nwrote {out / f'{name}.json'}")


def free_port() -> int:
    """A port nobody listens on now (other torchrun jobs may share the machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_worker(
    subcommand: str, world_size: int, worker_args: list[str], *, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``torchrun -m muonkit.cli bench SUBCOMMAND --worker --result=FILE ARGS`` on ``world_size``
    local ranks (gloo, one thread each); returns the JSON the workers wrote to ``FILE``.

    Raises ``RuntimeError`` if no result was written. A nonzero exit after the result exists is
    reported as a warning: about once in 10 runs here a rank aborts in C++ teardown at interpreter
    exit ("terminate called without an active exception") after every rank finished.
    """
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            "-m", "muonkit.cli", "bench", subcommand, "--worker", f"--result={result}", *worker_args,
        ]  # fmt: skip
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1", **(env or {})}
        done = subprocess.run(cmd, env=full_env)
        if not result.exists():
            raise RuntimeError(
                f"bench {subcommand} at W={world_size} failed (exit code {done.returncode}); see the output above"
            )
        if done.returncode != 0:
            print(f"warning: W={world_size} workers exited with code {done.returncode} after writing results")
        return dict(json.loads(result.read_text()))
