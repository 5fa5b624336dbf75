"""Count aten calls and blocking reads of one optimizer step on GPT-2 hidden shapes (not a test; issue 14).

GPT-2's four hidden matrices per block (c_attn 2304x768, attn c_proj 768x768, c_fc 3072x768, mlp
c_proj 768x3072) at 1/8 size, fp32 params, ``muonkit.Muon`` against ``torch.optim.Muon``, one
step after a warmup step, counted by :func:`muonkit.testing.op_counts.count_ops` (on the CPU it runs
muonkit's accelerator path). The chunking decides the count, so chunks are emulated at the
matrices' scale: the CPU's 2^22 elements over 8^2, and an 80 GB GPU's default (1/64 of its memory
in fp32) over 8^2, where all matrices of one shape share a chunk. Run::

    PYTHONPATH=src OMP_NUM_THREADS=1 python tools/measure_calls.py --layers 6,12
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

import muonkit
from muonkit.distributed import SingleDeviceStrategy
from muonkit.testing import GPT2_SCALE, OpCounts, count_ops, gpt2_hidden_params, step_tensors

CHUNKS = {"cpu": 2**22 // GPT2_SCALE**2, "gpu": 80 * 2**30 // 256 // GPT2_SCALE**2}
NS = {
    "fp32-gram": (torch.float32, "gram"),
    "fp32-ns": (torch.float32, "newton_schulz"),
    "bf16": (torch.bfloat16, "gram"),
}


def counted(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], layers: int) -> OpCounts:
    ps = gpt2_hidden_params(layers)
    opt = build(ps)
    opt.step()
    return count_ops(opt.step, host=lambda: step_tensors(opt))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="6,12", help="comma-separated block counts")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    print("layers  chunks  Newton-Schulz  skip (calls/reads)  unchecked  torch.optim.Muon")
    for layers in (int(n) for n in args.layers.split(",")):
        theirs = counted(lambda ps: torch.optim.Muon(ps, lr=0.02), layers)
        for chunk_name, chunk in CHUNKS.items():
            for ns_name, (dtype, method) in NS.items():
                cells = []
                for nonfinite in ("skip", "unchecked"):
                    build = functools.partial(
                        muonkit.Muon,
                        lr=0.02,
                        nonfinite=nonfinite,
                        ns_dtype=dtype,
                        ns_method=method,
                        strategy=SingleDeviceStrategy(max_chunk_elements=chunk),
                    )
                    c = counted(build, layers)
                    cells.append(f"{c.calls} / {c.reads}")
                print(
                    f"{layers:>6}  {chunk_name:<6}  {ns_name:<13}  {cells[0]:>18}  {cells[1]:>9}  {theirs.calls} / {theirs.reads}"
                )


if __name__ == "__main__":
    main()
