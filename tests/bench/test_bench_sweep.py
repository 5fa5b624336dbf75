"""`muonkit bench nanogpt --sweep`: the protocol at tiny size, the summary arithmetic, the stats."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from muonkit.cli import main
from muonkit_bench import stats, sweep
from muonkit_bench.sweep_report import plot_arms


def fake_run(seed: int, val: list[float], steps: int = 10, wall: float = 10.0) -> SimpleNamespace:
    config = SimpleNamespace(seed=seed, tokens_per_step=100, steps=steps, lr=0.02, adamw_lr=1e-3)
    evals = [round(i * steps / (len(val) - 1)) for i in range(len(val))]
    return SimpleNamespace(
        config=config, train_loss=[1.0] * steps, eval_steps=evals, val_loss=val, final_val_loss=val[-1],
        wall_time_s=wall, eval_time_s=0.0, optimizer_step_ms=2.0, optimizer_time_s=1.0,
    )  # fmt: skip


def test_summary_reads_tokens_to_adamw_loss_off_the_curve() -> None:
    full = {
        "adamw": [fake_run(0, [5.0, 4.0, 3.0]), fake_run(1, [5.0, 4.2, 3.2])],  # target: mean 3.1
        "muon": [fake_run(0, [5.0, 3.1, 2.5]), fake_run(1, [5.0, 3.5, 2.7])],
        "muon_short": [fake_run(0, [5.0, 3.0], steps=7), fake_run(1, [5.0, 3.2], steps=7)],
    }
    s = sweep.summarize(full)  # type: ignore[arg-type]
    assert s["target_val_loss"] == pytest.approx(3.1)
    # seed 0 reaches 3.1 exactly at step 5; seed 1 between steps 5 (3.5) and 10 (2.7): 5 + 5 * 0.4/0.8 = 7.5
    assert [r["steps"] for r in s["muon_reach"]] == pytest.approx([5.0, 7.5])
    assert s["muon_tokens_to_target"] == pytest.approx(625.0)
    assert s["token_ratio"] == pytest.approx(1000 / 625)
    assert s["short_reaches_target"] == [True, False]
    assert s["arms"]["adamw"]["final_val_loss"]["std"] == pytest.approx(math.sqrt(0.02))


def test_t_interval_and_binomial_noise() -> None:
    ci = stats.t_interval([0.80, 0.82, 0.84])
    assert ci["half_width"] == pytest.approx(4.303 * 0.02 / math.sqrt(3), rel=1e-6)
    assert math.isnan(stats.t_interval([0.5])["half_width"])
    assert stats.binomial_half_width(0.5, 100) == pytest.approx(0.098)
    assert stats.spread([1.0, math.inf])["diverged"] == 1


def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    argv = ["bench", "nanogpt", "--sweep", "tiny", "--out", str(tmp_path), "--steps", "12", "--no-progress"]
    assert main([*argv, "--adamw-lrs", "3e-3,1e-2", "--muon-lrs", "0.03"]) == 0
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert set(report["sweep"]["adamw"]) == {"0.003", "0.01"}
    assert report["plan"]["sweep_steps"] == 6 and report["plan"]["short_steps"] == 9
    for arm, runs in report["runs"].items():
        assert len(runs) == 2, arm  # two seeds
        for r in runs:
            assert all(math.isfinite(v) for v in r["val_loss"])
            assert r["val_loss"][-1] < r["val_loss"][0]  # it learns
    assert report["summary"]["arms"]["muon_short"]["steps"] == 9
    assert report["environment"]["torch"]


def test_gpu_preset_builds_a_gpt2_small_body_on_cuda() -> None:
    """The GPU preset is never run in CI (no GPU); check what it would run."""
    args = SimpleNamespace(sweep="gpu", seeds=None, adamw_lrs=None, muon_lrs=None)
    plan = sweep.plan_from_args(args, vocab_size=4096)  # type: ignore[arg-type]
    model = plan.base.model
    assert (model.n_layer, model.n_embd, model.n_head, model.block_size) == (12, 768, 12, 512)
    assert plan.base.device == "cuda" and plan.base.autocast == "auto" and plan.base.steps == 1000
    assert plan.steps(plan.sweep_frac) == 300 and plan.steps(plan.short_frac) == 740


def test_arms_summary_pairs_seeds_against_the_first_arm() -> None:
    full = {
        "adamw": [fake_run(0, [5.0, 4.0, 3.0]), fake_run(1, [5.0, 4.2, 3.2]), fake_run(2, [5.0, 4.1, 3.1])],
        "fp32": [fake_run(0, [5.0, 3.1, 2.5]), fake_run(1, [5.0, 3.5, 2.7]), fake_run(2, [5.0, 3.1, 2.6])],
        "8bit": [fake_run(0, [5.0, 3.1, 2.6]), fake_run(1, [5.0, 3.5, 2.8]), fake_run(2, [5.0, 3.1, 2.7])],
        "bf16": [fake_run(0, [5.0, 3.2, 2.4]), fake_run(1, [5.0, 3.5, 2.8]), fake_run(2, [5.0, 3.0, 2.6])],
    }
    s = sweep.summarize_arms(full, ("fp32", "8bit", "bf16"))  # type: ignore[arg-type]
    assert s["target_val_loss"] == pytest.approx(3.1)
    assert s["arms"]["fp32"]["variant"] == {"state_dtype": "fp32"}
    # fp32 reaches 3.1 at steps 5, 7.5, 5: 100 tokens a step
    assert s["arms"]["fp32"]["tokens_to_target"]["mean"] == pytest.approx(100 * 17.5 / 3)
    assert s["arms"]["fp32"]["token_ratio"] == pytest.approx(1000 / (100 * 17.5 / 3))
    eight = s["paired"]["8bit"]["final_val_loss"]  # +0.1 in every seed: no spread, outside the noise
    assert s["paired"]["8bit"]["vs"] == "fp32"
    assert eight["mean"] == pytest.approx(0.1) and eight["std"] == pytest.approx(0.0, abs=1e-12)
    assert eight["inside_noise"] is False
    bf16 = s["paired"]["bf16"]["final_val_loss"]  # -0.1, +0.1, 0: mean 0, inside the noise
    assert bf16["mean"] == pytest.approx(0.0, abs=1e-12) and bf16["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert bf16["inside_noise"] is True
    assert sweep.paired([0.5])["inside_noise"] is None  # one pair: no noise estimate


def test_arms_must_be_known_distinct_and_at_least_two() -> None:
    args = SimpleNamespace(sweep="tiny", seeds=None, adamw_lrs=None, muon_lrs=None)
    for bad in ("fp32", "fp32,fp16", "fp32,fp32"):
        with pytest.raises(ValueError, match="Invalid arms"):
            sweep.plan_from_args(SimpleNamespace(**vars(args), arms=bad), vocab_size=512)  # type: ignore[arg-type]
    plan = sweep.plan_from_args(SimpleNamespace(**vars(args), arms="whole,per_head"), vocab_size=512)  # type: ignore[arg-type]
    assert plan.arms == ("whole", "per_head")


def test_tiny_arms_sweep_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "nanogpt", "--sweep", "tiny", "--out", str(tmp_path), "--steps", "8", "--no-progress"]
    assert main([*argv, "--adamw-lrs", "8e-3", "--muon-lrs", "0.02,0.05", "--arms", "fp32,8bit", "--no-plot"]) == 0
    printed = capsys.readouterr().out
    assert "paired differences (same seed) against fp32" in printed and "HybridMuon 8bit" in printed
    report = json.loads((tmp_path / "sweep.json").read_text())
    assert report["plan"]["arms"] == ["fp32", "8bit"]
    assert set(report["sweep"]["muon"]) == {"fp32", "8bit"} and set(report["sweep"]["muon"]["8bit"]) == {"0.02", "0.05"}
    assert set(report["runs"]) == {"adamw", "fp32", "8bit"}
    plot_arms(report, tmp_path / "arms.png")  # the figure of an --arms run, from its report
    assert (tmp_path / "arms.png").stat().st_size > 0
    for arm, dtype in (("adamw", "fp32"), ("fp32", "fp32"), ("8bit", "8bit")):
        assert [r["config"]["seed"] for r in report["runs"][arm]] == [0, 1]
        assert {r["config"]["state_dtype"] for r in report["runs"][arm]} == {dtype}
        assert report["runs"][arm][0]["config"]["optimizer"] == ("adamw" if arm == "adamw" else "muon")
    assert report["summary"]["paired"]["8bit"]["final_val_loss"]["n"] == 2
