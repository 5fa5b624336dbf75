"""DeepSpeed ZeRO-2 with muonkit on one GPU against the single-device reference.

The model, data, config and reference are tests/deepspeed_engine/ds_common.py's (there run on 2 CPU
ranks with gloo): 3 optimizer steps of 2 accumulated micro-batches, gradient clipping active,
weight decay, Newton-Schulz in float64 on both sides. Tolerance: 1e-3 relative error of each
tensor's total update (the CPU ranks hold 1e-4, measured 3e-6; here the forward and backward run
in fp32 on the GPU and on the CPU, whose summation orders differ). A clip applied to the
orthogonalized update, Newton-Schulz per micro-batch or a skipped Muon update miss by order 1.
Skipped where deepspeed is not installed (it is not in the GPU image: it ships as an sdist).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed_engine"))

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_zero2_on_one_gpu_matches_single_device(cuda: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from ds_common import GA, Net, batch, config, full_params, muon_matrices, reference, update_errors

    from muonkit.integrations import deepspeed as mk_ds

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.manual_seed(0)
    model = Net()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = mk_ds.initialize(model=model, config=config(2))
    try:
        strategy = engine.optimizer.optimizer.strategy
        assert strategy.name == "zero" and engine.device.type == "cuda"
        for step in range(STEPS):
            for micro in range(GA):
                idx, targets = (t.to(engine.device) for t in batch(step, micro, 0))
                engine.backward(engine(idx, targets))
                engine.step()
        got = {n: t.cpu() for n, t in full_params(engine).items()}
        want, _ = reference(init, STEPS, world=1, bf16=False)
        errors = update_errors(got, want, init)
        assert max(errors.values()) <= 1e-3, errors
        assert strategy.stats.matrices == STEPS * muon_matrices(want)  # once per matrix per step
    finally:
        dist.destroy_process_group()
