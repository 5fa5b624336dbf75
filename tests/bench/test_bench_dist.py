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
import torch

from muonkit.functional import orthogonalization_flops
from muonkit_bench.model import GPT, GPTConfig

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
    ns_dtype = _ns_dtype(report)  # the run's default: bf16 where fast (the plain iteration), else fp32 (Gram)
    single = sum(orthogonalization_flops(p.shape[0], p.shape[1], 5, "gram", ns_dtype) for p in hidden)
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


def _ns_dtype(report: dict) -> torch.dtype:
    """The default Newton-Schulz dtype the benchmark ran with (it depends on the CPU; this test
    process forces fp32, see conftest.py)."""
    return getattr(torch, report["environment"]["default_ns_dtype"].removeprefix("torch."))


def _single_flops(layout: str, ns_dtype: torch.dtype) -> int:
    """Newton-Schulz FLOPs of one single-device HybridMuon step (Gram, 5 steps) on the layout's model."""
    import argparse
    import math

    import muonkit
    from muonkit_bench.dist_layouts import build_model

    sizes = argparse.Namespace(n_layer=1, n_embd=64, n_head=2, vocab=128, seq=16)
    groups = muonkit.param_groups(build_model(layout, sizes))
    shapes = [tuple(p.shape) for g in groups if g["algorithm"] == "muon" for p in g["params"]]
    return sum(math.prod(s[:-2]) * orthogonalization_flops(s[-2], s[-1], 5, "gram", ns_dtype) for s in shapes)


def test_bench_dist_layouts_on_meshes(tmp_path: Path) -> None:
    """``--layouts hsdp fsdp2-tp ep`` at W=4: the 2x2 meshes are built as intended, every row is
    measured or reported unsupported, and the HSDP baseline repeats Newton-Schulz in each replica."""
    cmd = [sys.executable, "-m", "muonkit.cli", "bench", "dist", "--world-sizes", "4", *MODEL]
    cmd += ["--layouts", "hsdp", "fsdp2-tp", "ep", "--warmup=1", "--steps=1", f"--out={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for title in ("HSDP", "FSDP2-TP", "EP"):
        assert f"\n{title}: optimizer step only" in done.stdout
    assert "DDP: optimizer" not in done.stdout and "vs 1-device" in done.stdout
    report = json.loads((tmp_path / "dist.json").read_text())
    rows, ns_dtype = report["runs"]["4"]["rows"], _ns_dtype(report)
    assert set(rows) == {"hsdp/muonkit", "hsdp/torch", "hsdp/replicas", "fsdp2-tp/muonkit", "fsdp2-tp/torch"} | {
        "ep/muonkit",
        "ep/torch",
    }
    # the layouts hand the optimizer what plain torch builds (the same for every row of a layout)
    for name in ("muonkit", "torch"):
        assert rows[f"hsdp/{name}"]["placements"] == {"2-D on (replicate=2, shard=2): (R, S(0))": 4}
        assert rows[f"fsdp2-tp/{name}"]["placements"] == {
            "2-D on (dp=2, tp=2): (_S(0, 2), S(0))": 2,  # Colwise c_attn, c_fc: TP rows, then FSDP rows, strided
            "2-D on (dp=2, tp=2): (S(0), S(1))": 2,  # Rowwise c_proj
        }
        assert rows[f"ep/{name}"]["placements"] == {
            "2-D on (dp=2, ep=2): (R, S(0))": 2,  # attention: HSDP over (dp, ep)
            "3-D on (dp=2, ep=2): (S(1), S(0))": 2,  # expert stacks: experts over ep, dim 1 over dp
        }
    # Newton-Schulz repeated in every replica: 2 replicas do the single-device work twice in total
    replicas, single = rows["hsdp/replicas"], _single_flops("hsdp", ns_dtype)
    assert replicas["flops"]["sum"] == 2 * single
    assert replicas["flops"]["max"] >= 2 * single // 4
    assert replicas["update_error"] < 1e-3  # same math as one device, only repeated
    for rank in replicas["per_rank"]:
        own = rank["muonkit_counters"]
        assert (own["flops"], own["bytes_sent"], own["collectives"]) == (
            rank["flops"],
            rank["bytes_sent"],
            rank["collectives"],
        )
    # torch.optim.Muon: runs on the 2-D DTensors of HSDP and FSDP2+TP (measured), rejects 3-D experts
    for layout in ("hsdp", "fsdp2-tp"):
        assert rows[f"{layout}/torch"]["flops"]["sum"] > 0 and rows[f"{layout}/torch"]["update_error"] is not None
    assert "Muon only supports 2D parameters" in rows["ep/torch"]["unsupported"]
    assert "ep/torch" not in done.stdout and "unsupported: ValueError: Muon only supports 2D" in done.stdout
    # HybridMuon: unsupported until N-D meshes land; then each matrix once over the whole mesh
    for layout in ("hsdp", "fsdp2-tp", "ep"):
        row = rows[f"{layout}/muonkit"]
        if "unsupported" in row:
            assert row["unsupported"].split(":")[0] in ("NotImplementedError", "ValueError"), row
            continue
        assert row["flops"]["sum"] == _single_flops(layout, ns_dtype), layout
        assert row["update_error"] < 1e-3, layout


def test_bench_dist_layouts_need_even_world_sizes() -> None:
    from muonkit.cli import main

    with pytest.raises(ValueError, match=r"--world-sizes \[2\] do not fit: use even world sizes >= 4"):
        main(["bench", "dist", "--layouts", "ddp", "hsdp", "--world-sizes", "2", "4"])
