"""``muonkit bench finetune``: does Muon fine-tuning help, and does it depend on how the model was pretrained?

Moonlight's design at a size this machine runs:

1. **Pretrain** the benchmark GPT on the Shakespeare corpus twice, with AdamW and with HybridMuon
   (:func:`muonkit_bench.train.train`, same data, steps and seed).
2. **Fine-tune** each pretrained model with AdamW and with HybridMuon (Moonlight's setting: the
   same lr and weight decay, Muon RMS-matched to AdamW) on offline labelled tasks
   (:mod:`muonkit_bench.labelled`), several seeds each, a mean-pooled linear head
   (:mod:`muonkit_bench.classifier`). Accuracy on a held-out test split (the same split for every
   run), reported as the mean with a 95% t-interval over seeds, the test set's own binomial noise
   beside it, and the paired difference HybridMuon - AdamW (same seed: same head init and order).
3. **MiniLM**: the offline all-MiniLM-L6-v2 fine-tuned with AdamW (plain ``Trainer``) and
   HybridMuon (:class:`muonkit.integrations.transformers.MuonTrainer`) on the same tasks
   (:mod:`muonkit_bench.finetune_hf`).

The intervals cover fine-tuning noise (seed of the head and of the batch order) only; each
pretraining is one run.

Example::

    muonkit bench finetune --preset tiny        # seconds: the CI smoke test
    muonkit bench finetune                      # the default preset (CPU; time in BENCHMARKS.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from muonkit_bench.cli import chosen

HELP = "pretrain the GPT with AdamW and HybridMuon, fine-tune each with both on labelled tasks; MiniLM via the Trainer"
logger = logging.getLogger(__name__)

OPTIMIZERS: tuple[Literal["adamw", "muon"], ...] = ("adamw", "muon")
NAMES = {"adamw": "AdamW", "muon": "HybridMuon"}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "pretrain": {"steps": 20, "batch_size": 8, "eval_interval": 10, "eval_batches": 2},
        "tasks": ("sentiment", "trec"),
        "max_train": 160,
        "max_test": 80,
        "seeds": (0, 1),
        "finetune": {"epochs": 1, "batch_size": 16, "lr": 1e-3},
        "minilm": {"tasks": ("sentiment",), "max_train": 32, "max_test": 32, "seeds": (0,), "max_steps": 2},
    },
    "default": {
        "vocab_size": 2048,
        "model": {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256},
        "pretrain": {"steps": 600, "batch_size": 16, "eval_interval": 100, "eval_batches": 8},
        "tasks": ("sentiment", "trec"),
        "max_train": None,
        "max_test": None,
        "seeds": (0, 1, 2),
        "finetune": {"epochs": 2, "batch_size": 32, "lr": 1e-3},
        "minilm": {
            "tasks": ("sentiment", "trec"),
            "max_train": 2000,
            "max_test": None,
            "seeds": (0, 1),
            "max_steps": -1,
        },
    },
}
TEST_FRAC = 0.2
SPLIT_SEED = 0


def task_splits(names: tuple[str, ...], *, max_train: int | None, max_test: int | None) -> dict[str, Any]:
    """{task: (train, test)}: the fixed seeded split, then optional subsamples."""
    from muonkit_bench.labelled import load_task

    out = {}
    for name in names:
        train, test = load_task(name).split(test_frac=TEST_FRAC, seed=SPLIT_SEED)
        out[name] = (train.subsample(max_train, seed=SPLIT_SEED), test.subsample(max_test, seed=SPLIT_SEED))
    return out


def pretrain(preset: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """({optimizer: model}, {optimizer: summary}, corpus)."""
    from muonkit_bench.data import load_corpus
    from muonkit_bench.model import GPTConfig
    from muonkit_bench.train import RunConfig, train

    corpus = load_corpus(vocab_size=preset["vocab_size"], cache_dir=args.cache_dir)
    run = {**preset["pretrain"], "device": args.device}
    if args.pretrain_steps:
        run["steps"] = args.pretrain_steps
    model = {**preset["model"], **{k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if getattr(args, k)}}
    base = RunConfig(model=GPTConfig(vocab_size=corpus.vocab_size, **model), **run)
    models: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        result = train(dataclasses.replace(base, optimizer=opt), corpus, progress=not args.no_progress)
        models[opt] = result.model
        summary[opt] = {
            "initial_val_loss": result.val_loss[0],
            "final_val_loss": result.final_val_loss,
            "wall_time_s": result.wall_time_s,
            "config": result.config.to_dict(),
        }
        logger.info("pretrained with %s: val loss %.4f", opt, result.final_val_loss)
    return models, summary, corpus


def gpt_finetunes(preset: dict[str, Any], args: argparse.Namespace, seeds: tuple[int, ...]) -> dict[str, Any]:
    """Pretrain twice, fine-tune each pretrained model with both optimizers on every task and seed."""
    from muonkit_bench.classifier import FinetuneConfig, GPTClassifier, encode, finetune

    models, pre_summary, corpus = pretrain(preset, args)
    block = preset["model"]["block_size"]
    max_train = args.max_train or preset["max_train"]
    max_test = args.max_test or preset["max_test"]
    splits = task_splits(args.tasks or preset["tasks"], max_train=max_train, max_test=max_test)
    results: dict[str, Any] = {}
    for task, (train, test) in splits.items():
        ids = {
            split.name: (
                encode(split.texts, tokenizer_path=str(corpus.tokenizer_path), max_len=block),
                list(split.labels),
            )
            for split in (train, test)
        }
        cells: dict[str, Any] = {}
        for pre in OPTIMIZERS:
            for ft in OPTIMIZERS:
                runs = []
                for seed in seeds:
                    config = FinetuneConfig(optimizer=ft, seed=seed, device=args.device, **preset["finetune"])
                    clf = GPTClassifier(models[pre], num_labels=len(train.label_names))
                    r = finetune(clf, ids[train.name], ids[test.name], config=config)
                    logger.info("%s pre=%s ft=%s seed=%d: accuracy %.4f", task, pre, ft, seed, r["accuracy"])
                    runs.append({"seed": seed, **r})
                cells[f"{pre}/{ft}"] = runs
        results[task] = {"n_train": len(train), "n_test": len(test), "classes": len(train.label_names), "cells": cells}
    return {"pretrain": pre_summary, "tasks": results}


def minilm_finetunes(preset: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from muonkit_bench.finetune_hf import finetune_minilm

    spec = preset["minilm"]
    seeds = tuple(int(s) for s in args.minilm_seeds.split(",")) if args.minilm_seeds else spec["seeds"]
    max_train = args.minilm_max_train or spec["max_train"]
    splits = task_splits(args.tasks or spec["tasks"], max_train=max_train, max_test=args.max_test or spec["max_test"])
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task, (train, test) in splits.items():
            cells = {}
            for opt in OPTIMIZERS:
                runs = []
                for seed in seeds:
                    r = finetune_minilm(
                        train,
                        test,
                        optimizer=opt,
                        seed=seed,
                        out_dir=tmp,
                        max_steps=spec["max_steps"],
                        muon_lr=args.minilm_muon_lr,
                        device=args.device,
                    )
                    logger.info("MiniLM %s %s seed=%d: accuracy %.4f", task, opt, seed, r["accuracy"])
                    runs.append({"seed": seed, **r})
                cells[opt] = runs
            results[task] = {
                "n_train": len(train),
                "n_test": len(test),
                "classes": len(train.label_names),
                "cells": cells,
            }
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--tasks", type=lambda s: tuple(s.split(",")), help="comma-separated: sentiment,trec,rotten")
    parser.add_argument("--seeds", help="comma-separated fine-tuning seeds of the GPT part (default: the preset's)")
    parser.add_argument("--minilm-seeds", help="comma-separated seeds of the MiniLM part (default: the preset's)")
    parser.add_argument("--pretrain-steps", type=int, help="override the preset's pretraining steps")
    for name in ("n_layer", "n_head", "n_embd"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"override the preset GPT's {name}")
    parser.add_argument("--max-train", type=int, help="at most this many training examples per task (GPT part)")
    parser.add_argument("--max-test", type=int, help="at most this many test examples per task (both parts)")
    parser.add_argument("--minilm-max-train", type=int, help="at most this many training examples per task (MiniLM)")
    parser.add_argument(
        "--minilm-muon-lr",
        type=float,
        help="Muon lr of the MiniLM HybridMuon runs, RMS-matched (default: the AdamW lr 5e-5, Moonlight's setting)",
    )
    parser.add_argument("--no-gpt", action="store_true", help="skip the GPT pretrain + fine-tune part")
    parser.add_argument("--no-minilm", action="store_true", help="skip the MiniLM part")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-dir", help="corpus cache (default: $MUONKIT_CACHE or ~/.cache/muonkit)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default="runs/finetune", help="output folder (finetune.json)")


def main(args: argparse.Namespace) -> int:
    from muonkit_bench.environment import environment
    from muonkit_bench.finetune_report import format_report, summarize
    from muonkit_bench.sweep_report import finite_json

    preset = PRESETS[args.preset]
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else preset["seeds"]
    if args.tasks:  # checked here, not after the pretraining
        from muonkit_bench.labelled import TASKS

        chosen("--tasks", ",".join(args.tasks), TASKS)
    start = time.perf_counter()
    report: dict[str, Any] = {
        "preset": args.preset,
        "environment": environment(),
        "split": {"test_frac": TEST_FRAC, "seed": SPLIT_SEED},
    }
    if not args.no_gpt:
        report["gpt"] = gpt_finetunes(preset, args, seeds)
        report["gpt_time_s"] = time.perf_counter() - start
    if not args.no_minilm:
        t0 = time.perf_counter()
        report["minilm"] = minilm_finetunes(preset, args)
        report["minilm_muon_lr"] = args.minilm_muon_lr  # None: the AdamW lr (Moonlight's setting)
        report["minilm_time_s"] = time.perf_counter() - t0
    report["total_time_s"] = time.perf_counter() - start
    report["summary"] = summarize(report)
    print(format_report(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "finetune.json").write_text(json.dumps(finite_json(report), indent=2, default=str))
    print(f"\nwrote {out / 'finetune.json'}")
    return 0
