"""One version: ``muonkit.__version__``. pyproject.toml reads it (dynamic), and bench/pyproject.toml's
version and its muonkit pin are the same string (a separate distribution, built by ``make dist``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import muonkit

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]


def test_muonkit_reads_its_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "muonkit.__version__"}


def test_the_bench_distribution_has_muonkits_version_and_pins_it() -> None:
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    assert bench["version"] == muonkit.__version__
    assert f"muonkit=={muonkit.__version__}" in bench["dependencies"]


def test_the_bench_sdist_holds_the_code() -> None:
    """bench/src/muonkit_bench is the suite's code (a link to src/muonkit_bench), so its sdist builds a wheel."""
    assert (ROOT / "bench" / "src" / "muonkit_bench" / "cli.py").samefile(ROOT / "src" / "muonkit_bench" / "cli.py")
