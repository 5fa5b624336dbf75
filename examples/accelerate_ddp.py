"""accelerate: build HybridMuon after Accelerator() and pass it to prepare. Under DDP give it the
process group (FSDP2 needs nothing: the params become DTensors).

    torchrun --nproc_per_node=2 examples/accelerate_ddp.py   # or: accelerate launch examples/accelerate_ddp.py
"""

import torch
import torch.distributed as dist
from accelerate import Accelerator
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn

import muonkit


def main(steps: int = 6) -> None:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = TinyLM()
    group = dist.group.WORLD if accelerator.num_processes > 1 else None  # DDP: the ranks share each matrix
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-3, process_group=group)
    model, opt = accelerator.prepare(model, opt)
    for step in range(steps):
        idx = counting_batch(step * accelerator.num_processes + accelerator.process_index).to(accelerator.device)
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    accelerator.print(f"loss {loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
