"""muonkit under TRL's SFTTrainer and PEFT LoRA, on a tiny random Qwen2 (no downloads, CPU).

The silent failure this guards: ``SFTTrainer(peft_config=...)`` with an optimizer built before
PEFT wrapped the model steps the frozen base weights and never sees the adapters.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import muonkit
from muonkit.integrations.transformers import make_optimizer, model_from_config

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

TINY = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}  # fmt: skip
NO_GRADIENT = "found no gradient on any of its"
ALLOWED = 3  # muonkit.group_checks.GRADIENTLESS_STEPS_ALLOWED: steps in a row without gradients before an error


def tiny_model() -> Any:
    torch.manual_seed(0)
    return model_from_config(TINY, device="cpu")


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t1")


def sft_args(out: Path, max_steps: int = 3) -> Any:
    return trl.SFTConfig(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
        use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0,
    )  # fmt: skip


def token_dataset() -> Any:
    ids = torch.randint(0, TINY["vocab_size"], (16, 12), generator=torch.Generator().manual_seed(1))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def lora_config() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def lora_weights(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_sft_trainer_with_peft_config_and_a_prebuilt_optimizer_warns(tmp_path: Path) -> None:
    # The optimizer holds the base weights; SFTTrainer then wraps the model with PEFT, which freezes
    # them and adds new LoRA params the optimizer never sees.
    model = tiny_model()
    args = sft_args(tmp_path)
    optimizer = make_optimizer(model, args)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=token_dataset(), processing_class=tiny_tokenizer(),
        optimizers=(optimizer, None), peft_config=lora_config(),
    )  # fmt: skip
    before = lora_weights(trainer.model)
    assert before, "PEFT added no LoRA params"
    with pytest.warns(RuntimeWarning, match=rf"{NO_GRADIENT}.*PEFT get_peft_model.*SFTTrainer\(peft_config"):
        trainer.train()
    after = lora_weights(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # what the warning is about: nothing trained
    assert not optimizer.state


def test_sft_trainer_with_peft_config_and_a_prebuilt_optimizer_raises_after_a_few_steps(tmp_path: Path) -> None:
    # The warning scrolled by and the run went to its end, training nothing: after ALLOWED steps
    # in a row without any gradient, the next one raises with the same message.
    model = tiny_model()
    args = sft_args(tmp_path, max_steps=ALLOWED + 3)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=token_dataset(), processing_class=tiny_tokenizer(),
        optimizers=(make_optimizer(model, args), None), peft_config=lora_config(),
    )  # fmt: skip
    with (
        pytest.warns(RuntimeWarning, match=NO_GRADIENT),
        pytest.raises(
            RuntimeError,
            match=rf"{NO_GRADIENT}.*SFTTrainer\(peft_config.*MuonSFTTrainer.*4 steps in a row had no gradient",
        ),
    ):
        trainer.train()
    assert trainer.state.global_step == ALLOWED


def test_muon_sft_trainer_with_peft_config_trains_lora(tmp_path: Path) -> None:
    # The shipped mixin: class MuonSFTTrainer(MuonTrainer, SFTTrainer) builds HybridMuon from the PEFT model.
    from muonkit.integrations.transformers import MuonSFTTrainer

    trainer = MuonSFTTrainer(
        model=tiny_model(), args=sft_args(tmp_path), train_dataset=token_dataset(), processing_class=tiny_tokenizer(),
        peft_config=lora_config(), muon_options={"muon_lr": 0.02},
    )  # fmt: skip
    assert isinstance(trainer, trl.SFTTrainer)
    before = lora_weights(trainer.model)
    assert before, "PEFT added no LoRA params"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{NO_GRADIENT}")
        trainer.train()
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer
        optimizer = optimizer.optimizer
    assert isinstance(optimizer, muonkit.HybridMuon), type(optimizer)
    after = lora_weights(trainer.model)
    assert all(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    assert len(optimizer.state) == len(before)
    assert {g["algorithm"] for g in optimizer.param_groups} >= {"muon"}


def test_sft_trainer_trains_lora_with_an_optimizer_built_after_get_peft_model(tmp_path: Path) -> None:
    # The TRL + PEFT lines of docs/stacks/trl-peft.md: wrap first, then build the optimizer from the wrapped model.
    args = sft_args(tmp_path)
    model = peft.get_peft_model(tiny_model(), lora_config())
    optimizer = make_optimizer(model, args)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=token_dataset(), processing_class=tiny_tokenizer(),
        optimizers=(optimizer, None),
    )  # fmt: skip
    before = lora_weights(trainer.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{NO_GRADIENT}")
        trainer.train()
    after = lora_weights(trainer.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    lora_b = [n for n in before if "lora_B" in n]
    assert set(lora_b) <= set(changed) and len(changed) == len(before)
    assert {len(optimizer.state)} == {len(before)}


def test_a_step_without_any_gradient_warns_with_the_likely_cause() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = muonkit.HybridMuon(muonkit.param_groups(model))
    model.requires_grad_(False)  # as PEFT does to the base weights
    with pytest.warns(RuntimeWarning, match=rf"{NO_GRADIENT} 4 params.*\(4 of them have requires_grad=False\)"):
        optimizer.step()
    model.requires_grad_(True)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()  # a step with gradients resets the count
    model(torch.ones(1, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{NO_GRADIENT}")
        optimizer.step()
    assert len(optimizer.state) == 4


def test_a_run_of_steps_without_any_gradient_raises_after_a_few() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = muonkit.HybridMuon(muonkit.param_groups(model))
    for _ in range(2):  # a step with a gradient in between starts the count afresh
        for _ in range(ALLOWED):
            with pytest.warns(RuntimeWarning, match=NO_GRADIENT):
                optimizer.step()
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for _ in range(ALLOWED):
        with pytest.warns(RuntimeWarning, match=NO_GRADIENT):
            optimizer.step()
    with pytest.raises(RuntimeError, match=rf"{NO_GRADIENT} 4 params.*4 steps in a row had no gradient"):
        optimizer.step()
