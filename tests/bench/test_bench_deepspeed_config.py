"""``muonkit bench deepspeed``'s configs and report, without launching DeepSpeed (its worker and table)."""

from __future__ import annotations

import argparse

from muonkit_bench import deepspeed as bench
from muonkit_bench.deepspeed_worker import METHODS, ds_config


def test_bench_configs_and_report() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    kinds = {m: ds_config(3, m, args)["optimizer"]["type"] for m in METHODS}
    assert kinds == {"muonkit": "muonkit.HybridMuon", "deepspeed_muon": "Muon", "deepspeed_adamw": "AdamW"}
    assert ds_config(3, "deepspeed_muon", args)["zero_optimization"]["reduce_scatter"] is False
    assert all(ds_config(1, m, args)["gradient_clipping"] == 1.0 for m in METHODS)
    row = {
        "train_loss_mean_over_ranks": 5.0, "val_loss": 5.1, "grad_norm_reported": [1.0, 2.0], "step_s": 0.1,
        "iter_s": 0.5, "backward_bytes": 1e6, "step_bytes": 2e6, "matmul_flops": 3e9, "state_bytes": 2**20,
        "orthogonalized_per_step": 16, "muonkit_bytes_per_step": 1e6, "gradient_bytes": 4e6,
    }  # fmt: skip
    report = {
        "setup": {"steps": 30, "ga": 2, "batch": 4, "seq": 128, "clip": 1.0, "bf16": True, "stages": [3],
                  "methods": ["muonkit"]},
        "run": {"world_size": 2, "rows": {"3/muonkit": row}},
    }  # fmt: skip
    text = bench.format_report(report)
    assert "muonkit" in text and "0.25x one bf16 gradient" in text
