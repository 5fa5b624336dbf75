"""Portable checkpoints of a model and its HybridMuon with ``torch.distributed.checkpoint`` (DCP).

Both helpers are the standard DCP recipe, written once: ``get_state_dict`` names every tensor by
its parameter's fully qualified name (without DDP's ``module.`` prefix), DCP writes each rank's
pieces once (replicated DDP tensors are deduplicated, FSDP2 DTensors saved as shards), and on
load DCP reads whatever slice each rank now holds. So a checkpoint saved by DDP or FSDP2 at one
world size loads at another, with either layout, or on one device: optimizer states are keyed
by parameter name and are whole tensors (or DTensors) shaped like their parameters.

Every rank must call them (they are collective when torch.distributed is initialized); on a
single process without a process group they work too.

Saving never destroys the previous checkpoint at ``path``: every rank writes into
``path.muonkit-tmp``, and once DCP has written its metadata (the last file), rank 0 swaps the
new directory into place atomically (:mod:`muonkit.atomic`); a ``kill -9`` at any moment
leaves the previous or the new checkpoint loadable. ``path`` must therefore be a directory
that all ranks see (one shared file system), and ``save_checkpoint`` owns it: it replaces it
whole, and refuses a directory holding files other than DCP's.

Loading unpickles DCP's ``.metadata`` file with ``pickle`` (DCP has no safe mode for it; the
tensor data itself loads with ``weights_only=True``): load only checkpoints you trust.

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
import torch.distributed as dist
from torch import nn

from muonkit.atomic import TMP_SUFFIX, check_replaceable, prepare_dir, publish_dir, readable_dir

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write model and optimizer state to the directory ``path`` (collective), replacing it atomically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.abspath(os.fspath(path))
    model_state, optim_state = get_state_dict(model, optimizer)
    check_replaceable(final, owned=_dcp_file, what="save_checkpoint")  # every rank: all raise alike
    _barrier()  # nobody still reads `final` when rank 0 restores or cleans beside it
    tmp = prepare_dir(final) if _rank() == 0 else final + TMP_SUFFIX
    _barrier()
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    # dcp.save returns once the coordinator (rank 0) wrote .metadata after every rank's data.
    if _rank() == 0:
        publish_dir(tmp, final)
    _barrier()


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

    path = readable_dir(os.path.abspath(os.fspath(path)))
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


def _dcp_file(name: str) -> bool:
    """Files DCP's FileSystemWriter writes (a directory holding others is not replaced)."""
    return name.endswith((".distcp", ".metadata", ".metadata.tmp"))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
