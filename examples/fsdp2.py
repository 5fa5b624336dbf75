"""FSDP2: shard each block and the root with fully_shard; HybridMuon reads the DTensor params.

torchrun --nproc_per_node=2 examples/fsdp2.py
"""

import torch
import torch.distributed as dist
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn
from torch.distributed.fsdp import fully_shard

import muonkit


def main(steps: int = 10) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-3)  # nothing else to pass
    for step in range(steps):
        idx = counting_batch(step * dist.get_world_size() + dist.get_rank())
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"strategy {opt.strategy.name}; loss {loss.item():.4f}")
    dist.barrier()  # every rank done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
