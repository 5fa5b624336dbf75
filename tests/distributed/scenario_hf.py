"""The Hugging Face Trainer under torchrun (DDP, 2 gloo ranks) with ``MuonTrainer``.

The Trainer wraps the model in DDP itself; ``make_optimizer`` must then hand HybridMuon the world
group, so that each matrix is orthogonalized once across ranks and every rank applies the same
update. Checked: the strategy, the exactly-once count, bit-identical params on both ranks (they
would drift apart if a rank skipped or repeated a matrix), and a finite training loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import Context, check

STEPS = 3


@check(2)
def muon_trainer_under_ddp(ctx: Context) -> None:
    import transformers

    from muonkit.integrations.transformers import MuonTrainer, model_from_config

    torch.manual_seed(0)
    config = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip
    model = model_from_config(config, device="cpu")
    data = [
        {"input_ids": x, "labels": x}
        for x in torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))
    ]
    args = transformers.TrainingArguments(
        output_dir=str(ctx.out_dir / "hf"), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.01, report_to="none",
        save_strategy="no", use_cpu=True, logging_steps=1, seed=0, ddp_backend="gloo",
    )  # fmt: skip
    trainer = MuonTrainer(model=model, args=args, train_dataset=data)
    trainer.train()

    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    assert optimizer.strategy.name == "replicated", optimizer.strategy.name
    matrices = sum(
        p.shape[0] if p.ndim == 3 else 1
        for g in optimizer.param_groups
        if g["algorithm"] == "muon"
        for p in g["params"]
    )
    total = torch.tensor([optimizer.strategy.stats.matrices])
    dist.all_reduce(total)
    assert total.item() == STEPS * matrices, (total.item(), STEPS, matrices)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered[1:]), "params differ across ranks"
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
