"""Measure two promises of ``orthogonalize`` (not a test; issue 20 point 5).

``--eps``: for each preset, compute dtype and method, the band of ``eps`` over which every output
singular value of every hard input (``tests/spectra.py``; kept where ``s >= min_relative *
||U||_F``) stays in the preset's promised band, at the preset's 5 steps and at 8: the largest
``eps`` of a grid from 1e-7 to 1 that keeps it, and the worst low edge there.

``--rank``: for each preset, compute dtype and method, the largest step count at which a
rank-deficient input (ranks 1, 4 and 8 of 16x48, 48x16, 64x256 and 32x128; fp32 or fp64 input in
its own compute dtype) still gives a rank-deficient output: every spurious singular value (beyond
the input's rank) below ``--spurious`` (default 1e-2), and the worst spurious value at 5 steps
and at that count.

``--capturable``: how many capturable steps differ from their plain twin, bit for bit, over a
grid of AdamW params (0-dim, 1 and 3 elements; fp32, bf16, fp64; lr 1.0 and 0.02; weight decay 0
and 0.1; cautious or not; 30 seeds; 3 steps each). Run::

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python tools/measure_promises.py --eps
    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python tools/measure_promises.py --rank
    PYTHONPATH=src:tests OMP_NUM_THREADS=1 python tools/measure_promises.py --capturable
"""

from __future__ import annotations

import argparse
import itertools

import torch
from torch import Tensor, nn

import spectra
from muonkit import HybridMuon, orthogonalize
from muonkit.functional.coefficients import PRESETS

F64 = torch.float64
EPS_GRID = (1e-7, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
RANK_SHAPES = ((16, 48), (48, 16), (64, 256), (32, 128))


def eps_band(preset: str, dtype: torch.dtype, method: str, steps: int) -> tuple[float, float]:
    """The largest grid eps keeping every kept output singular value in the band, and the worst low edge there."""
    lo, hi = PRESETS[preset].band
    inputs = [spectra.hard_batch(r, c, seed)[1] for r, c, seed in ((32, 128, 0), (128, 32, 1), (64, 64, 2))]
    best, edge = 0.0, float("nan")
    for eps in EPS_GRID:
        worst_lo, worst_hi = 2.0, 0.0
        for batch in inputs:
            out = orthogonalize(batch, coefficients=preset, steps=steps, eps=eps, dtype=dtype, method=method)
            for x, o in zip(batch, out, strict=True):
                diag, _ = spectra.response(x, o, PRESETS[preset].min_relative)
                worst_lo, worst_hi = min(worst_lo, diag.min().item()), max(worst_hi, diag.max().item())
        if not (worst_lo >= lo and worst_hi <= hi):
            break
        best, edge = eps, worst_lo
    return best, edge


def low_rank(rows: int, cols: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g, dtype=F64) @ torch.randn(rank, cols, generator=g, dtype=F64)


def spurious(preset: str, dtype: torch.dtype, method: str, steps: int) -> float:
    """The largest output singular value beyond the input's rank, over the rank-deficient inputs."""
    worst = 0.0
    for seed, (rows, cols) in enumerate(RANK_SHAPES):
        for rank in (1, 4, 8):
            x = low_rank(rows, cols, rank, seed).to(dtype)
            o = orthogonalize(x, coefficients=preset, steps=steps, dtype=dtype, method=method)
            worst = max(worst, torch.linalg.svdvals(o.to(F64))[rank:].max().item())
    return worst


def capturable_twin(capturable: bool, seed: int, dtype: torch.dtype, shape: tuple[int, ...], **hp: float) -> Tensor:
    torch.manual_seed(seed)
    param = nn.Parameter(torch.randn(shape).to(dtype))
    group = {"params": [param], "algorithm": "adamw", "lr": hp["lr"], "weight_decay": hp["wd"]}
    opt = HybridMuon([group], nonfinite="unchecked", capturable=capturable, cautious_wd=bool(hp["cautious"]))
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):
        param.grad = torch.randn(shape, generator=g).to(dtype)
        opt.step()
    return param.detach()


def capturable_differences() -> tuple[int, int, dict[str, int]]:
    """(differing twins, twins, differing twins by dtype and shape)."""
    grid = itertools.product(
        range(30), (torch.float32, torch.bfloat16, F64), ((), (1,), (3,)), (1.0, 0.02), (0.0, 0.1), (0, 1)
    )
    total, by = 0, dict[str, int]()
    for seed, dtype, shape, lr, wd, cautious in grid:
        hp = {"lr": lr, "wd": wd, "cautious": cautious}
        total += 1
        if not torch.equal(
            capturable_twin(False, seed, dtype, shape, **hp), capturable_twin(True, seed, dtype, shape, **hp)
        ):
            key = f"{str(dtype)[6:]} {shape}"
            by[key] = by.get(key, 0) + 1
    return sum(by.values()), total, by


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eps", action="store_true")
    parser.add_argument("--rank", action="store_true")
    parser.add_argument("--capturable", action="store_true")
    parser.add_argument("--spurious", type=float, default=1e-2)
    args = parser.parse_args()
    methods = ("newton_schulz", "gram")
    if args.eps:
        print("preset         dtype     method         steps  largest eps in band  low edge there")
        for preset in PRESETS:
            for dtype in (torch.float32, torch.bfloat16):
                for method in methods:
                    for steps in (5, 8):
                        best, edge = eps_band(preset, dtype, method, steps)
                        print(f"{preset:14s} {str(dtype)[6:]:9s} {method:14s} {steps:5d}  {best:19.0e}  {edge:.3f}")
    if args.rank:
        print(f"preset         dtype     method         spurious@5  last steps < {args.spurious:g}  spurious there")
        for preset in PRESETS:
            for dtype in (torch.float32, torch.float64):
                for method in methods:
                    last, value = 0, float("nan")
                    for steps in range(5, 101):
                        worst = spurious(preset, dtype, method, steps)
                        if worst >= args.spurious:
                            break
                        last, value = steps, worst
                    at5 = spurious(preset, dtype, method, 5)
                    print(f"{preset:14s} {str(dtype)[6:]:9s} {method:14s} {at5:10.2e}  {last:18d}  {value:.2e}")

    if args.capturable:
        differing, total, by = capturable_differences()
        print(f"capturable twins differing from the plain step: {differing} of {total} {by}")


if __name__ == "__main__":
    main()
