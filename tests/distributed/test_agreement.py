"""Single-process tests of distributed agreement and device placement (no ranks launched).

The all-reduce is simulated: its MAX over ranks is ``torch.stack(vectors).amax(0)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import muonkit
from muonkit.config import group_config
from muonkit.distributed.collectives import flag_device
from muonkit.distributed.guard.ranks import (
    Setting,
    _values_differ,
    check_agreement,
    encode,
    settings_of,
    value_vector,
    values_agree,
)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("cuda:nccl", torch.device("cuda", 3)),  # NCCL reduces CUDA tensors only, on the current device
        ("cpu:gloo,cuda:nccl", torch.device("cpu")),  # init_process_group() without a backend
        ("cpu:gloo,cuda:gloo", torch.device("cpu")),
        ("xpu:xccl", torch.device("xpu", 3)),
    ],
)
def test_flag_device_follows_the_group_backend(
    monkeypatch: pytest.MonkeyPatch, config: str, expected: torch.device
) -> None:
    group = object()
    monkeypatch.setattr(dist, "get_backend_config", lambda g: config if g is group else "wrong group")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 3)
    assert flag_device(group) == expected


def _reduce(vectors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(vectors).amax(0)  # what all_reduce(MAX) leaves on every rank


def _settings(lr: float = 0.02, shape: tuple[int, ...] = (4, 4)) -> list[Setting]:
    p, v = torch.nn.Parameter(torch.zeros(shape)), torch.nn.Parameter(torch.zeros(3))
    opt = muonkit.HybridMuon([{"params": [p], "algorithm": "muon", "lr": lr}, {"params": [v], "algorithm": "adamw"}])
    configs = [group_config(g, i) for i, g in enumerate(opt.param_groups)]
    return settings_of(configs, opt.param_groups, nonfinite="skip")


def test_agreeing_ranks_pass_and_a_word_is_62_bits() -> None:
    settings = _settings()
    check_agreement(_reduce([encode(settings, [True, False])] * 4), settings, [True, False])
    assert all(0 <= s.word() < 2**62 for s in settings)
    assert encode(settings, [True]).numel() == 2 * 64  # padded to a power of two, then negated


def test_a_differing_lr_names_the_group_and_this_ranks_value() -> None:
    mine, other = _settings(lr=0.02), _settings(lr=0.01)
    reduced = _reduce([encode(mine, [True, True]), encode(other, [True, True])])
    with pytest.raises(ValueError, match=r"settings differ across ranks: param group 0 lr \(here 0\.02\)\. Every"):
        check_agreement(reduced, mine, [True, True])


def test_differing_shapes_report_the_structure_only() -> None:
    mine, other = _settings(shape=(4, 4)), _settings(shape=(4, 5))
    reduced = _reduce([encode(mine, [True, True]), encode(other, [True, True])])
    with pytest.raises(ValueError, match=r"param groups \(algorithms, param shapes and dtypes\) differ across ranks"):
        check_agreement(reduced, mine, [True, True])


def test_differing_gradients_name_the_positions() -> None:
    settings = _settings()
    reduced = _reduce([encode(settings, [True, True]), encode(settings, [True, False])])
    with pytest.raises(RuntimeError, match=r"which params have gradients at positions \[1\]"):
        check_agreement(reduced, settings, [True, True])


def _min_reduce(vectors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(vectors).amin(0)  # what all_reduce(MIN) leaves on every rank


def test_device_values_every_rank_must_share_are_checked_bit_for_bit() -> None:
    """A fingerprint of gradients (what :meth:`~muonkit.distributed.guard.CollectiveGuard.expect_equal` sends with the verdict or
    one step late): equal on every rank passes, a difference in the last bit is caught; the error
    names the values, and says when a step without a verdict was applied."""
    sums = torch.tensor([1.5, -2.25e-30, 0.0], dtype=torch.float64)
    assert values_agree(_min_reduce([value_vector(sums)] * 3))
    other = sums.clone()
    other[1] = torch.nextafter(other[1], torch.tensor(0.0, dtype=torch.float64))
    assert not values_agree(_min_reduce([value_vector(sums), value_vector(other)]))
    with pytest.raises(ValueError, match=r"gradients of the plain params differ across ranks\. Every rank"):
        raise _values_differ("gradients of the plain params", late=False)
    with pytest.raises(ValueError, match=r"differ across ranks at the previous step .*that step was applied"):
        raise _values_differ("gradients of the plain params", late=True)


def test_a_steady_state_step_reuses_its_plan_without_building_jobs(one_rank: None) -> None:
    """Plans are keyed on the params' shapes and layout: jobs are built and hashed once, not every step."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 4), (4, 8), (8, 4), (6, 6)]]
    opt = muonkit.Muon(params, process_group=dist.group.WORLD)
    strategy = opt.strategy
    built = []
    jobs = strategy.jobs

    def counted(*args: object, **kwargs: object) -> object:
        built.append(1)
        return jobs(*args, **kwargs)  # type: ignore[arg-type]

    strategy.jobs = counted  # type: ignore[method-assign]
    for seed in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        opt.step()
        assert len(built) == 1  # the first step's (one chunk: every Muon param in one exchange)
