"""The docs' generated tables, from the one place each is kept: ``python -m muonkit._doc_tables``.

- ``hybrid-muon-defaults``: :class:`muonkit.HybridMuon`'s keywords, from the fields of
  :class:`muonkit.defaults.Defaults` (default, ``why``), the group key each sets derived from
  :mod:`muonkit.config`'s key lists;
- ``deepspeed-keys``: the ``optimizer.params`` of a DeepSpeed config, from the fields of
  :class:`muonkit.integrations.deepspeed_config.MuonkitOptions` (default, ``what``);
- ``routing-rules``: :data:`muonkit.routing.BUILT_IN_RULES`.

Each table sits in one page of the docs site (:data:`PAGES`) between
``<!-- generated: NAME ... -->`` and ``<!-- end: NAME -->``; ``python -m muonkit._doc_tables``
rewrites them in place, ``--check`` only says whether they are stale
(``tests/contract/test_defaults.py`` fails on a stale page, and ``make docs-check`` builds them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from muonkit.config import ALGORITHMS, GROUP_DEFAULT_KEYWORDS, OPTIMIZER_KEYWORDS, READ_KEYS
from muonkit.defaults import DEFAULTS, Defaults
from muonkit.integrations.deepspeed_config import MuonkitOptions
from muonkit.routing import BUILT_IN_RULES

ROOT = Path(__file__).resolve().parents[2]
"""The root of a clone (``src/muonkit/..``)."""


def hybrid_muon_defaults() -> str:
    """``| argument | default | group key | why |``, one row per keyword of :class:`Defaults`."""
    rows = [["argument", "default", "group key", "why"]]
    for f in fields(Defaults):
        shown = f"`{python(getattr(DEFAULTS, f.name))}`" + (f" {f.metadata['shown']}" if f.metadata["shown"] else "")
        rows.append([f"`{f.name}`", shown, group_key(f.name), f.metadata["why"]])
    rows.append(["`process_group`, `strategy`", "`None`", "— (optimizer)", "distributed runs (the stack pages)"])
    return _markdown(rows)


def deepspeed_keys() -> str:
    """``| key | default | meaning |``, one row per field of :class:`MuonkitOptions`."""
    rows = [["key", "default", "meaning"]]
    defaults = MuonkitOptions()
    for f in fields(MuonkitOptions):
        rows.append([f"`{f.name}`", as_json(getattr(defaults, f.name)), f.metadata["what"]])
    return _markdown(rows)


def routing_rules() -> str:
    """``| # | tensor | algorithm | layout |``, one row per built-in routing rule, in order."""
    rows = [["#", "tensor", "algorithm", "layout (how it becomes matrices)"]]
    for i, (tensor, algorithm, layout) in enumerate(BUILT_IN_RULES, 1):
        rows.append([str(i), tensor, {"muon": "Muon", "adamw": "AdamW"}[algorithm], layout])
    return _markdown(rows)


TABLES: dict[str, Callable[[], str]] = {
    "hybrid-muon-defaults": hybrid_muon_defaults,
    "deepspeed-keys": deepspeed_keys,
    "routing-rules": routing_rules,
}

PAGES: dict[str, Path] = {
    "hybrid-muon-defaults": ROOT / "docs" / "optimizer.md",
    "deepspeed-keys": ROOT / "docs" / "stacks" / "deepspeed.md",
    "routing-rules": ROOT / "docs" / "routing.md",
}
"""The one page each table lives on."""


def group_key(keyword: str) -> str:
    """The group key ``keyword`` is the default of, and the algorithms whose groups read it."""
    if keyword in OPTIMIZER_KEYWORDS:
        return "— (optimizer)"
    if keyword in GROUP_DEFAULT_KEYWORDS:
        key, owner = GROUP_DEFAULT_KEYWORDS[keyword]
        return f"`{key}` ({owner})"
    own = set(GROUP_DEFAULT_KEYWORDS.values())  # a rule's own eps is its keyword's, not eps's
    readers = [a for a in ALGORITHMS if keyword in READ_KEYS[a] and (keyword, a) not in own]
    return f"`{keyword}` ({', '.join(readers)})"


def markers(name: str) -> tuple[str, str]:
    """The lines a table ``name`` sits between."""
    return f"<!-- generated: {name} (python -m muonkit._doc_tables) -->\n", f"<!-- end: {name} -->"


def tables_in(text: str) -> list[str]:
    """The generated tables whose start marker ``text`` holds."""
    return [name for name in TABLES if markers(name)[0] in text]


def render(text: str, names: Sequence[str] | None = None) -> str:
    """``text`` with the tables ``names`` (default: every table it holds) rewritten; a table without
    exactly one pair of markers raises ``ValueError``."""
    for name in tables_in(text) if names is None else names:
        start, end = markers(name)
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"The page needs exactly one {start.strip()!r} and one {end!r} around the table")
        before, rest = text.split(start)
        after = rest.split(end)[1]
        text = f"{before}{start}{TABLES[name]()}{end}{after}"
    return text


def python(value: Any) -> str:
    """``value`` as a Python literal, numbers in their shortest form (``1e-7``, ``3e-4``)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "(" + ", ".join(python(v) for v in value) + ")"
    if isinstance(value, float):
        return number(value)
    return repr(value)


def as_json(value: Any) -> str:
    """``value`` as JSON, numbers in their shortest form."""
    if isinstance(value, float):
        return number(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(as_json(v) for v in value) + "]"
    return json.dumps(value)


def number(x: float) -> str:
    """The shortest of ``repr(x)`` and its scientific forms that reads back as ``x`` (repr on a tie)."""
    for digits in range(17):
        mantissa, exponent = f"{x:.{digits}e}".split("e")
        scientific = f"{mantissa}e{int(exponent)}"
        if float(scientific) == x:
            return min(repr(x), scientific, key=len)
    return repr(x)


def _markdown(rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table: the header row, the rule, the rows."""
    lines = ["|" + "|".join(f" {cell} " if cell else " " for cell in row) + "|" for row in rows]
    return "\n".join([lines[0], "|---" * len(rows[0]) + "|", *lines[1:]]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m muonkit._doc_tables", description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to rewrite (default: each table's page, PAGES)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is stale, change nothing")
    args = parser.parse_args(argv)
    jobs: list[tuple[Path, list[str] | None]] = (
        [(page, None) for page in args.pages] if args.pages else [(page, [name]) for name, page in PAGES.items()]
    )
    stale = False
    for page, names in jobs:
        text = page.read_text()
        fresh = render(text, names)
        if fresh == text:
            continue
        if args.check:
            print(f"{page}: generated tables are stale; run python -m muonkit._doc_tables", file=sys.stderr)
            stale = True
            continue
        page.write_text(fresh)
        print(f"{page}: tables rewritten")
    return int(stale)


if __name__ == "__main__":
    sys.exit(main())
