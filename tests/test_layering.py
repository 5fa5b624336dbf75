"""Imports flow one way: ``integrations, cli -> optimizer -> distributed -> functional -> torch``; nothing imports ``muonkit_bench``.

Read from the source (every ``import``, also those inside functions), so a lazy import that closes
a circle is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "muonkit"


def imports_of(path: Path) -> set[str]:
    """The muonkit modules ``path`` imports (``from muonkit.x import y`` counts as ``muonkit.x`` and ``muonkit.x.y``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name.split(".")[0] in ("muonkit", "muonkit_bench")}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def importers_of(prefix: str) -> list[str]:
    return sorted(m for m, names in MODULES.items() if any(n == prefix or n.startswith(prefix + ".") for n in names))


def test_the_library_never_imports_the_benchmark_suite() -> None:
    """muonkit_bench is a separate distribution (the ``bench`` extra): the CLI reaches it by name only."""
    assert importers_of("muonkit_bench") == []


def test_nothing_imports_the_cli() -> None:
    assert [m for m in importers_of("muonkit.cli") if m != "muonkit.cli"] == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("muonkit.functional", ("muonkit.distributed", "muonkit.optimizer", "muonkit.integrations", "muonkit.cli")),
        ("muonkit.distributed", ("muonkit.optimizer", "muonkit.integrations", "muonkit.cli", "muonkit_bench")),
    ],
)
def test_lower_layers_do_not_import_higher_ones(layer: str, forbidden: tuple[str, ...]) -> None:
    wrong = {
        m: sorted(n for n in names if n.startswith(forbidden))
        for m, names in MODULES.items()
        if m == layer or m.startswith(layer + ".")
    }
    assert {m: n for m, n in wrong.items() if n} == {}


def test_the_scan_sees_lazy_imports(tmp_path: Path) -> None:
    """deepspeed_convert imported the CLI inside a function; the scan must see imports there."""
    path = tmp_path / "probe.py"
    path.write_text("def main():\n    from muonkit.cli import main as cli_main\n    import muonkit_bench.model\n")
    assert {"muonkit.cli", "muonkit_bench.model"} <= imports_of(path)


def test_the_public_import_paths_survive_the_split() -> None:
    """``muonkit.optimizer`` was one module holding both classes; its names still import from there."""
    import muonkit
    from muonkit.optimizer import NONFINITE_CHOICES, HybridMuon, Muon

    assert (HybridMuon, Muon) == (muonkit.HybridMuon, muonkit.Muon)
    assert issubclass(Muon, HybridMuon) and NONFINITE_CHOICES == ("skip", "raise", "unchecked")


def test_no_file_of_the_library_is_longer_than_600_lines() -> None:
    lines = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lines.items() if n > 600} == {}
