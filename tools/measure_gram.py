"""Measure the Gram iteration's restart policy on hard inputs (not a test; issue 14 point 4).

For each compute dtype, preset and step count, on a batch of hard spectra (tests/spectra.py plus
condition 1e9 and 1e12, near-orthogonal, tiny and huge scales) it runs the plain iteration, the
Gram iteration with the restarts :func:`gram_restarts` uses for fp64 (step 2, then every 4), and
the Gram iteration without any restart, and prints per variant the worst polar distance
``||O - P||_F / ||P||_F`` (P: the fp64 SVD polar factor), the largest output singular value and
the worst distance to the plain iteration's output. ``--gpt2`` adds single GPT-2 shapes (with
timings: the fastest of ``--repeats`` interleaved runs). Run::

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python tools/measure_gram.py --shape 128x512
    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python tools/measure_gram.py --gpt2 --dtypes float32
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Collection

import torch

import spectra
from muonkit.functional.coefficients import resolve_preset
from muonkit.functional.orthogonalize import _gram_newton_schulz_, _newton_schulz_, _normalize_into

F64 = torch.float64


def hard_inputs(rows: int, cols: int, seed: int) -> tuple[list[str], torch.Tensor]:
    names, x = spectra.hard_batch(rows, cols, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = min(rows, cols)
    extra = {
        "cond_1e9": torch.logspace(0, -9, k, dtype=F64),
        "cond_1e12": torch.logspace(0, -12, k, dtype=F64),
        "near_orthogonal": 1 + 1e-3 * torch.randn(k, generator=g, dtype=F64),
    }
    mats = [spectra.with_spectrum(rows, cols, s, g) for s in extra.values()]
    gauss = torch.randn(rows, cols, generator=g, dtype=F64)
    mats += [gauss * 1e-30, gauss * 1e30]
    return [*names, *extra, "tiny_1e-30", "huge_1e30"], torch.cat([x, torch.stack(mats)])


def polar(x: torch.Tensor) -> torch.Tensor:
    p, _, qt = torch.linalg.svd(x.to(F64), full_matrices=False)
    return p @ qt


def run(x: torch.Tensor, dtype: torch.dtype, preset: str, steps: int, restarts: Collection[int] | None) -> torch.Tensor:
    """Normalize like orthogonalize_batches (short side first) and iterate; restarts None = plain."""
    schedule, k = resolve_preset(preset, steps=steps)
    tall = x.size(-2) > x.size(-1)
    src = x.mT if tall else x
    work = torch.empty(src.shape, dtype=dtype)
    _normalize_into([src], work, k + 1e-7, transpose=False)
    box = [work]
    out = _newton_schulz_(box, schedule) if restarts is None else _gram_newton_schulz_(box, schedule, restarts)
    return out.mT if tall else out


def variants(steps: int) -> dict[str, tuple[int, ...] | None]:
    return {"plain": None, "restart": tuple(range(2, steps, 4)), "none": ()}


def measure_batch(rows: int, cols: int, dtypes: list[torch.dtype], presets: list[str], steps_list: list[int]) -> None:
    names, x = hard_inputs(rows, cols, seed=0)
    full_rank = torch.tensor([n not in ("low_rank_4", "rank_1") for n in names])
    ref = polar(x)
    print(f"\n{rows}x{cols}, {len(names)} inputs: {', '.join(names)}")
    print(
        "exact = the plain iteration in fp64; polar = ||O - P|| / ||P|| (P the SVD polar factor; max over the "
        "full-rank inputs)\ndtype     preset         steps  variant  max-|O-exact|/|exact|  worst-input        "
        "max-sv    max-polar"
    )
    for preset in presets:
        for steps in steps_list:
            exact = run(x, F64, preset, steps, None)
            for dtype in dtypes:
                src = x if dtype == F64 else x.float()
                for name, restarts in variants(steps).items():
                    out = run(src, dtype, preset, steps, restarts).to(F64)
                    err = rel(out, exact).nan_to_num(torch.inf)
                    dist = rel(out, ref).nan_to_num(torch.inf)[full_rank]
                    top = max(
                        torch.linalg.svdvals(o).max().item() if torch.isfinite(o).all() else float("inf") for o in out
                    )
                    worst = int(err.argmax())
                    print(
                        f"{str(dtype)[6:]:<9} {preset:<14} {steps:>5}  {name:<7}  {err.max().item():21.2e}  "
                        f"{names[worst]:<17}  {top:8.4f}  {dist.max().item():9.3e}"
                    )


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)


def interleaved_min_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` runs of each, interleaved so load changes hit all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure_gpt2(dtypes: list[torch.dtype], presets: list[str], steps_list: list[int], repeats: int) -> None:
    print("\nGPT-2 shapes (cond_1e6, cond_1e12, low_rank_4, near_orthogonal, gaussian); time: one gaussian matrix")
    print("shape      dtype     preset        steps  variant  max-polar-dist  max-sv   |O-O_plain|  min-time(ms)")
    for rows, cols in ((768, 3072), (3072, 768), (768, 2304)):
        g = torch.Generator().manual_seed(1)
        k = min(rows, cols)
        specs = {
            "cond_1e6": torch.logspace(0, -6, k, dtype=F64),
            "cond_1e12": torch.logspace(0, -12, k, dtype=F64),
            "low_rank_4": torch.where(torch.arange(k) < 4, 1.0 / (1 + torch.arange(k, dtype=F64)), 0.0),
            "near_orthogonal": 1 + 1e-3 * torch.randn(k, generator=g, dtype=F64),
        }
        x = torch.stack([spectra.with_spectrum(rows, cols, s, g) for s in specs.values()])
        x = torch.cat([x, torch.randn(1, rows, cols, generator=g, dtype=F64)])
        ref = polar(x)
        for dtype in dtypes:
            src = x if dtype == F64 else x.float()
            for preset in presets:
                for steps in steps_list:
                    found = variants(steps)
                    outs = {name: run(src, dtype, preset, steps, r).to(F64) for name, r in found.items()}
                    one = src[-1:]
                    fns = {name: functools.partial(run, one, dtype, preset, steps, r) for name, r in found.items()}
                    times = interleaved_min_times(fns, repeats)
                    for name, out in outs.items():
                        dist = rel(out, ref).max().item()
                        top = torch.linalg.matrix_norm(out, ord=2).max().item()
                        gap = rel(out, outs["plain"]).max().item()
                        print(
                            f"{rows}x{cols:<5} {str(dtype)[6:]:<9} {preset:<13} {steps:>5}  {name:<7}  "
                            f"{dist:14.3e}  {top:7.4f}  {gap:.2e}  {1e3 * times[name]:12.1f}"
                        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="128x512")
    parser.add_argument("--dtypes", default="float32,float64,bfloat16")
    parser.add_argument("--presets", default="polar_express,keller,you")
    parser.add_argument("--steps", default="3,4,5,6,7,8,10,12")
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 shapes with timings instead of --shape")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    presets = args.presets.split(",")
    steps_list = [int(s) for s in args.steps.split(",")]
    torch.manual_seed(0)
    if args.gpt2:
        measure_gpt2(dtypes, presets, steps_list, args.repeats)
    else:
        rows, cols = (int(v) for v in args.shape.split("x"))
        measure_batch(rows, cols, dtypes, presets, steps_list)


if __name__ == "__main__":
    main()
