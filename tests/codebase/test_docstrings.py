"""Docstrings carry the algorithm and the reasons, not speed figures: those go stale with every
machine and torch release, so they live in BENCHMARKS.md (with the command that measured them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGES = [Path(__file__).resolve().parents[2] / "src" / name for name in ("muonkit", "muonkit_bench")]
SPEED = re.compile(r"~?\d[\d.]*(-[\d.]+)?x (faster|slower|the time|the CPU time)")


def docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [(getattr(n, "lineno", 1), doc) for n in nodes if (doc := ast.get_docstring(n))]


def speed_figures(path: Path) -> list[str]:
    return [f"{path.name}:{line}: {m.group(0)}" for line, doc in docstrings(path) for m in SPEED.finditer(doc)]


def test_no_docstring_states_a_speed_figure() -> None:
    found = [f for package in PACKAGES for p in sorted(package.rglob("*.py")) for f in speed_figures(p)]
    assert found == []


def test_the_check_sees_figures(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('def f():\n    """Gram is 1.4-1.5x faster here; bf16 took ~2x the time."""\n')
    assert speed_figures(probe) == ["probe.py:1: 1.4-1.5x faster", "probe.py:1: ~2x the time"]
