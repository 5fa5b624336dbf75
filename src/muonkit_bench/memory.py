"""``muonkit bench memory``: optimizer and ZeRO memory of AdamW vs HybridMuon, computed and measured.

For each model (a bundled config or any Hugging Face ``config.json``) the model is built on the
meta device, routed with :func:`muonkit.explain`, and the exact byte counts of
:mod:`muonkit_bench.memory_math` are reported: the Muon fraction f, the optimizer-state saving
(f/2), the saving counting fp32 master weights (f/3), and per-rank model-state bytes under
ZeRO-0/1/2/3 at ``--world-size`` ranks. With ``--measure``, a model that fits this machine is
trained for a few steps in one fresh process per optimizer and its peak RSS reported beside the
arithmetic (:mod:`muonkit_bench.memory_probe`).

Example::

    muonkit bench memory --config qwen2.5-3b --world-size 8
    muonkit bench memory --measure --probe-hidden 768 --probe-layers 12
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from muonkit.functional.quantize import STATE_DTYPES
from muonkit.state_precision import bytes_per_value
from muonkit_bench.cli import chosen
from muonkit_bench.memory_math import OPTIMIZERS, STAGES, ElementBytes, Savings, zero_table

logger = logging.getLogger(__name__)

HELP = "optimizer-state and per-rank ZeRO memory, AdamW vs HybridMuon, for Hugging Face configs (+ a measured peak)"


def bundled_configs() -> dict[str, Path]:
    """Name -> path of the bundled configs (``qwen2.5-3b``, ``llama-3-8b``, ...)."""
    root = resources.files("muonkit_bench") / "configs"
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".json")}


def load_config(name: str) -> tuple[str, dict[str, Any]]:
    """A bundled config by name, or a ``config.json`` (or its folder) by path."""
    bundled = bundled_configs()
    if name in bundled:
        path = bundled[name]
    else:
        path = Path(name)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"Invalid config={name!r}: not a file nor one of the bundled {sorted(bundled)}")
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return (name if name in bundled else path.parent.name or path.stem), data


def model_report(name: str, config: dict[str, Any], *, world_size: int, sizes: ElementBytes) -> dict[str, Any]:
    """Counts, f, savings and the ZeRO table of one model config (built on the meta device)."""
    from muonkit.integrations.transformers import model_from_config
    from muonkit.param_groups import explain

    model = model_from_config(config, device="meta")
    report = explain(model)
    n_muon, n_adamw = report.numel("muon"), report.numel("adamw")
    savings = Savings.of(n_muon=n_muon, n_adamw=n_adamw, sizes=sizes)
    table = zero_table(n_muon=n_muon, n_adamw=n_adamw, world_size=world_size, sizes=sizes)
    return {
        "name": name,
        "architecture": type(model).__name__,
        "params": {"total": n_muon + n_adamw, "muon": n_muon, "adamw": n_adamw},
        "muon_fraction": report.muon_fraction,
        "saving_states": savings.states,
        "saving_states_and_master": savings.states_and_master,
        "state_bytes": {"adamw_fp32": report.adamw_state_bytes}
        | {f"hybrid_{d}": report.state_bytes(d) for d in STATE_DTYPES},
        "world_size": world_size,
        "zero": {str(stage): {opt: rank.to_dict() for opt, rank in by_opt.items()} for stage, by_opt in table.items()},
    }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_report(r: dict[str, Any]) -> str:
    p = r["params"]
    lines = [
        f"{r['name']} ({r['architecture']}): {p['total'] / 1e9:.3f}B params, "
        f"{p['muon'] / 1e9:.3f}B on Muon, f = {r['muon_fraction']:.3f}",
        f"  optimizer states: -{r['saving_states']:.1%} (f/2);  states + fp32 master: "
        f"-{r['saving_states_and_master']:.1%} (f/3)",
        "  whole optimizer state (GiB, % of fp32 AdamW's): "
        + ";  ".join(
            f"{k.replace('_', ' ')} {gib(v)} ({v / r['state_bytes']['adamw_fp32']:.1%})"
            for k, v in r["state_bytes"].items()
        ),
        f"  per-rank model states at world size {r['world_size']} (GiB; bf16 params and grads, fp32 master and states):",
        "  stage  params  grads  master  states(AdamW)  states(Hybrid)  total(AdamW)  total(Hybrid)  saving",
    ]
    for stage in STAGES:
        a, h = (r["zero"][str(stage)][opt] for opt in OPTIMIZERS)
        saving = 1 - h["total"] / a["total"]
        lines.append(
            f"  {stage:>5}  {gib(a['params']):>6}  {gib(a['grads']):>5}  {gib(a['master']):>6}  "
            f"{gib(a['states']):>13}  {gib(h['states']):>14}  {gib(a['total']):>12}  {gib(h['total']):>13}  {saving:>6.1%}"
        )
    return "\n".join(lines)


def run_probes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One fresh process per optimizer; each prints one JSON line."""
    from muonkit_bench.memory_probe import probe_command

    results = []
    for optimizer in args.probe_optimizers.split(","):
        options = {
            "optimizer": optimizer, "model": args.probe_model, "hidden": args.probe_hidden,
            "layers": args.probe_layers, "vocab": args.probe_vocab, "batch": args.probe_batch,
            "seq": args.probe_seq, "dtype": args.probe_dtype, "steps": args.probe_steps,
        }  # fmt: skip
        argv, env = probe_command(options)
        logger.info("probe: %s", " ".join(argv[1:]))
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"memory probe for {optimizer} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def probe_prediction(result: dict[str, Any], *, n_muon: int) -> dict[str, int]:
    """The arithmetic for a measured run: params + grads + states (no master: params are the master);
    HybridMuon keeps ``2 n - n_muon`` state values at 4 B (fp32), 2 B (bf16) or 1 B + 4 B per 256 (8-bit)."""
    elem = 4 if result["dtype"] == "float32" else 2
    n = result["params"]
    state_dtype = result["optimizer"].removeprefix("hybrid_muon_")
    per_value = bytes_per_value(state_dtype if state_dtype in STATE_DTYPES else "fp32", torch.float32)
    states = 8 * n if result["optimizer"] == "adamw" else int((2 * n - n_muon) * per_value)
    return {"params": elem * n, "grads": elem * n, "states": states, "total": 2 * elem * n + states}


def format_probes(results: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = [
        "optimizer         params  states(MiB)  predicted  steady-rss  peak fwd+bwd  peak step  peak   (MiB; RSS includes the interpreter)",
    ]
    for r in results:
        lines.append(
            f"{r['optimizer']:<16}  {r['params'] / 1e6:5.1f}M  {r['state_bytes'] / mib:11.1f}  "
            f"{r['predicted']['states'] / mib:9.1f}  {r['steady'] / mib:10.1f}  {r['peak_fwd_bwd'] / mib:12.1f}  "
            f"{r['peak_step'] / mib:9.1f}  {r['peak'] / mib:5.1f}"
        )
    base = results[0]
    for r in results[1:]:
        lines.append(
            f"{r['optimizer']} - {base['optimizer']}: states {(r['state_bytes'] - base['state_bytes']) / mib:+.1f} MiB, "
            f"steady {(r['steady'] - base['steady']) / mib:+.1f} MiB, peak {(r['peak'] - base['peak']) / mib:+.1f} MiB "
            f"({r['peak'] / base['peak'] - 1:+.1%})"
        )
    return "\n".join(lines)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from muonkit.param_groups import explain
    from muonkit_bench.memory_probe import build_model

    probe_args = argparse.Namespace(
        model=args.probe_model, hidden=args.probe_hidden, layers=args.probe_layers, vocab=args.probe_vocab,
        seq=args.probe_seq, dtype="float32", seed=0,
    )  # fmt: skip
    n_muon = explain(build_model(probe_args)).numel("muon")
    results = run_probes(args)
    for r in results:
        r["muon_params"] = n_muon
        r["predicted"] = probe_prediction(r, n_muon=n_muon)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", action="append",
        help=f"bundled config name or a config.json path (repeatable; default: all bundled: {sorted(bundled_configs())})",
    )  # fmt: skip
    parser.add_argument("--world-size", type=int, default=8, help="ranks for the ZeRO per-rank table (default 8)")
    parser.add_argument(
        "--muon-state-bytes", type=int, default=4, help="bytes of Muon state per param (4: fp32; 2: bf16 as DeepSpeed)"
    )
    parser.add_argument("--measure", action="store_true", help="also measure peak RSS of real steps, one process each")
    parser.add_argument("--probe-model", choices=("qwen2", "gpt"), default="qwen2")
    parser.add_argument("--probe-hidden", type=int, default=768)
    parser.add_argument("--probe-layers", type=int, default=12)
    parser.add_argument("--probe-vocab", type=int, default=32768)
    parser.add_argument("--probe-batch", type=int, default=4)
    parser.add_argument("--probe-seq", type=int, default=256)
    parser.add_argument("--probe-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--probe-steps", type=int, default=3)
    parser.add_argument("--probe-optimizers", default="adamw,hybrid_muon,torch_muon")
    parser.add_argument("--out", default="runs/memory", help="output folder (memory.json)")


def main(args: argparse.Namespace) -> int:
    from muonkit_bench.environment import environment

    if args.measure:  # checked before the tables, not when the first probe process fails
        from muonkit_bench.memory_probe import PROBE_OPTIMIZERS

        chosen("--probe-optimizers", args.probe_optimizers, PROBE_OPTIMIZERS)
    sizes = ElementBytes(muon_state=args.muon_state_bytes)
    names = args.config or sorted(bundled_configs())
    reports = []
    for name in names:
        label, config = load_config(name)
        reports.append(model_report(label, config, world_size=args.world_size, sizes=sizes))
        print(format_report(reports[-1]), end="\n\n")
    probes = measure(args) if args.measure else []
    if probes:
        print(format_probes(probes))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory.json")
    with open(path, "w") as f:
        json.dump(
            {"environment": environment(), "element_bytes": asdict(sizes), "models": reports, "measured": probes},
            f,
            indent=2,
        )
    print(f"wrote {path}")
    return 0
