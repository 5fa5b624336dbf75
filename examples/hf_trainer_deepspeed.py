"""The Hugging Face Trainer with DeepSpeed ZeRO-2 and muonkit: trainer_setup gives the Trainer an
optimizer factory and binds HybridMuon once DeepSpeed's engine exists.

    torchrun --nproc_per_node=2 examples/hf_trainer_deepspeed.py [OUTPUT_DIR]
"""

import sys
import tempfile

import torch
import transformers
from hf_trainer import CONFIG  # the tiny Qwen2 of examples/hf_trainer.py

from muonkit.integrations import deepspeed as mk_ds
from muonkit.integrations.transformers import model_from_config

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2},
    # Muon's lr is not the Trainer's learning_rate (that one is adamw_lr): never "auto" here.
    "optimizer": {"type": "muonkit.HybridMuon", "params": {"lr": 0.02, "adamw_lr": 3e-4}},
}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="muonkit-hf-ds-")
    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU only: skip a JIT build gloo does not need
    setup = mk_ds.trainer_setup(DS_CONFIG)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=3e-4, save_strategy="no",
        deepspeed=setup.deepspeed, report_to="none", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_from_config(CONFIG, device="cpu")
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (32, 16))]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, **setup.trainer_kwargs())
    trainer.train()
    if trainer.is_world_process_zero():
        print(
            f"ZeRO-2 with {type(trainer.model_wrapped.optimizer.optimizer).__name__}: step {trainer.state.global_step}"
        )


if __name__ == "__main__":
    main()
