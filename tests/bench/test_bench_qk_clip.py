"""``muonkit bench qk-clip``: the logit meter against a float64 reference, the two arms, the outputs.

Tiny models and a few dozen steps on the real corpus (small BPE, per-session cache). Nothing here
is about speed or about which arm reaches the lower loss.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from muonkit import HybridMuon, QKClip, param_groups
from muonkit.cli import main
from muonkit_bench import qk_clip
from muonkit_bench.data import Corpus
from muonkit_bench.model import GPT, GPTConfig
from muonkit_bench.qk_clip import LogitMeter, run_arm
from muonkit_bench.train import RunConfig, lr_multiplier, train

VOCAB = 512  # the corpus fixture's (tests/bench/conftest.py)
TINY = GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32)
# Muon at lr 0.05 with no decay phase: the largest logit goes from 0.06 to ~13 in 60 steps.
CONFIG = RunConfig(
    model=TINY, lr=0.05, steps=60, batch_size=8, eval_interval=30, eval_batches=2, decay_frac=0.0, autocast=None
)
THRESHOLD = 2.0
# A step's forward runs on weights clipped for the previous batch and then updated once more, on a
# new batch: its largest logit is the threshold times one update's growth and the batch-to-batch
# spread (up to 1.42x here), not the threshold itself.
AFTER_CLIP = 2.0


def _reference_maxima(model: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per layer and head, max over batch and causal (i, j) of q_i . k_j / sqrt(d), in float64."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(model.blocks):
            h = block.ln_1(x).double()
            heads, channels = block.attn.n_head, h.shape[-1]
            q, k, _ = (h @ block.attn.c_attn.weight.double().T).split(channels, dim=2)
            q, k = (t.view(*idx.shape, heads, -1).transpose(1, 2) for t in (q, k))
            logits = q @ k.transpose(-1, -2) / math.sqrt(channels // heads)
            future = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), diagonal=1)
            out[f"blocks.{i}.attn"] = logits.masked_fill(future, -math.inf).amax(dim=(0, 2, 3))
            x = block(x)
    return out


def test_schedule_without_a_decay_phase_stays_at_one() -> None:
    """decay_frac=0 (the QK-Clip runs here): no division by the 0 decay steps at the scheduler's last call."""
    lrs = [lr_multiplier(s, steps=10, warmup_steps=2, decay_steps=0) for s in range(11)]
    assert lrs[:2] == [0.5, 1.0] and all(v == 1.0 for v in lrs[2:])


def test_meter_matches_float64_reference_and_skips_eval() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    with torch.no_grad():  # large q/k weights, so the logits are far from 0
        for block in model.blocks:
            block.attn.c_attn.weight[: 2 * TINY.n_embd].mul_(20.0)
    meter = LogitMeter(model)
    idx = torch.randint(0, VOCAB, (3, 16))
    model(idx)
    got = meter.collect()
    want = _reference_maxima(model, idx)
    assert set(got) == set(want)
    for name in want:  # fp32 logits of size ~10: rounding ~1e-6 relative
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-5)
    assert min(float(m.max()) for m in got.values()) > 1.0
    model(idx[:1])
    model(idx[1:])  # two passes in one step: the maxima over both
    torch.testing.assert_close(meter.collect(), got)
    assert meter.collect() == {}  # collect starts over
    model.eval()
    model(idx)
    assert meter.collect() == {}  # eval passes are not training steps
    meter.remove()
    model.train()
    model(idx)
    assert meter.collect() == {}


def test_meter_sees_what_qk_clip_acts_on() -> None:
    """Two ways to the same numbers: the bench's c_attn hook and QKClip's observed_attention."""
    torch.manual_seed(0)
    model = GPT(TINY)
    meter = LogitMeter(model)
    optimizer = HybridMuon(param_groups(model, lr=0.05))
    clip = QKClip(model, optimizer, threshold=1e-3)  # clips (nearly) every head
    for _ in range(2):
        idx = torch.randint(0, VOCAB, (2, 16))
        model(idx, idx)[1].backward()  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        assert clip.last_clipped_heads > 0
        seen = meter.collect()
        assert set(seen) == set(clip.last_max_logits)
        for name, heads in seen.items():
            torch.testing.assert_close(heads, clip.last_max_logits[name], rtol=1e-6, atol=1e-6)


def test_meter_refuses_a_model_without_the_gpt_attention() -> None:
    with pytest.raises(ValueError, match="LogitMeter found no CausalSelfAttention"):
        LogitMeter(torch.nn.Linear(4, 4))


def test_arms_clip_only_with_qk_clip_and_the_plain_arm_is_plain_training(corpus: Corpus) -> None:
    clipped = run_arm(CONFIG, corpus, qk_clip={"threshold": THRESHOLD}, progress=False)
    plain = run_arm(CONFIG, corpus, qk_clip=None, progress=False)
    assert clipped.qk_clip == {"threshold": THRESHOLD, "alpha": 0.5} and plain.qk_clip is None
    steps = CONFIG.steps
    for arm in (clipped, plain):
        assert len(arm.max_logit) == len(arm.trace.clipped_heads) == steps
        assert set(arm.trace.layer_max_logit) == {"blocks.0.attn", "blocks.1.attn"}
        assert arm.max_logit == [max(v) for v in zip(*arm.trace.layer_max_logit.values(), strict=True)]
    # The plain arm: never clipped, its logits far above the threshold, and its training exactly
    # what train() does without the meter (the hooks only read).
    assert plain.steps_clipped == 0 and plain.first_clip_step is None
    assert plain.peak_max_logit > 2 * AFTER_CLIP * THRESHOLD
    torch.manual_seed(CONFIG.seed)
    assert plain.run.train_loss == train(CONFIG, corpus, model=GPT(TINY), progress=False).train_loss
    # The clip arm: identical until the first clip, bounded after it.
    first = clipped.first_clip_step
    assert first is not None and clipped.steps_clipped > 1
    assert clipped.max_logit[:first] == plain.max_logit[:first]
    assert clipped.run.train_loss[:first] == plain.run.train_loss[:first]
    assert clipped.max_logit[first - 1] > THRESHOLD
    assert clipped.peak_after_first_clip is not None
    assert clipped.peak_after_first_clip <= AFTER_CLIP * THRESHOLD
    assert clipped.run.train_loss[first:] != plain.run.train_loss[first:]


def test_cli_writes_table_json_and_png(
    tmp_path: Path, cache_dir: Path, corpus: Corpus, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "qk"
    argv = ["bench", "qk-clip", "--preset", "tiny", "--steps", "12", "--threshold", "0.1", "--out", str(out)]
    assert main([*argv, "--cache-dir", str(cache_dir), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "peak logit" in printed and "QK-Clip" in printed and "no clip" in printed
    report = json.loads((out / "qk_clip.json").read_text())
    assert (out / "qk_clip.png").stat().st_size > 0
    assert report["benchmark"] == "qk-clip" and report["qk_clip"] == {"threshold": 0.1, "alpha": 0.5}
    arms = {a["name"]: a for a in report["arms"]}
    assert set(arms) == {"no clip", "QK-Clip"}
    assert all(len(a["max_logit"]) == 12 and a["run"]["steps"] == 12 for a in arms.values())
    assert arms["no clip"]["steps_clipped"] == 0 and arms["QK-Clip"]["steps_clipped"] > 0


def test_cli_refuses_a_bad_threshold_before_training(tmp_path: Path, cache_dir: Path, corpus: Corpus) -> None:
    argv = ["bench", "qk-clip", "--preset", "tiny", "--threshold", "-1", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=r"Invalid threshold=-1\.0"):
        main([*argv, "--cache-dir", str(cache_dir), "--no-progress"])
    assert not (tmp_path / "qk_clip.json").exists()


def test_per_head_flag_reaches_the_run_config() -> None:
    parser = argparse.ArgumentParser()
    qk_clip.add_arguments(parser)
    for flags, per_head in (([], False), (["--per-head"], True)):
        _, config, _ = qk_clip.build_configs(parser.parse_args(["--preset", "tiny", *flags]))
        assert config.per_head is per_head and config.optimizer == "muon"
