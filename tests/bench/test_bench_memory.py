"""`muonkit bench memory`: the arithmetic against hand-computed counts, and a tiny smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from muonkit import explain
from muonkit.cli import main
from muonkit_bench import memory
from muonkit_bench.memory_math import ElementBytes, Savings, model_state_bytes, shard, zero_table


class Tiny(nn.Module):
    """Counts by hand: embedding 10x4 = 40 (AdamW), fc 6x4 = 24 (Muon) + bias 6 (AdamW),
    norm 6 + 6 (AdamW), proj 4x6 = 24 (Muon). Muon 48, AdamW 58, total 106."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 4, bias=False)


def test_routing_counts_of_the_hand_model() -> None:
    report = explain(Tiny())
    assert (report.numel("muon"), report.numel("adamw")) == (48, 58)


@pytest.mark.parametrize(
    ("stage", "optimizer", "expected"),
    [
        # stage 0, everything replicated: params 2*106, grads 2*106, master 4*106, states.
        (0, "adamw", (212, 212, 424, 8 * 106)),
        (0, "hybrid_muon", (212, 212, 424, 4 * 48 + 8 * 58)),
        # world size 4: each set padded to a multiple of 4: ceil(48/4) = 12, ceil(58/4) = 15 -> 27.
        (1, "adamw", (212, 212, 4 * 27, 8 * 27)),
        (1, "hybrid_muon", (212, 212, 4 * 27, 4 * 12 + 8 * 15)),
        (2, "hybrid_muon", (212, 2 * 27, 4 * 27, 4 * 12 + 8 * 15)),
        (3, "adamw", (2 * 27, 2 * 27, 4 * 27, 8 * 27)),
        (3, "hybrid_muon", (2 * 27, 2 * 27, 4 * 27, 4 * 12 + 8 * 15)),
    ],
)
def test_zero_bytes_match_hand_computation(stage: int, optimizer: str, expected: tuple[int, int, int, int]) -> None:
    rank = model_state_bytes(n_muon=48, n_adamw=58, optimizer=optimizer, stage=stage, world_size=4)  # type: ignore[arg-type]
    assert (rank.params, rank.grads, rank.master, rank.states) == expected
    assert rank.total == sum(expected)


def test_savings_are_f_over_2_and_f_over_3() -> None:
    s = Savings.of(n_muon=48, n_adamw=58)
    f = 48 / 106
    assert s.states == pytest.approx(f / 2, abs=1e-12)
    assert s.states_and_master == pytest.approx(f / 3, abs=1e-12)
    bf16_momentum = Savings.of(n_muon=48, n_adamw=58, sizes=ElementBytes(muon_state=2))
    assert bf16_momentum.states == pytest.approx(0.75 * f, abs=1e-12)


def test_zero_table_shape_and_bad_arguments() -> None:
    table = zero_table(n_muon=48, n_adamw=58, world_size=1)
    assert sorted(table) == [0, 1, 2, 3]
    assert table[3]["adamw"] == table[0]["adamw"]  # one rank: partitioning changes nothing
    assert shard(10, 4) == 3
    with pytest.raises(ValueError, match="Invalid stage=4"):
        model_state_bytes(n_muon=1, n_adamw=1, optimizer="adamw", stage=4, world_size=1)
    with pytest.raises(ValueError, match="Invalid world_size=0"):
        model_state_bytes(n_muon=1, n_adamw=1, optimizer="adamw", stage=1, world_size=0)


def test_bundled_qwen_reproduces_the_45_percent_arithmetic() -> None:
    name, config = memory.load_config("qwen2.5-3b")
    report = memory.model_report(name, config, world_size=8, sizes=ElementBytes())
    assert report["params"]["total"] == 3_085_938_688  # Qwen2.5-3B's published 3.09B
    assert report["muon_fraction"] == pytest.approx(0.899, abs=5e-4)
    assert report["saving_states"] == pytest.approx(0.45, abs=1e-3)
    assert report["saving_states_and_master"] == pytest.approx(0.30, abs=1e-3)
    assert set(memory.bundled_configs()) >= {"qwen2.5-3b", "llama-3-8b", "mixtral-8x7b", "moonlight-16b-a3b"}


def test_cli_smoke_with_a_measured_probe(tmp_path: pytest.TempPathFactory) -> None:
    out = tmp_path / "mem"  # type: ignore[operator]
    argv = ["bench", "memory", "--config", "qwen2.5-3b", "--world-size", "4", "--measure", "--out", str(out)]
    argv += ["--probe-model", "gpt", "--probe-hidden", "64", "--probe-layers", "1", "--probe-vocab", "128"]
    argv += ["--probe-seq", "16", "--probe-batch", "2", "--probe-steps", "2", "--probe-optimizers", "adamw,hybrid_muon"]
    assert main(argv) == 0
    data = json.loads((out / "memory.json").read_text())
    assert data["environment"]["torch"] == torch.__version__
    assert data["models"][0]["zero"]["2"]["hybrid_muon"]["total"] < data["models"][0]["zero"]["2"]["adamw"]["total"]
    adamw, hybrid = data["measured"]
    for r in (adamw, hybrid):
        assert r["peak"] >= r["steady"] > 0
        assert r["state_bytes"] == r["predicted"]["states"]  # exact: the states the optimizer really holds
        assert all(torch.isfinite(torch.tensor(r["losses"])))


_SEES_ALLOCATION = """
import torch
from muonkit_bench import memory_probe
memory_probe.reset_peak()
before, _ = memory_probe.rss_bytes()
x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
del x
now, peak = memory_probe.rss_bytes()
print(before, now, peak)
"""


def test_rss_reader_sees_an_allocation() -> None:
    # In a fresh process under the probe's own malloc setting (every tensor its own mapping): in
    # the test process an allocation can reuse pages that are already resident and never show up.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SEES_ALLOCATION], env=env, capture_output=True, text=True, check=True)
    before, now, peak = map(int, out.stdout.split())
    assert peak - before > 32 * 2**20  # the high-water mark saw the 64 MiB
    assert now - before < 32 * 2**20  # and the freed tensor left RSS
