"""Update rules are plug-ins: a rule's hooks run in the step without the step knowing the rule.

A toy rule registered for the test only (beside Muon and NorMuon) keeps one state like the param
(set by its ``before`` hook) and one value per matrix row (set by its ``after`` hook), and counts
its commits; the step stores both states under the rule's keys and applies the lr shape scale
once, at the commit, to what ``after`` returns.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from muonkit.config import MuonConfig, group_config
from muonkit.distributed import SingleDeviceStrategy
from muonkit.functional import lr_scale, muon_update
from muonkit.functional.rules import RULES
from muonkit.functional.update_rule import MUON, RuleSettings, StateSpec, UpdateRule
from muonkit.stages import commit_muon, muon_chunks


class _Toy(UpdateRule):
    name = "toy"
    title = "Toy"
    states = (*UpdateRule.states, StateSpec("toy_like", "param"), StateSpec("toy_rows", "rows"))

    def __init__(self) -> None:
        self.commits = 0

    def before(
        self, buffers: list[Tensor], grads: list[Tensor], states: list[list[Tensor]], settings: RuleSettings
    ) -> tuple[list[Tensor], list[list[Tensor]]]:
        updates = muon_update(buffers, grads, momentum=settings.momentum, nesterov=settings.nesterov)
        return updates, [[old + 1.0 for old in olds] for olds in states]

    def after(self, o: Tensor, olds: Sequence[Tensor], settings: RuleSettings) -> tuple[Tensor, list[Tensor]]:
        return torch.ones_like(o), [old + 2.0 for old in olds]

    def committed(self, params: Sequence[Tensor], settings: RuleSettings) -> None:
        self.commits += len(params)


def _muon_config() -> MuonConfig:
    group = {
        "algorithm": "muon", "lr": 0.1, "momentum": 0.9, "nesterov": False, "ns_coefficients": "polar_express",
        "ns_steps": None, "eps": 1e-7, "weight_decay": 0.0, "adjust_lr": "keller", "layout": "auto",
        "split_sizes": None, "ns_dtype": torch.float32,
    }  # fmt: skip
    config = group_config(group)
    assert isinstance(config, MuonConfig)
    return config


def test_a_rules_hooks_and_states_run_in_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    toy = _Toy()
    monkeypatch.setitem(RULES, "toy", toy)  # type: ignore[index]
    config = dataclasses.replace(_muon_config(), algorithm="toy")
    p = torch.nn.Parameter(torch.zeros(6, 3))
    p.grad = torch.randn(6, 3)
    strategy, state = SingleDeviceStrategy(), defaultdict(dict)  # as torch.optim's
    for step in (1, 2):
        with torch.no_grad():  # as step() runs
            chunks = list(muon_chunks([p], config, strategy=strategy, state=state))
            commit_muon(chunks, config, (config.lr, 0.0), None, strategy=strategy, state=state, wrote=lambda: None)
        assert torch.equal(state[p]["toy_like"], torch.full((6, 3), float(step)))
        assert torch.equal(state[p]["toy_rows"], torch.full((6,), 2.0 * step))
    assert torch.equal(p.detach(), torch.full((6, 3), -2 * config.lr * lr_scale("keller", 6, 3)))
    assert toy.commits == 2


def test_muon_is_the_rule_of_muon_groups() -> None:
    assert _muon_config().rule is MUON and not MUON.changes_directions and RULES["normuon"].changes_directions


def test_scale_multiplies_a_batch_of_views_once_with_the_same_bits() -> None:
    """``scale_`` multiplies the directions that tile one batch (transposed views included) as one
    flat view: the same products as one ``mul_`` per tensor, and untouched neighbours stay untouched."""
    from muonkit.functional.muon import _stretches, scale_

    batch = torch.randn(4, 8, 3)
    views = [m.mT for m in batch.unbind(0)]  # (3, 8) views, each filling its own stretch
    expected = [v.clone().mul_(torch.tensor(1.5)) for v in views]
    assert len(_stretches(views)) == 1
    assert len(_stretches(views[:2] + views[3:])) == 2  # a gap: two stretches
    assert len(_stretches([batch[:, :, :2]])) == 1  # not dense: kept as it is
    apart = torch.randn(3, 8)
    before, fourth = apart.clone(), views[3].clone()
    scale_([*views[:3], apart], [1.5, 1.5, 1.5, 1.0])
    assert all(torch.equal(v, e) for v, e in zip(views[:3], expected[:3], strict=True))
    assert torch.equal(views[3], fourth) and torch.equal(apart, before)  # not in the call: not scaled
