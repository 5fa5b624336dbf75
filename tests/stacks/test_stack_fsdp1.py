"""FSDP1 (``FullyShardedDataParallel``, what Lightning's ``strategy="fsdp"`` and accelerate's
``fsdp_version=1`` use) flattens parameters to 1-D: muonkit refuses them and names FSDP2.

Lightning's ``strategy="fsdp"`` refuses a CPU accelerator, so this wraps with torch's FSDP1
directly, in this process on a one-rank gloo group (both of FSDP1's parameter modes).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

import muonkit

POINTER = (
    r"flattened by FSDP1.*FSDP2: torch\.distributed\.fsdp\.fully_shard \(Lightning: strategy=ModelParallelStrategy"
)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat_param", "use_orig_params"])
def test_fsdp1_params_are_refused_with_a_pointer_to_fsdp2(one_rank: None, use_orig_params: bool) -> None:
    model = FullyShardedDataParallel(mlp(), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match=POINTER):
        muonkit.param_groups(model)
    with pytest.raises(ValueError, match=POINTER):
        muonkit.explain(model)
    with pytest.raises(ValueError, match=POINTER):
        muonkit.HybridMuon(model.parameters())


def test_fsdp2_params_of_the_same_model_are_routed_to_muon(one_rank: None) -> None:
    model = mlp()
    fully_shard(model)
    groups = muonkit.param_groups(model)
    muon = [n for g in groups if g["algorithm"] == "muon" for n in g["param_names"]]
    assert muon == ["0.weight", "2.weight"]
    optimizer = muonkit.HybridMuon(groups)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    assert len(optimizer.state) == 4
