"""Measure the peak memory of real training steps, one optimizer per process.

Run as ``python -m muonkit_bench.memory_probe --optimizer hybrid_muon ...``; prints one JSON line.
:mod:`muonkit_bench.memory` starts one such process per optimizer so that no allocator cache or
state of one run leaks into the other.

How it measures (Linux): the resident set size (``VmRSS``) and its high-water mark (``VmHWM``)
from ``/proc/self/status``; writing ``5`` to ``/proc/self/clear_refs`` resets the high-water mark,
so each phase (forward+backward, optimizer step) gets its own peak. The parent sets
``MALLOC_MMAP_THRESHOLD_`` so that every tensor above 64 KiB is its own mapping and returns to
the OS when freed: RSS then follows the live tensors instead of glibc's cache.

Phases, after ``warmup`` full steps (so every state exists)::

    steady   RSS with params, grads and states alive (after step, before zero_grad)
    fwd_bwd  peak during forward + backward (activations)
    step     peak during optimizer.step() (states + the step's own temporaries)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

PROBE_OPTIMIZERS = ("adamw", "hybrid_muon", "torch_muon", "hybrid_muon_bf16", "hybrid_muon_8bit")
"""``hybrid_muon_bf16`` / ``_8bit``: HybridMuon with ``state_dtype="bf16"`` / ``"8bit"`` (every group)."""


def rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, kib, _ = line.split()
                values[key] = int(kib) * 1024
    return values["VmRSS:"], values["VmHWM:"]


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def qwen2_config(*, hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    """A small Qwen2 with Qwen2.5-3B's proportions: 8 query heads per KV head, MLP 5.375x wide, tied embeddings."""
    heads = max(1, hidden // 64)
    return {
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 5.375) // 64 * 64,  # Qwen2.5-3B: 11008 / 2048
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 8),
        "vocab_size": vocab,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    }


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    if args.model == "qwen2":
        from muonkit.integrations.transformers import model_from_config

        cfg = qwen2_config(hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        model = model_from_config(cfg, device="cpu")
    else:
        from muonkit_bench.model import GPT, GPTConfig

        heads = max(1, args.hidden // 64)
        model = GPT(
            GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=heads, n_embd=args.hidden)
        )
    return model.to(getattr(torch, args.dtype))


def build_optimizer(model: nn.Module, name: str) -> Any:
    import muonkit
    from muonkit_bench import peers

    groups = muonkit.param_groups(model, lr=0.02, adamw_lr=3e-4)
    if name == "adamw":
        return peers.adamw(groups)
    if name == "hybrid_muon":
        return peers.hybrid_muon(groups)
    if name.startswith("hybrid_muon_"):  # peers.hybrid_muon's groups, states kept in bf16 / 8-bit
        fresh = [{**g, "lr": 0.02} if g["algorithm"] == "muon" else {**g, "lr": 3e-4} for g in groups]
        return muonkit.HybridMuon(fresh, state_dtype=name.removeprefix("hybrid_muon_"))
    return peers.TorchMuonAdamW(groups)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if type(model).__module__.startswith("transformers"):
        return model(input_ids=batch, labels=batch).loss
    _, loss = model(batch, batch)
    return loss


def state_bytes(opt: Any) -> int:
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    rss_model, _ = rss_bytes()
    opt = build_optimizer(model, args.optimizer)
    gen = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    fwd_bwd = step = steady = 0
    losses = []
    start = time.perf_counter()
    for i in range(args.warmup + args.steps):
        opt.zero_grad(set_to_none=True)
        reset_peak()
        loss = _loss(model, batch)
        loss.backward()
        peak_fb = rss_bytes()[1]
        reset_peak()
        opt.step()
        now, peak_step = rss_bytes()
        losses.append(loss.item())
        if i >= args.warmup:
            fwd_bwd, step, steady = max(fwd_bwd, peak_fb), max(step, peak_step), max(steady, now)
    return {
        "optimizer": args.optimizer,
        "model": args.model,
        "params": params,
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "rss_model": rss_model,
        "steady": steady,
        "peak_fwd_bwd": fwd_bwd,
        "peak_step": step,
        "peak": max(fwd_bwd, step),
        "state_bytes": state_bytes(opt),
        "grad_bytes": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "losses": losses,
        "seconds": time.perf_counter() - start,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--optimizer", choices=PROBE_OPTIMIZERS, required=True)
    p.add_argument("--model", choices=("qwen2", "gpt"), default="qwen2")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    print(json.dumps(measure(args)))
    return 0


def probe_command(options: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run one probe in a fresh interpreter."""
    argv = [sys.executable, "-m", "muonkit_bench.memory_probe"]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TORCH_COMPILE_DISABLE": "1"}
    return argv, env


if __name__ == "__main__":
    sys.exit(main())
