"""``muonkit bench dist`` end to end on a tiny GPT at W=2: it launches, and its counters agree.

Checks the accounting, never speed: the dispatch-mode counter (which also sees DTensor's
implicit collectives) must equal muonkit's own StrategyStats for muonkit's step, muonkit must
spend the single-device Newton-Schulz FLOPs once in total, and torch.optim.Muon under DDP once
per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muonkit.bench.model import GPT, GPTConfig
from muonkit.functional import orthogonalization_flops

pytestmark = pytest.mark.distributed

MODEL = ["--n-layer=1", "--n-embd=64", "--n-head=2", "--vocab=128", "--seq=16", "--batch=1"]


def test_bench_dist_runs_and_counts_consistently(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "muonkit.cli", "bench", "dist", "--world-sizes", "2", *MODEL]
    cmd += ["--warmup=1", "--steps=1", f"--out={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DDP: optimizer step only" in done.stdout and "FSDP2: optimizer step only" in done.stdout
    report = json.loads((tmp_path / "dist.json").read_text())
    rows = report["runs"]["2"]["rows"]
    model = GPT(GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=64))
    hidden = [p for name, p in model.named_parameters() if name.startswith("blocks") and p.ndim == 2]
    single = sum(orthogonalization_flops(p.shape[0], p.shape[1], 5, "gram") for p in hidden)  # muonkit's default
    plain = sum(orthogonalization_flops(p.shape[0], p.shape[1], 5) for p in hidden)  # torch.optim.Muon
    for layout in ("ddp", "fsdp2"):
        for rank in rows[f"{layout}/muonkit"]["per_rank"]:
            own = rank["muonkit_counters"]
            assert (own["flops"], own["bytes_sent"], own["collectives"]) == (
                rank["flops"],
                rank["bytes_sent"],
                rank["collectives"],
            ), f"{layout}: StrategyStats {own} vs dispatch counter {rank}"
        assert rows[f"{layout}/muonkit"]["flops"]["sum"] == single, layout
    assert rows["ddp/torch"]["flops"]["sum"] == 2 * plain
    assert rows["ddp/torch"]["collectives"]["max"] == 0
    assert rows["fsdp2/torch"]["collectives"]["max"] > 0  # DTensor's implicit redistributions, counted
