"""The ways into DeepSpeed that skip muonkit's entry points fail naming the fix (1 rank)."""

from __future__ import annotations

import torch
from ds_common import GA, Net, batch, config
from ds_worker import Context, check, quiet_deepspeed

import muonkit


@check
def uninstalled_client_hybrid_muon_names_install(ctx: Context) -> None:
    """``deepspeed.initialize(optimizer=HybridMuon(...))`` without ``mk_ds.install(engine)``."""
    del ctx
    quiet_deepspeed()
    import deepspeed

    torch.manual_seed(0)
    model = Net()
    optimizer = muonkit.HybridMuon(muonkit.param_groups(model))
    cfg = {k: v for k, v in config(2).items() if k != "optimizer"} | {"zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    try:
        for micro in range(GA):  # the optimizer steps at the end of the accumulation
            idx, targets = batch(0, micro, 0)
            engine.backward(engine(idx, targets))
            engine.step()
    except ValueError as e:
        assert "muonkit.integrations.deepspeed.install(engine)" in str(e), e
    else:
        raise AssertionError("an uninstalled HybridMuon stepped DeepSpeed's flat partitions")
    # No check that the weights are untouched: ZeRO steps the optimizer one param group at a time
    # (param_groups swapped for [group]), so AdamW groups before the first Muon group have stepped.
