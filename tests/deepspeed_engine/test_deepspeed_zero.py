"""DeepSpeed ZeRO-1/2/3 with muonkit: 2-rank training checks, then 1-rank checkpoint loading.

See ds_checks_train (equivalence with the single-device reference, exactly-once, traffic,
schedulers, unsupported configurations, bit-identical resume), ds_checks_load (a 2-rank
checkpoint at 1 rank: the documented error, the conversion, the loaded state) and ds_checks_hf
(the Hugging Face Trainer driving DeepSpeed; ds_checks_hf_resume resumes its checkpoint at 1 rank).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ds_launch import launch, report
from ds_worker import names

pytest.importorskip("deepspeed", reason="the DeepSpeed extra is not installed (pip install 'muonkit[deepspeed]')")
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ds_shared")


@pytest.fixture(scope="module")
def train_results(shared: Path) -> dict:
    return launch("ds_checks_train", world_size=2, out_dir=shared.parent / "ds_train", shared=shared)


@pytest.fixture(scope="module")
def load_results(shared: Path, train_results: dict) -> dict:
    del train_results  # the checkpoints it saved are the input
    return launch("ds_checks_load", world_size=1, out_dir=shared.parent / "ds_load", shared=shared)


@pytest.fixture(scope="module")
def hf_results(shared: Path) -> dict:
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install 'muonkit[hf]')")
    return launch("ds_checks_hf", world_size=2, out_dir=shared.parent / "ds_hf", shared=shared)


@pytest.fixture(scope="module")
def hf_resume_results(shared: Path, hf_results: dict) -> dict:
    del hf_results  # the Trainer checkpoint it saved is the input
    return launch("ds_checks_hf_resume", world_size=1, out_dir=shared.parent / "ds_hf_resume", shared=shared)


@pytest.mark.parametrize("name", names("ds_checks_train"))
def test_train(train_results: dict, name: str) -> None:
    problem = report(train_results, name, 2)
    assert problem is None, problem


@pytest.fixture(scope="module")
def per_head_results(shared: Path) -> dict:
    return launch("ds_checks_per_head", world_size=2, out_dir=shared.parent / "ds_per_head", shared=shared)


@pytest.mark.parametrize("name", names("ds_checks_per_head"))
def test_per_head(per_head_results: dict, name: str) -> None:
    problem = report(per_head_results, name, 2)
    assert problem is None, problem


@pytest.mark.parametrize("name", names("ds_checks_load"))
def test_load_at_one_rank(load_results: dict, name: str) -> None:
    problem = report(load_results, name, 1)
    assert problem is None, problem


@pytest.mark.parametrize("name", names("ds_checks_hf"))
def test_hugging_face_trainer(hf_results: dict, name: str) -> None:
    problem = report(hf_results, name, 2)
    assert problem is None, problem


@pytest.mark.parametrize("name", names("ds_checks_hf_resume"))
def test_hugging_face_trainer_resumes_at_one_rank(hf_resume_results: dict, name: str) -> None:
    problem = report(hf_resume_results, name, 1)
    assert problem is None, problem
