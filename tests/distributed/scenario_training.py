"""Real DDP and FSDP2 training (forward, backward, gradient averaging by the engine) in float64.

Control: the single-device HybridMuon on the whole batch. Tolerance 1e-12 (absolute, on params
of size ~0.1-1 after a few steps of lr 0.02): everything runs in float64, Newton-Schulz included,
so the only difference is the order in which the engine sums the per-rank gradients (relative
rounding ~1e-16); Newton-Schulz is a fixed polynomial of moderate degree and a few steps of
lr 0.02 cannot grow that past ~1e-13. Measured: <= 7.3e-16 at W=2 and 4. (Bit equality of the
bf16 path on identical gradients is what scenario_optimizer checks.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import full
from harness import Context, check
from torch import nn

import muonkit

TOL = 1e-12
BATCH = 8  # global batch, split evenly over ranks


class Net(nn.Module):
    """Linear layers, MoE-style 3D experts (rows 5: uneven over 2 and 4 ranks), a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.hidden = nn.Linear(10, 10)
        self.experts = nn.Parameter(torch.randn(3, 10, 10) * 0.3)
        self.unused = nn.Linear(10, 10)  # never in the forward pass: no gradient, every rank
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = F.gelu(self.hidden(h))
        h = h + torch.einsum("bi,eoi->bo", h, self.experts) / 3
        return self.head(self.norm(h))


def _groups(model: nn.Module) -> list[dict]:
    muon = [model.inp.weight, model.hidden.weight, model.experts, model.unused.weight]
    ids = {id(p) for p in muon}
    adamw = [p for p in model.parameters() if id(p) not in ids]
    return [
        {"params": muon, "algorithm": "muon", "ns_dtype": torch.float64, "weight_decay": 0.01},
        {"params": adamw, "algorithm": "adamw", "lr": 1e-2},
    ]


def _data(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(
        rows, 5, generator=g, dtype=torch.float64
    )


def _net() -> Net:
    torch.manual_seed(1)
    return Net().double()


def _local(t: torch.Tensor, ctx: Context) -> torch.Tensor:
    return t.chunk(ctx.world_size)[ctx.rank]


def _train(layout: str, ctx: Context, *, steps: int = 3, micro: int = 1) -> nn.Module:
    """Train ``steps`` steps; each step's local batch in ``micro`` micro-batches (sync on the last)."""
    model = _net()
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(model, find_unused_parameters=True)
        opt = muonkit.HybridMuon(_groups(model), process_group=dist.group.WORLD)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.hidden)
        wrapped = fully_shard(model)
        opt = muonkit.HybridMuon(_groups(model))
    for step in range(steps):
        x, y = (_local(t, ctx) for t in _data(step))
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            last = i == micro - 1
            if layout == "ddp" and not last:
                with wrapped.no_sync():
                    (F.mse_loss(wrapped(xm), ym) / micro).backward()
            else:
                if layout == "fsdp":
                    wrapped.set_requires_gradient_sync(last)
                (F.mse_loss(wrapped(xm), ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    assert opt.state[model.unused.weight] == {}, "a param without gradient must get no state"
    return model


def _single(steps: int = 3) -> nn.Module:
    model = _net()
    opt = muonkit.HybridMuon(_groups(model), strategy=muonkit.distributed.SingleDeviceStrategy())
    for step in range(steps):
        x, y = _data(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def _compare(model: nn.Module, reference: nn.Module, what: str) -> None:
    worst = 0.0
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        err = (full(p.detach()) - full(r.detach())).abs().max().item()
        worst = max(worst, err)
        assert err <= TOL, f"{what}: {name} differs by {err:.3e} > {TOL}"
    if dist.get_rank() == 0:
        print(f"{what}: max |param - reference| = {worst:.2e} (tolerance {TOL})")
    moved = max(
        (full(p.detach()) - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), _net().parameters(), strict=True)
    )
    assert moved > 1e-3, f"{what}: params barely moved ({moved:.1e}); the comparison would prove nothing"


@check(2, 4)
def ddp_training_matches_single_device(ctx: Context) -> None:
    _compare(_train("ddp", ctx), _single(), "DDP")


@check(2, 4)
def fsdp2_training_matches_single_device(ctx: Context) -> None:
    _compare(_train("fsdp", ctx), _single(), "FSDP2")


@check(2)
def ddp_no_sync_accumulation_equals_big_batch(ctx: Context) -> None:
    _compare(_train("ddp", ctx, micro=2), _train("ddp", ctx), "DDP no_sync k=2 vs one batch")


@check(2)
def fsdp2_accumulation_equals_big_batch(ctx: Context) -> None:
    _compare(_train("fsdp", ctx, micro=2), _train("fsdp", ctx), "FSDP2 set_requires_gradient_sync k=2 vs one batch")
