"""``muonkit bench qk-clip``: the benchmark GPT trained with Muon at a high lr, with and without QK-Clip.

Muon at a high learning rate, with no weight decay and no QK norm, grows the query and key weights
of some heads until their attention logits reach the hundreds or thousands (the failure Kimi K2's
MuonClip fixes, arXiv 2507.20534). This benchmark trains the same seeded GPT twice on the same
batches, once plain and once with :class:`muonkit.QKClip` attached to the optimizer, records
every step's largest attention logit (over all layers and heads) and the validation loss, prints
a table, and writes ``qk_clip.json`` and ``qk_clip.png`` to ``--out``.

    muonkit bench qk-clip                             # the default preset (~50 s of CPU time per arm)
    muonkit bench qk-clip --preset tiny               # seconds; the CLI test starts from it
    muonkit bench qk-clip --lr 0.2 --threshold 30 --seeds 0 1 --out runs/qk

The logits are measured the same way in both arms, by a forward hook on every attention layer's
``c_attn`` (:class:`LogitMeter`), not by the QKClip under test: the clip arm's maxima are the
ones QK-Clip acted on, the plain arm's what it would have seen. A step's maximum comes from that
step's forward pass, before its optimizer update; in the clip arm the weights it ran with were
clipped after the previous step, so it can exceed the threshold by one update's growth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from muonkit_bench.data import Corpus
    from muonkit_bench.train import RunConfig, RunResult

HELP = "train the benchmark GPT with Muon at a high lr with and without QK-Clip; max attention logit and val loss"
logger = logging.getLogger(__name__)

# Each preset: the corpus vocabulary, GPTConfig / RunConfig fields on top of their defaults, and
# QKClip options on top of its defaults (threshold 100, alpha 0.5). Flags override them.
# "default": without the clip the largest logit passes 700 within 200 steps at lr 0.1 (lr 0.05
# reaches ~240 in 300 steps, lr 0.2 ~5900 in 200 with a worse loss).
PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "vocab_size": 512,
        "model": {"block_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 128},
        "run": {"steps": 200, "batch_size": 16, "eval_interval": 25, "eval_batches": 4, "lr": 0.1},
        "qk_clip": {},
    },
    "tiny": {
        "vocab_size": 512,
        "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "run": {"steps": 30, "batch_size": 8, "eval_interval": 10, "eval_batches": 2, "lr": 0.1},
        "qk_clip": {"threshold": 2.0},
    },
}
_RUN_FLAGS = (
    "steps",
    "batch_size",
    "eval_interval",
    "eval_batches",
    "lr",
    "adamw_lr",
    "weight_decay",
    "threads",
    "device",
)
ARMS = ("no clip", "QK-Clip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from muonkit_bench.nanogpt import add_run_arguments

    add_run_arguments(parser, presets=list(PRESETS), default="default", out="runs/qk-clip")
    hyper = parser.add_argument_group("hyperparameters (default: the preset's, then RunConfig's)")
    hyper.add_argument("--lr", type=float, help="Muon lr (Keller shape scaling)")
    hyper.add_argument("--adamw-lr", type=float, help="lr of the AdamW groups (embeddings, head, norms)")
    hyper.add_argument("--weight-decay", type=float, help="Muon weight decay (default 0: nothing holds q/k back)")
    hyper.add_argument("--threshold", type=float, help="QK-Clip's tau, the largest logit allowed (QKClip's default)")
    hyper.add_argument("--alpha", type=float, help="QK-Clip's query share of the factor (QKClip's default)")
    hyper.add_argument(
        "--per-head", action="store_true", help="orthogonalize attention per head (param_groups(per_head=True))"
    )
    run = parser.add_argument_group("run")
    run.add_argument("--seeds", type=int, nargs="+", default=[0], help="one pair of runs per seed (default: 0)")
    run.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    run.add_argument("--device", help="cpu (default) or cuda")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--no-plot", action="store_true", help="skip the PNG")


@dataclass
class LogitTrace:
    """The attention-logit maxima of every step of one run.

    ``max_logit[i]`` is the largest logit of step ``i + 1``'s forward pass over every layer and
    head, ``layer_max_logit[layer][i]`` the largest of that layer; ``clipped_heads[i]`` how many
    heads QK-Clip rescaled right after that step (always 0 without QK-Clip).
    """

    max_logit: list[float] = field(default_factory=list)
    layer_max_logit: dict[str, list[float]] = field(default_factory=dict)
    clipped_heads: list[int] = field(default_factory=list)

    def record(self, maxima: dict[str, Tensor], clipped: int) -> None:
        """Append one step: per layer the per-head maxima, and the heads clipped after it."""
        for layer, heads in maxima.items():
            self.layer_max_logit.setdefault(layer, []).append(float(heads.max()))
        self.max_logit.append(max((float(h.max()) for h in maxima.values()), default=-math.inf))
        self.clipped_heads.append(clipped)


@dataclass
class ArmResult:
    """One arm of one seed: the training run and its :class:`LogitTrace`."""

    name: str
    seed: int
    qk_clip: dict[str, float] | None
    """The QKClip's threshold and alpha; None for the plain arm."""
    run: RunResult
    trace: LogitTrace

    @property
    def clip(self) -> bool:
        return self.qk_clip is not None

    @property
    def max_logit(self) -> list[float]:
        return self.trace.max_logit

    @property
    def peak_max_logit(self) -> float:
        return max(self.max_logit, default=math.nan)

    @property
    def steps_clipped(self) -> int:
        return sum(1 for c in self.trace.clipped_heads if c)

    @property
    def first_clip_step(self) -> int | None:
        """The 1-based step after which QK-Clip first rescaled a head (None: never)."""
        return next((i + 1 for i, c in enumerate(self.trace.clipped_heads) if c), None)

    @property
    def peak_after_first_clip(self) -> float | None:
        """The largest logit of the steps that ran on clipped weights (None: none did)."""
        first = self.first_clip_step
        return None if first is None or first >= len(self.max_logit) else max(self.max_logit[first:])

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "qk_clip": self.qk_clip,
            **dataclasses.asdict(self.trace),
            "peak_max_logit": self.peak_max_logit,
            "final_max_logit": self.max_logit[-1] if self.max_logit else None,
            "steps_clipped": self.steps_clipped,
            "first_clip_step": self.first_clip_step,
            "peak_after_first_clip": self.peak_after_first_clip,
            "run": {k: v for k, v in self.run.to_dict().items() if k != "config"},
        }


class LogitMeter:
    """Each attention layer's per-head largest logit ``q . k / sqrt(d)`` over training forward passes.

    A forward hook on every :class:`~muonkit_bench.model.CausalSelfAttention`'s ``c_attn`` splits
    its output into queries and keys and takes :func:`muonkit.functional.qk_clip.max_attention_logits`
    (causal, fp32). Modules in eval mode are not measured. :meth:`collect` returns the maxima since
    the last call and starts over.
    """

    def __init__(self, model: nn.Module) -> None:
        from muonkit_bench.model import CausalSelfAttention

        self._current: dict[str, Tensor] = {}
        self._handles = [
            module.c_attn.register_forward_hook(partial(self._observe, name, module.n_head))
            for name, module in model.named_modules()
            if isinstance(module, CausalSelfAttention)
        ]
        if not self._handles:
            raise ValueError("LogitMeter found no CausalSelfAttention in the model (it measures the benchmark GPT)")

    def _observe(self, name: str, heads: int, module: nn.Module, inputs: Any, output: Tensor) -> None:
        from muonkit.functional.qk_clip import max_attention_logits

        if not module.training:
            return
        batch, time_, width = output.shape
        channels = width // 3
        query, key = (
            t.view(batch, time_, heads, channels // heads).transpose(1, 2) for t in output.split(channels, 2)[:2]
        )
        found = max_attention_logits(query, key, scale=(channels // heads) ** -0.5, causal=True)
        seen = self._current.get(name)
        self._current[name] = found if seen is None else torch.maximum(seen, found)

    def collect(self) -> dict[str, Tensor]:
        """Layer name -> per-head maxima (float32, CPU) since the last call."""
        current, self._current = self._current, {}
        return {name: heads.cpu() for name, heads in current.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def run_arm(
    config: RunConfig, data: Corpus, *, qk_clip: Mapping[str, float] | None, progress: bool = True
) -> ArmResult:
    """Train a fresh ``GPT(config.model)`` seeded with ``config.seed``, plain or with ``QKClip(**qk_clip)``."""
    from muonkit import QKClip
    from muonkit_bench.model import GPT
    from muonkit_bench.train import train

    torch.manual_seed(config.seed)
    model = GPT(config.model)
    meter = LogitMeter(model)
    trace = LogitTrace()
    used: dict[str, float] = {}

    def on_optimizer(optimizer: torch.optim.Optimizer) -> None:
        # QK-Clip's post-step hook first, so the recording hook sees what it just clipped.
        qk = None if qk_clip is None else QKClip(model, optimizer, **qk_clip)
        if qk is not None:
            used.update(threshold=qk.threshold, alpha=qk.alpha)
        optimizer.register_step_post_hook(
            lambda *_: trace.record(meter.collect(), qk.last_clipped_heads if qk is not None else 0)
        )

    run = train(config, data, model=model, progress=progress, on_optimizer=on_optimizer)
    meter.remove()
    name = ARMS[qk_clip is not None]
    return ArmResult(name=name, seed=config.seed, qk_clip=None if qk_clip is None else used, run=run, trace=trace)


def build_configs(args: argparse.Namespace) -> tuple[dict[str, Any], RunConfig, dict[str, float]]:
    """(corpus kwargs, base RunConfig, QKClip options) from the preset and the flags."""
    from muonkit_bench.model import GPTConfig
    from muonkit_bench.nanogpt import MODEL_FLAGS
    from muonkit_bench.train import RunConfig

    preset = PRESETS[args.preset]
    corpus = {"vocab_size": args.vocab_size or preset["vocab_size"], "cache_dir": args.cache_dir}
    model = {**preset["model"], **{k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None}}
    run = {**preset["run"], **{k: getattr(args, k) for k in _RUN_FLAGS if getattr(args, k) is not None}}
    qk_clip = {
        **preset["qk_clip"],
        **{k: getattr(args, k) for k in ("threshold", "alpha") if getattr(args, k) is not None},
    }
    if getattr(args, "per_head", False):
        run["per_head"] = True
    config = RunConfig(model=GPTConfig(vocab_size=corpus["vocab_size"], **model), optimizer="muon", **run)
    return corpus, config, qk_clip


def main(args: argparse.Namespace) -> int:
    from muonkit_bench.data import load_corpus
    from muonkit_bench.nanogpt import _finite

    corpus_kwargs, base, qk_clip = build_configs(args)
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"Invalid --seeds {args.seeds}: each seed once")
    corpus = load_corpus(**corpus_kwargs)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, vocab_size=corpus.vocab_size))
    start = time.perf_counter()
    arms: list[ArmResult] = []
    for seed in args.seeds:
        config = dataclasses.replace(base, seed=seed)
        # The clip arm first: QKClip checks threshold and alpha before any training happens.
        clipped = run_arm(config, corpus, qk_clip=qk_clip, progress=not args.no_progress)
        arms += [run_arm(config, corpus, qk_clip=None, progress=not args.no_progress), clipped]
    used = next(a.qk_clip for a in arms if a.qk_clip is not None)  # the same options in every seed
    threshold = used["threshold"]
    print(format_table(arms, threshold=threshold))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = _report(args, base, used, arms, corpus.meta, time.perf_counter() - start)
    (out / "qk_clip.json").write_text(json.dumps(_finite(report), indent=2))
    if not args.no_plot:
        plot(arms, threshold=threshold, path=out / "qk_clip.png")
    print(f"\nwrote {out / 'qk_clip.json'}" + ("" if args.no_plot else f" and {out / 'qk_clip.png'}"))
    return 0


def format_table(arms: list[ArmResult], *, threshold: float) -> str:
    """One row per arm and seed, then the largest logit at a few steps of each arm."""
    header = ("seed", "arm", "peak logit", "final logit", "steps clipped", "final val loss", "best val loss", "wall s")
    rows = [header] + [
        (
            str(a.seed), a.name, f"{a.peak_max_logit:.1f}", f"{a.max_logit[-1]:.1f}" if a.max_logit else "-",
            f"{a.steps_clipped}/{len(a.max_logit)}", f"{a.run.final_val_loss:.4f}", f"{min(a.run.val_loss):.4f}",
            f"{a.run.wall_time_s:.0f}",
        )
        for a in arms
    ]  # fmt: skip
    lines = _columns(rows)
    steps = max(len(a.max_logit) for a in arms)
    marks = sorted({1, *(max(1, round(steps * f)) for f in (0.1, 0.25, 0.5, 0.75)), steps})
    trace = [("step", *(f"{a.name} s{a.seed}" for a in arms))] + [
        (str(s), *(f"{a.max_logit[s - 1]:.1f}" if s <= len(a.max_logit) else "-" for a in arms)) for s in marks
    ]
    lines += ["", f"largest attention logit per step (threshold {threshold:g}):", *_columns(trace)]
    for a in arms:
        if a.clip and a.peak_after_first_clip is not None:
            lines.append(
                f"seed {a.seed}: QK-Clip first clipped after step {a.first_clip_step}; largest logit after it "
                f"{a.peak_after_first_clip:.1f} (each step's forward runs one update after the last clip)"
            )
    return "\n".join(lines)


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def plot(arms: list[ArmResult], *, threshold: float, path: str | Path) -> None:
    """Largest logit per step (log scale, the threshold dashed) above the loss curves, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    from muonkit_bench.compare import smooth

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), dpi=120, sharex=True)
    colors = {"no clip": "tab:red", "QK-Clip": "tab:blue"}
    styles = ("-", "--", ":", "-.")
    for a in arms:
        color, ls = colors[a.name], styles[a.seed % len(styles)] if len(arms) > 2 else "-"
        label = f"{a.name}" + (f" seed {a.seed}" if len(arms) > 2 else "")
        steps = range(1, len(a.max_logit) + 1)
        top.plot(steps, a.max_logit, ls, color=color, lw=1.2, label=label)
        bottom.plot(
            steps, smooth(a.run.train_loss), ls, color=color, alpha=0.4, lw=1, label=f"{label} train (smoothed)"
        )
        bottom.plot(a.run.eval_steps, a.run.val_loss, "o" + ls, color=color, ms=3, lw=1.6, label=f"{label} val")
    top.axhline(threshold, color="gray", ls="--", lw=0.8, label=f"threshold {threshold:g}")
    top.set_yscale("log")
    top.set_ylabel("largest attention logit (all layers, heads)")
    top.set_title("muonkit bench qk-clip: Muon at a high lr, with and without QK-Clip")
    shown = [v for a in arms for v in (*a.run.val_loss, *smooth(a.run.train_loss)) if math.isfinite(v)]
    if shown:  # the first evaluation sits near ln(vocab); zoom on the part that tells the arms apart
        low = min(shown)
        bottom.set_ylim(low - 0.05, low + max(1.0, 0.4 * (max(shown) - low)))
    bottom.set_xlabel("step")
    bottom.set_ylabel("cross-entropy loss (nats/token)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _report(
    args: argparse.Namespace,
    base: RunConfig,
    qk_clip: dict[str, float],
    arms: list[ArmResult],
    corpus_meta: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    from muonkit_bench.environment import environment
    from muonkit_bench.nanogpt import _cpu_model, _git_commit

    return {
        "benchmark": "qk-clip",
        "command": " ".join(["muonkit", *sys.argv[1:]]) if sys.argv and "muonkit" in sys.argv[0] else None,
        "preset": args.preset,
        "qk_clip": qk_clip,
        "seeds": list(args.seeds),
        "config": {k: v for k, v in base.to_dict().items() if k not in ("optimizer", "seed")},
        "arms": [a.to_dict() for a in arms],
        "corpus": {k: v for k, v in corpus_meta.items() if k != "train_plays"},
        "wall_time_s": wall_s,
        "environment": {**environment(), "cpu_model": _cpu_model(), "git_commit": _git_commit()},
        "note": "the machine may be shared with other jobs (see load_average), so times are indicative",
    }
