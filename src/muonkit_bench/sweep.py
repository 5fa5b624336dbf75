"""``muonkit bench nanogpt --sweep``: tuned AdamW vs tuned HybridMuon, several seeds, honest ratios.

The protocol of the public NanoGPT claims, at a size this machine can run:

1. **Sweep** (seed 0, ``sweep_frac * N`` steps, the same warmup-stable-decay shape): AdamW over
   ``adamw_lrs``; then HybridMuon's Muon lr over ``muon_lrs`` with its AdamW groups at AdamW's
   best lr. Best = lowest final validation loss.
2. **Full runs** at the best lrs, for every seed: AdamW at N steps, HybridMuon at N steps, and
   HybridMuon at ``round(0.74 N)`` steps (its schedule compressed to that length, as in Keller
   Jordan's GPT-2 XL comparison at 0.75x the steps).
3. **Report**: final validation losses (mean, sample std, min, max over seeds); the tokens (and
   wall-clock) HybridMuon at N needs to reach AdamW's mean final loss, read off its validation
   curve (:func:`muonkit_bench.compare.steps_to_reach`); whether the 0.74 N runs reach it; the
   optimizer-step time and its share of the training time; a plot.

Wall-clock to a loss is ``steps_to_reach / N * training time`` (training time = the run's wall
time minus its evaluations), i.e. it assumes steps of equal cost.

Example::

    muonkit bench nanogpt --sweep            # the CPU preset (see PRESETS for its size and time)
    muonkit bench nanogpt --sweep tiny       # seconds: the CI smoke test
    muonkit bench nanogpt --sweep gpu --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muonkit_bench.stats import spread

logger = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    # 2 CPU cores, bf16 autocast: ~17-20 min measured on lightly shared cores (target: <= ~60 min).
    "cpu": {
        "vocab_size": 2048,
        "model": {"block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256},
        "run": {"steps": 320, "batch_size": 16, "eval_interval": 20, "eval_batches": 8},
        # centred on the best of a first run whose bests sat at the low edges of 1e-3..8e-3 and 0.01..0.08
        "adamw_lrs": (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3),
        "muon_lrs": (0.0025, 0.005, 0.01, 0.02, 0.04),
        "sweep_frac": 0.3,
        "seeds": (0, 1),
    },
    # One modern GPU (bf16 autocast), GPT-2-small-like body (12 x 768, 12 heads); never run here.
    # The corpus has ~1.5M training tokens: 1000 steps x 32 x 512 tokens is ~11 passes over it.
    "gpu": {
        "vocab_size": 4096,
        "model": {"block_size": 512, "n_layer": 12, "n_head": 12, "n_embd": 768, "dropout": 0.1},
        "run": {"steps": 1000, "batch_size": 32, "eval_interval": 50, "eval_batches": 16, "device": "cuda"},
        "adamw_lrs": (3e-4, 6e-4, 1.2e-3, 2.4e-3),
        "muon_lrs": (0.01, 0.02, 0.04, 0.08),
        "sweep_frac": 0.3,
        "seeds": (0, 1),
    },
    "tiny": {
        "vocab_size": 512,
        "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "run": {"steps": 30, "batch_size": 8, "eval_interval": 5, "eval_batches": 2},
        "adamw_lrs": (2e-3, 8e-3),
        "muon_lrs": (0.02, 0.05),
        "sweep_frac": 0.5,
        "seeds": (0, 1),
    },
}
SHORT_FRAC = 0.74
ARMS = ("adamw", "muon", "muon_short")
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"state_dtype": "fp32"},
    "bf16": {"state_dtype": "bf16"},
    "8bit": {"state_dtype": "8bit"},
    "whole": {"per_head": False},
    "per_head": {"per_head": True},
}
"""``--arms``: each HybridMuon variant and the RunConfig fields it sets (on top of the base)."""


@dataclass(frozen=True)
class SweepPlan:
    """What to run: the full-length base config, the lr grids, the seeds."""

    base: Any  # muonkit_bench.train.RunConfig at N steps
    adamw_lrs: tuple[float, ...]
    muon_lrs: tuple[float, ...]
    sweep_frac: float
    seeds: tuple[int, ...]
    short_frac: float = SHORT_FRAC
    arms: tuple[str, ...] = ()
    """HybridMuon variants (keys of VARIANTS) compared against one AdamW baseline; () = the
    classic protocol (AdamW N, HybridMuon N and 0.74 N)."""

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in VARIANTS]
        if unknown or len(self.arms) == 1 or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"Invalid arms={self.arms}: give none, or two or more distinct of {sorted(VARIANTS)}")
        if not self.adamw_lrs or not self.muon_lrs:
            raise ValueError("Invalid sweep: adamw_lrs and muon_lrs must each have at least one lr")
        if not 0 < self.sweep_frac <= 1 or not 0 < self.short_frac <= 1:
            raise ValueError(f"Invalid sweep_frac={self.sweep_frac}, short_frac={self.short_frac}: must be in (0, 1]")
        if len(self.seeds) < 1:
            raise ValueError("Invalid seeds=(): need at least one seed")

    def steps(self, frac: float) -> int:
        return max(1, round(frac * self.base.steps))


def run_sweep(plan: SweepPlan, data: Any, *, progress: bool = False) -> dict[str, Any]:
    """Sweep, full runs, summary: everything JSON-ready (curves included)."""
    from muonkit_bench.train import train

    def run(**changes: Any) -> Any:
        config = dataclasses.replace(plan.base, **changes)
        logger.info(
            "%s lr=%s adamw_lr=%s steps=%d seed=%d state_dtype=%s per_head=%s",
            config.optimizer, config.lr, config.adamw_lr, config.steps, config.seed, config.state_dtype, config.per_head,
        )  # fmt: skip
        result = train(config, data, progress=progress)
        result.model = None  # keep memory flat across many runs
        return result

    short = plan.steps(plan.sweep_frac)
    seed0 = plan.seeds[0]
    adamw_sweep = {lr: run(optimizer="adamw", adamw_lr=lr, steps=short, seed=seed0) for lr in plan.adamw_lrs}
    best_adamw = _best(adamw_sweep)
    if plan.arms:
        return _run_arms(plan, run, adamw_sweep)
    muon_sweep = {
        lr: run(optimizer="muon", lr=lr, adamw_lr=best_adamw, steps=short, seed=seed0) for lr in plan.muon_lrs
    }
    best_muon = _best(muon_sweep)
    full: dict[str, list[Any]] = {arm: [] for arm in ARMS}
    for seed in plan.seeds:
        full["adamw"].append(run(optimizer="adamw", adamw_lr=best_adamw, seed=seed))
        full["muon"].append(run(optimizer="muon", lr=best_muon, adamw_lr=best_adamw, seed=seed))
        full["muon_short"].append(
            run(optimizer="muon", lr=best_muon, adamw_lr=best_adamw, seed=seed, steps=plan.steps(plan.short_frac))
        )
    return {
        "plan": _plan_record(plan, short_steps=plan.steps(plan.short_frac)),
        "sweep": {
            "adamw": {str(lr): _brief(r) for lr, r in adamw_sweep.items()},
            "muon": {str(lr): _brief(r) for lr, r in muon_sweep.items()},
            "best_adamw_lr": best_adamw,
            "best_muon_lr": best_muon,
        },
        "runs": {arm: [r.to_dict() for r in rs] for arm, rs in full.items()},
        "summary": summarize(full),
    }


def _best(results: dict[float, Any]) -> float:
    finals = {lr: r.final_val_loss for lr, r in results.items()}
    finite = {lr: v for lr, v in finals.items() if math.isfinite(v)}
    if not finite:
        raise RuntimeError(f"every run of the sweep diverged: {finals}")
    return min(finite, key=lambda lr: finite[lr])


def _brief(r: Any) -> dict[str, Any]:
    return {"final_val_loss": r.final_val_loss, "diverged": r.diverged, "wall_time_s": r.wall_time_s}


def _train_time(r: Any) -> float:
    return max(0.0, r.wall_time_s - r.eval_time_s)


def summarize(full: dict[str, list[Any]]) -> dict[str, Any]:
    """Final losses per arm, tokens and time to AdamW's mean final loss, step overhead."""
    arms = {arm: _arm_summary(rs) for arm, rs in full.items()}
    target = arms["adamw"]["final_val_loss"]["mean"]
    adamw_tokens = statistics.fmean(len(r.train_loss) * r.config.tokens_per_step for r in full["adamw"])
    adamw_time = statistics.fmean(_train_time(r) for r in full["adamw"])
    reach = _reach(full["muon"], target)
    reached = [x for x in reach if x["tokens"] is not None]
    tokens = statistics.fmean(x["tokens"] for x in reached) if len(reached) == len(reach) else None
    time_s = statistics.fmean(x["train_time_s"] for x in reached) if len(reached) == len(reach) else None
    short_finals = [r.final_val_loss for r in full["muon_short"]]
    return {
        "arms": arms,
        "target_val_loss": target,
        "adamw_tokens": adamw_tokens,
        "adamw_train_time_s": adamw_time,
        "muon_reach": reach,
        "muon_tokens_to_target": tokens,
        "token_ratio": None if not tokens else adamw_tokens / tokens,
        "muon_time_to_target_s": time_s,
        "time_ratio": None if not time_s else adamw_time / time_s,
        "short_reaches_target": [bool(v <= target) for v in short_finals],
        "short_minus_target": spread([v - target for v in short_finals]),
    }


def _reach(runs: list[Any], target: float) -> list[dict[str, Any]]:
    """Per run: the (interpolated) steps, tokens and training time to ``target`` (None: not reached)."""
    from muonkit_bench.compare import steps_to_reach

    reach = []
    for r in runs:
        s = steps_to_reach(r.eval_steps, r.val_loss, target=target) if math.isfinite(target) else None
        reach.append(
            {
                "seed": r.config.seed,
                "steps": s,
                "tokens": None if s is None else s * r.config.tokens_per_step,
                "train_time_s": None if s is None else s / len(r.train_loss) * _train_time(r),
            }
        )
    return reach


def _plan_record(plan: SweepPlan, **extra: Any) -> dict[str, Any]:
    """What a report records of its plan: the base config, the grids, the sweep's length, the seeds, and ``extra``."""
    return {
        "base": plan.base.to_dict(),
        "adamw_lrs": plan.adamw_lrs,
        "muon_lrs": plan.muon_lrs,
        "sweep_steps": plan.steps(plan.sweep_frac),
        "seeds": plan.seeds,
        **extra,
    }


def _run_arms(plan: SweepPlan, run: Any, adamw_sweep: dict[float, Any]) -> dict[str, Any]:
    """``--arms``: one AdamW baseline (already swept), each HybridMuon variant swept and run per seed."""
    short = plan.steps(plan.sweep_frac)
    best_adamw = _best(adamw_sweep)
    sweeps = {
        arm: {
            lr: run(optimizer="muon", lr=lr, adamw_lr=best_adamw, steps=short, seed=plan.seeds[0], **VARIANTS[arm])
            for lr in plan.muon_lrs
        }
        for arm in plan.arms
    }
    best = {arm: _best(results) for arm, results in sweeps.items()}
    full: dict[str, list[Any]] = {"adamw": [], **{arm: [] for arm in plan.arms}}
    for seed in plan.seeds:
        full["adamw"].append(run(optimizer="adamw", adamw_lr=best_adamw, seed=seed))
        for arm in plan.arms:
            full[arm].append(run(optimizer="muon", lr=best[arm], adamw_lr=best_adamw, seed=seed, **VARIANTS[arm]))
    return {
        "plan": _plan_record(plan, arms=plan.arms),
        "sweep": {
            "adamw": {str(lr): _brief(r) for lr, r in adamw_sweep.items()},
            "muon": {arm: {str(lr): _brief(r) for lr, r in results.items()} for arm, results in sweeps.items()},
            "best_adamw_lr": best_adamw,
            "best_muon_lr": best,
        },
        "runs": {arm: [r.to_dict() for r in rs] for arm, rs in full.items()},
        "summary": summarize_arms(full, plan.arms),
    }


def summarize_arms(full: dict[str, list[Any]], arms: tuple[str, ...]) -> dict[str, Any]:
    """Per variant: final losses, tokens to AdamW's mean final loss; paired (same seed)
    differences against the first variant, and whether each is inside the seed noise
    (``|mean| < 2 * std / sqrt(n)``, the standard error of the mean difference)."""
    target = spread([r.final_val_loss for r in full["adamw"]])["mean"]
    adamw_tokens = statistics.fmean(len(r.train_loss) * r.config.tokens_per_step for r in full["adamw"])
    out: dict[str, Any] = {"target_val_loss": target, "adamw_tokens": adamw_tokens, "arms": {}, "paired": {}}
    out["arms"]["adamw"] = _arm_summary(full["adamw"])
    reach = {arm: _reach(full[arm], target) for arm in arms}
    for arm in arms:
        tokens = [x["tokens"] for x in reach[arm]]
        all_reached = all(t is not None for t in tokens)
        out["arms"][arm] = {
            **_arm_summary(full[arm]),
            "variant": VARIANTS[arm],
            "reach": reach[arm],
            "tokens_to_target": spread(tokens) if all_reached else None,
            "token_ratio": adamw_tokens / statistics.fmean(tokens) if all_reached else None,
        }
    first = arms[0]
    for arm in arms[1:]:
        loss = [r.final_val_loss - r0.final_val_loss for r, r0 in zip(full[arm], full[first], strict=True)]
        tokens = [
            x["tokens"] - x0["tokens"]
            for x, x0 in zip(reach[arm], reach[first], strict=True)
            if x["tokens"] is not None and x0["tokens"] is not None
        ]
        out["paired"][arm] = {"vs": first, "final_val_loss": paired(loss), "tokens_to_target": paired(tokens)}
    return out


def paired(diffs: list[float]) -> dict[str, Any]:
    """Spread of paired differences, their standard error, and ``inside_noise``: ``|mean| < 2 se``
    (None with fewer than two finite pairs)."""
    s = spread(diffs)
    se = s["std"] / math.sqrt(s["n"]) if s["n"] > 1 else math.nan
    return {**s, "se": se, "inside_noise": bool(abs(s["mean"]) < 2 * se) if s["n"] > 1 else None}


def _arm_summary(results: list[Any]) -> dict[str, Any]:
    step_ms = [r.optimizer_step_ms for r in results]
    shares = [r.optimizer_time_s / _train_time(r) for r in results if _train_time(r) > 0]
    return {
        "final_val_loss": spread([r.final_val_loss for r in results]),
        "steps": len(results[0].train_loss) if results else 0,
        "tokens": results[0].config.tokens_per_step * results[0].config.steps if results else 0,
        "optimizer_step_ms": spread(step_ms),
        "optimizer_share_of_train_time": spread(shares),
        "train_time_s": spread([_train_time(r) for r in results]),
        "lr": results[0].config.lr if results else None,
        "adamw_lr": results[0].config.adamw_lr if results else None,
    }


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--sweep`` flags of ``muonkit bench nanogpt``."""
    group = parser.add_argument_group("sweep (muonkit_bench.sweep)")
    group.add_argument(
        "--sweep", nargs="?", const="cpu", choices=sorted(PRESETS),
        help="lr sweep + full runs (AdamW N, HybridMuon N and 0.74 N) over seeds; preset cpu (default), gpu or tiny",
    )  # fmt: skip
    group.add_argument("--seeds", help="comma-separated seeds of the full runs (default: the preset's)")
    group.add_argument("--adamw-lrs", help="comma-separated AdamW lrs to sweep (default: the preset's)")
    group.add_argument("--muon-lrs", help="comma-separated Muon lrs to sweep (default: the preset's)")
    group.add_argument(
        "--arms",
        help="compare HybridMuon variants against one AdamW baseline instead of the N / 0.74 N protocol: "
        f"comma-separated, two or more of {', '.join(VARIANTS)} (e.g. fp32,bf16,8bit or whole,per_head); "
        "each gets its own Muon lr sweep and a full run per seed at its best lr; paired differences are "
        "against the first",
    )


def plan_from_args(args: argparse.Namespace, *, vocab_size: int) -> SweepPlan:
    """The preset, with any size or run flag of ``muonkit bench nanogpt`` on top."""
    from muonkit_bench.model import GPTConfig
    from muonkit_bench.train import RunConfig, autocast_choice

    preset = PRESETS[args.sweep]
    model = dict(preset["model"])
    for name in ("block_size", "n_layer", "n_head", "n_embd"):
        if getattr(args, name, None) is not None:
            model[name] = getattr(args, name)
    run = dict(preset["run"])
    for name in ("steps", "batch_size", "eval_interval", "eval_batches", "device", "threads", "grad_clip"):
        if getattr(args, name, None) is not None:
            run[name] = getattr(args, name)
    run["autocast"] = autocast_choice(args)
    for name in ("split_qkv", "per_head", "state_dtype"):  # the variant flags; --arms sets them per arm
        if getattr(args, name, None):
            run[name] = getattr(args, name)
    base = RunConfig(model=GPTConfig(vocab_size=vocab_size, **model), **run)

    def floats(text: str | None, default: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split(",")) if text else default

    seeds = tuple(int(s) for s in args.seeds.split(",")) if getattr(args, "seeds", None) else preset["seeds"]
    return SweepPlan(
        base=base,
        adamw_lrs=floats(getattr(args, "adamw_lrs", None), preset["adamw_lrs"]),
        muon_lrs=floats(getattr(args, "muon_lrs", None), preset["muon_lrs"]),
        sweep_frac=preset["sweep_frac"],
        seeds=seeds,
        arms=tuple(a.strip() for a in args.arms.split(",")) if getattr(args, "arms", None) else (),
    )


def main(args: argparse.Namespace) -> int:
    import time

    from muonkit_bench.data import load_corpus
    from muonkit_bench.environment import environment
    from muonkit_bench.sweep_report import finite_json, format_arms, format_summary, plot_arms, plot_sweep

    vocab = getattr(args, "vocab_size", None) or PRESETS[args.sweep]["vocab_size"]
    corpus = load_corpus(vocab_size=vocab, cache_dir=getattr(args, "cache_dir", None))
    plan = plan_from_args(args, vocab_size=corpus.vocab_size)
    start = time.perf_counter()
    report = run_sweep(plan, corpus, progress=not getattr(args, "no_progress", False))
    report.update(
        preset=args.sweep,
        total_time_s=time.perf_counter() - start,
        corpus={k: corpus.meta[k] for k in corpus.meta if k != "train_plays"},
        environment=environment(),
    )
    print(format_arms(report) if plan.arms else format_summary(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(finite_json(report), indent=2, default=str))
    if not getattr(args, "no_plot", False):
        (plot_arms if plan.arms else plot_sweep)(report, out / "sweep.png")
    print(f"\nwrote {out / 'sweep.json'}" + ("" if getattr(args, "no_plot", False) else f" and {out / 'sweep.png'}"))
    return 0
