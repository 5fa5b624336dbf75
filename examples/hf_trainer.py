"""The Hugging Face Trainer with HybridMuon (MuonTrainer), a checkpoint and a resume; a tiny random
Qwen2 built from a config (no download). Under torchrun the Trainer's DDP is used.

    python examples/hf_trainer.py [OUTPUT_DIR]
"""

import sys
import tempfile

import torch
import transformers

from muonkit.integrations.transformers import MuonTrainer, make_optimizer, model_from_config

CONFIG = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64,
}  # fmt: skip


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="muonkit-hf-")
    torch.manual_seed(0)
    model = model_from_config(CONFIG, device="cpu")  # any transformers model works the same
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (32, 16))]
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-4, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=1, save_steps=2,
        report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    # learning_rate is the AdamW groups' lr (embeddings, head, norms); Muon's is muon_lr.
    trainer = MuonTrainer(model=model, args=args, train_dataset=data, muon_options={"muon_lr": 0.02})
    trainer.train()
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-2")  # restores HybridMuon's state too

    # Or a plain Trainer with the optimizer passed in (the Trainer still builds the lr scheduler).
    plain = transformers.Trainer(
        model=model, args=args, train_dataset=data, optimizers=(make_optimizer(model, args, muon_lr=0.02), None)
    )
    print(
        f"MuonTrainer reached step {trainer.state.global_step}; the plain Trainer holds a {type(plain.optimizer).__name__}"
    )


if __name__ == "__main__":
    main()
