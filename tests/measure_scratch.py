"""Measure one optimizer step's scratch memory on GPT-2 hidden-matrix shapes (not a test; issue 14).

Scratch = the peak bytes of tensors the second step allocates above weights, gradients and
momentum (:class:`muonkit_bench.live_bytes.LiveBytes`). Only each block's four Muon matrices
(c_attn 3d x d, attn c_proj d x d, c_fc 4d x d, mlp c_proj d x 4d), fp32 params and gradients.
``--layers`` caps the block count to keep the run short: enough layers fill every chunk, so
``unchecked`` (and torch.optim.Muon, per matrix) do not grow with more; ``skip`` then adds the
held directions of the missing layers (4 bytes per element), reported as ``skip@full``. Run::

    PYTHONPATH=src OMP_NUM_THREADS=1 python tests/measure_scratch.py --models 124m:8,350m:4,774m:2
"""

from __future__ import annotations

import argparse
import time

import torch

import muonkit
from muonkit_bench.live_bytes import LiveBytes

MODELS = {"124m": (768, 12), "350m": (1024, 24), "774m": (1280, 36)}
MIB = 2**20


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
    parser.add_argument("--opts", default="unchecked,skip,torch")
    parser.add_argument("--ns-steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print("model  layers  optimizer  scratch(MiB)  largest matrix(MiB)  all Muon fp32(MiB, full model)  skip@full")
    for item in args.models.split(","):
        name, layers = item.split(":")
        d, full = MODELS[name]
        for opt_name in args.opts.split(","):
            ps = params(d, int(layers))
            if opt_name == "torch":
                opt: torch.optim.Optimizer = torch.optim.Muon(ps, lr=0.02, ns_steps=args.ns_steps)
            else:
                opt = muonkit.HybridMuon(ps, ns_steps=args.ns_steps, ns_dtype=torch.float32, nonfinite=opt_name)
            opt.step()
            start = time.perf_counter()
            with LiveBytes() as live:
                opt.step()
            seconds = time.perf_counter() - start
            per_layer = sum(p.numel() for p in ps[:4]) * 4
            extra = (full - int(layers)) * per_layer if opt_name == "skip" else 0
            print(
                f"{name:<5}  {layers:>6}  {opt_name:<9}  {live.peak / MIB:12.1f}  {max(p.numel() for p in ps) * 4 / MIB:19.1f}"
                f"  {full * per_layer / MIB:30.1f}  {(live.peak + extra) / MIB if opt_name == 'skip' else float('nan'):9.1f}"
                f"   ({seconds:.0f} s)",
                flush=True,
            )
            del opt, ps


if __name__ == "__main__":
    main()
