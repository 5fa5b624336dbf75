"""Helpers shared by the single-process tests: a tiny model, its loss, and optimizer snapshots."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import muonkit


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(self.norm(x + self.down(torch.relu(self.up(x)))))


def tiny_loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (4, 6), generator=g)
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def frozen_state(opt: muonkit.HybridMuon) -> dict[str, Any]:
    return copy.deepcopy({"state": dict(opt.state), "groups": [dict(g) for g in opt.param_groups]})


def assert_unchanged(opt: muonkit.HybridMuon, before: dict[str, Any]) -> None:
    after = frozen_state(opt)
    assert len(after["groups"]) == len(before["groups"])
    for ga, gb in zip(after["groups"], before["groups"], strict=True):
        assert ga.keys() == gb.keys()
        for k in ga:
            if k == "params":
                assert all(torch.equal(x, y) for x, y in zip(ga[k], gb[k], strict=True))
            else:
                assert ga[k] == gb[k], k
    assert len(after["state"]) == len(before["state"])
    for sa, sb in zip(after["state"].values(), before["state"].values(), strict=True):
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
