"""Summary statistics and the printed table of ``muonkit bench finetune``."""

from __future__ import annotations

from typing import Any

from muonkit_bench.stats import binomial_half_width, t_interval

NAMES = {"adamw": "AdamW", "muon": "HybridMuon"}


def _cell(runs: list[dict[str, Any]], n_test: int) -> dict[str, Any]:
    ci = t_interval([r["accuracy"] for r in runs])
    return {**ci, "binomial_half_width": binomial_half_width(ci["mean"], n_test), "n_test": n_test}


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """t-interval of ``b - a`` over the seeds both have (same seed: same head init and batch order)."""
    by_seed = {r["seed"]: r["accuracy"] for r in a}
    return t_interval([r["accuracy"] - by_seed[r["seed"]] for r in b if r["seed"] in by_seed])


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "gpt" in report:
        gpt = {}
        for task, t in report["gpt"]["tasks"].items():
            cells = {key: _cell(runs, t["n_test"]) for key, runs in t["cells"].items()}
            paired = {pre: _paired(t["cells"][f"{pre}/adamw"], t["cells"][f"{pre}/muon"]) for pre in ("adamw", "muon")}
            gpt[task] = {"cells": cells, "muon_minus_adamw_finetune": paired}
        out["gpt"] = gpt
    if "minilm" in report:
        minilm = {}
        for task, t in report["minilm"].items():
            cells = {opt: _cell(runs, t["n_test"]) for opt, runs in t["cells"].items()}
            minilm[task] = {"cells": cells, "muon_minus_adamw": _paired(t["cells"]["adamw"], t["cells"]["muon"])}
        out["minilm"] = minilm
    return out


def _acc(c: dict[str, Any]) -> str:
    half = c["half_width"]
    ci = "   n/a" if half != half else f"{half:6.3f}"  # NaN with one seed
    return f"{c['mean']:.3f} ± {ci} [{c['min']:.3f}, {c['max']:.3f}]  ±{c['binomial_half_width']:.3f}"


def _diff(d: dict[str, Any]) -> str:
    half = d["half_width"]
    return f"{d['mean']:+.3f}" + ("" if half != half else f" ± {half:.3f}")


def format_report(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = []
    if "gpt" in s:
        pre = report["gpt"]["pretrain"]
        lines.append(
            "pretraining (one run each): final val loss "
            + ", ".join(f"{NAMES[k]} {v['final_val_loss']:.4f} ({v['wall_time_s']:.0f} s)" for k, v in pre.items())
        )
        lines.append(
            "GPT fine-tuning: test accuracy, mean ± 95% t-interval over seeds [min, max], ± test-set binomial noise"
        )
        lines.append(f"  {'task':<10} {'pretrained':<11} {'fine-tuned':<11} {'accuracy':<44} {'n test':>6}")
        for task, t in s["gpt"].items():
            for key, c in t["cells"].items():
                p, f = key.split("/")
                lines.append(f"  {task:<10} {NAMES[p]:<11} {NAMES[f]:<11} {_acc(c):<44} {c['n_test']:>6}")
            for p, d in t["muon_minus_adamw_finetune"].items():
                lines.append(f"  {task:<10} {NAMES[p]:<11} HybridMuon - AdamW fine-tune (paired): {_diff(d)}")
    if "minilm" in s:
        lines.append("MiniLM (all-MiniLM-L6-v2, transformers.Trainer): test accuracy")
        for task, t in s["minilm"].items():
            for opt, c in t["cells"].items():
                lines.append(f"  {task:<10} {NAMES[opt]:<11} {_acc(c):<44} {c['n_test']:>6}")
            lines.append(f"  {task:<10} HybridMuon - AdamW (paired): {_diff(t['muon_minus_adamw'])}")
    lines.append(f"total time {report['total_time_s']:.0f} s")
    return "\n".join(lines)
