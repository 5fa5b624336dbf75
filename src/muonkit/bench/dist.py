"""``muonkit bench dist``: muonkit vs torch.optim.Muon under DDP and FSDP2, W = 2 and 4 CPU ranks.

The command launches itself under ``torchrun`` (gloo, one thread per rank) once per world size.
Each rank trains the benchmark GPT (:mod:`muonkit.bench.model`) with both optimizers on both
layouts, routed by :func:`muonkit.param_groups`:

- ``muonkit``: :class:`muonkit.HybridMuon` (``process_group=WORLD`` under DDP; picks the DTensor
  strategy by itself under FSDP2), Keller's coefficients and 5 steps like torch's;
- ``torch``: ``torch.optim.Muon`` on the Muon groups + ``torch.optim.AdamW`` on the rest, the
  same tensors. Under DDP it issues no collectives and orthogonalizes every matrix on every rank;
  under FSDP2 it runs on DTensors, whose matmuls redistribute implicitly.

What is measured per rank, for the optimizer step only (forward/backward are outside):

- NS FLOPs: ``2 m n k`` of every matmul-family op in the step (:class:`StepCounter`); for
  muonkit this equals :class:`muonkit.distributed.StrategyStats` ``flops`` (checked, reported);
- bytes sent and collectives: every c10d / functional-collective op in the step, including the
  implicit ones of DTensor (:class:`StepCounter`; same rule as muonkit's own counters);
- step time: median over timed steps of the slowest rank (barrier before each step);
- memory: ``VmHWM - VmRSS`` around one step after ``clear_refs`` reset (the step's transient peak,
  with glibc returning every tensor > 64 KiB to the OS), and the bytes of optimizer state held.

Counting and memory use their own steps; the timed steps run without the dispatch mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from muonkit.bench.launch import add_worker_arguments, torchrun_worker, write_report

HELP = "DDP and FSDP2 on 2 and 4 CPU ranks: muonkit vs torch.optim.Muon (FLOPs, bytes, step time, memory)"
LAYOUTS = ("ddp", "fsdp2")
OPTIMIZERS = ("muonkit", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="ranks per run (default: 2 4)")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    add_worker_arguments(parser, batch_help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--out", default="runs/dist", help="directory for dist.json")


def main(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from muonkit.bench.environment import environment

    runs = {w: _launch(w, args) for w in args.world_sizes}
    report = {"setup": _setup(args), "environment": environment(), "runs": runs}
    write_report(args.out, "dist", report, format_report(report))
    return 0


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "vocab": args.vocab},
        "tokens_per_rank": args.batch * args.seq,
        "warmup": args.warmup,
        "timed_steps": args.steps,
        "backend": "gloo",
        "threads_per_rank": 1,
        "muon": "keller coefficients, 5 steps, bf16, Nesterov, lr 0.02; AdamW lr 3e-4 betas (0.9, 0.95)",
    }


def _launch(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run the worker under torchrun with ``world_size`` ranks; return rank 0's merged result."""
    forwarded = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("n_layer", "n_embd", "n_head", "vocab", "seq", "batch", "warmup", "steps")
    ]
    start = time.perf_counter()
    merged = torchrun_worker(
        "dist", world_size, ["--layouts", *args.layouts, *forwarded], env={"MALLOC_MMAP_THRESHOLD_": "65536"}
    )
    merged["wall_s"] = round(time.perf_counter() - start, 1)
    return merged


# ---------------------------------------------------------------------------------------- worker


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = {f"{layout}/{name}": _measure(layout, name, args) for layout in args.layouts for name in OPTIMIZERS}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        merged = {key: _merge([g[key] for g in gathered]) for key in rows}
        partial = Path(f"{args.result}.partial")
        partial.write_text(json.dumps({"world_size": dist.get_world_size(), "rows": merged}))
        partial.rename(args.result)  # all ranks measured: the results are complete
    dist.destroy_process_group()
    return 0


def _build(layout: str, name: str, args: argparse.Namespace) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist

    import muonkit
    from muonkit.bench.model import GPT, GPTConfig
    from muonkit.bench.peers import TorchMuonAdamW

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    model = GPT(config)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: Any = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    groups = muonkit.param_groups(model, lr=0.02, adamw_lr=3e-4)
    if name == "torch":
        return wrapped, TorchMuonAdamW(groups)
    group = dist.group.WORLD if layout == "ddp" else None  # FSDP2: picked from the DTensors
    return wrapped, muonkit.HybridMuon(groups, ns_coefficients="keller", ns_steps=5, process_group=group)


def _measure(layout: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist

    from muonkit.bench.dist_counters import StepCounter
    from muonkit.bench.memory_probe import reset_peak, rss_bytes

    wrapped, opt = _build(layout, name, args)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())

    def backward(model: Any = wrapped) -> None:
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    for _ in range(args.warmup):
        backward()
        opt.step()
        opt.zero_grad()
    stats = getattr(opt, "strategy", None)
    before = (stats.stats.flops, stats.stats.bytes_sent, stats.stats.collectives) if stats else None
    backward()
    with StepCounter() as counter:
        opt.step()
    opt.zero_grad()
    own = None
    if stats is not None and before is not None:
        own = {
            "flops": stats.stats.flops - before[0],
            "bytes_sent": stats.stats.bytes_sent - before[1],
            "collectives": stats.stats.collectives - before[2],
        }
    backward()
    gc.collect()
    dist.barrier()
    reset_peak()
    rss_before, _ = rss_bytes()
    opt.step()
    _, peak = rss_bytes()
    opt.zero_grad()
    times = []
    for _ in range(args.steps):
        backward()
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        opt.zero_grad()
    row = {
        "flops": counter.counts.matmul_flops,
        "bytes_sent": counter.counts.bytes_sent,
        "collectives": counter.counts.collectives,
        "collective_ops": counter.counts.by_op,
        "muonkit_counters": own,
        "step_s": statistics.median(times),
        "step_peak_bytes": peak - rss_before,
        "state_bytes": _state_bytes(opt),
    }
    del wrapped, opt
    gc.collect()
    return row


def _state_bytes(opt: Any) -> int:
    total = 0
    for state in opt.state.values():
        for value in state.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if hasattr(local, "element_size"):
                total += local.numel() * local.element_size()
    return total


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank values -> max (the slowest / busiest rank) and sum over ranks."""
    merged: dict[str, Any] = {"per_rank": per_rank}
    for key in ("flops", "bytes_sent", "collectives", "step_s", "step_peak_bytes", "state_bytes"):
        values = [r[key] for r in per_rank]
        merged[key] = {"max": max(values), "sum": sum(values)}
    return merged


# ---------------------------------------------------------------------------------------- tables


def format_report(report: dict[str, Any]) -> str:
    """One table per layout; ratios are torch / muonkit within the same run."""
    lines = []
    for layout in LAYOUTS:
        if not any(f"{layout}/muonkit" in run["rows"] for run in report["runs"].values()):
            continue
        lines += [
            f"\n{layout.upper()}: optimizer step only (max over ranks; 'total' = sum over ranks)",
            f"{'W':>2} {'optimizer':<9} {'NS GFLOP/rank':>13} {'NS GFLOP total':>14} {'MB sent/rank':>12} "
            f"{'collectives':>11} {'step ms':>9} {'step peak MB':>12} {'state MB/rank':>13}",
        ]
        for world_size, run in sorted(report["runs"].items(), key=lambda kv: int(kv[0])):
            rows = {name: run["rows"][f"{layout}/{name}"] for name in OPTIMIZERS}
            for name, r in rows.items():
                lines.append(
                    f"{world_size:>2} {name:<9} {r['flops']['max'] / 1e9:>13.3f} {r['flops']['sum'] / 1e9:>14.3f} "
                    f"{r['bytes_sent']['max'] / 1e6:>12.3f} {r['collectives']['max']:>11} "
                    f"{r['step_s']['max'] * 1e3:>9.1f} {r['step_peak_bytes']['max'] / 1e6:>12.1f} "
                    f"{r['state_bytes']['max'] / 1e6:>13.2f}"
                )
            mk, th = rows["muonkit"], rows["torch"]
            lines.append(
                f"{'':>2} {'torch/mk':<9} {_ratio(th['flops']['max'], mk['flops']['max']):>13} "
                f"{_ratio(th['flops']['sum'], mk['flops']['sum']):>14} "
                f"{_ratio(th['bytes_sent']['max'], mk['bytes_sent']['max']):>12} {'':>11} "
                f"{_ratio(th['step_s']['max'], mk['step_s']['max']):>9}"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 else f"{a / b:.2f}x"
