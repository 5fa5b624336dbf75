"""One source of defaults: ``muonkit.config.DEFAULTS`` (and ``TORCH_MUON_DEFAULTS`` for ``muonkit.Muon``).

Every place that states a default reads it from there or is checked against it here: the
keywords of ``HybridMuon`` and ``Muon``, the DeepSpeed config reader (and its docstring table),
the Hugging Face ``make_optimizer``, and the README's tables and signatures.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import muonkit
from muonkit.config import DEFAULTS, TORCH_MUON_DEFAULTS, Defaults
from muonkit.integrations import deepspeed_config
from muonkit.integrations.deepspeed_config import MuonkitOptions
from muonkit.integrations.transformers import make_optimizer

README = Path(__file__).resolve().parents[1] / "README.md"
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
    assert len(shared) == 19  # all but layout and split_sizes (routing decides those) and capturable
    assert {k: options[k] for k in shared} == {k: getattr(DEFAULTS, k) for k in shared}


def test_deepspeed_docstring_table_states_the_defaults() -> None:
    doc = deepspeed_config.__doc__ or ""
    rows = dict(re.findall(r"^``(\w+)``\s+(.+?)\s{2,}", doc, flags=re.M))
    stated = {k: _json_literal(v) for k, v in rows.items() if k in FIELDS}
    assert len(stated) == 19
    assert stated == {k: _as_json(getattr(DEFAULTS, k)) for k in stated}


def test_make_optimizer_without_arguments_uses_the_defaults() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    opt = make_optimizer(model)
    by_algorithm = {g["algorithm"]: g for g in opt.param_groups}
    assert (by_algorithm["muon"]["lr"], by_algorithm["muon"]["weight_decay"]) == (DEFAULTS.lr, DEFAULTS.weight_decay)
    assert (by_algorithm["adamw"]["lr"], tuple(by_algorithm["adamw"]["betas"])) == (DEFAULTS.adamw_lr, DEFAULTS.betas)


# ---------------------------------------------------------------------------------------- README


def readme_table(text: str, heading: str) -> dict[str, Any]:
    """``{argument: default}`` of the ``| `name` | `default` | why |`` rows under ``heading``."""
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)`", section, flags=re.M)
    return {name: ast.literal_eval(value) for name, value in rows}


def readme_signature(text: str, name: str) -> dict[str, Any]:
    """The keyword defaults of the ``### `muonkit.NAME(...)` `` heading."""
    match = re.search(rf"^### `muonkit\.{name}\((.*)\)`$", text, flags=re.M)
    assert match, f"no heading for muonkit.{name}"
    call = ast.parse(f"f({match.group(1).replace('*, ', '')})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}


def test_readme_hybrid_muon_table_states_the_defaults() -> None:
    table = readme_table(README.read_text(), "### `muonkit.HybridMuon(params, **defaults)`")
    assert table == dataclasses.asdict(DEFAULTS)


def test_readme_muon_signature_states_torch_muons_defaults() -> None:
    stated = readme_signature(README.read_text(), "Muon")
    assert stated.pop("adjust_lr_fn") is None
    assert stated == {k: getattr(TORCH_MUON_DEFAULTS, k) for k in stated}
    assert stated == {k: v for k, v in _keyword_defaults(muonkit.Muon.__init__).items() if k in stated}


def test_param_groups_heading_states_its_keywords() -> None:
    assert readme_signature(README.read_text(), "param_groups") == _keyword_defaults(muonkit.param_groups)


def test_the_readme_checks_fail_on_a_wrong_default() -> None:
    """The parsers above read what they claim to: a changed value in the text is caught."""
    text = README.read_text()
    heading = "### `muonkit.HybridMuon(params, **defaults)`"
    wrong = text.replace("| `momentum` | `0.95` |", "| `momentum` | `0.9` |", 1)
    assert wrong != text and readme_table(wrong, heading)["momentum"] == 0.9
    assert readme_table(wrong, heading) != dataclasses.asdict(DEFAULTS)
    with pytest.raises(AssertionError, match="no heading"):
        readme_signature(text, "NoSuchThing")


def _json_literal(text: str) -> Any:
    return ast.literal_eval(text.replace("true", "True").replace("false", "False").replace("null", "None"))


def _as_json(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return list(value) if isinstance(value, tuple) else value
