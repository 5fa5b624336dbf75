"""QK-Clip under DeepSpeed ZeRO-1/2/3 (used by ds_checks_train): the clipped run equals one device's.

A one-layer attention LM whose fused ``qkv`` Linear (q heads, then grouped k heads, then v) is
declared by ``qk_clip_layout`` and runs through :func:`muonkit.qk_clip.observed_attention`.
DeepSpeed trains it with HybridMuon (set up by muonkit.integrations.deepspeed); QKClip rescales
this rank's pieces of ``qkv`` in the flat fp32 master partitions after their update, and
DeepSpeed copies them into the module's weights (both compared). The control: one device, HybridMuon and a QKClip
over a one-rank group, the same micro-batches of every rank, the raw-norm gradient clip. What QKClip rescales is
what ``Strategy.regions`` says each flat partition holds: checked against DeepSpeed's own gathered fp32 weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ds_common import GA, OPTIONS, batch, config, full_params
from torch import Tensor, nn

import muonkit
from muonkit.distributed import SingleDeviceStrategy
from muonkit.qk_clip import HeadRows, QKLayout, observed_attention

VOCAB, D, HEADS, KV = 64, 16, 4, 2
HD = D // HEADS
THRESHOLD = 2.0
STEPS = 2


class AttnLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, (HEADS + 2 * KV) * HD)
        self.out = nn.Linear(HEADS * HD, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        with torch.no_grad():
            self.qkv.weight.mul_(4.0)

    def qk_clip_layout(self) -> QKLayout:
        rows = [HeadRows("qkv.weight", "query", HEADS, HD), HeadRows("qkv.weight", "key", KV, HD, HEADS * HD)]
        rows += [HeadRows("qkv.bias", r.part, r.count, r.width, r.offset) for r in rows]
        return QKLayout(HEADS, KV, tuple(rows))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.emb(idx)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([HEADS * HD, KV * HD, KV * HD], dim=-1)
        q = q.view(b, t, HEADS, HD).transpose(1, 2)
        k, v = (z.view(b, t, KV, HD).transpose(1, 2) for z in (k, v))
        y = observed_attention(self, q, k, v, causal=True).transpose(1, 2).reshape(b, t, HEADS * HD)
        return F.cross_entropy(self.head(x + self.out(y)).flatten(0, 1).float(), targets.flatten())


def _reference(init: dict[str, Tensor], world: int, group: Any) -> tuple[nn.Module, list[int]]:
    model = AttnLM()
    model.load_state_dict(init)
    options = {k: v for k, v in OPTIONS.items() if k != "ns_dtype"}
    opt = muonkit.HybridMuon(
        muonkit.param_groups(model, **options), ns_dtype=torch.float64, strategy=SingleDeviceStrategy()
    )
    clip = muonkit.QKClip(model, opt, threshold=THRESHOLD, process_group=group)
    clipped = []
    for step in range(STEPS):
        for rank in range(world):
            for micro in range(GA):
                (model(*batch(step, micro, rank)) / (GA * world)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        clipped.append(clip.last_clipped_heads)
    return model, clipped


def zero_run_equals_one_device(stage: int) -> None:
    from muonkit.integrations import deepspeed as mk_ds

    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(0)
    model = AttnLM()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = mk_ds.initialize(model=model, config=config(stage))
    clip = muonkit.QKClip(model, engine.optimizer, threshold=THRESHOLD)
    clipped = []
    for step in range(STEPS):
        for micro in range(GA):
            engine.backward(engine(*batch(step, micro, dist.get_rank())))
            engine.step()
        clipped.append(clip.last_clipped_heads)
    want, want_clipped = _reference(copy.deepcopy(init), dist.get_world_size(), singles[dist.get_rank()])
    assert want_clipped[0] > 0 and clipped == want_clipped, (clipped, want_clipped)
    got = full_params(engine)
    _regions_are_deepspeeds_partitions(engine, got, stage)
    for name, p in want.named_parameters():
        mine, theirs = got[name], p.detach()
        if name == "qkv.bias":  # a key bias has zero gradient (softmax ignores a per-query constant): Adam
            mine, theirs = mine[: HEADS * HD], theirs[: HEADS * HD]  # steps on rounding noise there; skip k, v
        err = float((mine - theirs).norm() / theirs.norm())
        assert err <= 1e-5, f"stage {stage} {name}: relative error {err:.2e}"
    module = dict(engine.module.named_parameters())  # the weights forward uses: DeepSpeed's copy of the master
    if stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([module["qkv.weight"]]):
            weight = module["qkv.weight"].detach().clone()
    else:
        weight = module["qkv.weight"].detach()
    torch.testing.assert_close(weight, want.qkv.weight.detach(), rtol=1e-5, atol=1e-6)


def _regions_are_deepspeeds_partitions(engine: Any, whole: dict[str, Tensor], stage: int) -> None:
    """Each flat fp32 partition: ``regions`` lists every param of it with the span this rank stores, equal to
    that span of DeepSpeed's gathered weight; over the ranks the spans cover every param once."""
    strategy = engine.optimizer.optimizer.strategy
    held = []
    for flat in strategy.partitions:
        regions = strategy.regions(flat)
        assert [r.shape for r in regions] == strategy.whole_shapes(flat), f"stage {stage}"
        for r in regions:
            if r.region.numel:
                part = r.part_of(flat)
                assert torch.equal(part, r.region.read(whole[str(r.name)])), f"stage {stage} {r}"
                held.append(r)
    names = sorted(whole)
    counts = torch.tensor([sum(r.region.numel for r in held if r.name == n) for n in names])
    dist.all_reduce(counts)
    assert counts.tolist() == [whole[n].numel() for n in names], f"stage {stage}: {counts.tolist()}"
