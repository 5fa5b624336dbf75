"""TRL's SFTTrainer with PEFT LoRA: wrap the model first, then build the optimizer from the wrapped
model (an optimizer built before get_peft_model never sees the LoRA params).

    python examples/trl_peft.py [OUTPUT_DIR]
"""

import sys
import tempfile

import datasets
import peft
import torch
import trl
from hf_trainer import CONFIG  # the tiny Qwen2 of examples/hf_trainer.py
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from muonkit.integrations.transformers import make_optimizer, model_from_config


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary (no download)."""
    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t1"
    )


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="muonkit-trl-")
    torch.manual_seed(0)
    model = model_from_config(CONFIG, device="cpu")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = trl.SFTConfig(
        output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
        use_cpu=True, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": torch.randint(0, 64, (16, 12)).tolist()})
    optimizer = make_optimizer(model, args)  # after get_peft_model: LoRA factors on Muon, the rest frozen
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer(), optimizers=(optimizer, None)
    )
    trainer.train()
    print(
        f"trained {sum(len(g['params']) for g in optimizer.param_groups)} LoRA tensors for {trainer.state.global_step} steps"
    )


if __name__ == "__main__":
    main()
