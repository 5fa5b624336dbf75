"""``muonkit bench nanogpt``: AdamW vs HybridMuon on the benchmark GPT, same data, same steps.

Builds (or loads from cache) the Shakespeare corpus, trains the same seeded GPT twice, once with
``torch.optim.AdamW`` and once with :class:`muonkit.HybridMuon`, on identical batches with the
same schedule, then prints a table, and writes ``nanogpt.json`` and ``nanogpt.png`` to ``--out``.
See docs/benchmarks.md, "The demo: make demo", for how to read them.

    muonkit bench nanogpt                       # the demo preset (~10 min on 2 CPU cores)
    muonkit bench nanogpt --preset tiny         # seconds; what the CI smoke test runs
    muonkit bench nanogpt --steps 1000 --n-layer 6 --lr 0.03 --adamw-lr 3e-3 --out runs/mine
    muonkit bench nanogpt --sweep               # lr sweeps and several seeds (muonkit_bench.sweep)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HELP = "train AdamW and HybridMuon on the same Shakespeare batches; compare loss, tokens-to-loss, time and memory"
logger = logging.getLogger(__name__)

# Each preset: the corpus vocabulary, then GPTConfig / RunConfig fields on top of their defaults
# (the defaults are the demo). Flags override them.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {"vocab_size": 2048, "model": {}, "run": {}},
    "tiny": {
        "vocab_size": 512,
        "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "run": {"steps": 40, "batch_size": 8, "eval_interval": 10, "eval_batches": 2},
    },
}
MODEL_FLAGS = ("block_size", "n_layer", "n_head", "n_embd")
_RUN_FLAGS = (
    "steps", "batch_size", "eval_interval", "eval_batches", "lr", "adamw_lr", "weight_decay",
    "adamw_weight_decay", "warmup_frac", "decay_frac", "grad_clip", "seed", "threads", "device", "normuon_lr",
)  # fmt: skip
NAMES = {"adamw": "AdamW", "muon": "HybridMuon", "normuon": "NorMuon"}
"""Each ``--optimizers`` choice and its name in the table and the JSON."""


def add_run_arguments(parser: argparse.ArgumentParser, *, presets: Sequence[str], default: str, out: str) -> None:
    """The flags every training benchmark shares: preset, output folder, corpus cache, sizes."""
    parser.add_argument(
        "--preset", choices=sorted(presets), default=default, help=f"sizes to start from (default: {default})"
    )
    parser.add_argument("--out", default=out, help=f"output folder (default: {out})")
    parser.add_argument("--cache-dir", help="corpus cache (default: $MUONKIT_CACHE or ~/.cache/muonkit)")
    sizes = parser.add_argument_group("sizes (default: the preset's)")
    sizes.add_argument("--vocab-size", type=int, help="BPE vocabulary")
    for name in (*MODEL_FLAGS, "steps", "batch_size", "eval_interval", "eval_batches"):
        sizes.add_argument("--" + name.replace("_", "-"), type=int)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, presets=list(PRESETS), default="demo", out="runs/nanogpt")
    hyper = parser.add_argument_group("hyperparameters (default: muonkit_bench.train.RunConfig's)")
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=sorted(NAMES),
        default=["adamw", "muon"],
        help="what to train (default: adamw muon); adamw is the baseline every other run is compared with",
    )
    hyper.add_argument("--lr", type=float, help="Muon lr (Keller shape scaling)")
    hyper.add_argument("--normuon-lr", type=float, help="NorMuon lr (Keller shape scaling; --optimizers normuon)")
    hyper.add_argument("--adamw-lr", type=float, help="AdamW lr: the baseline and HybridMuon's AdamW groups")
    hyper.add_argument("--weight-decay", type=float, help="Muon weight decay")
    hyper.add_argument("--adamw-weight-decay", type=float, help="AdamW weight decay (2D tensors only)")
    hyper.add_argument("--warmup-frac", type=float)
    hyper.add_argument("--decay-frac", type=float)
    hyper.add_argument("--grad-clip", type=float)
    hyper.add_argument("--split-qkv", action="store_true", help="orthogonalize Q, K, V blocks of c_attn separately")
    hyper.add_argument(
        "--per-head", action="store_true", help="orthogonalize attention per head (c_attn rows, c_proj columns)"
    )
    hyper.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "8bit"),
        help="HybridMuon's optimizer state (Muon momentum and its AdamW groups' moments): fp32 (default), bf16 "
        "(stochastic rounding) or 8bit (blockwise fp8 codes + fp32 scales); the AdamW baseline stays "
        "torch.optim.AdamW with fp32 state",
    )
    hyper.add_argument(
        "--autocast",
        choices=("auto", "bf16", "none"),
        default="auto",
        help="bf16 autocast for forward/backward: auto (default) = only where bf16 matmul is fast (CUDA, CPUs "
        "with AVX512-BF16 or AMX), else fp32; bf16 or none force it",
    )
    hyper.add_argument("--no-autocast", action="store_true", help="same as --autocast none")
    run = parser.add_argument_group("run")
    run.add_argument("--seed", type=int)
    run.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    run.add_argument("--device", help="cpu (default) or cuda")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--no-plot", action="store_true", help="skip the PNG")
    from muonkit_bench.sweep import add_sweep_arguments  # stdlib-only imports: cheap

    add_sweep_arguments(parser)


def build_configs(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """(corpus kwargs, base RunConfig) from the preset and the flags."""
    from muonkit_bench.model import GPTConfig
    from muonkit_bench.train import RunConfig, autocast_choice

    preset = PRESETS[args.preset]
    corpus = {"vocab_size": args.vocab_size or preset["vocab_size"], "cache_dir": args.cache_dir}
    model = {**preset["model"], **{k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None}}
    run = {**preset["run"], **{k: getattr(args, k) for k in _RUN_FLAGS if getattr(args, k, None) is not None}}
    if args.split_qkv:
        run["split_qkv"] = True
    if getattr(args, "per_head", False):
        run["per_head"] = True
    if getattr(args, "state_dtype", None):
        run["state_dtype"] = args.state_dtype
    run["autocast"] = autocast_choice(args)
    # The vocabulary is known once the corpus exists; GPTConfig is rebuilt then (main()).
    return corpus, RunConfig(model=GPTConfig(vocab_size=corpus["vocab_size"], **model), **run)


def autocast_note(requested: str | None, used: str | None) -> str:
    """One line saying which autocast the runs used, and why."""
    what = "bf16 autocast" if used == "bf16" else "no autocast (fp32 forward/backward)"
    if requested != "auto":
        return f"{what}: forced (--autocast {requested or 'none'})"
    if used == "bf16":
        return f"{what}: auto, this device has fast bf16 matrix products (--autocast none forces fp32)"
    return f"{what}: auto, this device has no fast bf16 matrix products (--autocast bf16 forces it)"


def main(args: argparse.Namespace) -> int:
    if getattr(args, "sweep", None):
        from muonkit_bench import sweep

        return sweep.main(args)
    from muonkit_bench.compare import compare, format_table, plot_curves
    from muonkit_bench.data import load_corpus
    from muonkit_bench.train import RunResult, train

    chosen = list(dict.fromkeys(getattr(args, "optimizers", None) or ["adamw", "muon"]))
    if "adamw" not in chosen or len(chosen) < 2:
        raise ValueError(f"Invalid --optimizers {' '.join(chosen)}: give adamw (the baseline) and at least one other")
    corpus_kwargs, base = build_configs(args)
    t0 = time.perf_counter()
    corpus = load_corpus(**corpus_kwargs)
    data_s = time.perf_counter() - t0
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, vocab_size=corpus.vocab_size))
    logger.info(
        "corpus: %s train / %s val tokens (%d plays held out), %.1f s; model %s",
        f"{len(corpus.train):,}", f"{len(corpus.val):,}", len(corpus.meta["val_plays"]), data_s, base.model,
    )  # fmt: skip
    results: dict[str, RunResult] = {}
    for optimizer in ["adamw", *[o for o in chosen if o != "adamw"]]:
        config = dataclasses.replace(base, optimizer=optimizer)
        results[NAMES[optimizer]] = train(config, corpus, progress=not args.no_progress)
    comparisons = {name: compare(results["AdamW"], r) for name, r in results.items() if name != "AdamW"}
    comparison = next(iter(comparisons.values()))  # HybridMuon's when it ran
    print(format_table(results, comparison, comparisons=comparisons))
    first = next(iter(results.values()))
    print(autocast_note(first.config.autocast, first.autocast))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"preset": args.preset, **_report(results, comparison, corpus.meta, data_s)}
    report["comparisons"] = {name: c.to_dict() for name, c in comparisons.items()}
    (out / "nanogpt.json").write_text(json.dumps(_finite(report), indent=2))
    if not args.no_plot:
        plot_curves(results, comparison, out / "nanogpt.png")
    print(f"\nwrote {out / 'nanogpt.json'}" + ("" if args.no_plot else f" and {out / 'nanogpt.png'}"))
    return 0


def _report(results: dict[str, Any], comparison: Any, corpus_meta: dict[str, Any], data_s: float) -> dict[str, Any]:
    from muonkit_bench.environment import environment

    first = next(iter(results.values()))
    return {
        "benchmark": "nanogpt",
        "command": " ".join(["muonkit", *sys.argv[1:]]) if sys.argv and "muonkit" in sys.argv[0] else None,
        "comparison": comparison.to_dict(),
        "runs": {name: r.to_dict() for name, r in results.items()},
        "config": {k: v for k, v in first.config.to_dict().items() if k != "optimizer"},
        "corpus": {k: v for k, v in corpus_meta.items() if k != "train_plays"},
        "autocast": {
            "requested": first.config.autocast,
            "used": first.autocast,
            "note": autocast_note(first.config.autocast, first.autocast),
        },
        "data_prep_s": data_s,
        "environment": {
            **environment(),
            "cpu_model": _cpu_model(),
            "git_commit": _git_commit(),
            "threads": first.threads,
        },
        "note": "one seed; the machine may be shared with other jobs (see load_average), so times are indicative",
    }


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
