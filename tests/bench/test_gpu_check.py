"""``muonkit bench gpu-check`` (``make gpu-check``) without a GPU: the plan for the GPU parses with
the real command-line parsers, the stage runner keeps its limits, and the ``--dry-run-cpu``
pipeline runs stages end to end and writes its JSON and table."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from muonkit.cli import build_parser
from muonkit_bench import gpu_check


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_it_stops_and_points_to_the_dry_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"torch\.cuda\.is_available\(\) is False.*--dry-run-cpu"):
        gpu_check.main(_args("--out", str(tmp_path)))
    assert not (tmp_path / "gpu_check.json").exists()


def test_bad_stage_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid stages='tests,bench': must be a comma-separated subset of"):
        gpu_check.main(_args("--stages", "tests,bench", "--dry-run-cpu"))


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry_run_cpu"])
def test_every_planned_command_parses(dry: bool, tmp_path: Path) -> None:
    """The GPU plan cannot be run here; its commands are parsed by the parsers that will run them."""
    args = _args("--out", str(tmp_path), *(["--dry-run-cpu"] if dry else []))
    stages = {s.name: s for s in gpu_check.plan(args, work=tmp_path, env={"deepspeed_importable": True})}
    assert list(stages) == list(gpu_check.STAGES)
    parser = build_parser()
    for name in ("step", "step_compiled", "sweep"):
        argv = stages[name].argv
        assert argv[:4] == [sys.executable, "-m", "muonkit.cli", "bench"]
        parsed = parser.parse_args(argv[3:])
        assert parsed.device == ("cpu" if dry else "cuda"), name
    step = build_parser().parse_args(stages["step_compiled"].argv[3:])
    assert step.compiled and stages["step_compiled"].env["TORCH_COMPILE_DISABLE"] == ("1" if dry else "0")
    assert ("deepspeed_standard" in step.methods) is not dry  # DeepSpeed's compiled update on the GPU
    sweep = build_parser().parse_args(stages["sweep"].argv[3:])
    assert sweep.sweep == ("tiny" if dry else "gpu") and sweep.seeds == "0"
    if not dry:
        assert parser.parse_args(stages["step"].argv[3:]).models == "gpt2-124m"
    tests = stages["tests"]
    assert Path(tests.argv[tests.argv.index("-p") + 2]).is_dir()  # tests/gpu of this checkout
    assert tests.env == ({"MUONKIT_GPU_TESTS_ON_CPU": "1"} if dry else {})


def _stage(name: str, code: str, **kw: object) -> gpu_check.Stage:
    return gpu_check.Stage(name, [sys.executable, "-c", code], **kw)  # type: ignore[arg-type]


def test_stage_runner_keeps_limits_and_reports_outcomes(tmp_path: Path) -> None:
    deadline = time.monotonic() + 60
    slow = gpu_check.run_stage(
        _stage("slow", "import time; print('started', flush=True); time.sleep(60)", limit_s=1.5, min_s=0),
        deadline=deadline,
        work=tmp_path,
    )
    assert slow["status"] == "timeout" and slow["returncode"] is None and slow["duration_s"] < 30
    assert "started" in slow["log_tail"] and "limit of 2 s" in slow["reason"]
    bad = gpu_check.run_stage(
        _stage("bad", "raise SystemExit(3)", limit_s=30, min_s=0), deadline=deadline, work=tmp_path
    )
    assert bad["status"] == "failed" and bad["returncode"] == 3
    late = gpu_check.run_stage(_stage("late", "pass", limit_s=30, min_s=120), deadline=deadline, work=tmp_path)
    assert late["status"] == "skipped" and "needs >= 120 s" in late["reason"]
    write = f"open({str(tmp_path / 'r.json')!r}, 'w').write('{{\"x\": 1}}')"
    good = gpu_check.run_stage(
        _stage(
            "good", write, limit_s=30, min_s=0,
            collect=lambda w: json.loads((w / "r.json").read_text()), summary=lambda r: f"x={r['x']}",
        ),
        deadline=deadline,
        work=tmp_path,
    )  # fmt: skip
    assert good["status"] == "passed" and good["results"] == {"x": 1} and good["summary"] == "x=1"


def test_dry_run_cpu_runs_the_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two real stages (the other two are the same machinery, with the commands checked above)."""
    argv = ["--dry-run-cpu", "--out", str(tmp_path), "--stages", "tests,step"]
    argv += ["--tests-k", "half_precision_gram_runs"]  # the cheapest: bf16 runs, fp16 skips on the CPU
    assert gpu_check.main(_args(*argv)) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run_cpu"] and report["environment"]["torch"] == torch.__version__
    stages = {r["name"]: r for r in report["stages"]}
    assert list(stages) == ["tests", "step"] and all(r["status"] == "passed" for r in stages.values()), stages
    tests = stages["tests"]["results"]
    assert tests["passed"] == 1 and tests["failed"] == 0 and tests["skipped"] == 1  # fp16: GPU only
    rows = stages["step"]["results"]["models"]["tiny"]["peers"]
    assert set(rows) == {"adamw", "hybrid_muon", "torch_muon"} and all(r["median_s"] > 0 for r in rows.values())
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "tests          passed" in table and "torch_muon" in table
    assert table.strip() in capsys.readouterr().out
