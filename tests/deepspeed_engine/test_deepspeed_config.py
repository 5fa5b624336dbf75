"""The muonkit section of a DeepSpeed config and the refusals that need no process group."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from muonkit.integrations.deepspeed_config import (
    MuonkitOptions,
    UnsupportedConfiguration,
    check_scheduler,
    load_config,
    split_config,
)

SECTION = {"type": "muonkit.HybridMuon", "params": {"lr": 0.01, "adamw_lr": 1e-3, "ns_dtype": "float32"}}


def test_split_moves_the_section_out_and_allows_the_client_optimizer() -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SECTION}
    ds_config, options = split_config(config)
    assert "optimizer" not in ds_config and ds_config["zero_allow_untested_optimizer"] is True
    assert "optimizer" in config  # the caller's dict is left alone
    assert options is not None
    kwargs = options.optimizer_kwargs()
    assert kwargs["lr"] == 0.01 and kwargs["adamw_lr"] == 1e-3 and kwargs["ns_dtype"] == torch.float32
    routing = {
        "rules": None,
        "split_qkv": False,
        "per_head": False,
        "heads": None,
        "head_dim": None,
        "muon_algorithm": "muon",
    }
    assert options.param_groups_kwargs() == routing  # hyperparameters: the optimizer's


def test_every_documented_key_is_accepted_and_reaches_the_optimizer() -> None:
    params = {
        "lr": 0.03, "weight_decay": 0.1, "momentum": 0.9, "nesterov": False, "ns_coefficients": "keller",
        "ns_steps": 4, "ns_method": "gram", "ns_dtype": "bfloat16", "eps": 1e-6, "adjust_lr": "match_adamw",
        "adamw_lr": 2e-4, "adamw_weight_decay": 0.01, "betas": [0.8, 0.9], "adamw_eps": 1e-7,
        "nonfinite": "raise", "split_qkv": True, "rules": [["head", "adamw"]], "muon_algorithm": "normuon",
        "normuon_beta2": 0.9, "normuon_eps": 1e-9, "cautious_wd": True, "ns_compile": True,
    }  # fmt: skip
    options = MuonkitOptions.from_params(params)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    import muonkit

    opt = muonkit.HybridMuon(muonkit.param_groups(model, **options.param_groups_kwargs()), **options.optimizer_kwargs())
    muon = next(g for g in opt.param_groups if g["algorithm"] == "normuon")
    assert (muon["lr"], muon["momentum"], muon["ns_steps"], muon["ns_method"]) == (0.03, 0.9, 4, "gram")
    assert (muon["beta2"], muon["eps"], muon["cautious_wd"], muon["ns_compile"]) == (0.9, 1e-9, True, True)
    assert opt.nonfinite == "raise"


def test_every_hybrid_muon_keyword_is_a_config_key_or_refused_with_the_reason() -> None:
    import inspect

    import muonkit

    keywords = [k for k in inspect.signature(muonkit.HybridMuon.__init__).parameters if k not in ("self", "params")]
    keywords.remove("unknown")  # **unknown: torch's keywords, answered with a hint
    fields = {f.name for f in dataclasses.fields(MuonkitOptions)}
    assert "ns_compile" in keywords and "capturable" in keywords
    for key in keywords:
        if key in fields:
            assert key in MuonkitOptions.from_params({}).optimizer_kwargs(), key  # and it reaches the optimizer
            continue
        with pytest.raises(
            ValueError, match=rf"^Invalid muonkit optimizer params \['{key}'\] \({key}: .+\): the allowed"
        ):
            MuonkitOptions.from_params({key: None})
    assert set(fields) - set(keywords) == {"muon_algorithm", "split_qkv", "per_head", "heads", "head_dim", "rules"}


def test_bad_params_name_the_key() -> None:
    with pytest.raises(ValueError, match="allowed keys"):
        MuonkitOptions.from_params({"learning_rate": 0.02})
    with pytest.raises(ValueError, match="ns_dtype"):
        MuonkitOptions.from_params({"ns_dtype": "float16"})


def test_auto_and_learning_rate_are_refused_explaining_muon_lr_is_not_hf_learning_rate() -> None:
    # HF's own config check suggests "lr": "auto", which would give Muon the Trainer's AdamW learning_rate.
    from muonkit.integrations.deepspeed import trainer_setup

    says = r"Muon's lr is not HF's learning_rate \(that one belongs in adamw_lr\).*trainer_setup"
    with pytest.raises(ValueError, match=rf"\['lr'\] = 'auto'.*{says}"):
        trainer_setup({"optimizer": {"type": "muonkit.HybridMuon", "params": {"lr": "auto", "adamw_lr": 1e-3}}})
    with pytest.raises(
        ValueError, match=r"\['learning_rate'\] \(HF's learning_rate is AdamW's lr: adamw_lr; Muon's is lr\)"
    ):
        MuonkitOptions.from_params({"learning_rate": 0.02})


def test_make_optimizer_under_trainer_deepspeed_names_trainer_setup_and_the_lrs() -> None:
    transformers = pytest.importorskip("transformers")
    from muonkit.integrations.transformers import make_optimizer

    args = transformers.TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    args.deepspeed = {"zero_optimization": {"stage": 2}}  # what deepspeed="ds.json" leaves after parsing
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"trainer_setup.*Muon's lr, which is not HF's learning_rate.*adamw_lr"):
        make_optimizer(model, args)


def test_another_optimizer_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"muonkit\.HybridMuon"):
        split_config({"optimizer": {"type": "AdamW", "params": {}}})


def test_no_section_means_bring_your_own() -> None:
    ds_config, options = split_config({"train_micro_batch_size_per_gpu": 2})
    assert options is None and ds_config["zero_allow_untested_optimizer"] is True


def test_load_from_json_path_and_args(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": SECTION}))
    assert load_config(path)["optimizer"]["type"] == "muonkit.HybridMuon"

    class Args:
        deepspeed_config = str(path)

    assert load_config(None, args=Args())["optimizer"] == SECTION
    with pytest.raises(ValueError, match="No DeepSpeed config"):
        load_config(None)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_max_lr": 1e-3}),
        ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "total_num_steps": 10}),
        ("OneCycle", {"cycle_max_lr": 1e-3}),
        ("LRRangeTest", {}),
    ],
)
def test_schedulers_with_one_absolute_lr_are_refused(name: str, params: dict) -> None:
    with pytest.raises(UnsupportedConfiguration, match=name):
        check_scheduler(name, params)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_num_steps": 10}),
        ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": [1e-3, 2e-2]}),
        ("WarmupCosineLR", {"total_num_steps": 10}),
        ("StepLR", {"step_size": 10}),
        (None, {}),
    ],
)
def test_schedulers_that_keep_group_lrs_pass(name: str | None, params: dict) -> None:
    check_scheduler(name, params)


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from muonkit.integrations import deepspeed as mk_ds

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"needs deepspeed: pip install deepspeed .*pip install -e '\.\[deepspeed\]'"):
        mk_ds.initialize(model=torch.nn.Linear(2, 2), config={"optimizer": SECTION})
