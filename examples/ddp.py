"""DDP: one HybridMuon per rank, each Muon matrix orthogonalized once across the ranks; a checkpoint
that loads at any world size.

    torchrun --nproc_per_node=2 examples/ddp.py [CHECKPOINT_DIR]
"""

import sys
import tempfile

import torch
import torch.distributed as dist
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import muonkit
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint


def main(steps: int = 10) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(TinyLM())
    opt = muonkit.HybridMuon(muonkit.param_groups(model.module), process_group=dist.group.WORLD)
    for step in range(steps):
        idx = counting_batch(step * dist.get_world_size() + rank)  # each rank its own batch
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        print(f"loss {loss.item():.4f}; matrices orthogonalized by rank 0: {opt.strategy.stats.matrices}")
    # Every rank calls both; the checkpoint loads at any world size (DDP, FSDP2 or one device).
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir() + "/muonkit-ddp-example"
    save_checkpoint(path, model=model.module, optimizer=opt)
    load_checkpoint(path, model=model.module, optimizer=opt)
    dist.barrier()  # every rank done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
