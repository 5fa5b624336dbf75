"""Lightning with ModelParallelStrategy (FSDP2): shard in configure_model, build HybridMuon in
configure_optimizers.

    python examples/lightning_fsdp2.py   # one process; Lightning launches more with devices=N
"""

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn
from torch.distributed.fsdp import fully_shard

import muonkit


class LitLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyLM()  # its output layer is named lm_head: routed to AdamW

    def configure_model(self) -> None:
        for block in self.net.blocks:
            fully_shard(block)
        fully_shard(self.net)  # the params become DTensors

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        return nn.functional.cross_entropy(self.net(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())

    def configure_optimizers(self) -> muonkit.HybridMuon:
        return muonkit.HybridMuon(muonkit.param_groups(self), lr=0.02, adamw_lr=3e-3)


def main() -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.cat([counting_batch(s) for s in range(8)]))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = LitLM()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    print(f"strategy {trainer.optimizers[0].strategy.name}; step {trainer.global_step}")


if __name__ == "__main__":
    main()
