"""Planning and a step's host work grow no faster than the layout, simulated at up to 4,096 ranks.

A reduced Kimi-K2-like model (one dense and two MoE blocks, 64 experts) under expert parallel x
FSDP2 (ep=16, fsdp=16/64/256: W = 256, 1,024, 4,096) is planned by the simulator
(:mod:`muonkit.simulator`), the same jobs and plans a run builds. Growth is measured in counts,
not seconds, so that a loaded machine cannot fail the tests: the Python lines of muonkit executed
(``sys.settrace``, deterministic) and the bytes the plans keep. Between sizes 4x apart each may
grow at most 1.3 x 4 (linear in W; the old planner grew 9x, its jobs O(W^2) in torch's splits);
a step's lines per piece the busiest rank handles at most 1.3x (the old executor: 3.7x, O(W x
jobs)). CPU time is checked too, with a generous margin (8x per 4x, the least of three runs).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import muonkit
from muonkit.simulator.host import host_step
from muonkit.simulator.meshes import parse_mesh
from muonkit.simulator.models import DEEPSEEK_TP_PLAN, KIMI_K2, ModelShapes, shapes_of
from muonkit.simulator.simulate import StagePlan, per_rank, plan_stage

SOURCE = str(Path(muonkit.__file__).resolve().parent)
SIZES = {256: "ep=16,fsdp=16", 1024: "ep=16,fsdp=64", 4096: "ep=16,fsdp=256"}
SLACK = 1.3


def _model() -> ModelShapes:
    config = {
        **KIMI_K2, "num_hidden_layers": 3, "hidden_size": 512, "intermediate_size": 4096,
        "moe_intermediate_size": 256, "n_routed_experts": 64, "num_attention_heads": 8, "q_lora_rank": 256,
        "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    }  # fmt: skip
    return shapes_of("reduced Kimi-K2", config, DEEPSEEK_TP_PLAN)


def executed_lines(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the number of lines of muonkit's own code it executed."""
    count = 0

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename.startswith(SOURCE) else None

    sys.settrace(call)
    try:
        result = fn()
    finally:
        sys.settrace(None)
    return result, count


def _pieces(stage: StagePlan) -> int:
    return sum(len(job.held) for group in stage.groups for job in group.plan.jobs)


@pytest.fixture(scope="module")
def stages() -> dict[int, tuple[StagePlan, int]]:
    """Per world size: the stage planned, and the lines planning it executed."""
    model = _model()
    return {w: executed_lines(lambda mesh=mesh: plan_stage(model, parse_mesh(mesh), 0)) for w, mesh in SIZES.items()}


def _growth(values: dict[int, float]) -> list[tuple[int, float, float]]:
    """(W, growth of the value, growth of W) from each size to the next."""
    sizes = sorted(values)
    return [(b, values[b] / values[a], b / a) for a, b in itertools.pairwise(sizes)]


def test_the_layout_grows_with_the_ranks(stages: dict[int, tuple[StagePlan, int]]) -> None:
    pieces = {w: _pieces(stage) for w, (stage, _) in stages.items()}
    assert pieces[256] < pieces[1024] < pieces[4096]  # the sizes measure something
    assert pieces[4096] > 2.5 * pieces[1024]


def test_planning_executes_lines_linear_in_the_ranks(stages: dict[int, tuple[StagePlan, int]]) -> None:
    lines = {w: float(count) for w, (_, count) in stages.items()}
    for w, grew, ranks in _growth(lines):
        assert grew <= SLACK * ranks, f"planning at W={w}: {grew:.2f}x the lines for {ranks:.0f}x the ranks"


def test_planning_time_grows_no_faster_than_the_ranks() -> None:
    model, seconds = _model(), {}
    for w, mesh in list(SIZES.items())[1:]:
        runs = []
        for _ in range(3):
            start = time.thread_time()
            plan_stage(model, parse_mesh(mesh), 0)
            runs.append(time.thread_time() - start)
        seconds[w] = min(runs)
    for w, grew, ranks in _growth(seconds):
        assert grew <= 2 * ranks, f"planning at W={w}: {grew:.2f}x the CPU time for {ranks:.0f}x the ranks"


def test_plans_keep_memory_linear_in_the_ranks(stages: dict[int, tuple[StagePlan, int]]) -> None:
    """Bytes of the jobs, plans and layout caches (every object reachable, once): linear, and compact
    (the old one Piece per job and holder kept over 550 bytes per piece here)."""
    memory = {w: float(stage.memory) for w, (stage, _) in stages.items()}
    for w, grew, ranks in _growth(memory):
        assert grew <= SLACK * ranks, f"plans at W={w}: {grew:.2f}x the bytes for {ranks:.0f}x the ranks"
    per_piece = memory[4096] / _pieces(stages[4096][0])
    assert per_piece < 400, f"{per_piece:.0f} bytes per piece"


def test_a_step_executes_lines_in_proportion_to_the_ranks_own_pieces() -> None:
    """The busiest rank's steady step: lines per piece it handles stay flat as W grows 16x."""
    model, per_piece = _model(), {}
    for w, mesh in SIZES.items():
        stage = plan_stage(model, parse_mesh(mesh), 0)
        work = per_rank(stage, w)[3]
        rank = max(range(w), key=lambda r: work[r])
        host_step(stage, rank, repeats=0)  # the first step computes the schedules
        _, lines = executed_lines(lambda stage=stage, rank=rank: host_step(stage, rank, repeats=0))
        per_piece[w] = lines / work[rank]
    for w, grew, _ in _growth(per_piece):
        assert grew <= SLACK, f"a step at W={w}: {grew:.2f}x the lines per piece of the busiest rank"
