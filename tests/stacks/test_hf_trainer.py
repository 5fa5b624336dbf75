"""HybridMuon under transformers.Trainer: param groups from TrainingArguments, lr scheduling,
gradient accumulation and resume from checkpoint, on a tiny random Qwen2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install 'muonkit[hf]')")

import transformers

import muonkit
from muonkit.integrations.transformers import MuonTrainer, make_optimizer, model_from_config

TINY = {
    "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}  # fmt: skip


class TokenData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """16 fixed random sequences of 12 tokens; labels = inputs (the model shifts them)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model() -> Any:
    torch.manual_seed(0)
    return model_from_config(TINY, device="cpu")


def training_args(out: Path, **kw: Any) -> Any:
    defaults = dict(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=1, lr_scheduler_type="linear", save_strategy="steps",
        save_steps=2, logging_steps=1, report_to="none", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**defaults, **kw})


def test_make_optimizer_follows_training_arguments(tmp_path: Path) -> None:
    model = tiny_model()
    args = training_args(tmp_path, adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6)
    opt = make_optimizer(model, args, muon_lr=0.03, adjust_lr="match_adamw")
    assert isinstance(opt, muonkit.HybridMuon)
    names = {n for g in opt.param_groups for n in g["param_names"]}
    assert names == {n for n, _ in model.named_parameters()}
    for g in opt.param_groups:
        if g["algorithm"] == "muon":
            assert (g["lr"], g["weight_decay"], g["adjust_lr"]) == (0.03, 0.1, "match_adamw")
        else:
            assert (g["lr"], tuple(g["betas"]), g["eps"]) == (1e-3, (0.8, 0.9), 1e-6)
            vectors = all(p.ndim < 2 for p in g["params"])
            assert g["weight_decay"] == (0.0 if vectors else 0.1)  # never on norms and biases


def test_trainer_schedules_each_group_from_its_own_lr(tmp_path: Path) -> None:
    trainer = MuonTrainer(
        model=tiny_model(), args=training_args(tmp_path, save_strategy="no"), train_dataset=TokenData()
    )
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, muonkit.HybridMuon)
    factors = {g["lr"] / g["initial_lr"] for g in opt.param_groups}
    assert len({round(f, 12) for f in factors}) == 1  # one schedule factor, each group from its own base lr
    bases = {g["algorithm"]: g["initial_lr"] for g in opt.param_groups}
    assert bases == {"muon": 0.02, "adamw": 1e-3}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


def _inner(optimizer: Any) -> muonkit.HybridMuon:
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer


def _states(trainer: Any) -> dict[str, torch.Tensor]:
    """Every param and optimizer state of a trained Trainer, by ``name:key``."""
    opt = _inner(trainer.optimizer)
    out = {f"{n}:param": p.detach() for n, p in trainer.model.named_parameters()}
    for n, p in trainer.model.named_parameters():
        out |= {f"{n}:{k}": v for k, v in opt.state[p].items()}
    return out


def test_resume_from_checkpoint_restores_hybrid_muon_state(tmp_path: Path) -> None:
    """4 steps in one go == 2 steps, save, resume in a fresh Trainer, 2 more steps: bit for bit, params
    and every optimizer state (the resume-fidelity matrix's Trainer cell on one device: the Trainer
    builds its optimizer and loads ``optimizer.pt`` before the first forward, gradients None)."""
    full = MuonTrainer(model=tiny_model(), args=training_args(tmp_path / "a"), train_dataset=TokenData())
    full.train()
    reference = _states(full)

    checkpoint = tmp_path / "a" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert any("momentum_buffer" in s for s in saved["state"].values())

    resumed = MuonTrainer(model=tiny_model(), args=training_args(tmp_path / "b"), train_dataset=TokenData())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    got = _states(resumed)
    assert got.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(got[k], reference[k])] == []

    # A corrupted state is refused (ValueError naming it) before anything trains.
    poisoned = {**saved, "state": {pid: dict(s) for pid, s in saved["state"].items()}}
    pid = next(pid for pid, s in poisoned["state"].items() if "momentum_buffer" in s)
    poisoned["state"][pid]["momentum_buffer"] = poisoned["state"][pid]["momentum_buffer"].clone().fill_(float("nan"))
    torch.save(poisoned, checkpoint / "optimizer.pt")
    refused = MuonTrainer(model=tiny_model(), args=training_args(tmp_path / "c"), train_dataset=TokenData())
    with pytest.raises(ValueError, match=r"Saved momentum_buffer of param .* non-finite"):
        refused.train(resume_from_checkpoint=str(checkpoint))

    # With the Muon momentum zeroed in the checkpoint the result differs: the check above can fail.
    for state in saved["state"].values():
        if "momentum_buffer" in state:
            state["momentum_buffer"].zero_()
    torch.save(saved, checkpoint / "optimizer.pt")
    fresh = MuonTrainer(model=tiny_model(), args=training_args(tmp_path / "d"), train_dataset=TokenData())
    fresh.train(resume_from_checkpoint=str(checkpoint))
    differs = any(not torch.allclose(p, reference[f"{n}:param"], atol=1e-6) for n, p in fresh.model.named_parameters())
    assert differs


def test_plain_trainer_with_make_optimizer(tmp_path: Path) -> None:
    model = tiny_model()
    args = training_args(tmp_path, save_strategy="no", max_steps=2)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=TokenData(), optimizers=(make_optimizer(model, args), None)
    )
    trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.parametrize(
    ("mode", "error", "says"),
    [
        ({"deepspeed": {"zero_optimization": {"stage": 2}}}, ValueError, "trainer_setup"),
        ({"fsdp": True, "fsdp_config": {"version": 1}}, NotImplementedError, r"\(FSDP1\).*Use FSDP2"),
        ({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": "1"}}, NotImplementedError, "Use FSDP2"),
    ],
)
def test_make_optimizer_refuses_trainer_modes_it_cannot_serve(mode: dict, error: type, says: str) -> None:
    with pytest.raises(error, match=says):
        make_optimizer(tiny_model(), _namespace_args(**mode))


@pytest.mark.parametrize("fsdp_config", [{"version": 2}, {"fsdp_version": 2}, {}, None])
def test_make_optimizer_serves_the_trainers_fsdp2(fsdp_config: dict | None) -> None:
    # FSDP2 (transformers 5's default version) is trained at 2 ranks in tests/distributed/scenario_hf.py.
    opt = make_optimizer(tiny_model(), _namespace_args(fsdp=True, fsdp_config=fsdp_config))
    assert isinstance(opt, muonkit.HybridMuon)


def test_the_fsdp2_snippet_muonkit_shows_is_the_one_that_works(tmp_path: Path, caplog: Any) -> None:
    """The module's FSDP2 lines: ``fsdp=True`` (the string form is deprecated) and a sharded state
    dict (the default crashes at the first save); make_optimizer's FSDP1 refusal says the same."""
    import ast
    import re

    from muonkit.integrations import transformers as mk_hf

    doc = " ".join((mk_hf.__doc__ or "").split())
    found = re.search(r"``(fsdp=True, fsdp_config=\{.*?\})``", doc)
    assert found, "the module docstring shows no fsdp=True, fsdp_config={...} snippet"
    call = ast.parse(f"f({found.group(1)})", mode="eval").body
    assert isinstance(call, ast.Call)
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert kwargs["fsdp_config"] == {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}, kwargs
    with caplog.at_level("WARNING"):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)
    assert "deprecated" not in caplog.text, caplog.text
    assert args.fsdp_config["state_dict_type"] == "SHARDED_STATE_DICT"
    with pytest.raises(NotImplementedError) as refused:
        make_optimizer(tiny_model(), _namespace_args(fsdp=True, fsdp_config={"version": 1}))
    assert found.group(1) in str(refused.value), str(refused.value)


def _namespace_args(**mode: Any) -> Any:
    from types import SimpleNamespace

    args = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8)
    for key, value in mode.items():
        setattr(args, key, value)
    return args


def test_muon_trainer_defers_to_an_explicit_optimizer_factory(tmp_path: Path) -> None:
    # trainer_setup (DeepSpeed) hands its factory over as optimizer_cls_and_kwargs: it must win.
    args = training_args(tmp_path, weight_decay=0.0)
    trainer = MuonTrainer(model=tiny_model(), args=args, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    assert type(trainer.create_optimizer()) is torch.optim.SGD
    assert isinstance(MuonTrainer(model=tiny_model(), args=args).create_optimizer(), muonkit.HybridMuon)


def test_muon_trainer_qk_clip_clips_and_logs_the_largest_logit(tmp_path: Path) -> None:
    """qk_clip= builds a QKClip, attaches it to the optimizer the Trainer creates; each log has the steps' peak."""
    model = tiny_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)
    args = training_args(tmp_path, save_strategy="no", max_steps=3)
    trainer = MuonTrainer(model=model, args=args, train_dataset=TokenData(), qk_clip={"threshold": 1.0})
    assert model.config._attn_implementation == "muonkit_qk_clip_sdpa"
    peaks: list[float] = []
    clipped: list[int] = []
    trainer.create_optimizer()
    trainer.optimizer.register_step_post_hook(
        lambda *_: (peaks.append(trainer.qk_clip.last_max_logit), clipped.append(trainer.qk_clip.last_clipped_heads))
    )
    trainer.train()
    logged = [e["qk_clip_max_logit"] for e in trainer.state.log_history if "loss" in e]
    assert len(peaks) == 3 and logged == pytest.approx(peaks) and peaks[0] > 1.0 and clipped[0] > 0
    with pytest.raises(TypeError, match="Invalid qk_clip=3"):
        MuonTrainer(model=tiny_model(), args=args, train_dataset=TokenData(), qk_clip=3)
    with pytest.raises(ValueError, match="Invalid threshold=-1"):
        MuonTrainer(model=tiny_model(), args=args, train_dataset=TokenData(), qk_clip={"threshold": -1})


def test_muon_trainer_with_8bit_state_resumes_bit_for_bit(tmp_path: Path) -> None:
    """``muon_options={"state_dtype": "8bit"}``: every group keeps 8-bit codes and scales, the Trainer's
    ``optimizer.pt`` holds them, and a resume from it equals the run in one go."""
    options = {"state_dtype": "8bit"}
    full = MuonTrainer(
        model=tiny_model(), args=training_args(tmp_path / "a"), train_dataset=TokenData(), muon_options=options
    )
    full.train()
    assert {g["state_dtype"] for g in full.optimizer.param_groups} == {"8bit"}
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    kinds = {(k, v.dtype) for s in saved["state"].values() for k, v in s.items() if k != "step"}
    assert ("momentum_buffer", torch.float8_e4m3fn) in kinds and ("exp_avg_sq_scale", torch.float32) in kinds
    resumed = MuonTrainer(
        model=tiny_model(), args=training_args(tmp_path / "b"), train_dataset=TokenData(), muon_options=options
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name
