"""HybridMuon's step against torch.optim.Muon in the same Newton-Schulz dtype, and the copies in it
(not a test; issue 22 point 10).

For each model and dtype, ``--rounds`` interleaved rounds of one step each of HybridMuon (Keller's
coefficients and 5 steps, torch's schedule) and of torch.optim.Muon running its own iteration in
that dtype (:func:`muonkit_bench.peers.torch_muon_in_fp32` for fp32), both with AdamW on the other
tensors, the same model, gradients and start. It prints the median steps, their ratio, the bound
the iteration's FLOPs set on it (the plain iteration's FLOPs over HybridMuon's, from
:func:`~muonkit.functional.orthogonalize.orthogonalization_flops`), and for one profiled HybridMuon
step the share of ``aten::copy_`` in its time and the number of copies, on the CPU path and on the
accelerator path (run on the CPU: :func:`muonkit.testing.as_on_an_accelerator`).

Another commit is measured by putting its ``src`` on ``PYTHONPATH``: the peers always come from
this checkout (older ``TorchMuonAdamW`` classes have no ``ns_dtype``). Run::

    PYTHONPATH=src OMP_NUM_THREADS=1 python tools/measure_same_dtype.py --models gpt2-124m,bench-gpt
    PYTHONPATH=/tmp/old/src OMP_NUM_THREADS=1 python tools/measure_same_dtype.py --models bench-gpt
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import muonkit
from muonkit.functional.orthogonalize import orthogonalization_flops
from muonkit_bench.step import build_model, make_grads

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@functools.cache
def _peers_here() -> Any:
    """This checkout's ``muonkit_bench.peers``, whichever muonkit is on the path."""
    path = Path(__file__).resolve().parents[1] / "src" / "muonkit_bench" / "peers.py"
    spec = importlib.util.spec_from_file_location("_peers_here", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _on_an_accelerator() -> Callable[[], contextlib.AbstractContextManager[None]]:
    for name in ("muonkit.testing", "muonkit_bench.op_counts"):  # where older commits kept it
        with contextlib.suppress(ImportError, AttributeError):
            return importlib.import_module(name).as_on_an_accelerator  # type: ignore[no-any-return]
    raise ImportError("no as_on_an_accelerator in this muonkit")


def flop_bound(groups: list[dict[str, Any]], dtype: torch.dtype) -> float:
    """The plain iteration's FLOPs over HybridMuon's (Gram where it runs it) at Keller x5."""
    shapes = [tuple(p.shape) for g in groups if g["algorithm"] == "muon" for p in g["params"]]
    plain = sum(orthogonalization_flops(r, c, 5) for r, c in shapes)
    ours = sum(orthogonalization_flops(r, c, 5, "gram", dtype) for r, c in shapes)
    return plain / ours


def copies(opt: Any, path: str) -> dict[str, float]:
    """One profiled step (after the caller's warmup): ``aten::copy_``'s share of it and its calls."""
    with _on_an_accelerator()() if path == "accel" else contextlib.nullcontext():
        opt.step()  # this path's first step (the accelerator path may make its state once)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
    events = {e.key: e for e in prof.key_averages()}
    total = sum(e.self_cpu_time_total for e in events.values())
    copy = events.get("aten::copy_")
    share = 0.0 if copy is None else copy.self_cpu_time_total / total
    return {"share": share, "calls": 0 if copy is None else copy.count}


def measure(model_name: str, dtype_name: str, rounds: int) -> dict[str, Any]:
    peers = _peers_here()
    model = build_model(model_name, device="cpu", seed=0)
    for p, g in zip(model.parameters(), make_grads(model, kind="random", seed=0), strict=True):
        p.grad = g
    groups = muonkit.param_groups(model)
    dtype = DTYPES[dtype_name]
    ours = [
        {**g, "lr": 0.02, "ns_coefficients": "keller", "ns_steps": 5, "ns_dtype": dtype}
        if g["algorithm"] == "muon"
        else {**g, "lr": 3e-4}
        for g in groups
    ]
    opts = {"hybrid_muon": muonkit.HybridMuon(ours), "torch_muon": peers.TorchMuonAdamW(groups, ns_dtype=dtype_name)}
    for opt in opts.values():
        opt.step()
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(rounds):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "ms": {name: 1e3 * m for name, m in median.items()},
        "ratio": median["torch_muon"] / median["hybrid_muon"],
        "bound": flop_bound(groups, dtype),
        "cpu": copies(opts["hybrid_muon"], "cpu"),
        "accel": copies(opts["hybrid_muon"], "accel"),
    }


def rows(args: argparse.Namespace) -> Iterator[str]:
    yield f"muonkit {muonkit.__file__}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    yield (
        f"{'model':<10} {'dtype':<5} {'HybridMuon ms':>13} {'torch ms':>9} {'ratio':>6} {'FLOP bound':>10}"
        f" {'copy_ cpu':>9} {'calls':>5} {'copy_ accel':>11} {'calls':>5}"
    )
    for model_name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            r = measure(model_name, dtype_name, args.rounds)
            yield (
                f"{model_name:<10} {dtype_name:<5} {r['ms']['hybrid_muon']:13.1f} {r['ms']['torch_muon']:9.1f}"
                f" {r['ratio']:6.2f} {r['bound']:10.2f} {r['cpu']['share']:9.1%} {r['cpu']['calls']:5d}"
                f" {r['accel']['share']:11.1%} {r['accel']['calls']:5d}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bench-gpt", help="comma-separated, from muonkit_bench.step.MODELS")
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, from {sorted(DTYPES)}")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed steps per method")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    bad = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad:
        sys.exit(f"Invalid --dtypes {args.dtypes!r}: each must be one of {sorted(DTYPES)}")
    torch.set_num_threads(args.threads)
    for line in rows(args):
        print(line, flush=True)


if __name__ == "__main__":
    main()
