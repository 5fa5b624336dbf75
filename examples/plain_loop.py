"""One device: a plain training loop with HybridMuon and a per-group OneCycleLR.

python examples/plain_loop.py
"""

import torch
from torch import nn

import muonkit


class TinyLM(nn.Module):
    """An embedding, two MLP blocks and an output head: small enough for a CPU in seconds."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(2)
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)


def counting_batch(step: int, batch: int = 8, length: int = 16, vocab: int = 64) -> torch.Tensor:
    """Sequences that count up from a random start (mod vocab): a pattern the model can learn."""
    start = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(step))
    return (start + torch.arange(length)) % vocab


def main(steps: int = 30) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    # Muon for the hidden Linear weights, AdamW for the embedding, the head, the norms and the biases.
    opt = muonkit.HybridMuon(muonkit.param_groups(model), lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
    print(muonkit.explain(model))
    # OneCycleLR sets absolute lrs: give it one max_lr per group, or Muon and AdamW get the same one.
    max_lr = [0.02 if g["algorithm"] != "adamw" else 3e-3 for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps)
    for step in range(steps):
        idx = counting_batch(step)
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clips the raw gradients
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
