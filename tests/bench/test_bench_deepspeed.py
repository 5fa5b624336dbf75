"""Smoke run of ``muonkit bench deepspeed`` at tiny size (2 ranks, ZeRO-1 and 3): fields, counts, finite losses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is not installed (pip install 'muonkit[deepspeed]')")
pytestmark = pytest.mark.distributed

MODEL = ["--n-layer=1", "--n-embd=32", "--n-head=2", "--vocab=512", "--seq=16", "--batch=2"]


def test_bench_deepspeed_runs_every_method_at_each_stage(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "muonkit.cli", "bench", "deepspeed", "--stages", "1", "3", *MODEL]
    cmd += ["--steps=3", "--warmup=1", "--val-batches=1", f"--out={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "deepspeed.json").read_text())
    rows = report["run"]["rows"]
    assert set(rows) == {f"{s}/{m}" for s in (1, 3) for m in ("muonkit", "deepspeed_muon", "deepspeed_adamw")}
    for key, row in rows.items():
        assert math.isfinite(row["val_loss"]) and math.isfinite(row["final_train_loss"]), key
        assert row["state_bytes"] > 0 and row["gradient_bytes"] > 0, key
    for stage in (1, 3):
        # 4 hidden matrices in one block (qkv, proj, fc, proj), each orthogonalized once per step over both ranks
        assert rows[f"{stage}/muonkit"]["orthogonalized_per_step"] == 4
        # muonkit clips by the raw gradient's norm, as AdamW does: about the same mean reported norm
        # over 3 steps (the built-in Muon reports its orthogonalized update's norm, ~50x larger)
        assert rows[f"{stage}/muonkit"]["grad_norm_reported"] == pytest.approx(
            rows[f"{stage}/deepspeed_adamw"]["grad_norm_reported"], rel=0.2
        )
