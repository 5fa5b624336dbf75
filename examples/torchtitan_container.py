"""torchtitan: HybridMuonContainer is a torchtitan optimizer container (one HybridMuon per model
part), here under FSDP2 with torchtitan's lr-scheduler container. In a torchtitan job config:
config.optimizer = HybridMuonContainer.Config(lr=0.02, adamw_lr=3e-4, weight_decay=0.01).

    torchrun --nproc_per_node=2 examples/torchtitan_container.py
"""

import torch
import torch.distributed as dist
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer

from muonkit.integrations.torchtitan import HybridMuonContainer


def main(steps: int = 6) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizers = HybridMuonContainer.Config(lr=0.02, adamw_lr=3e-3, weight_decay=0.01).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    for step in range(steps):
        idx = counting_batch(step * dist.get_world_size() + dist.get_rank())
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f}; state dict keys like {next(iter(optimizers.state_dict()))}")
    dist.barrier()  # every rank done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
