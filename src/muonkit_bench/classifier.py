"""Fine-tuning the benchmark GPT as a text classifier (the small-scale Moonlight design).

The classifier reuses a pretrained :class:`muonkit_bench.model.GPT`'s embeddings, blocks and
final norm (a deep copy: the pretrained model is left as it was), mean-pools the hidden states
over the real (unpadded) tokens and applies a new linear ``classifier``::

    h      = ln_f(blocks(wte[ids] + wpe[0..T)))          (B, T, C)
    pooled = sum_t mask[t] h[t] / sum_t mask[t]           (B, C)
    logits = classifier(pooled)                           (B, classes)

:func:`muonkit.param_groups` routes it like the GPT: hidden matrices to Muon, embeddings, norms
and the ``classifier`` head to AdamW. Fine-tuning with ``"muon"`` follows Moonlight: HybridMuon
with ``adjust_lr="match_adamw"``, so both optimizers use the same lr and weight decay.

Example::

    clf = GPTClassifier(pretrained_gpt, num_labels=6)
    acc = finetune(clf, train_ids, train_labels, test_ids, test_labels, config=FinetuneConfig(optimizer="muon"))
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from muonkit_bench.model import GPT
from muonkit_bench.train import resolve_autocast

PAD = 0


class GPTClassifier(nn.Module):
    """A pretrained GPT body with mean pooling and a new linear head (``classifier``)."""

    def __init__(self, gpt: GPT, *, num_labels: int) -> None:
        super().__init__()
        body = copy.deepcopy(gpt)
        self.block_size: int = body.config.block_size
        self.wte, self.wpe, self.drop, self.blocks, self.ln_f = body.wte, body.wpe, body.drop, body.blocks, body.ln_f
        self.classifier = nn.Linear(body.config.n_embd, num_labels)
        nn.init.normal_(self.classifier.weight, std=0.02)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Logits ``(B, classes)`` for token ids ``(B, T)`` with ``mask`` 1 on real tokens."""
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x).float()
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return self.classifier(pooled)


def encode(texts: list[str] | tuple[str, ...], *, tokenizer_path: str, max_len: int) -> list[list[int]]:
    """Token ids of each text with the corpus BPE, truncated to ``max_len`` (at least one token)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    return [enc.ids[:max_len] or [PAD] for enc in tokenizer.encode_batch(list(texts))]


def pad_batch(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    """(ids, mask), right-padded with :data:`PAD` to the longest sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run. ``lr`` and ``weight_decay`` are shared by both optimizers (Moonlight)."""

    optimizer: Literal["adamw", "muon"] = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    epochs: int = 2
    batch_size: int = 32
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    autocast: bool = True
    """bf16 autocast where bf16 matrix products are fast on ``device`` (else fp32); False: never."""


def build_optimizer(model: nn.Module, config: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW everywhere, or HybridMuon (match_adamw: same lr and wd); no decay on vectors."""
    if config.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))
    from muonkit.integrations.transformers import make_optimizer

    return make_optimizer(
        model, None, muon_lr=config.lr, adamw_lr=config.lr, weight_decay=config.weight_decay, adjust_lr="match_adamw"
    )


def _schedule(step: int, *, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def _autocast(config: FinetuneConfig) -> Any:
    """bf16 autocast where bf16 matrix products are fast (:func:`~muonkit_bench.train.resolve_autocast`)."""
    enabled = config.autocast and resolve_autocast("auto", config.device) == "bf16"
    return torch.autocast(torch.device(config.device).type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def accuracy(model: GPTClassifier, seqs: list[list[int]], labels: list[int], config: FinetuneConfig) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(seqs), 128):
        ids, mask = pad_batch(seqs[i : i + 128])
        with _autocast(config):
            logits = model(ids.to(config.device), mask.to(config.device))
        correct += int((logits.argmax(-1).cpu() == torch.tensor(labels[i : i + 128])).sum())
    model.train()
    return correct / len(seqs)


def finetune(
    model: GPTClassifier,
    train: tuple[list[list[int]], list[int]],
    test: tuple[list[list[int]], list[int]],
    *,
    config: FinetuneConfig,
) -> dict[str, Any]:
    """Train on ``train`` (ids, labels), return test accuracy, the loss curve and the time."""
    torch.manual_seed(config.seed)
    model.to(config.device).train()
    optimizer = build_optimizer(model, config)
    n = len(train[0])
    steps_per_epoch = math.ceil(n / config.batch_size)
    total = steps_per_epoch * config.epochs
    warmup = max(1, round(config.warmup_frac * total))
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _schedule(s, total=total, warmup=warmup))
    generator = torch.Generator().manual_seed(config.seed)
    losses = []
    start = time.perf_counter()
    for _ in range(config.epochs):
        order = torch.randperm(n, generator=generator).tolist()
        for i in range(0, n, config.batch_size):
            idx = order[i : i + config.batch_size]
            ids, mask = pad_batch([train[0][j] for j in idx])
            y = torch.tensor([train[1][j] for j in idx], device=config.device)
            with _autocast(config):
                logits = model(ids.to(config.device), mask.to(config.device))
            loss = F.cross_entropy(logits.float(), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
            losses.append(float(loss.detach()))
    train_s = time.perf_counter() - start
    return {
        "accuracy": accuracy(model, test[0], test[1], config),
        "train_loss": losses,
        "train_time_s": train_s,
        "steps": total,
        "config": asdict(config),
    }
