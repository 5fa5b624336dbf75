"""The ``muonkit`` command: ``muonkit inspect``, ``muonkit bench <name>``, ``muonkit convert-deepspeed``.

Each benchmark lives in its own module under :mod:`muonkit.bench` and exposes ``HELP`` (one
line), ``add_arguments(parser)`` and ``main(args) -> int``. The CLI configures logging; the
library never does. Under torchrun only rank 0 logs at INFO.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from muonkit.integrations import deepspeed_convert

BENCHES: dict[str, str] = {
    "nanogpt": "muonkit.bench.nanogpt",
    "step": "muonkit.bench.step",
    "memory": "muonkit.bench.memory",
    "finetune": "muonkit.bench.finetune",
    "dist": "muonkit.bench.dist",
    "deepspeed": "muonkit.bench.deepspeed",
    "lora": "muonkit.bench.lora",
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # that benchmark is not part of this build
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muonkit", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="show where each tensor of a model goes (Muon or AdamW) and why")
    inspect.add_argument(
        "model", nargs="?", default="gpt",
        help="'gpt' (the benchmark GPT), or a Hugging Face config.json (built on the meta device, no weights)",
    )  # fmt: skip
    inspect.add_argument("--split-qkv", action="store_true", help="split fused QKV projections into Q, K, V blocks")
    inspect.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    convert = commands.add_parser(
        "convert-deepspeed", help=deepspeed_convert.HELP, description=deepspeed_convert.DESCRIPTION
    )
    deepspeed_convert.add_arguments(convert)
    convert.set_defaults(run=deepspeed_convert.run)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        module = _load(module_name)
        if module is not None:
            sub = bench.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(sub)
            sub.set_defaults(run=module.main)
    return parser


def _inspect(args: argparse.Namespace) -> int:
    import json

    from muonkit.param_groups import explain

    if args.model == "gpt":
        import torch

        from muonkit.bench.model import GPT, GPTConfig

        with torch.device("meta"):
            model: torch.nn.Module = GPT(GPTConfig())
    else:
        from muonkit.integrations.transformers import model_from_config

        model = model_from_config(args.model)
    report = explain(model, split_qkv=args.split_qkv)
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
    if args.command == "inspect":
        return _inspect(args)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
