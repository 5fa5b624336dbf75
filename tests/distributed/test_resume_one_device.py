"""The resume-fidelity matrix (:mod:`resume_matrix`) on one device, in this process without a
process group: every path x gradients at load time x fresh or used optimizer, and every corrupted
checkpoint refused. The distributed layouts run in ``scenario_resume``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from harness import ns_default
from resume_matrix import (
    CELLS,
    CORRUPTIONS,
    DCP_OUTCOMES,
    PATHS,
    Run,
    dcp_outcome,
    refusals,
    resume_cell,
    save_before_the_first_step,
    uninterrupted,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    root = tmp_path_factory.mktemp("resume")
    # Module-scoped: conftest's per-test default Newton-Schulz dtype is not in force yet; force it here.
    with warnings.catch_warnings(), ns_default("fp32"):
        warnings.simplefilter("ignore", UserWarning)  # DCP without a process group: "assuming ... a single process"
        return root, uninterrupted("single", 1, root, tuple(CORRUPTIONS))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("grads", "optimizer"), CELLS, ids=[f"grads_{g}-{o}" for g, o in CELLS])
def test_resume_equals_the_uninterrupted_run(run: tuple[Path, Run], path: str, grads: str, optimizer: str) -> None:
    root, uninterrupted_run = run
    if path == "dcp":  # torch's recipe by hand: pinned, see resume_matrix.DCP_OUTCOMES
        assert dcp_outcome("single", 1, root, grads, optimizer) == DCP_OUTCOMES[(grads, optimizer)]
        return
    problems = resume_cell(uninterrupted_run, "single", 1, root, path, grads, optimizer)
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_corrupted_checkpoint_is_refused_and_changes_nothing(run: tuple[Path, Run]) -> None:
    problems = refusals("single", 1, run[0])
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_before_the_first_step_holds_no_state_and_changes_nothing(tmp_path: Path) -> None:
    problems = save_before_the_first_step("single", 1, tmp_path)
    assert not problems, "\n".join(problems)
