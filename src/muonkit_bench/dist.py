"""``muonkit bench dist``: muonkit vs torch.optim.Muon under DDP and FSDP2, W = 2 and 4 CPU ranks,
and with ``--layouts`` on the 2-D meshes of HSDP, FSDP2 + TP and EP (:mod:`muonkit_bench.dist_layouts`).

The command launches itself under ``torchrun`` (gloo, one thread per rank) once per world size.
Each rank trains the benchmark GPT (:mod:`muonkit_bench.model`) with both optimizers on each
layout, routed by :func:`muonkit.param_groups`:

- ``muonkit``: :class:`muonkit.HybridMuon` (``process_group=WORLD`` under DDP; picks the DTensor
  strategy by itself under FSDP2), Keller's coefficients and 5 steps like torch's;
- ``torch``: ``torch.optim.Muon`` on the Muon groups + ``torch.optim.AdamW`` on the rest, the
  same tensors. Under DDP it issues no collectives and orthogonalizes every matrix on every rank;
  under FSDP2 it runs on DTensors, whose matmuls redistribute implicitly;
- ``replicas`` (HSDP only): :class:`~muonkit_bench.dist_layouts.ReplicaMuon`, HybridMuon run once
  per replica group over its shard sub-mesh (what torchtitan and dion do under HSDP).

An optimizer that raises on a layout (when built or on its first step) is reported as
``unsupported: <message>`` and the run goes on. On the 2-D layouts each row also states how far
its first update is from the same optimizer's on one device (``vs 1-device``), so that an
optimizer that runs but computes something else shows it, and which placements it was handed.

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
import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from muonkit_bench.launch import add_worker_arguments, torchrun_worker, write_report

HELP = (
    "DDP and FSDP2 on 2 and 4 CPU ranks (and HSDP, FSDP2+TP, EP with --layouts): muonkit vs torch.optim.Muon "
    "(FLOPs, bytes, step time, memory)"
)
LAYOUTS = ("ddp", "fsdp2", "hsdp", "fsdp2-tp", "ep")
DEFAULT_LAYOUTS = ("ddp", "fsdp2")
OPTIMIZERS = ("muonkit", "torch")


def optimizers(layout: str) -> tuple[str, ...]:
    """The rows of a layout: HSDP adds ``replicas``, Newton-Schulz repeated in every replica group."""
    return (*OPTIMIZERS, "replicas") if layout == "hsdp" else OPTIMIZERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="ranks per run (default: 2 4)")
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=list(DEFAULT_LAYOUTS),
        help="default: ddp fsdp2; hsdp, fsdp2-tp and ep build 2 x W/2 meshes (even W >= 4)",
    )  # fmt: skip
    add_worker_arguments(parser, batch_help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--out", default="runs/dist", help="directory for dist.json")


def main(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from muonkit_bench.dist_layouts import check_world_size
    from muonkit_bench.environment import environment

    problem = check_world_size(args.layouts, args.world_sizes)
    if problem:
        raise ValueError(f"Invalid --world-sizes for --layouts: {problem}")
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
    # DTensor warns on every rank about torch.optim.Muon's sequential all-reduces on 2-D meshes (counted here)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # the logits
    dist.init_process_group("gloo")
    rows = {
        f"{layout}/{name}": _measure_or_report(layout, name, args)
        for layout in args.layouts
        for name in optimizers(layout)
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        merged = {key: _merge([g[key] for g in gathered]) for key in rows}
        partial = Path(f"{args.result}.partial")
        partial.write_text(json.dumps({"world_size": dist.get_world_size(), "rows": merged}))
        partial.rename(args.result)  # all ranks measured: the results are complete
    dist.destroy_process_group()
    return 0


class Unsupported(Exception):
    """An optimizer that raised on some rank while being built or stepped on a layout."""

    def __init__(self, message: str, placements: dict[str, int]) -> None:
        super().__init__(message)
        self.placements = placements


def _agree(error: BaseException | None, placements: dict[str, int]) -> None:
    """Raise :class:`Unsupported` on every rank if any rank failed (so that no rank waits alone)."""
    import torch.distributed as dist

    message = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    failed = [m for m in gathered if m is not None]
    if failed:
        raise Unsupported(failed[0], placements)


def _measure_or_report(layout: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The row of ``name`` on ``layout``, or ``{"unsupported": message}`` if it raised (the run goes on)."""
    import gc

    try:
        return _measure(layout, name, args)
    except Unsupported as e:
        gc.collect()
        return {"unsupported": str(e), "placements": e.placements}


def _build(layout: str, name: str, args: argparse.Namespace) -> tuple[Any, Any, list[dict[str, Any]], dict[str, int]]:
    import torch.distributed as dist

    import muonkit
    from muonkit_bench.dist_layouts import ReplicaMuon, build_layout, build_model, placements
    from muonkit_bench.peers import TorchMuonAdamW

    model = build_model(layout, args)
    wrapped, mesh = build_layout(layout, model, dist.get_world_size())
    groups = muonkit.param_groups(model, lr=0.02, adamw_lr=3e-4)
    where = placements(model, groups)
    error = None
    opt: Any = None
    try:
        if name == "torch":
            opt = TorchMuonAdamW(groups)
        elif name == "replicas":
            opt = ReplicaMuon(groups, mesh, ns_coefficients="keller", ns_steps=5)
        else:
            group = dist.group.WORLD if layout == "ddp" else None  # DTensors: picked from their mesh
            opt = muonkit.HybridMuon(groups, ns_coefficients="keller", ns_steps=5, process_group=group)
    except Exception as e:  # reported as "unsupported: <message>"
        error = e
    _agree(error, where)
    return wrapped, opt, groups, where


def _measure(layout: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist

    from muonkit.testing import StepCounter
    from muonkit_bench.memory_probe import reset_peak, rss_bytes

    wrapped, opt, groups, where = _build(layout, name, args)
    # tensor-parallel ranks of one data-parallel group must see the same tokens
    data_rank = dist.get_rank() // 2 if layout == "fsdp2-tp" else dist.get_rank()
    generator = torch.Generator().manual_seed(1 + data_rank)

    def backward(model: Any = wrapped) -> None:
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    update_error = None
    for k in range(max(1, args.warmup)):  # the first step shows whether the optimizer runs here at all
        backward()
        error = None
        if k == 0:
            old, grads = _full_values(groups), _full_values(groups, grads=True)
        try:
            opt.step()
        except Exception as e:  # e.g. an optimizer that rejects these params only when it steps
            error = e
        if k == 0:
            _agree(error, where)
            new = _full_values(groups)
            if dist.get_rank() == 0:
                update_error = _update_error(name, groups, old, grads, new)
            del old, grads, new
        elif error is not None:
            raise error
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
        "placements": where,
        "update_error": update_error,
    }
    del wrapped, opt
    gc.collect()
    return row


def _full_values(groups: list[dict[str, Any]], *, grads: bool = False) -> list[list[Any]]:
    """Whole copies of every param (or grad) of ``groups``, on every rank (DTensors gathered)."""
    out = []
    for group in groups:
        values = []
        for p in group["params"]:
            t = p.grad if grads else p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            values.append(None if t is None else t.detach().clone())
        out.append(values)
    return out


def _update_error(
    name: str, groups: list[dict[str, Any]], before: list[list[Any]], grads: list[list[Any]], after: list[list[Any]]
) -> float:
    """max over Muon params of ``||update - reference||_F / ||reference||_F`` after the first step: the
    reference is the same optimizer on one device, fresh, stepping whole copies of the params with
    the whole gradients.

    0 (or bf16 rounding) when the layout changes nothing; ~1 when it silently computes something
    else (e.g. orthogonalizes each shard instead of the whole matrix)."""
    import torch

    import muonkit
    from muonkit.distributed import SingleDeviceStrategy
    from muonkit_bench.peers import TorchMuonAdamW

    plain = []
    for group, values, gs in zip(groups, before, grads, strict=True):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        for p, g in zip(params, gs, strict=True):
            p.grad = g
        plain.append({**group, "params": params})
    if name == "torch":
        ref: Any = TorchMuonAdamW(plain)
    else:
        ref = muonkit.HybridMuon(plain, ns_coefficients="keller", ns_steps=5, strategy=SingleDeviceStrategy())
    ref.step()
    worst = 0.0
    for group, values, new in zip(plain, before, after, strict=True):
        if group["algorithm"] != "muon":
            continue
        for p, old, got in zip(group["params"], values, new, strict=True):
            want = p.detach() - old
            worst = max(worst, float((got - old - want).norm() / want.norm().clamp_min(1e-30)))
    return worst


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
    if "unsupported" in per_rank[0]:  # every rank agreed on it (see _agree)
        return {"unsupported": per_rank[0]["unsupported"], "placements": per_rank[0]["placements"]}
    merged: dict[str, Any] = {"per_rank": per_rank}
    for key in ("flops", "bytes_sent", "collectives", "step_s", "step_peak_bytes", "state_bytes"):
        values = [r[key] for r in per_rank]
        merged[key] = {"max": max(values), "sum": sum(values)}
    merged["placements"] = per_rank[0]["placements"]
    merged["update_error"] = max((r["update_error"] for r in per_rank if r["update_error"] is not None), default=None)
    return merged


# ---------------------------------------------------------------------------------------- tables

RATIOS = {"torch": "torch/mk", "replicas": "repl/mk"}


def format_report(report: dict[str, Any]) -> str:
    """One table per layout; ratios are torch / muonkit and replicas / muonkit within the same run."""
    lines = []
    for layout in LAYOUTS:
        runs = sorted(report["runs"].items(), key=lambda kv: int(kv[0]))
        if not any(f"{layout}/muonkit" in run["rows"] for _, run in runs):
            continue
        checked = layout not in DEFAULT_LAYOUTS  # today's tables stay as they were
        lines += [
            f"\n{layout.upper()}: optimizer step only (max over ranks; 'total' = sum over ranks)",
            f"{'W':>2} {'optimizer':<9} {'NS GFLOP/rank':>13} {'NS GFLOP total':>14} {'MB sent/rank':>12} "
            f"{'collectives':>11} {'step ms':>9} {'step peak MB':>12} {'state MB/rank':>13}"
            + (f" {'vs 1-device':>11}" if checked else ""),
        ]
        for world_size, run in runs:
            rows = {name: run["rows"][f"{layout}/{name}"] for name in optimizers(layout)}
            for name, r in rows.items():
                lines.append(_row(world_size, name, r, checked=checked))
            mk = rows["muonkit"]
            for name, label in RATIOS.items():
                if name in rows and "unsupported" not in rows[name] and "unsupported" not in mk:
                    lines.append(_ratios(label, rows[name], mk))
        if checked:  # what the optimizers were handed
            lines.append(
                "   vs 1-device: ||update - same optimizer on one device||_F / ||that||_F, first step, worst matrix"
            )
            found = [run["rows"][f"{layout}/{n}"] for _, run in runs for n in optimizers(layout)]
            found = [r["placements"] for r in found if "placements" in r]
            for where, count in (found[0] if found else {}).items():
                lines.append(f"   Muon params: {count} x {where}")
    return "\n".join(lines)


def _row(world_size: str, name: str, r: dict[str, Any], *, checked: bool) -> str:
    if "unsupported" in r:
        return f"{world_size:>2} {name:<9} unsupported: {r['unsupported'].splitlines()[0][:160]}"
    error = r.get("update_error")
    return (
        f"{world_size:>2} {name:<9} {r['flops']['max'] / 1e9:>13.3f} {r['flops']['sum'] / 1e9:>14.3f} "
        f"{r['bytes_sent']['max'] / 1e6:>12.3f} {r['collectives']['max']:>11} "
        f"{r['step_s']['max'] * 1e3:>9.1f} {r['step_peak_bytes']['max'] / 1e6:>12.1f} "
        f"{r['state_bytes']['max'] / 1e6:>13.2f}"
        + (f" {'-' if error is None else f'{error:.1e}':>11}" if checked else "")
    )


def _ratios(label: str, other: dict[str, Any], mk: dict[str, Any]) -> str:
    return (
        f"{'':>2} {label:<9} {_ratio(other['flops']['max'], mk['flops']['max']):>13} "
        f"{_ratio(other['flops']['sum'], mk['flops']['sum']):>14} "
        f"{_ratio(other['bytes_sent']['max'], mk['bytes_sent']['max']):>12} {'':>11} "
        f"{_ratio(other['step_s']['max'], mk['step_s']['max']):>9}"
    )


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 else f"{a / b:.2f}x"
