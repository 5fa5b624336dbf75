"""``muonkit bench deepspeed``: muonkit vs DeepSpeed's built-in Muon vs DeepSpeed AdamW, ZeRO-1/2/3.

The command launches itself under ``torchrun`` (2 CPU ranks, gloo, one thread each) and trains
the benchmark GPT (:mod:`muonkit_bench.model`) on the bundled Shakespeare corpus with each
method at each ZeRO stage, ``gradient_clipping`` 1.0 and 2 accumulated micro-batches per step:

- ``muonkit``: :func:`muonkit.integrations.deepspeed.initialize`, Keller's coefficients x5, bf16
  Newton-Schulz (the same arithmetic as the built-in's ``ns_method: standard``);
- ``deepspeed_muon``: ``"optimizer": {"type": "Muon"}`` (``ns_method: standard``: its default,
  ``gram``, computes in fp16, unusable on CPUs; at ZeRO-3 ``reduce_scatter: false``, which it
  requires);
- ``deepspeed_adamw``: ``"type": "AdamW"`` with ``torch_adam``.

What each column means is in :mod:`muonkit_bench.deepspeed_worker`. Results go to
``OUT/deepspeed.json`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from muonkit_bench.deepspeed_worker import METHODS
from muonkit_bench.launch import add_worker_arguments, torchrun_worker, write_report

HELP = "DeepSpeed ZeRO-1/2/3 on 2 CPU ranks: muonkit vs DeepSpeed's Muon vs AdamW (loss, time, bytes, state)"
_FORWARDED = ("n_layer", "n_embd", "n_head", "vocab", "seq", "batch", "ga", "steps", "warmup", "val_batches", "clip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default: 2)")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add_worker_arguments(parser, batch_help="sequences per micro-batch and rank")
    parser.add_argument("--ga", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timings")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping")
    parser.add_argument("--lr", type=float, default=0.02, help="Muon lr")
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="AdamW lr (AdamW runs and AdamW groups)")
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 instead of bf16 training")
    parser.add_argument("--out", default="runs/deepspeed", help="directory for deepspeed.json")


def main(args: argparse.Namespace) -> int:
    if args.worker:
        from muonkit_bench.deepspeed_worker import worker

        return worker(args)
    from muonkit_bench.deepspeed_worker import ds_config
    from muonkit_bench.environment import environment

    start = time.perf_counter()
    run = _launch(args)
    setup = {k: getattr(args, k) for k in (*_FORWARDED, "world_size", "stages", "methods", "lr", "adamw_lr", "bf16")}
    setup["configs"] = {m: ds_config(1, m, args) for m in args.methods}
    report = {"setup": setup, "environment": environment(), "run": run, "wall_s": round(time.perf_counter() - start)}
    write_report(args.out, "deepspeed", report, format_report(report))
    return 0


def _launch(args: argparse.Namespace) -> dict[str, Any]:
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _FORWARDED]
    forwarded += [f"--lr={args.lr}", f"--adamw-lr={args.adamw_lr}", *([] if args.bf16 else ["--fp32"])]
    stages = ["--stages", *map(str, args.stages), "--methods", *args.methods]
    return torchrun_worker("deepspeed", args.world_size, [*stages, *forwarded])


def format_report(report: dict[str, Any]) -> str:
    """One row per (stage, method); ratios against muonkit at the same stage."""
    rows = report["run"]["rows"]
    setup = report["setup"]
    head = (
        f"{'ZeRO':>4} {'method':<16} {'train loss':>10} {'val loss':>8} {'norm':>6} {'step ms':>8} {'iter ms':>8} "
        f"{'MB bwd':>7} {'MB step':>7} {'GFLOP':>7} {'state MiB':>9} {'NS/step':>7}"
    )
    lines = [
        f"{setup['steps']} steps x {setup['ga']} micro-batches x {setup['batch']}x{setup['seq']} tokens per rank, "
        f"W={report['run']['world_size']}, clip {setup['clip']}, {'bf16' if setup['bf16'] else 'fp32'}; "
        "times: median over steps of the slowest rank; MB: sent per rank in one step (bwd = forward+backward, "
        "step = engine.step()); GFLOP: matmuls of one whole step; norm: DeepSpeed's reported grad norm (mean)",
        head,
    ]
    for stage in setup["stages"]:
        for method in setup["methods"]:
            r = rows[f"{stage}/{method}"]
            ns = r["orthogonalized_per_step"]
            norm = sum(r["grad_norm_reported"]) / len(r["grad_norm_reported"])
            lines.append(
                f"{stage:>4} {method:<16} {r['train_loss_mean_over_ranks']:>10.3f} {r['val_loss']:>8.3f} {norm:>6.2f} "
                f"{r['step_s'] * 1e3:>8.1f} {r['iter_s'] * 1e3:>8.1f} {r['backward_bytes'] / 1e6:>7.2f} "
                f"{r['step_bytes'] / 1e6:>7.2f} {r['matmul_flops'] / 1e9:>7.1f} {r['state_bytes'] / 2**20:>9.2f} "
                f"{'-' if ns is None else f'{ns:.0f}':>7}"
            )
    for stage in setup["stages"]:
        r = rows.get(f"{stage}/muonkit")
        if r is not None:
            sent, grad = r["muonkit_bytes_per_step"], r["gradient_bytes"]
            lines.append(
                f"ZeRO-{stage}: muonkit's own collectives {sent / 1e6:.3f} MB per rank and step = "
                f"{sent / grad:.2f}x one {'bf16' if setup['bf16'] else 'fp32'} gradient of the model ({grad / 1e6:.2f} MB)"
            )
    return "\n".join(lines)
