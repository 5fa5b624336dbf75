"""Imports flow one way: ``integrations, cli -> optimizer -> distributed -> functional -> torch``; nothing imports ``muonkit_bench``
but the benchmark tests, and ``muonkit.testing`` only tests and benchmarks.

Read from the source (every ``import``, also those inside functions), so a lazy import that closes
a circle is caught as well. Every module of ``muonkit`` and ``muonkit_bench`` is a node of one
import graph (an edge per import, lazy ones too; ``if TYPE_CHECKING:`` blocks never run and are
left out), which has no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "muonkit"
PACKAGES = ("muonkit", "muonkit_bench")


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
FILES = {module_name(p): p for name in PACKAGES for p in sorted((SRC / name).rglob("*.py"))}


def _runs(node: ast.AST) -> list[ast.AST]:
    """The statements under ``node`` that can run (an ``if TYPE_CHECKING:`` body never does)."""
    if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING":
        return list(node.orelse)
    return list(ast.iter_child_nodes(node))


def import_edges(path: Path, name: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (at ``path``) imports, anywhere in it.

    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``; ``import a.b.c``
    to ``a.b.c``; relative imports are resolved. A name no module of ``modules`` holds (outside
    imports, or a module that does not exist) gives the nearest enclosing module, or nothing.
    """
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        todo += _runs(node)
    edges = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    return {name: import_edges(path, name, set(files)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph``: its strongly connected components of more than one module, each as
    one circular path ``[a, b, ..., a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set(stack[stack.index(node) :])
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(_path(graph, component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A circular path through ``component`` from its first module (breadth first, back to the start)."""
    start = min(component)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if nxt not in came:
                came[nxt] = node
                frontier.append(nxt)
    raise AssertionError(f"no circle through {sorted(component)}")


def importers_of(prefix: str) -> list[str]:
    return sorted(m for m, names in MODULES.items() if any(n == prefix or n.startswith(prefix + ".") for n in names))


def test_the_library_never_imports_the_benchmark_suite() -> None:
    """muonkit_bench is a separate distribution (the ``bench`` extra): the CLI reaches it by name only."""
    assert importers_of("muonkit_bench") == []


def test_only_tests_and_benchmarks_import_the_testing_tools() -> None:
    """``muonkit.testing`` counts and measures; the optimizer never depends on it, and it reaches
    nothing above the math (its switch flips a global of :mod:`muonkit.functional.orthogonalize`)."""
    assert [m for m in importers_of("muonkit.testing") if not m.startswith("muonkit.testing")] == []
    above = ("muonkit.optimizer", "muonkit.distributed", "muonkit.qk_clip", "muonkit.integrations", "muonkit.cli")
    assert {
        m: sorted(n for n in names if n.startswith(above))
        for m, names in MODULES.items()
        if m.startswith("muonkit.testing") and any(n.startswith(above) for n in names)
    } == {}


def test_library_tests_do_not_need_the_benchmark_suite() -> None:
    """Only tests/bench imports muonkit_bench: the library's tests run without the ``bench`` extra."""
    tests = Path(__file__).resolve().parents[1]
    importers = sorted(
        str(p.relative_to(tests))
        for p in tests.rglob("*.py")
        if "bench" not in p.relative_to(tests).parts[:1] and any(n.startswith("muonkit_bench") for n in imports_of(p))
    )
    assert importers == []


def test_nothing_imports_the_cli() -> None:
    assert [m for m in importers_of("muonkit.cli") if m != "muonkit.cli"] == []


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        (
            "muonkit.functional",
            ("muonkit.distributed", "muonkit.optimizer", "muonkit.qk_clip", "muonkit.integrations", "muonkit.cli"),
        ),
        (
            "muonkit.distributed",
            ("muonkit.optimizer", "muonkit.qk_clip", "muonkit.integrations", "muonkit.cli", "muonkit_bench"),
        ),
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


def test_no_import_circle_anywhere() -> None:
    """Not in the library, not in the benchmark suite, not even through a lazy import."""
    graph = import_graph(FILES)
    assert {"muonkit", "muonkit.qk_clip.clip", "muonkit.distributed.base", "muonkit_bench.cli"} <= set(graph)
    assert len(graph) == sum(1 for name in PACKAGES for _ in (SRC / name).rglob("*.py"))
    assert circles(graph) == []


def test_every_import_of_the_packages_names_a_module_that_exists() -> None:
    """A moved module leaves no import of its old name behind (it would fail only when that line runs)."""
    modules = set(FILES)
    gone = {
        f"{name}: {target}"
        for name, path in FILES.items()
        for target in imports_of(path)
        if target not in modules and target.rpartition(".")[0] not in modules
    }
    assert gone == set()


def test_the_circle_check_sees_circles(tmp_path: Path) -> None:
    """A lazy import that closes a circle (as ``qk_clip`` <-> ``qk_transformers`` once did), a circle through a
    relative import and a package's own ``__init__``; a ``TYPE_CHECKING`` import is no edge."""
    files = {
        "pkg": "from pkg.b import g\n",
        "pkg.a": "import os\nfrom pkg.b import f\n",
        "pkg.b": "def f():\n    from pkg import a\n",
        "pkg.c": "from . import d\n",
        "pkg.d": "from pkg.c import x\n",
        "pkg.e": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
        "pkg.sub": "from pkg.sub.f import h\n",
        "pkg.sub.f": "from pkg.sub import g\n",
        "pkg.sub.g": "from pkg import sub\n",
    }
    paths = {}
    for name, text in files.items():
        parts = name.split(".")
        path = tmp_path.joinpath(*parts, "__init__.py") if name in ("pkg", "pkg.sub") else tmp_path.joinpath(*parts)
        path = path if path.name == "__init__.py" else path.with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths[name] = path
    graph = import_graph(paths)
    assert graph["pkg.e"] == set() and graph["pkg"] == {"pkg.b"} and graph["pkg.a"] == {"pkg.b"}
    assert circles(graph) == [
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.c", "pkg.d", "pkg.c"],
        ["pkg.sub", "pkg.sub.f", "pkg.sub.g", "pkg.sub"],
    ]


def test_the_public_import_paths_survive_the_split() -> None:
    """``muonkit.optimizer`` was one module holding both classes; its names still import from there."""
    import muonkit
    from muonkit.optimizer import NONFINITE_CHOICES, HybridMuon, Muon

    assert (HybridMuon, Muon) == (muonkit.HybridMuon, muonkit.Muon)
    assert issubclass(Muon, HybridMuon) and NONFINITE_CHOICES == ("skip", "raise", "unchecked")


def test_no_file_of_the_library_is_longer_than_600_lines() -> None:
    lines = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lines.items() if n > 600} == {}
