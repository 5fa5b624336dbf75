"""Loading a DCP checkpoint runs no code from it (one device; 2 ranks: scenario_checkpoint).

A crafted payload (a pickle whose ``__reduce__`` creates a marker directory) in any file of a
checkpoint, ``.metadata``, the ``.distcp`` data or ``muonkit-values.json``, is refused by
``load_checkpoint`` before the payload runs and before the model or optimizer changes; a
checkpoint of the previous format (values pickled in the ``.distcp`` files) is refused unless
``trusted=True``, and with it resumes bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import muonkit
from crafted_checkpoints import (
    TRUSTED_HINT,
    Craft,
    Payload,
    data_file_outside,
    metadata_nested_payload,
    metadata_payload,
    piece_payload,
    piece_plain_pickle,
    previous_format_save,
    tensor_listed_as_pickled_value,
    truncated_values,
    values_edit,
    values_payload,
)
from helpers import Tiny, assert_unchanged, frozen_state, tiny_loss
from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint
from muonkit.distributed.checkpoint_files import VALUES_FILE
from muonkit.safe_load import UntrustedCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _build(seed: int = 0, **kwargs: Any) -> tuple[Tiny, muonkit.HybridMuon]:
    torch.manual_seed(seed)
    model = Tiny()
    return model, muonkit.HybridMuon(muonkit.param_groups(model), ns_dtype=torch.float32, **kwargs)


def _train(model: Tiny, opt: muonkit.HybridMuon, steps: range) -> None:
    for i in steps:
        opt.zero_grad(set_to_none=True)
        tiny_loss(model, i).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def _params(model: Tiny) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same_run(a: tuple[Tiny, muonkit.HybridMuon], b: tuple[Tiny, muonkit.HybridMuon]) -> None:
    for (name, x), y in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert torch.equal(x, y), name
    assert_unchanged(b[1], frozen_state(a[1]))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, opt = _build()
    _train(model, opt, range(3))
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    return tmp_path / "ckpt"


def test_loading_unpickles_nothing_and_reads_tensors_weights_only(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's own readers in torch 2.13: tensors through torch.load(weights_only=True), .metadata
    through pickle.load, pickled values through torch.load(weights_only=False). Only the first runs."""
    assert sorted(os.listdir(saved)) == [".metadata", "__0_0.distcp", VALUES_FILE]
    model, opt = _build(seed=1)
    calls: list[Any] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    def no_pickle(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle.load called")

    monkeypatch.setattr(torch, "load", spy)
    monkeypatch.setattr(pickle, "load", no_pickle)
    load_checkpoint(saved, model=model, optimizer=opt)
    monkeypatch.undo()
    assert calls and set(calls) == {True}, calls  # one torch.load per tensor piece, all weights_only

    reference = _build()
    _train(*reference, range(6))
    _train(model, opt, range(3, 6))
    _same_run(reference, (model, opt))


def test_values_keep_their_types(tmp_path: Path) -> None:
    """Tuples, nested tuples, dtypes, None, bools and ints come back as they were."""
    model, opt = _build(ns_coefficients=((3.4445, -4.7750, 2.0315),) * 2, betas=(0.8, 0.99))
    opt.param_groups[0]["ns_dtype"] = torch.bfloat16
    _train(model, opt, range(2))
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    again, fresh = _build(seed=1)
    load_checkpoint(tmp_path / "ckpt", model=again, optimizer=fresh)
    for a, b in zip(opt.param_groups, fresh.param_groups, strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
        assert all(type(a[k]) is type(b[k]) for k in a if k != "params"), [(k, a[k], b[k]) for k in a]


def test_a_value_without_a_json_form_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model, opt = _build()
    _train(model, opt, range(1))
    opt.param_groups[0]["note"] = {1, 2}  # a set: JSON has none
    with pytest.raises(ValueError, match=r"optimizer.param_groups.0.note: save_checkpoint stores values .* set"):
        save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# The previous format: values pickled in the .distcp files


def test_previous_format_is_refused_by_default_and_resumes_bit_exactly_when_trusted(tmp_path: Path) -> None:
    model, opt = _build()
    _train(model, opt, range(3))
    previous_format_save(tmp_path / "old", model, opt)
    _train(model, opt, range(3, 6))

    resumed, ropt = _build(seed=1)
    _train(resumed, ropt, range(1))  # a used optimizer: states that must survive the refusal
    before, params = frozen_state(ropt), _params(resumed)
    message = rf"has no {VALUES_FILE} \(it was written by dcp.save directly.* \d+ values pickled .*{TRUSTED_HINT}"
    with pytest.raises(UntrustedCheckpointError, match=message):
        load_checkpoint(tmp_path / "old", model=resumed, optimizer=ropt)
    assert_unchanged(ropt, before)
    assert all(torch.equal(a, b) for a, b in zip(params, resumed.parameters(), strict=True))

    load_checkpoint(tmp_path / "old", model=resumed, optimizer=ropt, trusted=True)
    _train(resumed, ropt, range(3, 6))
    _same_run((model, opt), (resumed, ropt))


def test_trusted_loads_the_new_format_too(saved: Path) -> None:
    model, opt = _build(seed=1)
    load_checkpoint(saved, model=model, optimizer=opt, trusted=True)
    reference = _build()
    _train(*reference, range(3))
    _same_run(reference, (model, opt))


# ---------------------------------------------------------------------------------------------
# Crafted files: each refused before its payload runs and before anything changes


LR = "optimizer.param_groups.0.lr"
WEIGHT = "model.up.weight"


def _set_value(key: str, value: Any) -> Craft:
    return values_edit(lambda d: d["values"].__setitem__(key, value))


def _lr_as(text: str) -> Craft:
    """The values file with the JSON ``text`` written for the lr, as no JSON encoder would write it."""

    def edit(document: dict[str, Any]) -> str:
        document["values"][LR] = "LR-HERE"
        return json.dumps(document).replace('"LR-HERE"', text)

    return values_edit(edit)


def _previous_format_with_payload(ckpt: Path, marker: Path) -> None:
    model, opt = _build()
    _train(model, opt, range(1))
    for name in os.listdir(ckpt):
        os.remove(ckpt / name)
    os.rmdir(ckpt)
    previous_format_save(ckpt, model, opt, lr=Payload(marker))


def _pickled_value_beside_a_values_file(ckpt: Path, marker: Path) -> None:
    values = (ckpt / VALUES_FILE).read_text()
    _previous_format_with_payload(ckpt, marker)
    (ckpt / VALUES_FILE).write_text(values)


# name -> (craft, exception, message); every message names what was refused
CRAFTED: list[tuple[str, Craft, type[Exception], str]] = [
    ("metadata_payload", metadata_payload, UntrustedCheckpointError,
     rf"\.metadata holds a pickle of posix\.mkdir, not one of DCP's metadata classes.*{TRUSTED_HINT}"),
    ("metadata_nested_payload", metadata_nested_payload, UntrustedCheckpointError,
     rf"\.metadata holds a pickle of posix\.mkdir.*{TRUSTED_HINT}"),
    ("distcp_piece_payload", piece_payload(WEIGHT), UntrustedCheckpointError,
     rf"__0_0\.distcp holds, for {WEIGHT}, a pickle of \['posix\.mkdir'\].*{TRUSTED_HINT}"),
    ("distcp_piece_plain_pickle", piece_plain_pickle(WEIGHT), UntrustedCheckpointError,
     rf"__0_0\.distcp holds, for {WEIGHT}, bytes that are not a torch\.save of tensors.*{TRUSTED_HINT}"),
    ("distcp_tensor_listed_as_pickled", tensor_listed_as_pickled_value(WEIGHT), UntrustedCheckpointError,
     rf"\.metadata lists 1 values pickled in the \.distcp files \(\['{WEIGHT}'\]\).*{TRUSTED_HINT}"),
    ("distcp_file_outside_the_directory", data_file_outside, ValueError,
     r"lies in '\.\./elsewhere\.distcp', not a \*\.distcp file in the checkpoint directory"),
    ("distcp_pickled_lr_previous_format", _previous_format_with_payload, UntrustedCheckpointError,
     rf"has no {VALUES_FILE} .*values pickled in the \.distcp files.*{TRUSTED_HINT}"),
    ("distcp_pickled_lr_beside_values_file", _pickled_value_beside_a_values_file, UntrustedCheckpointError,
     rf"\.metadata lists \d+ values pickled in the \.distcp files.*{TRUSTED_HINT}"),
    ("values_file_a_pickle", values_payload, ValueError, r"not a muonkit values file: UnicodeDecodeError"),
    ("values_malformed", truncated_values, ValueError, r"not a muonkit values file: JSONDecodeError"),
    ("values_top_level_extra_key", values_edit(lambda d: d.__setitem__("pickle", "x")), ValueError,
     r"exactly the keys format, version, values"),
    ("values_wrong_format", values_edit(lambda d: d.__setitem__("format", "dcp")), ValueError,
     r"format 'dcp' version 1"),
    ("values_version_as_bool", values_edit(lambda d: d.__setitem__("version", True)), ValueError, r"version True"),
    ("values_not_an_object", values_edit(lambda d: d.__setitem__("values", [])), ValueError,
     r"values must be an object"),
    ("values_tag_with_extra_key", _set_value(LR, {"float": "inf", "code": "x"}), ValueError, r"exactly one key of"),
    ("values_unknown_tag", _set_value(LR, {"pickle": "gASV"}), ValueError, r"exactly one key of"),
    ("values_dtype_not_a_dtype", _set_value("optimizer.param_groups.0.ns_dtype", {"dtype": "Tensor"}), ValueError,
     r"not a valid dtype"),
    ("values_dtype_not_a_string", _set_value("optimizer.param_groups.0.ns_dtype", {"dtype": 5}), ValueError,
     r"not a valid dtype"),
    ("values_tuple_not_a_list", _set_value("optimizer.param_groups.0.betas", {"tuple": "ab"}), ValueError,
     r"not a valid tuple"),
    ("values_float_tag_not_special", _set_value(LR, {"float": "1e400"}), ValueError, r"not a valid float"),
    ("values_lr_a_string", _set_value(LR, "0.02"), ValueError,
     rf"{LR} is '0\.02', and the state being loaded holds a number"),
    ("values_lr_a_list", _set_value(LR, [0.02]), ValueError,
     rf"{LR} is \[0\.02\], and the state being loaded holds a number"),
    ("values_nesterov_an_int", _set_value("optimizer.param_groups.0.nesterov", 1), ValueError, r"holds a bool there"),
    ("values_huge_float", _lr_as("1e999"), ValueError, r"too large for a float"),
    ("values_huge_int", _set_value(LR, 10**30), ValueError, r"integer 1e\+30, outside 64 bits"),
    ("values_int_of_5000_digits", _lr_as("9" * 5000), ValueError, r"ValueError: Exceeds the limit"),
    ("values_nan_literal", _lr_as("NaN"), ValueError, r"NaN is not JSON"),
    ("values_duplicate_key", _lr_as(f'0.02, "{LR}": 1.0'), ValueError, r"repeats a key"),
    ("values_deep_nesting", _set_value(LR, json.loads("[" * 40 + "0" + "]" * 40)), ValueError, r"deeper than 32"),
    ("values_of_a_group_it_lacks", _set_value("optimizer.param_groups.7.lr", 1.0), ValueError, r"holds 3 param groups"),
]  # fmt: skip


def _refused(ckpt: Path, marker: Path, exception: type[Exception], message: str) -> None:
    """load_checkpoint raises ``exception`` matching ``message``; nothing ran, nothing changed."""
    model, opt = _build(seed=1)
    _train(model, opt, range(1))
    before, params = frozen_state(opt), _params(model)
    with pytest.raises(exception, match=message):
        load_checkpoint(ckpt, model=model, optimizer=opt)
    assert not marker.exists(), "the payload ran"
    assert_unchanged(opt, before)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


@pytest.mark.parametrize(("craft", "exception", "message"), [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_a_crafted_checkpoint_file_is_refused_unexecuted(
    saved: Path, tmp_path: Path, craft: Craft, exception: type[Exception], message: str
) -> None:
    marker = tmp_path / "payload_ran"
    craft(saved, marker)
    assert not marker.exists()
    _refused(saved, marker, exception, message)


@pytest.mark.parametrize("craft", [metadata_payload, piece_payload(WEIGHT), values_payload, truncated_values])
def test_a_fresh_optimizer_stays_fresh_when_a_file_is_refused(saved: Path, tmp_path: Path, craft: Craft) -> None:
    """The file checks come before get_state_dict, which would create a fresh optimizer's states."""
    craft(saved, tmp_path / "payload_ran")
    model, opt = _build(seed=1)
    params = _params(model)
    with pytest.raises(ValueError, match=r"metadata|distcp|values"):
        load_checkpoint(saved, model=model, optimizer=opt)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))


def test_values_the_state_has_no_place_for_are_ignored_like_dcp(saved: Path) -> None:
    _set_value("optimizer.param_groups.0.initial_lr", 1.0)(saved, saved / "unused")  # a key a scheduler adds
    model, opt = _build(seed=1)
    load_checkpoint(saved, model=model, optimizer=opt)
    reference = _build()
    _train(*reference, range(3))
    _same_run(reference, (model, opt))


def test_a_group_key_the_values_lack_keeps_its_value_as_load_state_dict_does(saved: Path) -> None:
    """A key a checkpoint lacks was saved before that option existed: it keeps the current value."""
    values_edit(lambda d: d["values"].pop(LR))(saved, saved / "unused")
    model, opt = _build(seed=1)
    opt.param_groups[0]["lr"] = 0.0125
    load_checkpoint(saved, model=model, optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.0125


def test_the_payloads_do_run_under_a_full_unpickler(saved: Path, tmp_path: Path) -> None:
    """The crafted files are real: plain pickle and DCP's trusted path execute them."""
    marker = tmp_path / "payload_ran"
    metadata_payload(saved, marker)
    with open(saved / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.exists()
    os.rmdir(marker)
    old = tmp_path / "old"
    old.mkdir()
    _previous_format_with_payload(old, marker)
    model, opt = _build(seed=1)
    with contextlib.suppress(Exception):  # the lr it unpickles is mkdir's None
        load_checkpoint(old, model=model, optimizer=opt, trusted=True)
    assert marker.exists()
