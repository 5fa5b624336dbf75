"""The Hugging Face Trainer drives DeepSpeed ZeRO-2 with muonkit (2 ranks), via ``trainer_setup``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ds_common import GA, Net, batch, config, muon_matrices
from ds_worker import Context, check, quiet_deepspeed
from torch import Tensor, nn


class LM(nn.Module):
    """The test Net with the Trainer's calling convention (keyword inputs, a dict with the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, input_ids: Tensor, labels: Tensor) -> dict[str, Tensor]:
        return {"loss": self.net(input_ids, labels)}


@check
def trainer_trains_with_muonkit_on_zero2(ctx: Context) -> None:
    quiet_deepspeed()
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from muonkit.integrations import deepspeed as mk_ds

    steps = 3
    data = [
        {"input_ids": x, "labels": y}
        for s in range(steps * 2)
        for m in range(GA)
        for x, y in zip(*batch(s, m, 0), strict=True)
    ]
    setup = mk_ds.trainer_setup(config(2, bf16=True))
    args = TrainingArguments(
        output_dir=str(ctx.out_dir / "hf"), per_device_train_batch_size=4, gradient_accumulation_steps=GA,
        max_steps=steps, deepspeed=setup.deepspeed, report_to=[], save_strategy="no", seed=0,
        lr_scheduler_type="constant", bf16=True, use_cpu=True, logging_steps=1,
    )  # fmt: skip
    seen: list[dict[str, float]] = []

    class RecordLr(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            seen.append({g["algorithm"]: g["lr"] for g in optimizer.param_groups})

    torch.manual_seed(0)
    model = LM()
    kwargs = setup.trainer_kwargs()
    kwargs["callbacks"].append(RecordLr())
    trainer = Trainer(model=model, args=args, train_dataset=data, **kwargs)
    trainer.train()
    hybrid = trainer.model_wrapped.optimizer.optimizer
    assert hybrid.strategy.name == "zero", hybrid.strategy
    total = torch.tensor([hybrid.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == steps * muon_matrices(model), total.item()
    assert seen and all(s == {"muon": 0.02, "adamw": 3e-3} for s in seen), seen
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses


@check
def muon_trainer_takes_trainer_setup_on_zero2(ctx: Context) -> None:
    """``MuonTrainer(..., **setup.trainer_kwargs())``: the DeepSpeed factory wins over make_optimizer."""
    quiet_deepspeed()
    from transformers import TrainingArguments

    from muonkit.integrations import deepspeed as mk_ds
    from muonkit.integrations.transformers import MuonTrainer

    data = [{"input_ids": x, "labels": y} for m in range(GA) for x, y in zip(*batch(0, m, 0), strict=True)]
    setup = mk_ds.trainer_setup(config(2))
    args = TrainingArguments(
        output_dir=str(ctx.out_dir / "hf_muon_trainer"), per_device_train_batch_size=4,
        gradient_accumulation_steps=GA, max_steps=1, deepspeed=setup.deepspeed, report_to=[],
        save_strategy="no", seed=0, lr_scheduler_type="constant", use_cpu=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LM()
    trainer = MuonTrainer(model=model, args=args, train_dataset=data, **setup.trainer_kwargs())
    trainer.train()
    hybrid = trainer.model_wrapped.optimizer.optimizer
    assert hybrid.strategy.name == "zero", hybrid.strategy
    total = torch.tensor([hybrid.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == muon_matrices(model), total.item()


RESUME_DIR = (
    "hf_resume"  # in ctx.shared: the Trainer's checkpoint saved here at 2 ranks, resumed at 1 (ds_checks_hf_resume)
)


def trainer_args(out: Any, deepspeed: Any, **kw: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=GA, deepspeed=deepspeed,
        report_to=[], seed=0, lr_scheduler_type="constant", use_cpu=True, logging_steps=1, **kw,
    )  # fmt: skip


def trainer_data(steps: int) -> list[dict[str, Tensor]]:
    return [
        {"input_ids": x, "labels": y}
        for s in range(steps * 2)
        for m in range(GA)
        for x, y in zip(*batch(s, m, 0), strict=True)
    ]


@check
def trainer_saves_a_checkpoint_to_resume_at_one_rank(ctx: Context) -> None:
    """The Trainer's ``checkpoint-2`` at 2 ranks (ZeRO-2), for ds_checks_hf_resume at 1 rank."""
    quiet_deepspeed()
    from transformers import Trainer

    from muonkit.integrations import deepspeed as mk_ds

    setup = mk_ds.trainer_setup(config(2))
    args = trainer_args(ctx.shared / RESUME_DIR, setup.deepspeed, max_steps=2, save_strategy="steps", save_steps=2)
    torch.manual_seed(0)
    trainer = Trainer(model=LM(), args=args, train_dataset=trainer_data(4), **setup.trainer_kwargs())
    trainer.train()
    assert (ctx.shared / RESUME_DIR / "checkpoint-2" / "trainer_state.json").is_file()
