"""``muonkit bench lora``: where should PEFT LoRA factors go, Muon or AdamW?

PEFT's ``lora_A`` (r x in) and ``lora_B`` (out x r) are ``nn.Linear`` weights, so structure alone
would route both to Muon, where Keller's shape scale gives ``lora_B`` sqrt(out/r). This benchmark
measures the three choices of :func:`muonkit.lora_rules` on one small task:

1. **Pretrain** the benchmark GPT with AdamW on the training plays of the Shakespeare corpus
   (one run, shared by every fine-tune).
2. **LoRA fine-tune** it (PEFT, rank ``r`` on every attention and MLP Linear, base frozen) on the
   held-out plays: their first 80% is the fine-tuning data, the last 20% the evaluation set (the
   same windows for every run). Each routing runs with each seed (the seed sets the LoRA A init
   and the batch order, the same for every routing), with the same Muon lr (0.02, Keller scale)
   and AdamW lr; HybridMuon for all three, so only the routing of the factors differs.
3. Report the evaluation loss after fine-tuning: mean, std and 95% t-interval over seeds, and
   the paired difference to Muon-on-both (same seed).

Example::

    muonkit bench lora --preset tiny     # seconds: the CI smoke test
    muonkit bench lora                   # the default preset (< 3 min on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

HELP = "LoRA fine-tune of the benchmark GPT with LoRA factors on Muon, on Muon for B only, or on AdamW"
logger = logging.getLogger(__name__)

ROUTING_NAMES = {"muon": "Muon on A and B", "b_muon": "Muon on B, AdamW on A", "adamw": "AdamW on A and B"}
TARGETS = ["c_attn", "c_proj", "c_fc"]
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "model": {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "pretrain": {"steps": 20, "batch_size": 8, "eval_interval": 10, "eval_batches": 2},
        "lora": {"r": 4, "alpha": 8, "steps": 6, "batch_size": 4, "eval_batches": 2},
        "seeds": (0, 1),
    },
    "default": {
        "vocab_size": 1024,
        "model": {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 128},
        "pretrain": {"steps": 200, "batch_size": 16, "eval_interval": 100, "eval_batches": 4},
        "lora": {"r": 8, "alpha": 16, "steps": 100, "batch_size": 16, "eval_batches": 8},
        "seeds": (0, 1, 2),
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--seeds", help="comma-separated fine-tuning seeds (default: the preset's)")
    parser.add_argument("--routings", default=",".join(ROUTING_NAMES), help="comma-separated: muon,b_muon,adamw")
    parser.add_argument("--lr", type=float, default=0.02, help="Muon lr (Keller shape scale)")
    parser.add_argument("--adamw-lr", type=float, default=1e-3, help="AdamW lr (LoRA factors on AdamW, and the head)")
    parser.add_argument("--rank", type=int, help="LoRA rank r (default: the preset's; lora_alpha = 2r)")
    parser.add_argument("--steps", type=int, help="fine-tuning steps (default: the preset's)")
    parser.add_argument("--cache-dir", help="corpus cache (default: $MUONKIT_CACHE or ~/.cache/muonkit)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default="runs/lora", help="output folder (lora.json)")


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(
            "muonkit bench lora needs peft: pip install peft (in a clone of muonkit: pip install -e '.[integrations]')"
        ) from e
    return peft


def pretrain(preset: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """(the AdamW-pretrained GPT, the corpus, a summary)."""
    from muonkit_bench.data import load_corpus
    from muonkit_bench.model import GPTConfig
    from muonkit_bench.train import RunConfig, train

    corpus = load_corpus(vocab_size=preset["vocab_size"], cache_dir=args.cache_dir)
    config = RunConfig(
        model=GPTConfig(vocab_size=corpus.vocab_size, **preset["model"]), optimizer="adamw", **preset["pretrain"]
    )
    result = train(config, corpus, progress=not args.no_progress)
    summary = {"final_val_loss": result.final_val_loss, "wall_time_s": result.wall_time_s}
    logger.info("pretrained with AdamW: val loss %.4f (%.1f s)", result.final_val_loss, result.wall_time_s)
    return result.model, corpus, summary


def windows(tokens: Any, starts: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.as_tensor(tokens, dtype=torch.long)
    x = torch.stack([data[s : s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts.tolist()])
    return x, y


def finetune(
    base: Any, corpus: Any, preset: dict[str, Any], routing: str, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One LoRA fine-tune; returns its evaluation losses before and after, and its time."""
    import muonkit

    peft = _peft()
    lora = preset["lora"]
    block = preset["model"]["block_size"]
    split = int(len(corpus.val) * 0.8)
    tune, held = corpus.val[:split], corpus.val[split:]
    eval_starts = torch.linspace(0, len(held) - block - 2, lora["eval_batches"] * lora["batch_size"]).long()
    eval_set = windows(held, eval_starts, block)
    torch.manual_seed(seed)  # the LoRA A init
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=TARGETS)
    )
    groups = muonkit.param_groups(model, lr=args.lr, adamw_lr=args.adamw_lr, rules=muonkit.lora_rules(routing))
    optimizer = muonkit.HybridMuon(groups)
    steps = lora["steps"]
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (1 - s / steps) if s < steps else 0.0
    )
    generator = torch.Generator().manual_seed(seed)
    before = evaluate(model, eval_set, lora["batch_size"])
    start = time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, len(tune) - block - 1, (lora["batch_size"],), generator=generator)
        x, y = windows(tune, starts, block)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    seconds = time.perf_counter() - start
    after = evaluate(model, eval_set, lora["batch_size"])
    return {"routing": routing, "seed": seed, "eval_loss_before": before, "eval_loss": after, "train_s": seconds,
            "factors": factor_algorithms(groups)}  # fmt: skip


def factor_algorithms(groups: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{"lora_A": [algorithms], "lora_B": [...]}``: where the factors actually went."""
    out: dict[str, set[str]] = {"lora_A": set(), "lora_B": set()}
    for g in groups:
        for name in g["param_names"]:
            for factor, algorithms in out.items():
                if f".{factor}." in name:
                    algorithms.add(g["algorithm"])
    return {k: sorted(v) for k, v in out.items()}


@torch.no_grad()
def evaluate(model: Any, eval_set: tuple[torch.Tensor, torch.Tensor], batch_size: int) -> float:
    model.eval()
    x, y = eval_set
    losses = [float(model(x[i : i + batch_size], y[i : i + batch_size])[1]) for i in range(0, len(x), batch_size)]
    model.train()
    return sum(losses) / len(losses)


def summarize(runs: list[dict[str, Any]], routings: list[str]) -> dict[str, Any]:
    from muonkit_bench.stats import t_interval

    out: dict[str, Any] = {}
    by = {r: {run["seed"]: run["eval_loss"] for run in runs if run["routing"] == r} for r in routings}
    for r in routings:
        out[r] = {"eval_loss": t_interval(list(by[r].values()))}
        if r != "muon" and "muon" in by:
            paired = [by[r][s] - by["muon"][s] for s in by[r] if s in by["muon"]]
            out[r]["minus_muon"] = t_interval(paired)
    return out


def table(summary: dict[str, Any], before: float) -> str:
    lines = [f"eval loss before fine-tuning (every run): {before:.4f}", "",
             f"{'routing':<24} {'eval loss mean':>14} {'std':>7} {'95% CI':>17} {'vs Muon on A and B (paired)':>30}"]  # fmt: skip
    for r, s in summary.items():
        e = s["eval_loss"]
        ci = f"[{e['low']:.4f}, {e['high']:.4f}]" if math.isfinite(e["half_width"]) else "n/a"
        d = s.get("minus_muon")
        diff = f"{d['mean']:+.4f} ± {d['half_width']:.4f}" if d and math.isfinite(d["half_width"]) else ""
        lines.append(f"{ROUTING_NAMES[r]:<24} {e['mean']:>14.4f} {e['std']:>7.4f} {ci:>17} {diff:>30}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from muonkit_bench.environment import environment

    preset = copy.deepcopy(PRESETS[args.preset])
    if args.rank:
        preset["lora"].update(r=args.rank, alpha=2 * args.rank)
    if args.steps:
        preset["lora"]["steps"] = args.steps
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else preset["seeds"]
    routings = args.routings.split(",")
    for r in routings:
        if r not in ROUTING_NAMES:
            raise SystemExit(f"Invalid routing {r!r}: must be one of {sorted(ROUTING_NAMES)}")
    torch.manual_seed(0)
    start = time.perf_counter()
    base, corpus, pre = pretrain(preset, args)
    runs = [finetune(base, corpus, preset, r, s, args) for s in seeds for r in routings]
    summary = summarize(runs, routings)
    print(table(summary, runs[0]["eval_loss_before"]))
    result = {"preset": preset, "seeds": list(seeds), "lr": args.lr, "adamw_lr": args.adamw_lr, "pretrain": pre,
              "runs": runs, "summary": summary, "wall_time_s": time.perf_counter() - start,
              "environment": environment()}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out / 'lora.json'} ({result['wall_time_s']:.0f} s)")
    return 0
