"""Comparing two training runs: where one reaches the other's final loss, a table, a plot.

The headline number of the NanoGPT claims is not wall-clock but *tokens*: how many training
tokens the Muon run needed to reach the AdamW run's final validation loss. We read it off Muon's
validation curve by linear interpolation between the two evaluations around the crossing::

    target = adamw.val_loss[-1]
    j      = first eval with muon.val_loss[j] <= target
    step   = s[j-1] + (s[j] - s[j-1]) * (v[j-1] - target) / (v[j-1] - v[j])

Example::

    >>> steps_to_reach([0, 100, 200], [5.0, 4.0, 3.0], target=3.5)
    150.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muonkit_bench.train import RunResult

__all__ = ["Comparison", "compare", "format_table", "plot_curves", "smooth", "steps_to_reach"]


def steps_to_reach(steps: Sequence[float], losses: Sequence[float], *, target: float) -> float | None:
    """First (interpolated) step at which ``losses`` falls to ``target``; None if it never does."""
    if len(steps) != len(losses):
        raise ValueError(f"steps and losses differ in length: {len(steps)} vs {len(losses)}")
    for j, (s, v) in enumerate(zip(steps, losses, strict=True)):
        if not math.isfinite(v) or v > target:
            continue
        if j == 0 or not math.isfinite(losses[j - 1]) or losses[j - 1] == v:
            return float(s)
        s0, v0 = steps[j - 1], losses[j - 1]
        return float(s0 + (s - s0) * (v0 - target) / (v0 - v))
    return None


@dataclass(frozen=True)
class Comparison:
    """HybridMuon against the AdamW baseline, from one pair of runs."""

    adamw_final_val_loss: float
    muon_final_val_loss: float
    steps: int
    tokens_per_step: int
    muon_steps_to_adamw_loss: float | None
    """Steps Muon needed to reach AdamW's final val loss (interpolated); None: not reached."""

    @property
    def muon_tokens_to_adamw_loss(self) -> float | None:
        s = self.muon_steps_to_adamw_loss
        return None if s is None else s * self.tokens_per_step

    @property
    def token_ratio(self) -> float | None:
        """AdamW's tokens / Muon's tokens to the same loss (> 1: Muon needed fewer)."""
        s = self.muon_steps_to_adamw_loss
        return None if s is None or s <= 0 else self.steps / s

    def to_dict(self) -> dict[str, Any]:
        return {
            "adamw_final_val_loss": self.adamw_final_val_loss,
            "muon_final_val_loss": self.muon_final_val_loss,
            "steps": self.steps,
            "tokens": self.steps * self.tokens_per_step,
            "muon_steps_to_adamw_loss": self.muon_steps_to_adamw_loss,
            "muon_tokens_to_adamw_loss": self.muon_tokens_to_adamw_loss,
            "token_ratio": self.token_ratio,
        }


def compare(adamw: RunResult, muon: RunResult) -> Comparison:
    """Compare two runs of the same length on the same data."""
    target = adamw.final_val_loss
    reached = steps_to_reach(muon.eval_steps, muon.val_loss, target=target) if math.isfinite(target) else None
    return Comparison(
        adamw_final_val_loss=target,
        muon_final_val_loss=muon.final_val_loss,
        steps=len(adamw.train_loss),
        tokens_per_step=adamw.config.tokens_per_step,
        muon_steps_to_adamw_loss=reached,
    )


def format_table(results: dict[str, RunResult], comparison: Comparison) -> str:
    """The report printed by ``muonkit bench nanogpt``: one row per optimizer, ratios below."""
    header = (
        "optimizer",
        "final val",
        "steps to AdamW's loss",
        "tokens to AdamW's loss",
        "wall s",
        "cpu s",
        "opt ms/step",
        "opt state",
    )
    rows = [header]
    for name, r in results.items():
        if r.config.optimizer == "muon":
            s, t = comparison.muon_steps_to_adamw_loss, comparison.muon_tokens_to_adamw_loss
            reach = ("not reached", "not reached") if s is None or t is None else (f"{s:,.0f}", f"{t / 1e6:.2f}M")
        else:
            reach = (f"{len(r.train_loss):,}", f"{len(r.train_loss) * r.config.tokens_per_step / 1e6:.2f}M")
        rows.append((
            name, f"{r.final_val_loss:.4f}", *reach, f"{r.wall_time_s:.0f}", f"{r.cpu_time_s:.0f}", f"{r.optimizer_step_ms:.1f}",
            f"{r.optimizer_state_bytes / 2**20:.2f} MiB",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines += _ratios(results, comparison)
    return "\n".join(lines)


def _ratios(results: dict[str, RunResult], comparison: Comparison) -> list[str]:
    adamw, muon = (next(r for r in results.values() if r.config.optimizer == o) for o in ("adamw", "muon"))
    ratio = comparison.token_ratio
    reach = (
        "did not reach AdamW's final val loss"
        if ratio is None
        else f"reached AdamW's final val loss with {ratio:.2f}x fewer tokens"
    )
    return [
        f"HybridMuon {reach} (one seed; interpolated between evaluations every {muon.config.eval_interval} steps)",
        f"final val loss: HybridMuon - AdamW = {comparison.muon_final_val_loss - comparison.adamw_final_val_loss:+.4f}",
        f"wall time: HybridMuon / AdamW = {muon.wall_time_s / adamw.wall_time_s:.2f}x; "
        f"optimizer step: {muon.optimizer_step_ms / adamw.optimizer_step_ms:.2f}x",
        f"optimizer state: HybridMuon / AdamW = {muon.optimizer_state_bytes / max(adamw.optimizer_state_bytes, 1):.2f}x "
        f"(Muon fraction f = {muon.muon_params / max(muon.num_params, 1):.3f})",
    ]


def smooth(values: Sequence[float], *, beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (the usual training-curve smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot_curves(results: dict[str, RunResult], comparison: Comparison, path: str | Path) -> None:
    """Train loss (smoothed, thin) and val loss (markers) of each run against tokens, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for (name, r), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False):
        tokens_m = [t / 1e6 for t in r.tokens]
        ax.plot(tokens_m, smooth(r.train_loss), color=color, alpha=0.45, lw=1, label=f"{name} train (smoothed)")
        ax.plot([t / 1e6 for t in r.eval_tokens], r.val_loss, "o-", color=color, ms=3, lw=1.8, label=f"{name} val")
    if math.isfinite(comparison.adamw_final_val_loss):
        ax.axhline(comparison.adamw_final_val_loss, color="gray", ls="--", lw=0.8, label="AdamW final val")
    reached = comparison.muon_tokens_to_adamw_loss
    if reached is not None:
        ax.axvline(reached / 1e6, color="gray", ls=":", lw=0.8, label="HybridMuon reaches it")
    shown = [v for r in results.values() for v in (*r.val_loss, *smooth(r.train_loss)) if math.isfinite(v)]
    if shown:  # the first evaluations sit near ln(vocab); zoom on the part that tells runs apart
        low = min(shown)
        ax.set_ylim(low - 0.05, low + max(1.5, 0.5 * (max(shown) - low)))
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title("muonkit bench nanogpt: AdamW vs HybridMuon, same data and steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
