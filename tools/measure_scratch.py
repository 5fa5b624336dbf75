"""Measure one optimizer step's scratch memory on GPT-2 hidden-matrix shapes (not a test; issue 14).

Scratch = the peak bytes of tensors the second step allocates above weights, gradients and
momentum (:class:`muonkit.testing.live_bytes.LiveBytes`). Only each block's four Muon matrices
(c_attn 3d x d, attn c_proj d x d, c_fc 4d x d, mlp c_proj d x 4d), fp32 params and gradients.
``--layers`` caps the block count to keep the run short: enough layers fill every chunk, so
``unchecked``, ``skip`` (the CPU's path), ``skip-accel`` (an accelerator's masked path, run on
the CPU) and torch.optim.Muon (per matrix) do not grow with more; ``skip-custom`` (a custom
schedule: every direction held until the verdict) then adds the held directions of the missing
layers (4 bytes per element), reported as ``held@full``. Run::

    PYTHONPATH=src OMP_NUM_THREADS=1 python tools/measure_scratch.py --models 124m:8,350m:4,774m:2
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import muonkit
from muonkit.testing import LiveBytes, as_on_an_accelerator

MODELS = {"124m": (768, 12), "350m": (1024, 24), "774m": (1280, 36)}
MIB = 2**20
CUSTOM = [(3.4, -4.7, 2.0)]  # near Keller's, not a preset's schedule


def params(d: int, layers: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        for shape in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d)):
            p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
            p.grad = torch.randn(shape, generator=g) * 1e-2
            out.append(p)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="124m:8,350m:4,774m:2", help="name:layers, comma-separated")
    parser.add_argument("--opts", default="unchecked,skip,skip-accel,skip-custom,torch")
    parser.add_argument("--ns-steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print("model  layers  optimizer    scratch(MiB)  largest matrix(MiB)  all Muon fp32(MiB, full model)  held@full")
    for item in args.models.split(","):
        name, layers = item.split(":")
        d, full = MODELS[name]
        for opt_name in args.opts.split(","):
            ps = params(d, int(layers))
            if opt_name == "torch":
                opt: torch.optim.Optimizer = torch.optim.Muon(ps, lr=0.02, ns_steps=args.ns_steps)
            else:
                nonfinite = opt_name.split("-")[0]
                coefficients = CUSTOM if opt_name == "skip-custom" else "polar_express"
                opt = muonkit.HybridMuon(
                    ps,
                    ns_steps=args.ns_steps,
                    ns_dtype=torch.float32,
                    nonfinite=nonfinite,
                    ns_coefficients=coefficients,
                )
            with as_on_an_accelerator() if opt_name == "skip-accel" else contextlib.nullcontext():
                opt.step()
                start = time.perf_counter()
                with LiveBytes() as live:
                    opt.step()
            seconds = time.perf_counter() - start
            per_layer = sum(p.numel() for p in ps[:4]) * 4
            held = opt_name == "skip-custom"
            extra = (full - int(layers)) * per_layer if held else 0
            print(
                f"{name:<5}  {layers:>6}  {opt_name:<11}  {live.peak / MIB:12.1f}  {max(p.numel() for p in ps) * 4 / MIB:19.1f}"
                f"  {full * per_layer / MIB:30.1f}  {(live.peak + extra) / MIB if held else float('nan'):9.1f}"
                f"   ({seconds:.0f} s)",
                flush=True,
            )
            del opt, ps


if __name__ == "__main__":
    main()
