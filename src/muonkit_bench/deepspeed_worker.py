"""The rank side of ``muonkit bench deepspeed``: train, time and count one (stage, method) run.

Every run starts from the same GPT (seed 0) and sees the same Shakespeare windows (one seeded
generator per rank), so losses are comparable across methods and stages. Per optimizer step:
``GA`` micro-batches, each ``engine(x, y)`` / ``engine.backward`` / ``engine.step``.

Measured on each rank and merged on rank 0:

- ``step_s``: ``engine.step()`` at the accumulation boundary (DeepSpeed's optimizer step: norm,
  clip, the client optimizer, parameter all-gather); ``iter_s``: the whole step (all micro-
  batches). DeepSpeed's built-in Muon does its Newton-Schulz inside the gradient reduction, in
  the backward pass, so only ``iter_s`` compares it fairly.
- bytes and collectives (:class:`muonkit.testing.dist_counters.StepCounter`, which sees every c10d
  op DeepSpeed and muonkit issue), counted on one extra step: in forward/backward (gradient
  reduction) and in ``engine.step()``; also matmul FLOPs of the whole step (model + Newton-Schulz).
- optimizer state bytes on the rank (the client optimizer's ``state``; fp32 master weights and
  DeepSpeed's buffers are the same for every method and left out).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

METHODS = ("muonkit", "deepspeed_muon", "deepspeed_adamw")


def ds_config(stage: int, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed config of one run (what BENCHMARKS.md shows)."""
    zero: dict[str, Any] = {"stage": stage}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.ga,
        "gradient_clipping": args.clip,
        "bf16": {"enabled": args.bf16},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if method == "muonkit":
        params = {"lr": args.lr, "adamw_lr": args.adamw_lr, "ns_coefficients": "keller", "ns_steps": 5}
        config["optimizer"] = {"type": "muonkit.HybridMuon", "params": params}
    elif method == "deepspeed_muon":
        # ns_method "gram" (DeepSpeed's default) computes in fp16: unusable on CPUs; "standard" is bf16.
        params = {"muon_lr": args.lr, "adam_lr": args.adamw_lr, "momentum": 0.95, "betas": [0.9, 0.95]}
        config["optimizer"] = {"type": "Muon", "params": {**params, "ns_method": "standard", "torch_adam": True}}
        if stage == 3:
            zero["reduce_scatter"] = False  # DeepSpeed's Muon refuses ZeRO-3 with the default reduce_scatter
    else:
        params = {"lr": args.adamw_lr, "betas": [0.9, 0.95], "weight_decay": 0.0, "torch_adam": True}
        config["optimizer"] = {"type": "AdamW", "params": params}
    return config


def worker(args: argparse.Namespace) -> int:
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    # DeepSpeed's shared-memory comm op is a JIT C++ build (20 s to minutes) that would also route
    # collectives around torch.distributed, where they could not be counted.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from muonkit_bench.data import load_corpus

    corpus = load_corpus(vocab_size=args.vocab)
    rows = {}
    for stage in args.stages:
        for method in args.methods:
            rows[f"{stage}/{method}"] = _run(stage, method, args, corpus)
            gc.collect()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        merged = {key: _merge([g[key] for g in gathered]) for key in rows}
        Path(args.result).write_text(json.dumps({"world_size": dist.get_world_size(), "rows": merged}))
    dist.destroy_process_group()
    return 0


def _engine(stage: int, method: str, args: argparse.Namespace) -> Any:
    import deepspeed
    import torch

    from muonkit.integrations import deepspeed as mk_ds
    from muonkit_bench.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(gpt)
    config = ds_config(stage, method, args)
    if method == "muonkit":
        return mk_ds.initialize(model=model, config=config)[0]
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))[0]


def _run(stage: int, method: str, args: argparse.Namespace, corpus: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    engine = _engine(stage, method, args)
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())

    def micro(step_boundary: bool) -> float:
        x, y = corpus.batch("train", batch_size=args.batch, block_size=args.seq, generator=generator)
        _, loss = engine(x, y)
        engine.backward(loss)
        if not step_boundary:
            engine.step()
        return float(loss.detach())

    losses, norms, step_s, iter_s = [], [], [], []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step_losses = [micro(m == args.ga - 1) for m in range(args.ga)]
        boundary = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        if step >= args.warmup:
            step_s.append(end - boundary)
            iter_s.append(end - start)
        losses.append(sum(step_losses) / len(step_losses))
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    val = _val_loss(engine, corpus, args)
    counts = _count(engine, micro, args)
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    strategy = getattr(base, "strategy", None)
    row = {
        "loss": losses,
        "final_train_loss": statistics.mean(losses[-3:]),
        "val_loss": val,
        "grad_norm_reported": norms,
        "step_s": statistics.median(step_s),
        "iter_s": statistics.median(iter_s),
        "state_bytes": _state_bytes(base),
        "orthogonalized_per_step": strategy.stats.matrices / (args.steps + 1) if strategy is not None else None,
        "muonkit_bytes_per_step": strategy.stats.bytes_sent / (args.steps + 1) if strategy is not None else None,
        "gradient_bytes": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
        * (2 if args.bf16 else 4),
        **counts,
    }
    engine.destroy()
    return row


def _val_loss(engine: Any, corpus: Any, args: argparse.Namespace) -> float:
    import torch

    engine.eval()
    batches = corpus.eval_batches(batches=args.val_batches, batch_size=args.batch, block_size=args.seq)
    with torch.no_grad():
        value = statistics.mean(float(engine(x, y)[1]) for x, y in batches)
    engine.train()
    return value


def _count(engine: Any, micro: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One more step under StepCounter: forward/backward and the optimizer step counted apart."""
    from muonkit.testing import StepCounter

    with StepCounter() as backward:
        for m in range(args.ga):
            micro(m == args.ga - 1)
    with StepCounter() as step:
        engine.step()
    return {
        "backward_bytes": backward.counts.bytes_sent,
        "step_bytes": step.counts.bytes_sent,
        "backward_ops": backward.counts.by_op,
        "step_ops": step.counts.by_op,
        "matmul_flops": backward.counts.matmul_flops + step.counts.matmul_flops,
    }


def _state_bytes(optimizer: Any) -> int:
    return sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")
    )


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Losses are the same on every rank up to the data it saw: keep rank 0's; times and bytes: max."""
    merged = dict(per_rank[0])
    for key in ("step_s", "iter_s", "state_bytes", "backward_bytes", "step_bytes", "matmul_flops"):
        merged[key] = max(r[key] for r in per_rank)
    merged["train_loss_mean_over_ranks"] = statistics.mean(r["final_train_loss"] for r in per_rank)
    if merged["orthogonalized_per_step"] is not None:  # matrices per step summed over ranks; bytes: max
        merged["orthogonalized_per_step"] = sum(r["orthogonalized_per_step"] for r in per_rank)
        merged["muonkit_bytes_per_step"] = max(r["muonkit_bytes_per_step"] for r in per_rank)
    return merged
