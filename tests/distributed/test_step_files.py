"""How much of the library a steady step walks through: the muonkit files one ``step()`` enters on
2 gloo ranks (FSDP2 and DDP, a model of 3 matrices), measured with ``sys.setprofile``.

Issue 22's goal: at most 12 files (a steady step had come to enter 25). A steady step reads what it
needs from objects made once (plans, schedules, configs, limits) and enters only the modules
whose code it runs: the optimizer and its group checks, the stages, the three math modules, and
the strategy's base, reader, executor, collectives and guard.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ranks import failure_report, launch_ranks

CEILING = 12
"""Files a steady step may enter (issue 22)."""

pytestmark = [pytest.mark.distributed]


@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_a_steady_step_enters_no_more_files_than_the_ceiling(tmp_path: Path, mode: str) -> None:
    worker = Path(__file__).resolve().parent / "step_files_worker.py"
    results = launch_ranks(worker, [str(tmp_path), mode], world_size=2, out_dir=tmp_path, timeout=180.0)
    problem = failure_report(results, mode, 2)
    assert problem is None, problem
    found = json.loads((tmp_path / f"files_{mode}.json").read_text())
    assert len(found["files"]) <= CEILING, f"a steady {mode} step enters {len(found['files'])} files: {found['files']}"
