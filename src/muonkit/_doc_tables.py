"""The README's tables, generated from the one place each is kept: ``python -m muonkit._doc_tables``.

- ``hybrid-muon-defaults``: :class:`muonkit.HybridMuon`'s keywords, from the fields of
  :class:`muonkit.defaults.Defaults` (default, ``why``), the group key each sets derived from
  :mod:`muonkit.config`'s key lists;
- ``deepspeed-keys``: the ``optimizer.params`` of a DeepSpeed config, from the fields of
  :class:`muonkit.integrations.deepspeed_config.MuonkitOptions` (default, ``what``);
- ``routing-rules``: :data:`muonkit.routing.BUILT_IN_RULES`.

Each table sits in the README between ``<!-- generated: NAME ... -->`` and ``<!-- end: NAME -->``;
``python -m muonkit._doc_tables`` rewrites them in place, ``--check`` only says whether they are
stale (``tests/contract/test_defaults.py`` fails on a stale README).
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

README = Path(__file__).resolve().parents[2] / "README.md"
"""The README of a clone (``src/muonkit/..``); pass another path on the command line."""


def hybrid_muon_defaults() -> str:
    """``| argument | default | group key | why |``, one row per keyword of :class:`Defaults`."""
    rows = [["argument", "default", "group key", "why"]]
    for f in fields(Defaults):
        shown = f"`{python(getattr(DEFAULTS, f.name))}`" + (f" {f.metadata['shown']}" if f.metadata["shown"] else "")
        rows.append([f"`{f.name}`", shown, group_key(f.name), f.metadata["why"]])
    rows.append(["`process_group`, `strategy`", "`None`", "— (optimizer)", "distributed runs (section below)"])
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


def render(text: str) -> str:
    """``text`` with every generated table rewritten; a missing marker raises ``ValueError``."""
    for name, table in TABLES.items():
        start, end = f"<!-- generated: {name} (python -m muonkit._doc_tables) -->\n", f"<!-- end: {name} -->"
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"The README needs exactly one {start.strip()!r} and one {end!r} around the table")
        before, rest = text.split(start)
        after = rest.split(end)[1]
        text = f"{before}{start}{table()}{end}{after}"
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
    parser.add_argument("readme", nargs="?", type=Path, default=README)
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is stale, change nothing")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    fresh = render(text)
    if fresh == text:
        return 0
    if args.check:
        print(f"{args.readme}: generated tables are stale; run python -m muonkit._doc_tables", file=sys.stderr)
        return 1
    args.readme.write_text(fresh)
    print(f"{args.readme}: tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
