"""QK-Clip at 2 gloo ranks: under DDP and FSDP2 the clipped weights equal one device's.

Each rank runs its own micro-batch, so each rank sees other logit maxima; QKClip all-reduces them
(MAX) and every rank rescales the rows it holds. The control, on every rank, is one device that
runs both micro-batches (mean loss, the same SGD) with a QKClip over a one-rank group. The models
are cut so that FSDP2's row shards split a query head and the single key head across ranks
(Llama, 3 heads, 1 key head, head size 6) and GPT-2's Conv1D ``c_attn`` is sharded on its input dim.
With SGD the rows come from the strategy muonkit picks for the q/k weights, with HybridMuon from
the optimizer's own; either way the all-reduce is counted in ``QKClip.stats``: one per step, of
``2 (W-1)/W`` times the maxima's bytes (the Collectives rule), and none over a one-rank group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import Context, check
from torch import nn

STEPS = 2
THRESHOLD = 0.5


def _model(kind: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        config: Any = tf.LlamaConfig(vocab_size=64, hidden_size=18, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=3, num_key_value_heads=1, bos_token_id=0, eos_token_id=1)  # fmt: skip
    else:
        config = tf.GPT2Config(vocab_size=64, n_embd=18, n_layer=2, n_head=3, n_positions=16, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "c_attn")):
                p.mul_(6.0)
    return model.train()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def _optimizer(model: nn.Module, optimizer: str, *, ddp: bool = False, one_device: bool = False) -> Any:
    import muonkit

    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    extra: dict[str, Any] = {"process_group": dist.group.WORLD} if ddp else {}
    if one_device:
        extra = {"strategy": muonkit.distributed.SingleDeviceStrategy()}
    return muonkit.HybridMuon(muonkit.param_groups(model), lr=0.05, adamw_lr=0.01, **extra)


def _one_device(kind: str, world_size: int, group: Any, optimizer: str) -> tuple[nn.Module, Any, list[int]]:
    import muonkit

    model = _model(kind)
    opt = _optimizer(model, optimizer, one_device=True)
    clip = muonkit.QKClip(model, opt, threshold=THRESHOLD, process_group=group)
    clipped = []
    for step in range(STEPS):
        for rank in range(world_size):
            ids = _batch(step, rank)
            (model(input_ids=ids, labels=ids).loss / world_size).backward()
        opt.step()
        opt.zero_grad()
        clipped.append(clip.last_clipped_heads)
    return model, clip, clipped


def _compare(ctx: Context, kind: str, wrap: str, optimizer: str = "sgd") -> None:
    import muonkit

    singles = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank creates every group
    model = _model(kind)
    if wrap == "ddp":
        trained: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers if kind == "llama" else model.transformer.h:
            fully_shard(block)
        trained = fully_shard(model)
    opt = _optimizer(model if optimizer != "sgd" else trained, optimizer, ddp=wrap == "ddp")
    clip = muonkit.QKClip(model, opt, threshold=THRESHOLD)
    seen, clipped = [], []
    for step in range(STEPS):
        ids = _batch(step, ctx.rank)
        trained(input_ids=ids, labels=ids).loss.backward()
        seen.append(torch.cat(list(clip.max_logits().values())))
        opt.step()
        opt.zero_grad()
        clipped.append(clip.last_clipped_heads)
    reference, ref_clip, ref_clipped = _one_device(kind, ctx.world_size, singles[ctx.rank], optimizer)
    heads = sum(m.numel() for m in clip.last_max_logits.values())
    w = ctx.world_size
    assert (clip.stats.collectives, clip.stats.bytes_sent) == (STEPS, STEPS * round(2 * (w - 1) / w * heads * 4))
    assert (ref_clip.stats.collectives, ref_clip.stats.bytes_sent) == (0, 0), "a one-rank group reduces nothing"
    mine = torch.stack(seen)
    others = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(others, mine)
    assert not torch.equal(others[0], others[1]), "the ranks saw the same maxima: the check would not need the reduce"
    assert sum(ref_clipped) > 0 and clipped == ref_clipped, (clipped, ref_clipped)
    for name in clip.last_max_logits:
        torch.testing.assert_close(clip.last_max_logits[name], ref_clip.last_max_logits[name], rtol=1e-5, atol=1e-6)
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        got = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(
            got.detach(), want[name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@check(2)
def qk_clip_under_ddp_equals_one_device(ctx: Context) -> None:
    for kind in ("llama", "gpt2"):
        _compare(ctx, kind, "ddp")


@check(2)
def qk_clip_under_fsdp2_equals_one_device(ctx: Context) -> None:
    for kind in ("llama", "gpt2"):
        _compare(ctx, kind, "fsdp2")


@check(2)
def qk_clip_after_hybridmuon_under_ddp_and_fsdp2_equals_one_device(ctx: Context) -> None:
    """The rows each rank holds come from HybridMuon's strategy (ReplicatedStrategy, DTensorStrategy)."""
    for wrap in ("ddp", "fsdp2"):
        _compare(ctx, "llama", wrap, "muon")
