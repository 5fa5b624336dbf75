"""``muonkit plan``: the plan simulator on the command line."""

from __future__ import annotations

import argparse
import json

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

HELP = "simulate muonkit's distributed plan of a model on a mesh of any size (no cluster, no GPU)"
DESCRIPTION = """\
Build the jobs and the plan muonkit makes for a model on a device mesh, as every rank would at
start-up, with no process group, and report: jobs, pieces, planning time and memory, Newton-Schulz
FLOPs per rank (busiest and busiest / mean), bytes sent and received per rank (also in bf16
gradients of the Muon params), the executor's host work per step on the busiest rank, and the
estimated optimizer overhead per step.

Meshes: fsdp=F, hsdp=RxS (R replicas of S-way FSDP2), ddp=N; with fsdp or hsdp: tp=T; with fsdp:
ep=E; with any: pp=P (pipeline stages). Example: muonkit plan kimi-k2 --mesh ep=64,fsdp=64
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from muonkit.simulator.simulate import Estimate

    e = Estimate()
    parser.add_argument(
        "model", nargs="?", default="gpt2",
        help="gpt2, llama-70b, kimi-k2, deepseek-v3 (bundled shapes), or a Hugging Face config.json or its folder "
        "(built on the meta device by transformers)",
    )  # fmt: skip
    parser.add_argument(
        "--mesh", action="append", help="mesh description, e.g. fsdp=4096, hsdp=512x8, ep=64,fsdp=64, tp=8,fsdp=512, "
        "pp=8,fsdp=512; repeat for one row each (default: fsdp=8)",
    )  # fmt: skip
    parser.add_argument("--tokens", type=int, default=e.tokens, help=f"tokens per step (default {e.tokens:,})")
    parser.add_argument(
        "--peak-tflops", type=float, default=e.peak_tflops,
        help=f"dense bf16 TFLOP/s of one device (default {e.peak_tflops:g}: H100 SXM)",
    )  # fmt: skip
    parser.add_argument("--mfu", type=float, default=e.mfu, help=f"training's fraction of the peak (default {e.mfu})")
    parser.add_argument(
        "--ns-efficiency", type=float, default=e.ns_efficiency,
        help=f"Newton-Schulz's fraction of the peak (default {e.ns_efficiency})",
    )  # fmt: skip
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=e.bandwidth,
        help=f"GB/s one rank sends or receives (default {e.bandwidth:g})",
    )
    parser.add_argument(
        "--no-split", action="store_true",
        help="never split a matrix's Newton-Schulz over a group of ranks (default: where it pays, as the executor does)",
    )  # fmt: skip
    parser.add_argument(
        "--split-flops-per-byte", type=float, default=None,
        help="the split cost model's FLOPs per byte a member sends (default 2000: an NVLink domain; raise it for slower links)",
    )  # fmt: skip
    parser.add_argument("--no-host", action="store_true", help="skip measuring the executor's host work per step")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import math

    import torch

    from muonkit.distributed.split_plan import SplitPolicy
    from muonkit.simulator.meshes import parse_mesh
    from muonkit.simulator.models import load
    from muonkit.simulator.report import footnote, header, row
    from muonkit.simulator.simulate import Estimate, simulate

    torch.set_num_threads(1)  # planning is one rank's work on one core
    try:
        model = load(args.model)
        meshes = [parse_mesh(m) for m in args.mesh or ["fsdp=8"]]
        estimate = Estimate(args.tokens, args.peak_tflops, args.mfu, args.ns_efficiency, args.bandwidth)
        policy = SplitPolicy(threshold=math.inf) if args.no_split else SplitPolicy()
        if args.split_flops_per_byte is not None:
            policy = dataclasses.replace(policy, flops_per_byte=args.split_flops_per_byte)
    except ValueError as e:
        raise SystemExit(f"muonkit plan: {e}") from None
    print(header(), flush=True)
    sims = []
    for mesh in meshes:  # a row as soon as it is known: large meshes take a while
        sims.append(simulate(model, mesh, estimate=estimate, host=not args.no_host, split=policy))
        print(row(sims[-1]), flush=True)
    print(f"\n{footnote(estimate)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([sim.to_dict() for sim in sims], f, indent=2)
    return 0
