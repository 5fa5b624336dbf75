"""DeepSpeed ZeRO with muonkit: the config names "muonkit.HybridMuon", mk_ds.initialize reads it.

deepspeed --num_gpus 2 examples/deepspeed_launcher.py
torchrun --nproc_per_node=2 examples/deepspeed_launcher.py   # on CPUs (gloo)
"""

import torch
import torch.distributed as dist
from plain_loop import TinyLM, counting_batch  # the model and data of examples/plain_loop.py
from torch import nn

from muonkit.integrations import deepspeed as mk_ds

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,  # on the raw gradients, as for AdamW
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "muonkit.HybridMuon", "params": {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.01}},
}


class LossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.lm(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


def main(steps: int = 4) -> None:
    if not torch.cuda.is_available():
        import deepspeed.ops

        dist.init_process_group("gloo")
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # CPU only: skip a JIT build gloo does not need
    torch.manual_seed(0)
    engine, *_ = mk_ds.initialize(model=LossModel(), config=CONFIG)
    for step in range(steps * CONFIG["gradient_accumulation_steps"]):
        loss = engine(counting_batch(step * dist.get_world_size() + dist.get_rank()).to(engine.device))
        engine.backward(loss)
        engine.step()  # the optimizer steps every gradient_accumulation_steps micro-batches
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f}; DeepSpeed's global grad norm {float(engine.get_global_grad_norm()):.3f}")


if __name__ == "__main__":
    main()
