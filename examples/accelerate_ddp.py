"""accelerate: build HybridMuon and pass it to prepare; nothing else. Under DDP its first step
finds the same params on every rank and takes them for replicas (and checks every step that their
gradients agree); under FSDP2 the params become DTensors.

    torchrun --nproc_per_node=2 examples/accelerate_ddp.py   # or: accelerate launch examples/accelerate_ddp.py
"""

import torch
from accelerate import Accelerator
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn

import muonkit


def main(steps: int = 6) -> None:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = TinyLM()
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-3)
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
