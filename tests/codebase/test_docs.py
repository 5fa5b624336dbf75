"""The README lands a newcomer and the docs site holds the rest (issue 25): the README is short, its
first two commands are `make demo` and `make test`, every relative link in it exists, and install,
the AdamW migration, each stack's page and resuming at another world size are one link away.
``make docs-check`` builds the site with ``--strict`` (broken links, missing snippets or symbols)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LINKS = re.findall(r"\]\(([^)#\s]+)(#[^)\s]*)?\)", README)


def test_the_readme_is_a_landing_page() -> None:
    assert len(README.splitlines()) <= 300
    commands = re.findall(r"^make \w+", README, flags=re.M)
    assert commands[:2] == ["make demo", "make test"]


def test_every_relative_link_of_the_readme_exists() -> None:
    relative = [path for path, _ in LINKS if not path.startswith(("http://", "https://"))]
    assert relative and [p for p in relative if not (ROOT / p).exists()] == []


def test_a_newcomer_finds_each_thing_in_one_hop() -> None:
    targets = {path + anchor for path, anchor in LINKS}
    assert "docs/getting-started.md" in targets
    assert "docs/coming-from-adamw.md" in targets
    assert "docs/checkpoints.md#resume-at-another-world-size" in targets
    stacks = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "stacks").glob("*.md")}
    assert stacks and stacks <= targets
    assert "## Install" in README and "pip install muonkit` does not install it" in README


def test_the_anchor_the_readme_names_exists() -> None:
    assert re.search(r"^## Resume at another world size$", (ROOT / "docs" / "checkpoints.md").read_text(), re.M)


def test_every_example_is_shown_on_a_docs_page() -> None:
    pages = " ".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    shown = set(re.findall(r'--8<-- "examples/([\w.]+)"', pages))
    assert shown == {p.name for p in (ROOT / "examples").glob("*.py")}
