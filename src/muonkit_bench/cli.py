"""The ``muonkit bench <name>`` commands, registered on the library's ``muonkit`` parser.

Each benchmark lives in its own module here and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``main(args) -> int``. A benchmark whose own dependencies are not
installed is still listed, and says what to install when run.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterable
from types import ModuleType
from typing import Any

BENCHES: dict[str, str] = {
    "nanogpt": "muonkit_bench.nanogpt",
    "step": "muonkit_bench.step",
    "memory": "muonkit_bench.memory",
    "finetune": "muonkit_bench.finetune",
    "dist": "muonkit_bench.dist",
    "deepspeed": "muonkit_bench.deepspeed",
    "lora": "muonkit_bench.lora",
    "qk-clip": "muonkit_bench.qk_clip",
    "capturable": "muonkit_bench.capturable",
    "gpu-check": "muonkit_bench.gpu_check",
}

INSTALL = "pip install -e ./bench in a clone of muonkit (or make setup)"


def _missing(e: ModuleNotFoundError) -> str | None:
    """What to say when a third-party package is missing, or None when ``e`` is about our own code."""
    if e.name is None or e.name.split(".")[0] in ("muonkit", "muonkit_bench"):
        return None
    return f"this benchmark needs the package {e.name!r}, which is not installed: {INSTALL}"


def _load(module: str) -> ModuleType | str:
    """The benchmark module, or why it cannot be imported (a missing third-party package)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        message = _missing(e)
        if message is None:
            raise
        return message


def add_commands(bench: Any) -> None:
    """Add one sub-parser per benchmark to ``bench`` (an argparse sub-parsers action)."""
    for name, module_name in BENCHES.items():
        module = _load(module_name)
        if isinstance(module, str):
            sub = bench.add_parser(name, help=f"(unavailable) {module}", description=module)
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            sub.set_defaults(run=_unavailable(module))
        else:
            sub = bench.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(sub)
            sub.set_defaults(run=_guarded(module.main))


def _guarded(main: Any) -> Any:
    """``main``, with a missing package imported lazily inside it reported as what to install."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(main(args) or 0)
        except ModuleNotFoundError as e:
            message = _missing(e)
            if message is None:
                raise
            raise SystemExit(f"muonkit bench {args.bench}: {message}") from e

    return run


def chosen(option: str, text: str, known: Iterable[str], *, hint: str = "") -> list[str]:
    """The comma-separated names of ``option`` (``--methods``), each one of ``known``, or SystemExit
    naming the unknown ones and listing the known ones (before the benchmark runs anything)."""
    names = [n for n in text.split(",") if n]
    allowed = list(known)
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(
            f"Invalid {option} {text!r}: {', '.join(map(repr, unknown)) or 'no name'}; known: {', '.join(allowed)}{hint}"
        )
    return names


def _unavailable(message: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise SystemExit(f"muonkit bench {args.bench}: {message}")

    return run
