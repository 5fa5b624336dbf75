"""``muonkit bench step``: optimizer step time and orthogonalization quality, muonkit vs its peers.

For each model (GPT-2-124M shapes, the benchmark GPT) the same gradients are fed to every
method (:mod:`muonkit_bench.peers`): AdamW, HybridMuon, torch.optim.Muon + AdamW, DeepSpeed's
single-device Muon. Step time: ``--warmup`` untimed steps (at least 2), then ``--repeats`` timed steps
(synchronized on GPU), each after the same gradients are copied back in (DeepSpeed overwrites
``p.grad``); reported as the median with min and max. Beside each time, the quality of the
orthogonalization of the first step, on one matrix of each shape::

    O = (W_before - W_after) / (lr * scale(rows, cols))     # the update the method applied
    max|s-1|, mean|s-1| over the singular values s of O      (float64 SVD)
    polar = ||O - P||_F / ||P||_F,  P = the exact polar factor of the gradient

(at step one every method's momentum update is a multiple of the gradient, so all of them
orthogonalize the same matrix). Beside them, what one step (after the warmup) asks of the device,
counted by :mod:`muonkit.testing.op_counts`: ``calls``, its aten ops (about one kernel launch each
on a GPU), and ``reads``, its blocking device-to-host reads; and the step's scratch memory: the
peak bytes of the tensors an untimed second step allocates above weights, gradients and state
(:mod:`muonkit.testing.live_bytes`). A second table runs HybridMuon with each coefficient preset and
step count. Example::

    muonkit bench step                       # GPT-2-124M shapes and the benchmark GPT
    muonkit bench step --models tiny --repeats 2 --ns-steps 3,5
    TORCH_COMPILE_DISABLE=0 muonkit bench step --device cuda --compiled --warmup 3   # + torch.compile'd peers
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

from muonkit_bench.cli import chosen

HELP = "optimizer step time and orthogonalization error: HybridMuon vs torch.optim.Muon vs DeepSpeed Muon vs AdamW"
logger = logging.getLogger(__name__)

MODELS: dict[str, dict[str, Any]] = {
    # GPT-2 small: 12 x (c_attn 2304x768, attn c_proj 768x768, c_fc 3072x768, mlp c_proj 768x3072),
    # wte 50257x768 (tied head), wpe 1024x768, LayerNorm gains and biases, Linear biases.
    "gpt2-124m": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768,
                  "bias": True, "tie_embeddings": True},
    "bench-gpt": {"vocab_size": 2048, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256},
    "tiny": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64},
}  # fmt: skip
MUON_LR = 0.02


def build_model(name: str, *, device: str, seed: int) -> Any:
    import torch

    from muonkit_bench.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**MODELS[name])).to(device)


def make_grads(model: Any, *, kind: str, seed: int) -> list[Any]:
    """Random normal gradients, or those of one backward pass on random tokens."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = list(model.parameters())
    if kind == "random":
        return [(torch.randn(p.shape, generator=gen) * 1e-2).to(p.device) for p in params]
    config = model.config
    tokens = torch.randint(0, config.vocab_size, (4, min(128, config.block_size) + 1), generator=gen)
    tokens = tokens.to(params[0].device)
    model.zero_grad(set_to_none=True)
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    grads = [p.grad.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    return grads


def orthogonality_error(update: Any, reference: Any) -> dict[str, float]:
    """Singular values of ``update`` against 1, and its distance to the polar factor ``reference``."""
    import torch

    s = torch.linalg.svdvals(update.double())
    dev = (s - 1).abs()
    polar = torch.linalg.matrix_norm(update.double() - reference) / torch.linalg.matrix_norm(reference)
    return {"max_abs_s_minus_1": float(dev.max()), "mean_abs_s_minus_1": float(dev.mean()), "polar": float(polar)}


def polar_factor(g: Any) -> Any:
    import torch

    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return u @ vh


def probe_matrices(groups: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """(index into model.parameters(), param) of the first Muon matrix of each shape."""
    seen: dict[tuple[int, ...], Any] = {}
    for g in groups:
        if g["algorithm"] == "muon":
            for p in g["params"]:
                seen.setdefault(tuple(p.shape), p)
    return list(enumerate(seen.values()))


class Harness:
    """One model, its initial weights and gradients; runs any method from the same start."""

    def __init__(self, name: str, *, device: str, grads: str, seed: int) -> None:
        import muonkit

        self.name, self.device = name, device
        self.model = build_model(name, device=device, seed=seed)
        self.params = list(self.model.parameters())
        self.initial = [p.detach().clone() for p in self.params]
        self.grads = make_grads(self.model, kind=grads, seed=seed)
        groups = muonkit.param_groups(self.model)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.probes = [index[id(p)] for _, p in probe_matrices(groups)]
        self.polar = {i: polar_factor(self.grads[i]) for i in self.probes}
        self.n_params = sum(p.numel() for p in self.params)
        self.n_muon = sum(p.numel() for g in groups if g["algorithm"] == "muon" for p in g["params"])

    def groups(self, *, per_head: bool = False) -> list[dict[str, Any]]:
        import muonkit

        return muonkit.param_groups(self.model, lr=MUON_LR, per_head=per_head)

    def reset(self) -> None:
        import torch

        with torch.no_grad():
            for p, w in zip(self.params, self.initial, strict=True):
                p.copy_(w)
                p.grad = None

    def load_grads(self) -> None:
        import torch

        with torch.no_grad():
            for p, g in zip(self.params, self.grads, strict=True):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)

    def sync(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(
        self, build: Any, *, warmup: int, repeats: int, muon: bool = True, per_head: bool = False
    ) -> dict[str, Any]:
        """Build from fresh groups (attention per head with ``per_head``: no error measured, its
        matrices are the heads), measure the first step's error and the second's scratch memory,
        then time ``repeats`` steps."""
        import torch

        from muonkit.testing import LiveBytes

        self.reset()
        opt = build(self.groups(per_head=per_head))
        self.load_grads()
        before = {i: self.params[i].detach().clone() for i in self.probes}
        opt.step()
        errors = {}
        if muon and not per_head:
            for i in self.probes:
                p = self.params[i]
                scale = math.sqrt(max(1.0, p.shape[0] / p.shape[1]))  # every peer here uses Keller's
                update = (before[i] - p.detach()).double() / (MUON_LR * scale)
                errors["x".join(map(str, p.shape))] = orthogonality_error(update, self.polar[i])
        self.load_grads()  # a second untimed step, its scratch memory measured (state exists by now)
        with LiveBytes() as live:
            opt.step()
        for _ in range(max(0, warmup - 2)):
            self.load_grads()
            opt.step()
        self.load_grads()
        counts = self.count(opt)
        work = _work(opt)
        times = []
        for _ in range(repeats):
            self.load_grads()
            self.sync()
            start = time.perf_counter()
            opt.step()
            self.sync()
            times.append(time.perf_counter() - start)
        work_per_step = _per_step(work, _work(opt), repeats)
        del opt
        torch.cuda.empty_cache() if self.device.startswith("cuda") else None
        summary = {"times_s": times, **_time_summary(times), **counts, "scratch_bytes": live.peak, **work_per_step}
        return {**summary, "errors": errors, **_error_summary(errors)}

    def count(self, opt: Any) -> dict[str, int | None]:
        """One step under :class:`muonkit.testing.op_counts.OpCounter`: its aten calls and blocking reads."""
        from muonkit.testing import count_ops, step_tensors

        try:
            counts = count_ops(opt.step, host=lambda: step_tensors(opt), device=self.device)
        except Exception as e:  # a peer whose step a dispatch mode breaks (torch.compile'd code)
            logger.warning("could not count the ops of a step: %s", e)
            return {"aten_calls": None, "host_reads": None}
        return {"aten_calls": counts.calls, "host_reads": counts.reads}


def _work(opt: Any) -> tuple[int, int] | None:
    """HybridMuon's cumulative orthogonalized matrices and their matrix-product FLOPs (None for a peer)."""
    stats = getattr(getattr(opt, "strategy", None), "stats", None)
    return None if stats is None else (int(stats.matrices), int(stats.flops))


def _per_step(before: tuple[int, int] | None, after: tuple[int, int] | None, steps: int) -> dict[str, int | None]:
    if before is None or after is None:
        return {"matrices": None, "flops": None}
    return {"matrices": (after[0] - before[0]) // steps, "flops": (after[1] - before[1]) // steps}


def _time_summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def _error_summary(errors: dict[str, dict[str, float]]) -> dict[str, float | None]:
    if not errors:
        return {"max_abs_s_minus_1": None, "mean_abs_s_minus_1": None, "polar": None}
    return {
        "max_abs_s_minus_1": max(e["max_abs_s_minus_1"] for e in errors.values()),
        "mean_abs_s_minus_1": statistics.fmean(e["mean_abs_s_minus_1"] for e in errors.values()),
        "polar": max(e["polar"] for e in errors.values()),
    }


def compare_peers(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    from muonkit_bench.peers import peers

    table = peers(deepspeed=not args.no_deepspeed, compiled=args.compiled, ns_dtype=getattr(args, "ns_dtype", None))
    wanted = _methods(args) or list(table)
    rows = {}
    for name in wanted:
        peer = table[name]
        logger.info("%s: %s", h.name, name)
        rows[name] = {
            "notes": peer.notes,
            **h.run(peer.build, warmup=args.warmup, repeats=args.repeats, muon=not name.startswith("adamw")),
        }
        for dtype in _state_dtypes(args) if name.startswith("hybrid_muon") else ():
            logger.info("%s: %s, %s state", h.name, name, dtype)
            rows[f"{name}+{dtype}"] = {
                "notes": f"{peer.notes}; state_dtype={dtype!r} in every group",
                **h.run(
                    lambda g, build=peer.build, d=dtype: build([{**x, "state_dtype": d} for x in g]),
                    warmup=args.warmup,
                    repeats=args.repeats,
                ),
            }
        if args.per_head and name.startswith("hybrid_muon"):
            logger.info("%s: %s per head", h.name, name)
            rows[f"{name}+per_head"] = {
                "notes": f"{peer.notes}; attention per head (param_groups(per_head=True))",
                **h.run(peer.build, warmup=args.warmup, repeats=args.repeats, per_head=True),
            }
    return rows


def compare_presets(h: Harness, args: argparse.Namespace) -> dict[str, Any]:
    from muonkit.functional.coefficients import PRESETS
    from muonkit_bench.peers import hybrid_muon, ns_options

    ours = ns_options(getattr(args, "ns_dtype", None))
    rows = {}
    for preset in chosen("--presets", args.presets, PRESETS):
        for steps in _ns_steps(args.ns_steps):
            logger.info("%s: hybrid_muon %s x%d", h.name, preset, steps)

            def build(groups: list[dict[str, Any]], preset: str = preset, steps: int = steps) -> Any:
                return hybrid_muon(groups, ns_coefficients=preset, ns_steps=steps, **ours)

            rows[f"{preset}x{steps}"] = {
                "preset": preset,
                "ns_steps": steps,
                **h.run(build, warmup=args.warmup, repeats=args.repeats),
            }
    return rows


def _methods(args: argparse.Namespace) -> list[str]:
    """``--methods``, each a peer of this run (SystemExit listing them otherwise); [] if not given."""
    from muonkit_bench.peers import peers

    if args.methods is None:
        return []
    table = peers(deepspeed=not args.no_deepspeed, compiled=args.compiled)
    compiled = [n for n in peers(deepspeed=not args.no_deepspeed, compiled=True) if n not in table]
    deepspeed = [n for n in peers(deepspeed=True, compiled=args.compiled) if n not in table]
    hints = [f"{', '.join(compiled)} need --compiled"] if compiled else []
    hints += [f"--no-deepspeed leaves out {', '.join(deepspeed)}"] if deepspeed else []
    return chosen("--methods", args.methods, table, hint=f" ({'; '.join(hints)})" if hints else "")


def _state_dtypes(args: argparse.Namespace) -> list[str]:
    """``--state-dtypes`` other than fp32 (each HybridMuon peer's plain row is fp32): one row each."""
    from muonkit.functional.quantize import STATE_DTYPES

    text = getattr(args, "state_dtypes", None)
    if not text:
        return []
    wanted = [d for d in text.split(",") if d]
    bad = [d for d in wanted if d not in STATE_DTYPES]
    if bad:
        raise SystemExit(f"Invalid --state-dtypes {text!r}: each must be one of {', '.join(STATE_DTYPES)}")
    return [d for d in dict.fromkeys(wanted) if d != "fp32"]


def _ns_steps(text: str) -> list[int]:
    steps = [s for s in text.split(",") if s]
    if not steps or not all(s.isdigit() and int(s) >= 1 for s in steps):
        raise SystemExit(f"Invalid --ns-steps {text!r}: must be comma-separated integers >= 1, e.g. 3,5")
    return [int(s) for s in steps]


def _check_names(args: argparse.Namespace) -> None:
    """Every name list of the command line, checked before anything runs (a typo would otherwise
    stop the run at its first use, minutes in)."""
    from muonkit.functional.coefficients import PRESETS

    chosen("--models", args.models, MODELS)
    _methods(args)
    _state_dtypes(args)
    if not args.no_presets:
        chosen("--presets", args.presets, PRESETS)
        _ns_steps(args.ns_steps)


def _fmt_err(r: dict[str, Any]) -> str:
    if r["max_abs_s_minus_1"] is None:
        return f"{'-':>9}  {'-':>9}  {'-':>7}"
    return f"{r['max_abs_s_minus_1']:9.3f}  {r['mean_abs_s_minus_1']:9.3f}  {r['polar']:7.3f}"


def _fmt_counts(r: dict[str, Any]) -> str:
    calls, reads = r.get("aten_calls"), r.get("host_reads")
    return f"{'-' if calls is None else calls:>6} {'-' if reads is None else reads:>5}"


def format_peers(model: str, rows: dict[str, Any], *, base: str = "hybrid_muon") -> str:
    base = base if base in rows else next(iter(rows))
    ref = rows[base]
    adamw = rows.get("adamw")
    lines = [
        f"{model}: optimizer step (ms: median [min, max]); ratio = median / {base}'s; error on the first step",
        f"{'method':<24} {'median':>9} {'[min':>9} {'max]':>9} {'ratio':>6} {'vs AdamW':>9} {'calls':>6} {'reads':>5}"
        f"  {'max|s-1|':>9}  {'mean|s-1|':>9}  {'polar':>7}  {'scratch MiB':>11} {'matrices':>8} {'GFLOP':>7}",
    ]
    for name, r in rows.items():
        vs_adamw = f"{r['median_s'] / adamw['median_s']:8.1f}x" if adamw else f"{'-':>9}"
        work = f"{'-':>8} {'-':>7}" if r.get("flops") is None else f"{r['matrices']:>8} {r['flops'] / 1e9:7.2f}"
        lines.append(
            f"{name:<24} {r['median_s'] * 1e3:9.1f} {r['min_s'] * 1e3:9.1f} {r['max_s'] * 1e3:9.1f} "
            f"{r['median_s'] / ref['median_s']:6.2f} {vs_adamw} {_fmt_counts(r)}  {_fmt_err(r)}"
            f"  {r['scratch_bytes'] / 2**20:11.1f} {work}"
        )
    lines.append("calls: aten ops of one step (kernel launches on a GPU); reads: blocking device-to-host reads")
    lines.append("matrices, GFLOP: orthogonalized per step and their matrix-product FLOPs (HybridMuon's own count)")
    return "\n".join(lines)


def format_presets(model: str, rows: dict[str, Any]) -> str:
    lines = [
        f"{model}: HybridMuon step by coefficient preset and Newton-Schulz steps (ms: median [min, max])",
        f"{'preset':<15} {'steps':>5} {'median':>9} {'[min':>9} {'max]':>9} {'calls':>6} {'reads':>5}"
        f"  {'max|s-1|':>9}  {'mean|s-1|':>9}  {'polar':>7}",
    ]
    for r in rows.values():
        lines.append(
            f"{r['preset']:<15} {r['ns_steps']:>5} {r['median_s'] * 1e3:9.1f} {r['min_s'] * 1e3:9.1f} "
            f"{r['max_s'] * 1e3:9.1f} {_fmt_counts(r)}  {_fmt_err(r)}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="gpt2-124m,bench-gpt", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--methods", help="comma-separated peers (default: all; see muonkit_bench.peers)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's Muon out")
    parser.add_argument(
        "--compiled", action="store_true",
        help="add the torch.compile'd peers (adamw_compiled, torch_muon_compiled); they compile only with "
        "TORCH_COMPILE_DISABLE=0 set, and compile during --warmup",
    )  # fmt: skip
    parser.add_argument("--presets", default="keller,you,polar_express", help="presets for the second table")
    parser.add_argument("--ns-steps", default="3,4,5,6,7,8", help="Newton-Schulz step counts for the second table")
    parser.add_argument("--no-presets", action="store_true", help="skip the second table")
    parser.add_argument(
        "--per-head", action="store_true", help="also run each HybridMuon peer with attention per head (+per_head rows)"
    )
    parser.add_argument(
        "--state-dtypes",
        help="also run each HybridMuon peer with these optimizer-state precisions (e.g. fp32,bf16,8bit): one "
        "+bf16 / +8bit row each beside the plain (fp32) row; ratio = median / the base row's",
    )
    parser.add_argument(
        "--ns-dtype", choices=("bf16", "fp32"),
        help="Newton-Schulz dtype of HybridMuon and torch.optim.Muon alike, for a same-dtype comparison (default: "
        "each its own: HybridMuon bf16 where this machine multiplies bf16 fast, else fp32; torch.optim.Muon bf16); "
        "DeepSpeed's Muon keeps its own",
    )  # fmt: skip
    parser.add_argument("--grads", choices=("random", "backward"), default="random")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first also gives the error)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/step", help="output folder (step.json)")


def main(args: argparse.Namespace) -> int:
    import torch

    from muonkit_bench.environment import environment

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.warmup < 1 or args.repeats < 1:
        raise ValueError(f"Invalid warmup={args.warmup}, repeats={args.repeats}: both must be >= 1")
    _check_names(args)
    report: dict[str, Any] = {
        "environment": environment(),
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
        "models": {},
    }
    if getattr(args, "ns_dtype", None):
        print(f"Newton-Schulz in {args.ns_dtype} for HybridMuon and torch.optim.Muon (DeepSpeed's Muon: its own)\n")
    for name in args.models.split(","):
        h = Harness(name, device=args.device, grads=args.grads, seed=args.seed)
        entry: dict[str, Any] = {"params": h.n_params, "muon_params": h.n_muon, "peers": compare_peers(h, args)}
        print(format_peers(name, entry["peers"]), end="\n\n")
        if not args.no_presets:
            entry["presets"] = compare_presets(h, args)
            print(format_presets(name, entry["presets"]), end="\n\n")
        report["models"][name] = entry
        del h
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out / 'step.json'}")
    return 0
