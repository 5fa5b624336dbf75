"""A small, reusable training loop for the benchmark GPT: AdamW or HybridMuon, same everything else.

Both optimizers get the same model initialization (seeded), the same batches in the same order
(a seeded generator), the same warmup-stable-decay schedule shape, the same gradient clipping and
the same fixed validation set. What differs is only the optimizer:

- ``"adamw"``: ``torch.optim.AdamW`` on every parameter; weight decay on the 2D matrices only
  (embeddings, head, hidden weights), none on norms and biases (the nanoGPT convention).
- ``"muon"``: :class:`muonkit.HybridMuon` with :func:`muonkit.param_groups` routing: hidden
  matrices on Muon (``lr``, ``weight_decay``, muonkit's defaults otherwise), everything else on
  AdamW with exactly the baseline's settings (``adamw_lr``, betas, eps, decay on 2D tensors).

Schedule (multiplier on every group's base lr, ``s`` = 0-based step, ``N`` steps)::

    warmup  s < W:          (s + 1) / W
    stable  W <= s < N - D: 1
    decay   s >= N - D:     (N - s) / D          (linear to 0 after the last step)

Example::

    from muonkit_bench.data import load_corpus
    from muonkit_bench.model import GPTConfig
    from muonkit_bench.train import RunConfig, train

    corpus = load_corpus(vocab_size=2048)
    result = train(RunConfig(model=GPTConfig(vocab_size=corpus.vocab_size), optimizer="muon", steps=200), corpus)
    print(result.final_val_loss, result.optimizer_time_s)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from muonkit.functional.orthogonalize import default_compute_dtype
from muonkit.functional.quantize import STATE_DTYPES
from muonkit_bench.model import GPT, GPTConfig

logger = logging.getLogger(__name__)

__all__ = [
    "Batch",
    "RunConfig",
    "RunResult",
    "TrainData",
    "autocast_choice",
    "build_optimizer",
    "evaluate",
    "lr_multiplier",
    "optimizer_state_bytes",
    "resolve_autocast",
    "train",
]

OptimizerName = Literal["adamw", "muon", "normuon"]
OPTIMIZERS: tuple[str, ...] = ("adamw", "muon", "normuon")
Batch = tuple[Tensor, Tensor]


class TrainData(Protocol):
    """What :func:`train` needs from a dataset (:class:`muonkit_bench.data.Corpus` is one)."""

    def batch(
        self, split: Literal["train", "val"], *, batch_size: int, block_size: int, generator: torch.Generator
    ) -> Batch: ...

    def eval_batches(self, *, batches: int, batch_size: int, block_size: int) -> list[Batch]: ...


@dataclass(frozen=True)
class RunConfig:
    """One training run. The defaults are ``muonkit bench nanogpt --preset demo``.

    The two learning rates come from short sweeps at the demo size (300 steps, BENCHMARKS.md):
    AdamW 1e-3 was the best of {5e-4, 1e-3, 2e-3, 4e-3}; Muon 0.01 and 0.02 tied, 0.04 was
    worse, and 0.02 is Keller's and muonkit's default. ``muonkit bench nanogpt --sweep`` tunes
    both properly, over seeds.

    Args:
        model: the GPT's shape (``vocab_size`` must match the data).
        optimizer: ``"adamw"`` (torch.optim.AdamW everywhere), ``"muon"`` (HybridMuon) or
            ``"normuon"`` (HybridMuon with NorMuon groups for the matrices, ``algorithm="normuon"``).
        lr: Muon lr (Keller scaling ``sqrt(max(1, rows/cols))``); used by ``"muon"`` only.
        normuon_lr: NorMuon's lr (Keller scaling, muonkit's NorMuon defaults ``beta2=0.95``,
            ``eps=1e-8``). Muon's 0.02: NorMuon keeps the orthogonalized update's Frobenius norm,
            so Muon's lr carries over, and on the tiny preset (seeds 0-1, lrs 0.0025-0.08) the
            two optimizers' best lrs coincided (BENCHMARKS.md).
        adamw_lr: the AdamW baseline's lr, and the lr of HybridMuon's AdamW groups.
        weight_decay: Muon groups' decoupled weight decay (muonkit's default 0).
        adamw_weight_decay: AdamW weight decay on 2D tensors (never on norms and biases).
        betas, adamw_eps: AdamW moments, for the baseline and HybridMuon's AdamW groups alike.
        momentum, ns_coefficients, adjust_lr, split_qkv: Muon settings (muonkit's defaults).
        per_head: attention projections orthogonalized per head (``param_groups(per_head=True)``).
        state_dtype: HybridMuon's optimizer state (Muon momentum, NorMuon row moments and its
            AdamW groups' moments): ``"fp32"``, ``"bf16"`` or ``"8bit"`` (issue 24). The
            ``"adamw"`` baseline is ``torch.optim.AdamW`` and always keeps fp32 state.
        steps, batch_size: optimizer steps and sequences per step (tokens/step = batch * block).
        warmup_frac, decay_frac: schedule fractions (see the module docstring).
        grad_clip: clip the global gradient norm to this before every step (None: no clipping).
        eval_interval, eval_batches: evaluate every ``eval_interval`` steps (and at 0 and the
            end) on ``eval_batches`` fixed validation batches of ``batch_size`` sequences.
        seed: seeds the model initialization and the batch order.
        autocast: ``"auto"`` (default: bf16 where bf16 matrix products are fast, else None; see
            :func:`resolve_autocast`), ``"bf16"`` (bf16 autocast for forward/backward; fp32 master
            weights and optimizer) or None (fp32 throughout).
        threads: ``torch.set_num_threads`` for the run (None: leave torch's setting).
        device: where to train (``"cpu"``, ``"cuda"``).
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    optimizer: OptimizerName = "muon"
    lr: float = 0.02
    normuon_lr: float = 0.02
    adamw_lr: float = 1e-3
    weight_decay: float = 0.0
    adamw_weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    momentum: float = 0.95
    ns_coefficients: str = "polar_express"
    adjust_lr: str | None = "keller"
    split_qkv: bool = False
    per_head: bool = False
    state_dtype: str = "fp32"
    steps: int = 600
    batch_size: int = 16
    warmup_frac: float = 0.05
    decay_frac: float = 0.3
    grad_clip: float | None = 1.0
    eval_interval: int = 50
    eval_batches: int = 8
    seed: int = 0
    autocast: Literal["auto", "bf16"] | None = "auto"
    threads: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Invalid optimizer={self.optimizer!r}: must be one of {OPTIMIZERS}")
        for name in ("steps", "batch_size", "eval_interval", "eval_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Invalid {name}={value!r}: must be a positive int")
        for name in ("lr", "normuon_lr", "adamw_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be > 0")
        for name in ("warmup_frac", "decay_frac"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: must be in [0, 1]")
        if self.warmup_frac + self.decay_frac > 1.0:
            raise ValueError(f"Invalid warmup_frac + decay_frac = {self.warmup_frac + self.decay_frac}: must be <= 1")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"Invalid grad_clip={self.grad_clip!r}: must be None or > 0")
        if self.autocast not in ("auto", "bf16", None):
            raise ValueError(f"Invalid autocast={self.autocast!r}: must be 'auto', 'bf16' or None")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"Invalid state_dtype={self.state_dtype!r}: must be one of {STATE_DTYPES}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"Invalid threads={self.threads!r}: must be None or a positive int")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.block_size

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_frac * self.steps)

    @property
    def decay_steps(self) -> int:
        return round(self.decay_frac * self.steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    """Everything measured in one run. ``to_dict()`` is JSON-ready (the model is left out).

    Curves: ``train_loss[i]`` is the loss of step ``i + 1``'s batch, seen after
    ``tokens[i] = (i + 1) * tokens_per_step`` tokens; ``val_loss[j]`` was measured after
    ``eval_steps[j]`` steps (``eval_tokens[j]`` tokens), the first at step 0.
    """

    config: RunConfig
    train_loss: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_tokens: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    """Seconds of each ``optimizer.step()`` call alone (synchronized)."""
    wall_time_s: float = 0.0
    """The whole loop: batches, forward, backward, clipping, optimizer, evaluations."""
    cpu_time_s: float = 0.0
    """CPU seconds of this process over the same loop (all threads): on a shared machine, less
    sensitive to other jobs than wall time."""
    eval_time_s: float = 0.0
    optimizer_state_bytes: int = 0
    num_params: int = 0
    muon_params: int = 0
    diverged: bool = False
    threads: int = 0
    autocast: Literal["bf16"] | None = None
    """The autocast the run used (``config.autocast`` with ``"auto"`` resolved on its device)."""
    model: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1] if self.val_loss else math.nan

    @property
    def optimizer_time_s(self) -> float:
        return sum(self.step_times_s)

    @property
    def optimizer_step_ms(self) -> float:
        """Median optimizer-step time, skipping the first step (it allocates the states)."""
        times = self.step_times_s[1:] or self.step_times_s
        return 1000 * statistics.median(times) if times else math.nan

    def to_dict(self) -> dict[str, Any]:
        # Not asdict(self): it would deep-copy the model.
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model", "config")}
        out["config"] = self.config.to_dict()
        out.update(
            final_val_loss=self.final_val_loss,
            optimizer_time_s=self.optimizer_time_s,
            optimizer_step_ms=self.optimizer_step_ms,
            steps=len(self.train_loss),
        )
        return out


def lr_multiplier(step: int, *, steps: int, warmup_steps: int, decay_steps: int) -> float:
    """Warmup-stable-decay factor for 0-based ``step`` (see the module docstring)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps and step >= steps - decay_steps:
        return (steps - step) / decay_steps
    return 1.0


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` or :class:`muonkit.HybridMuon` for ``model``, as ``config`` says."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    adamw = {"betas": config.betas, "eps": config.adamw_eps}
    if config.optimizer == "adamw":
        groups = [
            {"params": decay, "weight_decay": config.adamw_weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.adamw_lr, **adamw)  # type: ignore[arg-type]

    from muonkit import HybridMuon, param_groups
    from muonkit.param_groups import no_decay_on_vectors

    muon = {"momentum": config.momentum, "ns_coefficients": config.ns_coefficients, "adjust_lr": config.adjust_lr}
    routed = param_groups(
        model,
        lr=config.normuon_lr if config.optimizer == "normuon" else config.lr,
        muon_algorithm="normuon" if config.optimizer == "normuon" else "muon",
        adamw_lr=config.adamw_lr,
        weight_decay=config.weight_decay,
        adamw_weight_decay=config.adamw_weight_decay,
        split_qkv=config.split_qkv,
        per_head=config.per_head,
        muon_options=muon,
        adamw_options=adamw,
    )
    return HybridMuon(no_decay_on_vectors(routed), state_dtype=config.state_dtype)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer holds in its state (moments, momentum, step counters)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, Tensor)
    )


def autocast_choice(args: argparse.Namespace) -> Literal["auto", "bf16"] | None:
    """``RunConfig.autocast`` from the ``--autocast`` and ``--no-autocast`` flags (``bench nanogpt``, its sweep)."""
    choice = getattr(args, "autocast", "auto")
    if getattr(args, "no_autocast", False):
        if choice == "bf16":
            raise ValueError("Invalid flags --no-autocast with --autocast bf16: give one of them")
        return None
    return {"auto": "auto", "bf16": "bf16", "none": None}[choice]


def resolve_autocast(autocast: Literal["auto", "bf16"] | None, device: str) -> Literal["bf16"] | None:
    """``"auto"`` -> ``"bf16"`` where bf16 matrix products are fast on ``device``, else None.

    The rule ``orthogonalize`` uses for its compute dtype (:func:`default_compute_dtype`): CUDA
    with bf16 support and CPUs with AVX512-BF16 or AMX. Elsewhere bf16 autocast makes training
    slower, not faster (CPUs without bf16 units emulate it; figures in BENCHMARKS.md).
    """
    if autocast != "auto":
        return autocast
    return "bf16" if default_compute_dtype(device) == torch.bfloat16 else None


def _autocast(config: RunConfig) -> contextlib.AbstractContextManager[Any]:
    if resolve_autocast(config.autocast, config.device) is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], config: RunConfig) -> float:
    """Mean loss over ``batches`` (each batch weighted equally), in eval mode."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with _autocast(config):
            _, loss = model(x.to(config.device), y.to(config.device))
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


def train(
    config: RunConfig,
    data: TrainData,
    *,
    model: nn.Module | None = None,
    progress: bool = True,
    on_eval: Callable[[int, float], None] | None = None,
    on_optimizer: Callable[[torch.optim.Optimizer], None] | None = None,
) -> RunResult:
    """Train ``model`` (default: a fresh seeded ``GPT(config.model)``) and measure it.

    ``model`` must map ``(x, y)`` to ``(logits, loss)``; it is trained in place and returned in
    ``RunResult.model``. ``on_eval(step, val_loss)`` is called after each evaluation;
    ``on_optimizer(optimizer)`` once, before the first step (to attach step hooks: QK-Clip, a
    per-step probe). A non-finite training loss stops the run (``diverged=True``, final val loss ``inf``).
    """
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if model is None:
        torch.manual_seed(config.seed)
        model = GPT(config.model)
    model.to(config.device).train()
    optimizer = build_optimizer(model, config)
    if on_optimizer is not None:
        on_optimizer(optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, steps=config.steps, warmup_steps=config.warmup_steps, decay_steps=config.decay_steps
        ),
    )
    block = config.model.block_size
    val_set = data.eval_batches(batches=config.eval_batches, batch_size=config.batch_size, block_size=block)
    generator = torch.Generator().manual_seed(config.seed)
    autocast = resolve_autocast(config.autocast, config.device)
    result = RunResult(config=config, model=model, threads=torch.get_num_threads(), autocast=autocast)
    result.num_params = sum(p.numel() for p in model.parameters())
    result.muon_params = sum(
        p.numel() for g in optimizer.param_groups if g.get("algorithm") in ("muon", "normuon") for p in g["params"]
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    _record_eval(result, model, val_set, 0, on_eval)
    bar = _bar(config, progress)
    for step in bar:
        x, y = data.batch("train", batch_size=config.batch_size, block_size=block, generator=generator)
        with _autocast(config):
            _, loss = model(x.to(config.device), y.to(config.device))
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            logger.warning("%s diverged at step %d (loss %s); stopping the run", config.optimizer, step, loss_value)
            result.diverged = True
            result.val_loss.append(math.inf)
            result.eval_steps.append(step)
            result.eval_tokens.append(step * config.tokens_per_step)
            break
        loss.backward()
        if config.grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        _sync(config.device)
        t0 = time.perf_counter()
        optimizer.step()
        _sync(config.device)
        result.step_times_s.append(time.perf_counter() - t0)
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        result.train_loss.append(loss_value)
        result.tokens.append((step + 1) * config.tokens_per_step)
        if (step + 1) % config.eval_interval == 0 or step + 1 == config.steps:
            _record_eval(result, model, val_set, step + 1, on_eval)
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{result.val_loss[-1]:.3f}")
    result.wall_time_s = time.perf_counter() - start
    result.cpu_time_s = time.process_time() - cpu_start
    result.optimizer_state_bytes = optimizer_state_bytes(optimizer)
    return result


def _record_eval(
    result: RunResult, model: nn.Module, val_set: list[Batch], step: int, on_eval: Callable[[int, float], None] | None
) -> None:
    t0 = time.perf_counter()
    val = evaluate(model, val_set, result.config)
    result.eval_time_s += time.perf_counter() - t0
    result.eval_steps.append(step)
    result.eval_tokens.append(step * result.config.tokens_per_step)
    result.val_loss.append(val)
    if on_eval is not None:
        on_eval(step, val)


def _bar(config: RunConfig, progress: bool) -> Any:
    from tqdm.auto import tqdm

    name = "HybridMuon" if config.optimizer == "muon" else "AdamW"
    return tqdm(range(config.steps), desc=f"{name:>10}", disable=not progress, dynamic_ncols=True, leave=True)
