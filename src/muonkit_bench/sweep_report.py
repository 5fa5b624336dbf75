"""The printed table and the plot of ``muonkit bench nanogpt --sweep`` (see :mod:`muonkit_bench.sweep`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

ARM_NAMES = {"adamw": "AdamW, N", "muon": "HybridMuon, N", "muon_short": "HybridMuon, 0.74 N"}
COLORS = {"adamw": "tab:blue", "muon": "tab:orange", "muon_short": "tab:green"}


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (strict JSON), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _pm(s: dict[str, Any], digits: int = 4) -> str:
    if not s["n"]:
        return "diverged"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def format_summary(report: dict[str, Any]) -> str:
    plan, sweep, summary = report["plan"], report["sweep"], report["summary"]
    lines = [f"lr sweep at {plan['sweep_steps']} steps (seed {plan['seeds'][0]}), final val loss:"]
    for name, key in (("AdamW lr", "adamw"), ("Muon lr", "muon")):
        cells = "  ".join(f"{lr}: {_loss(r['final_val_loss'])}" for lr, r in sweep[key].items())
        lines.append(f"  {name:<9} {cells}")
    lines.append(
        f"  best: AdamW lr {sweep['best_adamw_lr']}, Muon lr {sweep['best_muon_lr']} (AdamW groups at AdamW's)"
    )
    for name, key, best in (("AdamW", "adamw", sweep["best_adamw_lr"]), ("Muon", "muon", sweep["best_muon_lr"])):
        grid = sorted(float(lr) for lr in sweep[key])
        if len(grid) > 1 and best in (grid[0], grid[-1]):
            lines.append(f"  NOTE: the best {name} lr {best} is at the edge of the grid {grid}: widen it to be sure")
    lines += [
        "",
        f"full runs, seeds {list(plan['seeds'])} (mean ± sample std [min, max]):",
        f"  {'arm':<20} {'steps':>6} {'final val loss':<38} {'opt step ms':>12} {'opt share':>10} {'train s':>9}",
    ]
    for arm, s in summary["arms"].items():
        lines.append(
            f"  {ARM_NAMES[arm]:<20} {s['steps']:>6} {_pm(s['final_val_loss']):<38} "
            f"{s['optimizer_step_ms']['mean']:>12.1f} {s['optimizer_share_of_train_time']['mean']:>10.1%} "
            f"{s['train_time_s']['mean']:>9.0f}"
        )
    lines += ["", f"AdamW's mean final val loss (the target): {summary['target_val_loss']:.4f}"]
    if summary["muon_tokens_to_target"] is None:
        lines.append("  HybridMuon at N did not reach it in every seed (no token ratio).")
    else:
        lines.append(
            f"  HybridMuon at N reaches it after {summary['muon_tokens_to_target']:,.0f} tokens "
            f"vs AdamW's {summary['adamw_tokens']:,.0f}: {summary['token_ratio']:.2f}x fewer tokens; "
            f"wall-clock (training only) {summary['time_ratio']:.2f}x"
        )
    short = summary["short_minus_target"]
    reached = sum(summary["short_reaches_target"])
    lines.append(
        f"  HybridMuon at 0.74 N: final minus target {short['mean']:+.4f} ± {short['std']:.4f}; "
        f"reaches the target in {reached}/{len(summary['short_reaches_target'])} seeds"
    )
    return "\n".join(lines)


def _loss(v: float | None) -> str:
    return "div" if v is None or not math.isfinite(v) else f"{v:.4f}"


def plot_sweep(report: dict[str, Any], path: str | Path) -> None:
    """Left: final val loss against lr (the sweep). Right: val loss against tokens (the full runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    sweep = report["sweep"]
    curves = [(sweep["adamw"], "AdamW (lr)", "tab:blue"), (sweep["muon"], "HybridMuon (Muon lr)", "tab:orange")]
    _sweep_curves(left, curves, report, xlabel="learning rate", title="lr sweep (seed 0)")
    _full_runs(right, report, color=COLORS.__getitem__, name=ARM_NAMES.__getitem__, lw=1.4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _sweep_curves(
    left: Any, curves: list[tuple[dict[str, Any], str, str]], report: dict[str, Any], *, xlabel: str, title: str
) -> None:
    """The left panel: each ``(results by lr, label, color)`` curve's final val loss against the lr
    (diverged runs left out)."""
    for results, label, color in curves:
        points = [(float(lr), r["final_val_loss"]) for lr, r in results.items()]
        points = [(lr, v) for lr, v in points if v is not None and math.isfinite(v)]
        if points:
            left.plot(*zip(*points, strict=True), "o-", color=color, label=label)
    left.set_xscale("log")
    left.set_xlabel(xlabel)
    left.set_ylabel(f"final val loss after {report['plan']['sweep_steps']} steps")
    left.set_title(title)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)


def _full_runs(right: Any, report: dict[str, Any], *, color: Any, name: Any, lw: float) -> None:
    """The right panel: every full run's validation curve against tokens (``color(arm)``, ``name(arm)``)
    and AdamW's mean final loss."""
    finals = []
    for arm, runs in report["runs"].items():
        for i, r in enumerate(runs):
            vals = [v if v is not None and math.isfinite(v) else math.nan for v in r["val_loss"]]
            finals += [v for v in vals[1:] if math.isfinite(v)]
            right.plot(
                [t / 1e6 for t in r["eval_tokens"]], vals, "-", color=color(arm), lw=lw, alpha=0.8,
                label=name(arm) if i == 0 else None,
            )  # fmt: skip
    target = report["summary"]["target_val_loss"]
    if target is not None and math.isfinite(target):
        right.axhline(target, color="gray", ls="--", lw=0.8, label="AdamW mean final")
    if finals:
        low = min(finals)
        right.set_ylim(low - 0.05, low + max(1.0, 0.5 * (max(finals) - low)))
    right.set_xlabel("training tokens (millions)")
    right.set_ylabel("val loss (nats/token)")
    right.set_title("full runs, every seed")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)


def format_arms(report: dict[str, Any]) -> str:
    """The table of ``--sweep --arms``: each HybridMuon variant against one AdamW baseline."""
    plan, sweep, summary = report["plan"], report["sweep"], report["summary"]
    arms = list(plan["arms"])
    lines = [f"lr sweep at {plan['sweep_steps']} steps (seed {plan['seeds'][0]}), final val loss:"]
    rows = [("AdamW lr", sweep["adamw"], sweep["best_adamw_lr"])]
    rows += [(f"{arm} Muon lr", sweep["muon"][arm], sweep["best_muon_lr"][arm]) for arm in arms]
    for name, results, best in rows:
        cells = "  ".join(f"{lr}: {_loss(r['final_val_loss'])}" for lr, r in results.items())
        grid = sorted(float(lr) for lr in results)
        edge = (
            "  (best at the grid's edge: widen it to be sure)" if len(grid) > 1 and best in (grid[0], grid[-1]) else ""
        )
        lines.append(f"  {name:<16} {cells}   best {best}{edge}")
    lines += [
        "",
        f"full runs, seeds {list(plan['seeds'])} (mean ± sample std [min, max]); "
        f"target = AdamW's mean final val loss {summary['target_val_loss']:.4f}:",
        f"  {'arm':<20} {'lr':>8} {'final val loss':<38} {'tokens to target':<26} {'ratio':>6} {'opt step ms':>12}",
    ]
    for arm, s in summary["arms"].items():
        if arm == "adamw":
            name, lr, tokens, ratio = "AdamW", s["adamw_lr"], f"{summary['adamw_tokens']:,.0f} (all)", ""
        else:
            name, lr, t = f"HybridMuon {arm}", s["lr"], s["tokens_to_target"]
            tokens = "not reached in every seed" if t is None else f"{t['mean']:,.0f} ± {t['std']:,.0f}"
            ratio = "" if s["token_ratio"] is None else f"{s['token_ratio']:.2f}x"
        lines.append(
            f"  {name:<20} {lr:>8g} {_pm(s['final_val_loss']):<38} {tokens:<26} {ratio:>6} "
            f"{s['optimizer_step_ms']['mean']:>12.1f}"
        )
    if summary["paired"]:
        lines += ["", f"paired differences (same seed) against {arms[0]}; inside the noise: |mean| < 2 se:"]
    for arm, p in summary["paired"].items():
        for what, digits in (("final_val_loss", 4), ("tokens_to_target", 0)):
            d = p[what]
            if not d["n"]:
                lines.append(f"  {arm} - {arms[0]} {what}: no complete pairs")
                continue
            verdict = {True: "inside the noise", False: "outside the noise", None: "one pair: no noise estimate"}
            lines.append(
                f"  {arm} - {arms[0]} {what}: {d['mean']:+,.{digits}f} ± {d['std']:,.{digits}f} "
                f"(se {d['se']:,.{digits}f}, n {d['n']}): {verdict[d['inside_noise']]}"
            )
    return "\n".join(lines)


def plot_arms(report: dict[str, Any], path: str | Path) -> None:
    """``--arms``: left, each variant's Muon lr sweep; right, val loss against tokens, every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    arm_colors = {"adamw": "tab:blue", **dict(zip(report["plan"]["arms"], colors, strict=False))}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    curves = [(results, f"HybridMuon {arm}", arm_colors[arm]) for arm, results in report["sweep"]["muon"].items()]
    _sweep_curves(left, curves, report, xlabel="Muon learning rate", title="Muon lr sweep per variant (seed 0)")
    _full_runs(
        right, report, color=arm_colors.__getitem__, lw=1.2,
        name=lambda arm: "AdamW" if arm == "adamw" else f"HybridMuon {arm}",
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
