"""muonkit.integrations.torchtitan: HybridMuon as torchtitan's optimizer container, under FSDP2
(``fully_shard`` on a one-rank gloo group in this process) with torchtitan's activation-checkpoint
wrapper, lr-scheduler container and DCP checkpoint contract; the control is a plain HybridMuon
with the same lr schedule on an unwrapped copy of the model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard

import muonkit
from muonkit.param_groups import no_decay_on_vectors

pytest.importorskip("torchtitan")
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig

from muonkit.integrations.torchtitan import HybridMuonContainer

STEPS = 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, 2 * d)
        self.w2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): Block(d) for i in range(2)})
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(x)


def tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def titan_parallelize(model: Tiny) -> Tiny:
    """What torchtitan's parallelize does to a model, at this size: full activation checkpointing
    of each block (``_checkpoint_wrapped_module`` in the FQNs), then FSDP2 per block and at the root."""
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return model


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = value.detach().clone()
    return out


CONFIG = {"lr": 0.02, "adamw_lr": 3e-3, "weight_decay": 0.01, "adamw_weight_decay": 0.1}


def test_container_under_fsdp2_trains_like_a_plain_hybrid_muon(one_rank: None) -> None:
    model = titan_parallelize(tiny())
    container = HybridMuonContainer.Config(**CONFIG).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=container, training_steps=STEPS)
    names = [n for g in container.optimizers[0].param_groups for n in g["param_names"]]
    assert "layers.0.w1.weight" in names and not any("_checkpoint_wrapped_module" in n for n in names)

    control = tiny()
    groups = muonkit.param_groups(control, **CONFIG)
    reference = muonkit.HybridMuon(no_decay_on_vectors(groups))
    lr_lambda = schedulers.schedulers[0].lr_lambdas[0]
    reference_schedule = torch.optim.lr_scheduler.LambdaLR(reference, lr_lambda)

    lrs = []
    for step in range(STEPS):
        for m, opt in ((model, container), (control, reference)):
            loss_of(m, step).backward()
            opt.step()
            opt.zero_grad()
        schedulers.step()
        reference_schedule.step()
        lrs.append({g["algorithm"]: g["lr"] for g in container.optimizers[0].param_groups})
    assert lrs[0] == {"muon": pytest.approx(0.02 * lr_lambda(1)), "adamw": pytest.approx(3e-3 * lr_lambda(1))}
    assert container.optimizers[0].strategy.name == "fsdp2"
    got, want = full_weights(model), full_weights(control)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(want[n], v) for n, v in full_weights(tiny()).items())  # it trained


def test_checkpoint_through_dcp_resumes_exactly(one_rank: None, tmp_path: Path) -> None:
    model = titan_parallelize(tiny())
    container = HybridMuonContainer.Config(**CONFIG).build(model_parts=[model])
    for step in range(2):
        loss_of(model, step).backward()
        container.step()
        container.zero_grad()
    saved = container.state_dict()
    assert "state.layers.0.w1.weight.momentum_buffer" in saved and "state.output.weight.exp_avg" in saved
    dcp.save({"model": model.state_dict(), "optimizer": saved}, checkpoint_id=str(tmp_path))

    resumed = titan_parallelize(tiny())
    fresh = HybridMuonContainer.Config(**CONFIG).build(model_parts=[resumed])
    loaded = {"model": resumed.state_dict(), "optimizer": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(loaded["model"])
    fresh.load_state_dict(loaded["optimizer"])
    for m, opt in ((model, container), (resumed, fresh)):
        loss_of(m, 2).backward()
        opt.step()
    got, want = full_weights(resumed), full_weights(model)
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"implementation": "fused"}, r"Invalid implementation='fused' for HybridMuon: must be 'foreach'"),
        ({"param_groups": [ParamGroupConfig(pattern=".*", optimizer_name="AdamW")]}, r"muonkit routes params by model structure.*rules="),
        ({"optimizer_factory_kwargs_by_name": {"AdamW": {}}}, r"HybridMuon takes none"),
        ({"nonfinite": "ignore"}, r"Invalid nonfinite='ignore'"),
    ],
)  # fmt: skip
def test_torchtitan_settings_muonkit_cannot_honour_are_refused(change: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        HybridMuonContainer.Config(**change).build(model_parts=[tiny()])


def test_torchtitan_own_groups_with_fused_keys_are_refused_by_hybrid_muon() -> None:
    # A user who maps "HybridMuon" into torchtitan's own table gets groups with fused/foreach keys.
    model = tiny()
    group = {"params": list(model.parameters()), "algorithm": "adamw", "fused": True, "foreach": False}
    with pytest.raises(ValueError, match=r"Unknown key 'fused'.*torch\.optim's fused option is not supported"):
        muonkit.HybridMuon([copy.copy(group)])


def test_rules_override_the_routing_per_model_part() -> None:
    parts = [tiny(), tiny()]
    container = HybridMuonContainer.Config(rules=[(r"^output\.", "muon")]).build(model_parts=parts)
    assert len(container) == 2
    for optimizer in container:
        muon = [n for g in optimizer.param_groups if g["algorithm"] == "muon" for n in g["param_names"]]
        assert "output.weight" in muon and "tok_embeddings.weight" not in muon


def test_per_head_routing_reaches_the_groups() -> None:
    """``per_head=True`` (with ``heads=`` where the model does not say) cuts attention into per-head matrices."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(32, 16)
            self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
            self.output = nn.Linear(16, 32, bias=False)

    whole = HybridMuonContainer.Config().build(model_parts=[Attn()])
    split = HybridMuonContainer.Config(per_head=True).build(model_parts=[Attn()])
    sizes = {
        n: g.get("split_sizes")
        for opt in split
        for g in opt.param_groups
        if g["algorithm"] == "muon"
        for n in g["param_names"]
    }
    assert sizes["attn.in_proj_weight"] == (4,) * 12  # 4 heads of 4 rows each for Q, K and V
    assert sizes["attn.out_proj.weight"] == (4,) * 4  # 4 heads' column blocks
    assert all(g.get("split_sizes") is None for opt in whole for g in opt.param_groups)
