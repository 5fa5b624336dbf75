"""Per-head Muon under DeepSpeed ZeRO-1/2/3 on 2 CPU ranks (issue 23): ``"per_head": true`` in the
config's muonkit params equals single-device HybridMuon with ``param_groups(model, per_head=True)``
on the same micro-batches (fp32, Newton-Schulz in float64: 1e-4 of each tensor's update, as the
other fp32 checks), and every per-head matrix is orthogonalized exactly once per optimizer step
over the ranks, whichever partition the heads' rows and columns fall in."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ds_common import GA, OPTIONS, VOCAB, batch, config, full_params, train, update_errors
from ds_worker import Context, check, quiet_deepspeed
from torch import Tensor, nn

import muonkit
from muonkit.distributed import SingleDeviceStrategy

STEPS = 2
HEADS = 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, HEADS, batch_first=True)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(x)))


class AttnNet(nn.Module):
    """Two attention blocks of 4 heads: Q/K/V rows and output columns by head."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return 4 * F.cross_entropy(self.head(x).flatten(0, 1).float(), targets.flatten())


def reference(init: dict[str, Tensor], *, world: int) -> tuple[nn.Module, int]:
    """Single-device per-head HybridMuon on the averaged, clipped gradient; and its matrices per step."""
    master = AttnNet()
    master.load_state_dict(init)
    options = {k: v for k, v in OPTIONS.items() if k != "ns_dtype"}
    groups = muonkit.param_groups(master, **options, per_head=True)
    strategy = SingleDeviceStrategy()
    opt = muonkit.HybridMuon(groups, ns_dtype=torch.float64, strategy=strategy)
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in master.parameters()]
        for rank in range(world):
            for micro in range(GA):
                grads = torch.autograd.grad(master(*batch(step, micro, rank)) / GA, list(master.parameters()))
                total = [t + g for t, g in zip(total, grads, strict=True)]
        for p, g in zip(master.parameters(), total, strict=True):
            p.grad = g / world
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
    return master, strategy.stats.matrices // STEPS


def _per_head_matches(stage: int) -> None:
    quiet_deepspeed()
    from muonkit.integrations import deepspeed as mk_ds

    torch.manual_seed(0)
    model = AttnNet()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = config(stage)
    cfg["optimizer"]["params"]["per_head"] = True
    engine, *_ = mk_ds.initialize(model=model, config=cfg)
    hybrid = engine.optimizer.optimizer
    train(engine, STEPS)
    want, per_step = reference(init, world=dist.get_world_size())
    split = [g for g in hybrid.param_groups if g.get("split_sizes")]
    assert split, "the config's per_head reached no group"
    got = full_params(engine)
    errors = update_errors(got, want, init)
    for name in [n for n in errors if n.endswith("in_proj_bias")]:
        # the key bias's gradient is zero but for rounding (softmax ignores a shift of every logit of a row)
        # and Adam divides that noise by itself: compared on the query and value thirds only
        d = init[name].numel() // 3
        keep = torch.cat([torch.arange(d), torch.arange(2 * d, 3 * d)])
        expected = (dict(want.named_parameters())[name].detach() - init[name])[keep]
        errors[name] = float(((got[name] - init[name])[keep] - expected).norm() / expected.norm())
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= 1e-4, f"stage {stage}: {worst}: relative update error {errors[worst]:.2e} ({errors})"
    total = torch.tensor([hybrid.strategy.stats.matrices])
    dist.all_reduce(total)
    assert per_step == 2 * (3 * HEADS + HEADS + 2), per_step  # per block: Q/K/V heads, output heads, fc1, fc2
    assert total.item() == STEPS * per_step, f"{total.item()} orthogonalizations, expected {STEPS * per_step}"
    print(f"stage {stage}: per-head update error {errors[worst]:.1e} ({worst}), {per_step} matrices a step")


@check
def zero1_per_head_matches_single_device(ctx: Context) -> None:
    _per_head_matches(1)


@check
def zero2_per_head_matches_single_device(ctx: Context) -> None:
    _per_head_matches(2)


@check
def zero3_per_head_matches_single_device(ctx: Context) -> None:
    _per_head_matches(3)
