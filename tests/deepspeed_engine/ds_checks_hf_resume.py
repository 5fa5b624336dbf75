"""The Hugging Face Trainer resumes at 1 rank from its DeepSpeed ``checkpoint-2`` saved at 2 ranks
(ds_checks_hf), through ``muonkit convert-deepspeed``: the converted directory holds the
Trainer's own files too, so the Trainer goes on from step 2 with the saved optimizer state."""

from __future__ import annotations

from typing import Any

import torch
from ds_checks_hf import LM, RESUME_DIR, trainer_args, trainer_data
from ds_common import config
from ds_worker import Context, check, quiet_deepspeed


@check
def trainer_resumes_a_converted_checkpoint_at_another_world_size(ctx: Context) -> None:
    quiet_deepspeed()
    from transformers import Trainer, TrainerCallback

    from muonkit.cli import main
    from muonkit.integrations import deepspeed as mk_ds

    saved = ctx.shared / RESUME_DIR / "checkpoint-2"
    converted = ctx.out_dir / "w1" / "checkpoint-2"
    assert main(["convert-deepspeed", str(saved), "--world-size", "1", "--output", str(converted)]) == 0
    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(state.global_step)

    setup = mk_ds.trainer_setup(config(2))
    args = trainer_args(ctx.out_dir / "resumed", setup.deepspeed, max_steps=3, save_strategy="no")
    torch.manual_seed(0)
    kwargs = setup.trainer_kwargs()
    kwargs["callbacks"].append(Steps())
    trainer = Trainer(model=LM(), args=args, train_dataset=trainer_data(4), **kwargs)
    trainer.train(resume_from_checkpoint=str(converted))
    assert steps == [3], f"steps trained after resuming at step 2: {steps}"  # not 3 fresh steps from 0
    hybrid = trainer.model_wrapped.optimizer.optimizer
    assert hybrid.strategy.name == "zero" and hybrid.strategy.world_size == 1, hybrid.strategy
    assert any("momentum_buffer" in s for s in hybrid.state.values()), "the saved Muon momentum was not loaded"
