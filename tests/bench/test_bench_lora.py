"""`muonkit bench lora`: a tiny smoke run of the three LoRA routings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from muonkit.cli import main

pytest.importorskip("peft")


def test_lora_smoke_runs_each_routing_with_its_factors_where_it_says(tmp_path: Path) -> None:
    argv = ["bench", "lora", "--preset", "tiny", "--seeds", "0,1", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "lora.json").read_text())
    want = {"muon": (["muon"], ["muon"]), "b_muon": (["adamw"], ["muon"]), "adamw": (["adamw"], ["adamw"])}
    assert {r["routing"] for r in report["runs"]} == set(want)
    for run in report["runs"]:
        assert (run["factors"]["lora_A"], run["factors"]["lora_B"]) == want[run["routing"]]
        assert math.isfinite(run["eval_loss"])
    befores = {r["eval_loss_before"] for r in report["runs"]}
    assert len(befores) == 1  # lora_B starts at zero: every run starts from the pretrained model's loss
    for routing, summary in report["summary"].items():
        assert summary["eval_loss"]["n"] == 2
        if routing != "muon":
            assert summary["minus_muon"]["n"] == 2
