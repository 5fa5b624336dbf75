"""Torch versions: a feature the running torch is too old for raises "X needs torch >= Y" when it is
chosen (``muonkit._compat``), never an AttributeError inside a step. ``make compat TORCH=2.4.1``
runs this file on the floor version, where the FSDP2 case raises the named error."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import muonkit
from muonkit._compat import (
    DTENSOR_FEATURE,
    DTENSOR_TORCH,
    TorchVersionError,
    requires_torch,
    torch_at_least,
    version_tuple,
)


def test_versions_are_read_as_numbers() -> None:
    assert version_tuple("2.4.1+cpu") == (2, 4, 1)
    assert version_tuple("2.10.0") > version_tuple("2.9.1")
    assert version_tuple("2.6.0a0+git1234") == (2, 6, 0)
    assert torch_at_least("2.4") and not torch_at_least("99.0")


def test_a_feature_beyond_this_torch_raises_naming_both_versions() -> None:
    with pytest.raises(
        TorchVersionError, match="^" + re.escape(f"a feature needs torch >= 99.0 (this is torch {torch.__version__})")
    ):
        requires_torch("a feature", "99.0")
    requires_torch("a feature", "2.4")  # the floor: nothing raised


def _fully_shard() -> object:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6: FSDP2 was private
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def test_fsdp2_params_work_or_raise_the_named_error(one_rank: None) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    _fully_shard()(model)  # type: ignore[operator]
    if not torch_at_least(DTENSOR_TORCH):
        with pytest.raises(
            TorchVersionError, match="^" + re.escape(f"{DTENSOR_FEATURE} needs torch >= {DTENSOR_TORCH}")
        ):
            muonkit.HybridMuon(muonkit.param_groups(model))
        return
    opt = muonkit.HybridMuon(muonkit.param_groups(model))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert opt.strategy.name == "fsdp2"
