"""Plain params at world size > 1 without ``process_group=``: taken for DDP replicas where every rank
holds the same params, refused alike on every rank where they differ (pipeline stages, a model per
rank), and checked every step (ranks whose gradients differ raise instead of drifting apart).

accelerate's and Lightning's DDP build the optimizer from the plain model without a group, as
their READMEs show; before, the first step raised and asked for ``process_group=``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from common import all_sum, rank_differences
from harness import Context, check
from torch import nn

import muonkit
from muonkit.distributed import ReplicatedStrategy, SingleDeviceStrategy


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train_ddp(steps: int, **kwargs: Any) -> tuple[muonkit.HybridMuon, list[torch.Tensor]]:
    """Plain torch DDP, HybridMuon built from the unwrapped model as users do, each rank its own data."""
    model = nn.parallel.DistributedDataParallel(_model())
    opt = muonkit.HybridMuon(muonkit.param_groups(model.module, lr=0.02, adamw_lr=3e-4), **kwargs)
    data = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=data), torch.randint(0, 4, (4,), generator=data)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt, [p.detach().clone() for p in model.parameters()]


@check(2)
def ddp_without_a_process_group_trains_as_replicas(ctx: Context) -> None:
    """Every matrix orthogonalized once over the ranks per step, bit for bit the run with
    ``process_group=WORLD``, ranks identical."""
    steps = 3
    explicit_opt, explicit = _train_ddp(steps, process_group=dist.group.WORLD)
    opt, params = _train_ddp(steps)
    strategy = opt.strategy
    assert isinstance(strategy, ReplicatedStrategy) and strategy.verify_grads, strategy
    assert not explicit_opt.strategy.verify_grads  # the user said so: no fingerprint
    assert all_sum(strategy.stats.matrices) == 2 * steps, strategy.stats
    assert all(torch.equal(a, b) for a, b in zip(explicit, params, strict=True)), "differs from process_group=WORLD"
    assert not rank_differences(params)


def _own_models(**kwargs: Any) -> tuple[muonkit.HybridMuon, list[nn.Parameter]]:
    """Same shapes on every rank, but each rank its own model and gradients (no DDP)."""
    model = _model(seed=ctx_rank())
    params = list(model.parameters())
    opt = muonkit.HybridMuon(muonkit.param_groups(model, lr=0.02, adamw_lr=3e-4), **kwargs)
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7 + ctx_rank()))
    return opt, params


def ctx_rank() -> int:
    return dist.get_rank()


def _raises_everywhere(opt: muonkit.HybridMuon, *expected: str) -> None:
    try:
        opt.step()
    except ValueError as e:
        assert all(text in str(e) for text in expected), str(e)
    else:
        raise AssertionError(f"no error on rank {dist.get_rank()}")


@check(2)
def ranks_whose_gradients_differ_raise_instead_of_drifting(ctx: Context) -> None:
    opt, params = _own_models()
    before = [p.detach().clone() for p in params]
    _raises_everywhere(opt, "gradients (plain params taken as DDP replicas", "SingleDeviceStrategy()")
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True)), "a param changed"
    assert not opt.state, "state was created"

    # no verdict to ride with: checked one step late, on every rank
    opt, params = _own_models(nonfinite="unchecked")
    opt.step()
    _raises_everywhere(opt, "at the previous step", "SingleDeviceStrategy()")

    # the explicit opt-out trains each rank's model on its own
    opt, params = _own_models(strategy=SingleDeviceStrategy())
    opt.step()
    assert len(opt.state) == 4


def _stage(rank: int) -> nn.Module:
    """A pipeline stage of a 3-layer model: rank 0 holds the first layer, rank 1 the two others."""
    torch.manual_seed(rank)
    return nn.Linear(8, 16) if rank == 0 else nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))


@check(2)
def pipeline_stages_are_refused_on_every_rank(ctx: Context) -> None:
    """Ranks that hold different params (here even different counts) all raise at the first step,
    before anything changes, naming what to pass; one group per stage trains."""
    stage = _stage(ctx.rank)
    params = list(stage.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt = muonkit.HybridMuon(muonkit.param_groups(stage, lr=0.02, adamw_lr=3e-4))
    before = [p.detach().clone() for p in params]
    _raises_everywhere(opt, "the ranks hold different ones", "pipeline stages", "process_group=")
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True)), "a param changed"
    assert not opt.state, "state was created"

    groups = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank makes every group
    opt = muonkit.HybridMuon(muonkit.param_groups(stage, lr=0.02, adamw_lr=3e-4), process_group=groups[ctx.rank])
    opt.step()
    assert isinstance(opt.strategy, ReplicatedStrategy) and opt.strategy.comm.world_size == 1


@check(2)
def lightning_ddp_without_a_process_group_trains_as_replicas(ctx: Context) -> None:
    """Lightning's ``strategy="ddp"`` with ``configure_optimizers`` as its docs show."""
    try:
        import lightning as L
    except ImportError:
        return  # the [dev] extra installs it; without it there is nothing to check

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> muonkit.HybridMuon:
            return muonkit.HybridMuon(muonkit.param_groups(self, lr=0.02, adamw_lr=3e-4))

    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    model = Lit()
    trainer = L.Trainer(
        accelerator="cpu", devices=ctx.world_size, strategy="ddp", max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    opt = trainer.optimizers[0]
    assert isinstance(opt.strategy, ReplicatedStrategy), opt.strategy
    assert all_sum(opt.strategy.stats.matrices) == 2 * 3, opt.strategy.stats
    assert not rank_differences(list(model.parameters()))
    assert dist.is_initialized()
