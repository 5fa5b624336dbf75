"""FSDP2 + tensor parallelism on a 2-D mesh ("dp", "tp"): plain torch APIs, nothing passed to HybridMuon.
With 4 ranks the mesh is 2 x 2; with 2 ranks, 1 x 2. HSDP is the same with
fully_shard(model, mesh=init_device_mesh(..., (R, S), mesh_dim_names=("replicate", "shard"))).

    torchrun --nproc_per_node=4 examples/mesh_2d.py
"""

import torch
import torch.distributed as dist
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import muonkit


def main(steps: int = 10) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:  # each MLP: first Linear column-parallel, second row-parallel
        parallelize_module(block, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-3)
    for step in range(steps):
        idx = counting_batch(step * mesh["dp"].size() + mesh["dp"].get_local_rank())  # same batch across tp
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"mesh {tuple(mesh.shape)}; strategy {opt.strategy.name}; loss {loss.item():.4f}")
    dist.barrier()  # every rank done with the group before any tears it down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
