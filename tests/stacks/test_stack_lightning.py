"""muonkit with Lightning: ``ModelParallelStrategy`` (FSDP2) on CPU, the lines of docs/stacks/lightning.md.

(``strategy="fsdp"``, FSDP1, is refused by muonkit and needs a GPU in Lightning:
tests/stacks/test_stack_fsdp1.py checks the refusal with torch's FSDP1 directly.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import muonkit

L = pytest.importorskip("lightning")


class LitModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net)  # FSDP2: the params become DTensors, HybridMuon takes its sharded path

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> muonkit.HybridMuon:
        return muonkit.HybridMuon(muonkit.param_groups(self, lr=0.02, adamw_lr=3e-4))


@pytest.fixture
def no_process_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_model_parallel_strategy_trains_with_hybrid_muon_on_fsdp2(no_process_group: None) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    model = LitModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    optimizer = trainer.optimizers[0]
    assert optimizer.strategy.name == "fsdp2"
    muon = [n for g in optimizer.param_groups if g["algorithm"] == "muon" for n in g["param_names"]]
    assert muon == ["net.0.weight", "net.2.weight"] and len(optimizer.state) == 4
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    assert all(not torch.equal(before[n], after[n]) for n in before)
