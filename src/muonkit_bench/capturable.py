"""``muonkit bench capturable``: step time of the plain, capturable and compiled HybridMuon steps.

The hidden matrices of GPT-2-124M (per layer: c_attn 2304x768, attn c_proj 768x768, c_fc
3072x768, mlp c_proj 768x3072, Linear layout) for ``--layers`` of its 12 layers, on Muon, and
each layer's LayerNorm gains and biases and Linear biases on AdamW; fixed random gradients, an lr
that changes at every step (as under a schedule). Variants, each on the same start and the same
gradients:

- ``plain``: ``HybridMuon(nonfinite="unchecked")``, eager;
- ``capturable``: ``capturable=True``, eager (lr and weight decay as device tensors);
- ``ns_compile``: the plain step with ``ns_compile=True`` (Newton-Schulz through inductor);
- ``compiled``: ``torch.compile`` of the whole capturable step (inductor, ``fullgraph=True``).

Reported: the median step time over ``--repeats`` timed steps after ``--warmup`` steps (the
first compiled call's time, less one steady step, is the compile time), the recompiles after the
first compiled step (0 expected: the lr is a tensor), and whether the params after every step
equal the plain step's bit for bit (else the largest difference). Example::

    muonkit bench capturable --layers 2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HELP = "step time: plain vs capturable vs torch.compile (whole step, and Newton-Schulz only)"
logger = logging.getLogger(__name__)

VARIANTS = ("plain", "capturable", "ns_compile", "compiled")
GPT2_HIDDEN = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]  # per layer, (out, in)
GPT2_VECTORS = [768, 768, 2304, 768, 3072, 768, 768, 768]  # ln_1 w/b, c_attn b, c_proj b, c_fc b, c_proj b, ln_2 w/b


def make_params(layers: int, *, width: int, seed: int) -> tuple[list[Any], list[Any]]:
    """GPT-2's hidden matrices and vectors for ``layers`` layers (scaled by ``width / 768``), and gradients."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    scale = width / 768

    def dims(n: int) -> int:
        return max(1, round(n * scale))

    shapes: list[tuple[int, ...]] = [(dims(r), dims(c)) for _ in range(layers) for r, c in GPT2_HIDDEN]
    shapes += [(dims(n),) for _ in range(layers) for n in GPT2_VECTORS]
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    return params, grads


def run_variant(variant: str, start: list[Any], grads: list[Any], *, lrs: list[float], warmup: int) -> dict[str, Any]:
    """Step ``len(lrs)`` times; the first ``warmup`` untimed. Returns times and the params after each step."""
    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    import muonkit

    params = [nn.Parameter(p.clone()) for p in start]
    matrices = [p for p in params if p.ndim == 2]
    vectors = [p for p in params if p.ndim == 1]
    groups = [
        {"params": matrices, "algorithm": "muon", "weight_decay": 0.01},
        {"params": vectors, "algorithm": "adamw"},
    ]
    capturable = variant in ("capturable", "compiled")
    opt = muonkit.HybridMuon(
        groups, nonfinite="unchecked", capturable=capturable, ns_compile=variant == "ns_compile", ns_dtype=torch.float32
    )
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    step: Callable[[], Any] = opt.step
    times, snapshots = [], []
    graphs_before = counters["stats"]["unique_graphs"]
    graphs_after_first = None
    for i, lr in enumerate(lrs):
        for group in opt.param_groups[:1]:
            if capturable:
                group["lr"].fill_(lr)  # what torch's lr schedulers do to a tensor lr
            else:
                group["lr"] = lr
        if variant == "compiled" and i == 1:  # one eager step creates every state first
            step = torch.compile(opt.step, fullgraph=True)
        start_time = time.perf_counter()
        step()
        times.append(time.perf_counter() - start_time)
        if variant == "compiled" and i == 1:
            graphs_after_first = counters["stats"]["unique_graphs"]
        snapshots.append([p.detach().clone() for p in params])
    steady = times[warmup:]
    result: dict[str, Any] = {
        "median_s": statistics.median(steady),
        "min_s": min(steady),
        "max_s": max(steady),
        "first_s": times[0] if variant != "compiled" else times[1],
        "graphs": counters["stats"]["unique_graphs"] - graphs_before,
    }
    if graphs_after_first is not None:
        result["recompiles_after_first"] = counters["stats"]["unique_graphs"] - graphs_after_first
        result["compile_s"] = times[1] - result["median_s"]
    result["snapshots"] = snapshots
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=2, help="GPT-2-124M layers (of 12) whose shapes are stepped")
    parser.add_argument(
        "--width", type=int, default=768, help="hidden size (768 = GPT-2 small; smaller for a smoke run)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the compiled variant compiles at step 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    import torch

    from muonkit_bench.environment import environment

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or args.warmup < 2 or args.repeats < 1 or args.layers < 1 or args.width < 1:
        raise SystemExit(
            f"invalid arguments: variants must be in {VARIANTS} (got {unknown}), --warmup >= 2, "
            "--repeats >= 1, --layers >= 1, --width >= 1"
        )
    compile_disabled = bool(torch._dynamo.config.disable)
    if compile_disabled and any(v in ("ns_compile", "compiled") for v in variants):
        logger.warning("TORCH_COMPILE_DISABLE is set: the compiled variants run eagerly")
    start, grads = make_params(args.layers, width=args.width, seed=args.seed)
    steps = args.warmup + args.repeats
    lrs = [0.02 * (1 - i / (2 * steps)) for i in range(steps)]  # a new lr at every step
    results = {v: run_variant(v, start, grads, lrs=lrs, warmup=args.warmup) for v in variants}
    snapshots = {v: r.pop("snapshots") for v, r in results.items()}
    if "plain" in snapshots:
        for name, result in results.items():
            pairs = [
                (a, b) for mine, theirs in zip(snapshots[name], snapshots["plain"], strict=True)
                for a, b in zip(mine, theirs, strict=True)
            ]  # fmt: skip
            result["equal_to_plain"] = all(torch.equal(a, b) for a, b in pairs)
            result["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
    report = {
        "layers": args.layers,
        "width": args.width,
        "compile_disabled": compile_disabled,
        "results": results,
        "environment": environment(),
    }
    print(format_table(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"GPT-2-124M hidden shapes, {report['layers']} layer(s), width {report['width']}, fp32"
        + (" (torch.compile disabled)" if report["compile_disabled"] else ""),
        f"{'variant':<12} {'median ms':>10} {'min':>8} {'max':>8} {'compile s':>10} {'graphs':>7} {'equal':>6} {'max diff':>9}",
    ]
    for name, r in report["results"].items():
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        lines.append(
            f"{name:<12} {r['median_s'] * 1e3:>10.1f} {r['min_s'] * 1e3:>8.1f} {r['max_s'] * 1e3:>8.1f} "
            f"{compile_s:>10} {r['graphs']:>7} {r.get('equal_to_plain', '-')!s:>6} {r.get('max_abs_diff', 0.0):>9.1e}"
        )
    return "\n".join(lines)
