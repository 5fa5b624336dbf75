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
whole, and refuses a directory holding files other than a checkpoint's.

Loading runs no code from the checkpoint: values that are not tensors (a param group's ``lr``,
``betas``...) are saved as JSON in ``muonkit-values.json``, not as the pickles plain DCP puts in
its ``.distcp`` files; ``.metadata`` is unpickled allowing only DCP's metadata classes; DCP reads
every tensor piece with ``torch.load(weights_only=True)``, and each piece's pickle is first
scanned for anything that would refuse. A file only a full unpickler could read raises
:class:`~muonkit.safe_load.UntrustedCheckpointError` naming it (a malformed values file, a
``ValueError``), before anything is loaded. ``trusted=True`` opts out, unpickling with ``pickle``
as plain DCP does: for checkpoints you wrote yourself with ``dcp.save``, or with muonkit's
``save_checkpoint`` before the values file. The file format and every check:
:mod:`muonkit.distributed.checkpoint_files`.

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
from muonkit.distributed import checkpoint_files

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write model and optimizer state to the directory ``path`` (collective), replacing it atomically."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.abspath(os.fspath(path))
    model_state, optim_state = get_state_dict(model, optimizer)
    check_replaceable(final, owned=checkpoint_files.owned_file, what="save_checkpoint")  # every rank: all raise alike
    _barrier()  # nobody still reads `final` when rank 0 restores or cleans beside it
    tmp = prepare_dir(final) if _rank() == 0 else final + TMP_SUFFIX
    _barrier()
    checkpoint_files.save({"model": model_state, "optimizer": optim_state}, tmp, rank=_rank())
    # save returns once the coordinator (rank 0) wrote .metadata after every rank's data, and the values.
    if _rank() == 0:
        publish_dir(tmp, final)
    _barrier()


def load_checkpoint(
    path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer, trusted: bool = False
) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer`` (collective).

    Refuses, with :class:`~muonkit.safe_load.UntrustedCheckpointError` and nothing changed, any
    checkpoint file only a full unpickler could read (see the module docstring); ``trusted=True``
    unpickles them, for checkpoints you trust (plain ``dcp.save`` ones, or muonkit's before
    ``muonkit-values.json``).

    The optimizer may be fresh (no state yet): ``get_state_dict`` then creates its states with one
    zero-gradient, zero-lr step, and the loaded values replace them; states the checkpoint does
    not have (params that had no gradient before the save) are dropped again.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = readable_dir(os.path.abspath(os.fspath(path)))
    files = checkpoint_files.open_checkpoint(path, trusted=trusted)  # checks the files before anything changes
    model_state, optim_tree = get_state_dict(model, optimizer)
    optim_state = cast(dict[str, Any], optim_tree)
    # States the saving run did not have yet (a param that never had a gradient) must stay
    # absent, not zero: an AdamW state with step=1 would change its bias correction.
    saved = files.keys
    kept = {
        name: entry
        for name, full in optim_state["state"].items()
        if (entry := {k: v for k, v in full.items() if f"optimizer.state.{name}.{k}" in saved})
    }
    complete = len(kept) == len(optim_state["state"])
    optim_state["state"] = kept
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    files.load(state)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=complete))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
