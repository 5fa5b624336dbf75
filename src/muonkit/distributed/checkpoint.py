"""Portable checkpoints of a model and its HybridMuon with ``torch.distributed.checkpoint`` (DCP).

Both helpers are the standard DCP recipe, written once: ``get_state_dict`` names every tensor by
its parameter's fully qualified name (without DDP's ``module.`` prefix), DCP writes each rank's
pieces once (replicated DDP tensors are deduplicated, FSDP2 DTensors saved as shards), and on
load DCP reads whatever slice each rank now holds. So a checkpoint saved by DDP or FSDP2 at one
world size loads at another, with either layout, or on one device: optimizer states are keyed
by parameter name and are whole tensors (or DTensors) shaped like their parameters.

Every rank must call them (they are collective when torch.distributed is initialized); on a
single process without a process group they work too.

Example::

    from muonkit.distributed.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint("ckpt/step_1000", model=model, optimizer=opt)
    ...  # later, maybe at another world size, with a freshly built model and optimizer
    load_checkpoint("ckpt/step_1000", model=model, optimizer=opt)
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
from torch import nn

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write model and optimizer state to the directory ``path`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.fspath(path))


def load_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer`` (collective).

    The optimizer may be fresh (no state yet): ``get_state_dict`` then creates its states with one
    zero-gradient, zero-lr step, and the loaded values replace them; states the checkpoint does
    not have (params that had no gradient before the save) are dropped again.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_state, optim_tree = get_state_dict(model, optimizer)
    optim_state = cast(dict[str, Any], optim_tree)
    # States the saving run did not have yet (a param that never had a gradient) must stay
    # absent, not zero: an AdamW state with step=1 would change its bias correction.
    saved = set(dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata)
    kept = {
        name: entry
        for name, full in optim_state["state"].items()
        if (entry := {k: v for k, v in full.items() if f"optimizer.state.{name}.{k}" in saved})
    }
    complete = len(kept) == len(optim_state["state"])
    optim_state["state"] = kept
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=complete))
