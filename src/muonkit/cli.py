"""The ``muonkit`` command: ``muonkit inspect``, ``muonkit plan``, ``muonkit bench <name>``, ``muonkit convert-deepspeed``.

``muonkit bench`` is the benchmark suite, a separate package (:mod:`muonkit_bench`, installed by
the ``bench`` extra) that this module reaches by name only when it is installed; the library
never imports it. The CLI configures logging; the library never does. Under torchrun only rank 0
logs at INFO.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from muonkit import __version__
from muonkit.integrations import deepspeed_convert
from muonkit.simulator import command

BENCH_SUITE = "muonkit_bench.cli"
INSTALL_BENCH = (
    "muonkit-bench is not on PyPI yet: in a clone of the repository, make setup or pip install -e ./bench; "
    "from the wheels make dist builds, pip install --find-links dist 'muonkit[bench]'"
)


def _bench_suite() -> ModuleType | None:
    """The benchmark suite's command registry, or None when the suite is not installed."""
    try:
        return importlib.import_module(BENCH_SUITE)
    except ModuleNotFoundError as e:
        if e.name in ("muonkit_bench", BENCH_SUITE):
            return None
        raise


def _bench_missing(args: argparse.Namespace) -> int:
    raise SystemExit(f"muonkit bench: the benchmark suite (package muonkit_bench) is not installed: {INSTALL_BENCH}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muonkit", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"muonkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="show where each tensor of a model goes (Muon or AdamW) and why")
    inspect.add_argument(
        "model", nargs="?", default="gpt2",
        help="a Hugging Face config.json (or its folder), or 'gpt2' (GPT-2 124M); built on the meta device, no weights",
    )  # fmt: skip
    inspect.add_argument("--split-qkv", action="store_true", help="split fused QKV projections into Q, K, V blocks")
    inspect.add_argument(
        "--per-head", action="store_true", help="orthogonalize attention projections per head (shows each split)"
    )
    inspect.add_argument("--heads", type=int, help="with --per-head: the head count (default: read from the model)")
    inspect.add_argument("--head-dim", type=int, help="with --per-head: the head size (default: read from the model)")
    inspect.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    plan = commands.add_parser(
        "plan", help=command.HELP, description=command.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    command.add_arguments(plan)
    plan.set_defaults(run=command.run)
    convert = commands.add_parser(
        "convert-deepspeed", help=deepspeed_convert.HELP, description=deepspeed_convert.DESCRIPTION
    )
    deepspeed_convert.add_arguments(convert)
    convert.set_defaults(run=deepspeed_convert.run)
    suite = _bench_suite()
    if suite is None:
        missing = commands.add_parser("bench", help=f"benchmarks (not installed: {INSTALL_BENCH})")
        missing.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        missing.set_defaults(run=_bench_missing)
    else:
        suite.add_commands(commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True))
    return parser


def _inspect(args: argparse.Namespace) -> int:
    import json

    from muonkit.integrations.transformers import model_from_config
    from muonkit.param_groups import explain

    if args.model == "gpt2":
        config: Any = {"model_type": "gpt2"}  # transformers' GPT2Config defaults: GPT-2 124M
    elif os.path.exists(args.model):
        config = args.model
    else:
        raise SystemExit(f"muonkit inspect: {args.model!r} is neither 'gpt2' nor a path to a Hugging Face config.json")
    model = model_from_config(config)
    try:
        report = explain(
            model, split_qkv=args.split_qkv, per_head=args.per_head, heads=args.heads, head_dim=args.head_dim
        )
    except ValueError as e:
        raise SystemExit(f"muonkit inspect: {e}") from None
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0


def _configure_logging(verbose: bool) -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s: %(message)s", datefmt="%H:%M:%S")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        if args.command == "inspect":
            return _inspect(args)
        return int(args.run(args) or 0)
    except ImportError as e:  # an optional dependency (transformers for a config.json): one line, no traceback
        if not _missing_dependency(e):
            raise
        raise SystemExit(f"muonkit {args.command}: {e}") from None


def _missing_dependency(e: ImportError) -> bool:
    """Whether ``e`` says an optional package is not installed (it, or the error it was raised from, is a
    ModuleNotFoundError for a module outside muonkit), rather than a broken import of muonkit's own."""
    missing = e if isinstance(e, ModuleNotFoundError) else e.__cause__
    return isinstance(missing, ModuleNotFoundError) and not (missing.name or "muonkit").startswith("muonkit")


if __name__ == "__main__":
    sys.exit(main())
