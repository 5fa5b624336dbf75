"""Zero-size params on one device: empty in, empty out, and the step is a no-op for them.

The distributed strategies (DDP, FSDP2, ZeRO) are checked in tests/distributed/scenario_agreement.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import muonkit
from muonkit.distributed import SingleDeviceStrategy
from muonkit.functional.matrices import MatrixLayout
from muonkit.functional.muon import NSOptions, muon_directions

MUON_SHAPES = [(0, 8), (8, 0), (3, 0, 8), (0, 4, 4), (2, 0, 3, 3)]


@pytest.mark.parametrize("shape", MUON_SHAPES)
def test_muon_directions_of_an_empty_tensor_are_empty(shape: tuple[int, ...]) -> None:
    calls: list[tuple[int, int, int]] = []
    (out,) = muon_directions([torch.zeros(shape)], [MatrixLayout()], NSOptions(), on_batch=lambda *a: calls.append(a))
    assert out.shape == shape and not calls


def test_zero_size_chunks_are_not_lost() -> None:
    params = [torch.zeros(0, 8), torch.zeros(0, 8), torch.zeros(4, 4)]
    chunks = SingleDeviceStrategy(max_chunk_elements=8).muon_chunks(params, _config())
    assert sorted(i for c in chunks for i in c) == [0, 1, 2]


def _config() -> muonkit.config.MuonConfig:
    opt = muonkit.HybridMuon([torch.nn.Parameter(torch.zeros(2, 2))])
    config = muonkit.config.group_config(opt.param_groups[0])
    assert isinstance(config, muonkit.config.MuonConfig)
    return config


def _model() -> tuple[list[torch.nn.Parameter], muonkit.HybridMuon]:
    g = torch.Generator().manual_seed(0)
    muon = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [*MUON_SHAPES, (4, 4), (8, 3)]]
    adamw = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(0,), (0, 3), (5,)]]
    groups = [
        {"params": muon, "algorithm": "muon", "weight_decay": 0.1},
        {"params": adamw, "algorithm": "adamw", "weight_decay": 0.1},
    ]
    return muon + adamw, muonkit.HybridMuon(groups)


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_zero_size_params_step_as_a_no_op_beside_real_ones() -> None:
    params, opt = _model()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params if p.numel()]
    ref_opt = muonkit.HybridMuon(
        [
            {"params": ref[:2], "algorithm": "muon", "weight_decay": 0.1},
            {"params": ref[2:], "algorithm": "adamw", "weight_decay": 0.1},
        ]
    )
    for step in range(3):
        _grads(params, step)
        for r, p in zip(ref, [p for p in params if p.numel()], strict=True):
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for r, p in zip(ref, [p for p in params if p.numel()], strict=True):
        assert torch.equal(r, p)  # the empty params change nothing for the others
    for p in params:
        state = opt.state[p]
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in state:
                assert state[key].shape == p.shape and state[key].dtype == torch.float32
    assert opt.strategy.stats.matrices == 3 * 2  # only the (4, 4) and (8, 3) matrices, every step


def test_zero_size_state_dict_round_trip() -> None:
    params, opt = _model()
    _grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh_params, fresh = _model()
    fresh.load_state_dict(saved)
    for p, q in zip(params, fresh_params, strict=True):
        q.data.copy_(p.data)
    _grads(params, 1)
    _grads(fresh_params, 1)
    opt.step()
    fresh.step()
    for p, q in zip(params, fresh_params, strict=True):
        assert torch.equal(p, q) and p.shape == q.shape
        for key, value in opt.state[p].items():
            assert torch.equal(value, fresh.state[q][key]), key
