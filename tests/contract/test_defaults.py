"""One source of defaults: ``muonkit.defaults.DEFAULTS`` (and ``TORCH_MUON_DEFAULTS`` for ``muonkit.Muon``).

Every place that states a default reads it from there or is checked against it here: the
keywords of ``HybridMuon`` and ``Muon``, the DeepSpeed config reader, the Hugging Face
``make_optimizer``, torchtitan's container, and the docs' tables (generated from the code by
``python -m muonkit._doc_tables``) and signatures. Every keyword reaches every consumer.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import muonkit
from muonkit import _doc_tables
from muonkit.config import DEFAULTS, GROUP_DEFAULT_KEYWORDS, OPTIMIZER_KEYWORDS, TORCH_MUON_DEFAULTS, Defaults
from muonkit.integrations.deepspeed_config import MuonkitOptions
from muonkit.integrations.transformers import make_optimizer

DOCS = Path(__file__).resolve().parents[2] / "docs"
OPTIMIZER_PAGE = DOCS / "optimizer.md"  # HybridMuon's table, the Muon and orthogonalize headings
ROUTING_PAGE = DOCS / "routing.md"  # the param_groups heading
DEEPSPEED_PAGE = DOCS / "stacks" / "deepspeed.md"  # the DeepSpeed keys
FIELDS = [f.name for f in dataclasses.fields(Defaults)]


def _keyword_defaults(fn: Any) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_hybrid_muon_keywords_are_the_defaults() -> None:
    keywords = _keyword_defaults(muonkit.HybridMuon.__init__)
    assert {k: keywords[k] for k in FIELDS} == dataclasses.asdict(DEFAULTS)


def test_muon_keywords_are_torch_muons_defaults() -> None:
    keywords = _keyword_defaults(muonkit.Muon.__init__)
    shared = [k for k in FIELDS if k in keywords]
    assert len(shared) == 7  # lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps
    assert {k: keywords[k] for k in shared} == {k: getattr(TORCH_MUON_DEFAULTS, k) for k in shared}
    assert TORCH_MUON_DEFAULTS.adjust_lr == "keller"  # torch's adjust_lr_fn=None ("original")


def test_deepspeed_options_are_the_defaults() -> None:
    options = dataclasses.asdict(MuonkitOptions())
    shared = [k for k in FIELDS if k in options]
    assert len(shared) == 20  # all but layout and split_sizes (routing decides those) and capturable
    assert {k: options[k] for k in shared} == {k: getattr(DEFAULTS, k) for k in shared}


def test_deepspeed_table_states_the_defaults() -> None:
    """The table of the config's keys (once, in the DeepSpeed page; it was in deepspeed_config's docstring)."""
    table = (
        DEEPSPEED_PAGE.read_text()
        .split("<!-- generated: deepspeed-keys", 1)[1]
        .split("<!-- end: deepspeed-keys -->")[0]
    )
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|", table, flags=re.M))
    stated = {k: _json_literal(v) for k, v in rows.items() if k in FIELDS}
    assert len(stated) == 20
    assert stated == {k: _as_json(getattr(DEFAULTS, k)) for k in stated}


def test_make_optimizer_without_arguments_uses_the_defaults() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = make_optimizer(model)
    by_algorithm = {g["algorithm"]: g for g in opt.param_groups}
    assert (by_algorithm["muon"]["lr"], by_algorithm["muon"]["weight_decay"]) == (DEFAULTS.lr, DEFAULTS.weight_decay)
    assert (by_algorithm["adamw"]["lr"], tuple(by_algorithm["adamw"]["betas"])) == (DEFAULTS.adamw_lr, DEFAULTS.betas)


# ------------------------------------------------------------------------------------------ docs


def page_table(text: str, heading: str) -> dict[str, Any]:
    """``{argument: default}`` of the ``| `name` | `default` | why |`` rows under ``heading``."""
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)`", section, flags=re.M)
    return {name: ast.literal_eval(value) for name, value in rows}


def page_signature(text: str, name: str) -> dict[str, Any]:
    """The keyword defaults of the ``### `muonkit.NAME(...)` `` heading."""
    match = re.search(rf"^### `muonkit\.{name}\((.*)\)`$", text, flags=re.M)
    assert match, f"no heading for muonkit.{name}"
    call = ast.parse(f"f({match.group(1).replace('*, ', '')})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}


def test_docs_hybrid_muon_table_states_the_defaults() -> None:
    table = page_table(OPTIMIZER_PAGE.read_text(), "### `muonkit.HybridMuon(params, **defaults)`")
    assert table == dataclasses.asdict(DEFAULTS)


def test_docs_muon_signature_states_torch_muons_defaults() -> None:
    stated = page_signature(OPTIMIZER_PAGE.read_text(), "Muon")
    assert stated.pop("adjust_lr_fn") is None
    assert stated == {k: getattr(TORCH_MUON_DEFAULTS, k) for k in stated}
    assert stated == {k: v for k, v in _keyword_defaults(muonkit.Muon.__init__).items() if k in stated}


def test_param_groups_heading_states_its_keywords() -> None:
    assert page_signature(ROUTING_PAGE.read_text(), "param_groups") == _keyword_defaults(muonkit.param_groups)


def test_the_docs_checks_fail_on_a_wrong_default() -> None:
    """The parsers above read what they claim to: a changed value in the text is caught."""
    text = OPTIMIZER_PAGE.read_text()
    heading = "### `muonkit.HybridMuon(params, **defaults)`"
    wrong = text.replace("| `momentum` | `0.95` |", "| `momentum` | `0.9` |", 1)
    assert wrong != text and page_table(wrong, heading)["momentum"] == 0.9
    assert page_table(wrong, heading) != dataclasses.asdict(DEFAULTS)
    with pytest.raises(AssertionError, match="no heading"):
        page_signature(text, "NoSuchThing")


def _json_literal(text: str) -> Any:
    return ast.literal_eval(text.replace("true", "True").replace("false", "False").replace("null", "None"))


def _as_json(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return list(value) if isinstance(value, tuple) else value


# ------------------------------------------------------------------ one keyword, one place

ALTERNATIVES: dict[str, Any] = {
    "lr": 0.03, "momentum": 0.9, "nesterov": False, "ns_coefficients": "keller", "ns_steps": 4, "eps": 1e-6,
    "weight_decay": 0.1, "adjust_lr": "spectral", "layout": "matrix", "split_sizes": (4, 4),
    "ns_dtype": torch.float64, "ns_method": "newton_schulz", "adamw_lr": 1e-3, "betas": (0.8, 0.9),
    "adamw_eps": 1e-7, "adamw_weight_decay": 0.01, "nonfinite": "raise", "normuon_beta2": 0.9,
    "normuon_eps": 1e-9, "cautious_wd": True, "state_dtype": "8bit", "capturable": True, "ns_compile": True,
}  # fmt: skip
"""A value other than the default for each keyword of ``Defaults``."""


def test_every_keyword_has_an_alternative_here() -> None:
    """A keyword added to ``Defaults`` needs a value here, so the test below checks that it reaches
    every consumer."""
    assert list(ALTERNATIVES) == FIELDS
    assert all(ALTERNATIVES[k] != getattr(DEFAULTS, k) for k in FIELDS)


def _setting_of(opt: muonkit.HybridMuon, keyword: str) -> Any:
    """Where ``keyword`` of ``opt`` ends up: an attribute (optimizer-wide), or a group key of the
    algorithm whose default it is (AdamW's ``betas``; Muon's otherwise)."""
    if keyword in OPTIMIZER_KEYWORDS:
        return getattr(opt, keyword)
    key, algorithm = GROUP_DEFAULT_KEYWORDS.get(keyword, (keyword, "adamw" if keyword == "betas" else "muon"))
    value = next(g[key] for g in opt.param_groups if g["algorithm"] == algorithm)  # the first of them
    return tuple(value) if isinstance(value, list) else value


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))


def _groups() -> list[dict[str, Any]]:
    """A group of each algorithm, with no hyperparameter of its own."""
    return [
        {"params": [nn.Parameter(torch.randn(8, 8))], "algorithm": "muon"},
        {"params": [nn.Parameter(torch.randn(8, 8))], "algorithm": "normuon"},
        {"params": [nn.Parameter(torch.randn(8))], "algorithm": "adamw"},
    ]


@pytest.mark.parametrize("keyword", FIELDS)
def test_every_keyword_reaches_every_consumer(keyword: str) -> None:
    """The constructor, a copy, the DeepSpeed config, make_optimizer, torchtitan's config and the
    docs' table all take the keyword, and it lands where the optimizer reads it."""
    value = ALTERNATIVES[keyword]
    setting = {keyword: value} | ({"nonfinite": "unchecked"} if keyword == "capturable" else {})
    opt = muonkit.HybridMuon(_groups(), **setting)
    assert _setting_of(opt, keyword) == value
    assert _setting_of(copy.deepcopy(opt), keyword) == value
    routing = {"muon_algorithm": "normuon"} if keyword.startswith("normuon_") else {}
    assert _setting_of(make_optimizer(_model(), **routing, **setting), keyword) == value

    if keyword in {f.name for f in dataclasses.fields(MuonkitOptions)}:
        json_value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
        assert MuonkitOptions.from_params({keyword: json_value}).optimizer_kwargs()[keyword] == value
    else:
        with pytest.raises(ValueError, match=rf"\['{keyword}'\] \({keyword}: "):
            MuonkitOptions.from_params({keyword: value})

    if importlib.util.find_spec("torchtitan") is not None:
        from muonkit.integrations import torchtitan

        if keyword in torchtitan._ROUTING:
            assert keyword not in {f.name for f in dataclasses.fields(torchtitan.HybridMuonContainer.Config)}
        else:
            config = torchtitan.HybridMuonContainer.Config(**setting)
            assert torchtitan._keywords(config)[keyword] == value

    assert keyword in page_table(OPTIMIZER_PAGE.read_text(), "### `muonkit.HybridMuon(params, **defaults)`")


def test_the_doc_tables_are_generated_from_the_code(tmp_path: Path) -> None:
    """The routing, defaults and DeepSpeed tables are what ``python -m muonkit._doc_tables`` writes,
    each on its one page of the docs and nowhere else (README included)."""
    for name, page in _doc_tables.PAGES.items():
        text = page.read_text()
        assert _doc_tables.render(text, [name]) == text, f"stale table {name}: run python -m muonkit._doc_tables"
    pages = [*DOCS.rglob("*.md"), DOCS.parent / "README.md"]
    holders = {name: [p for p in pages if name in _doc_tables.tables_in(p.read_text())] for name in _doc_tables.TABLES}
    assert holders == {name: [page] for name, page in _doc_tables.PAGES.items()}
    assert _doc_tables.main(["--check"]) == 0
    text = OPTIMIZER_PAGE.read_text()
    stale = tmp_path / "optimizer.md"
    stale.write_text(text.replace("| `momentum` | `0.95` |", "| `momentum` | `0.9` |", 1))
    assert _doc_tables.main([str(stale), "--check"]) == 1
    assert _doc_tables.main([str(stale)]) == 0 and stale.read_text() == text
    assert _doc_tables.main([str(stale), "--check"]) == 0
