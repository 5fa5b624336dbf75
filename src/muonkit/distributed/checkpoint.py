"""Portable checkpoints of a model and its HybridMuon with ``torch.distributed.checkpoint`` (DCP).

Both helpers follow the DCP recipe: ``get_state_dict`` names every tensor by its parameter's
fully qualified name (without DDP's ``module.`` prefix), DCP writes each rank's pieces once
(replicated DDP tensors are deduplicated, FSDP2 DTensors saved as shards), and on load DCP reads
whatever slice each rank now holds. So a checkpoint saved by DDP or FSDP2 at one world size
loads at another, with either placement, or on one device: optimizer states are keyed by parameter
name and are whole tensors (or DTensors) shaped like their parameters. Unlike the bare recipe,
``load_checkpoint`` reads the optimizer state entries the checkpoint holds, not those the
optimizer happens to have (a fresh optimizer whose params hold gradients has none, and the bare
recipe then loads no state at all, without an error), and neither helper gives a fresh
optimizer DCP's zero-lr step (which would save states the run never had).

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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from muonkit._compat import CHECKPOINT_FEATURE, CHECKPOINT_TORCH, requires_torch
from muonkit.atomic import TMP_SUFFIX, check_replaceable, prepare_dir, publish_dir, readable_dir
from muonkit.distributed import checkpoint_files
from muonkit.functional.quantize import BLOCK, CODE_DTYPE, SCALE_SUFFIX, block_shape, quantize_into

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write model and optimizer state to the directory ``path`` (collective), replacing it atomically."""
    requires_torch(CHECKPOINT_FEATURE, CHECKPOINT_TORCH)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.abspath(os.fspath(path))
    with _names_only(optimizer):  # an optimizer that never stepped is saved without states
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

    Every optimizer state entry the checkpoint holds is loaded, whether the optimizer is fresh or
    has stepped already, whatever the params' gradients are (None, zero or set: they are neither
    read nor changed). States the checkpoint does not have (params that had no gradient before
    the save) are absent afterwards, as in the saving run, also where this optimizer had them.
    A checkpoint that does not fit raises ``ValueError`` naming what is wrong (state for params
    this optimizer does not have, other param groups, or whatever the optimizer's
    ``load_state_dict`` refuses: for HybridMuon a missing, non-finite or wrongly shaped entry) and
    leaves the model and the optimizer as they were.

    The checkpoint is read into new tensors laid out like this run's params (each rank reads its
    own slices), so a load holds about one more copy of the rank's weights and states for a
    moment; the optimizer takes its state first (checking it), then the model its weights.

    Refuses, with :class:`~muonkit.safe_load.UntrustedCheckpointError` and nothing changed, any
    checkpoint file only a full unpickler could read (see the module docstring); ``trusted=True``
    unpickles them, for checkpoints you trust (plain ``dcp.save`` ones, or muonkit's before
    ``muonkit-values.json``).
    """
    requires_torch(CHECKPOINT_FEATURE, CHECKPOINT_TORCH)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    path = readable_dir(os.path.abspath(os.fspath(path)))
    files = checkpoint_files.open_checkpoint(path, trusted=trusted)  # checks the files before anything changes
    state, names, recode = _state_to_load(model, optimizer, files.entries, where=path)
    files.load(state)
    params = dict(zip((n for group in names for n in group), _params(optimizer), strict=True))
    _recode(params, state["optimizer"]["state"], recode, where=path)
    _load_optimizer(optimizer, state["optimizer"], names, where=path)
    set_model_state_dict(model, state["model"])


_STATE, _GROUPS = "optimizer.state.", "optimizer.param_groups."


def _state_to_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], *, where: str
) -> tuple[dict[str, Any], list[list[str]], list[tuple[str, str]]]:
    """What to read (new tensors for every model entry, for exactly the optimizer state entries the
    checkpoint holds and for the group keys it holds), the names of each group's params, and the
    8-bit states read whole, to be coded again in this layout's blocks (:func:`_recode`).

    Built from the checkpoint's metadata, not from the optimizer's states: a fresh optimizer has
    none (DCP's ``get_state_dict`` creates them with a zero-lr step, but only when no param has a
    gradient), and one that has stepped may have other ones.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _names_only(optimizer):
        model_state, optim_tree = get_state_dict(model, optimizer)
    groups = cast(dict[str, Any], optim_tree)["param_groups"]
    names = [list(group["params"]) for group in groups]
    count = len({name[len(_GROUPS) :].split(".", 1)[0] for name in saved if name.startswith(_GROUPS)})
    if count != len(groups):
        raise ValueError(f"The checkpoint at {where} holds {count} param groups, this optimizer has {len(groups)}")
    entries: dict[str, dict[str, Any]] = {}
    for name, meta in saved.items():
        if name.startswith(_STATE):  # optimizer.state.FQN.KEY (state keys hold no dots)
            fqn, key = name[len(_STATE) :].rsplit(".", 1)
            entries.setdefault(fqn, {})[key] = meta
    params = dict(zip((n for group in names for n in group), _params(optimizer), strict=True))
    unknown = sorted(set(entries) - set(params))
    if unknown:
        raise ValueError(
            f"The checkpoint at {where} holds optimizer state for {len(unknown)} params this optimizer does not "
            f"have: {_some(unknown)} (its params: {_some(list(params))})"
        )
    state = {fqn: {key: _new_like(params[fqn], meta) for key, meta in keys.items()} for fqn, keys in entries.items()}
    recode = [(fqn, key) for fqn, keys in entries.items() for key in _lay_out_scales(params[fqn], keys, state[fqn])]
    kept = [  # a key the checkpoint lacks (saved before it existed) keeps its current value
        {key: _new(value) for key, value in group.items() if f"{_GROUPS}{i}.{key}" in saved}
        for i, group in enumerate(groups)
    ]
    new_model = {key: _new(value) for key, value in model_state.items()}
    return {"model": new_model, "optimizer": {"state": state, "param_groups": kept}}, names, recode


@contextmanager
def _names_only(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Keep DCP's ``get_state_dict`` from stepping a fresh optimizer: we need only the names.

    ``get_state_dict`` gives an optimizer without state one zero-gradient, zero-lr step when no
    param has a gradient. In a save that writes states the run never had (AdamW ``step=1``) into
    the checkpoint and into the running optimizer; in a load it is wasted work, left behind if
    the checkpoint is refused. It leaves an optimizer with any state entry alone, so an empty
    entry stands in for the duration of the call.
    """
    params = _params(optimizer)
    if optimizer.state or not params:
        yield
        return
    optimizer.state[params[0]] = {}
    try:
        yield
    finally:
        del optimizer.state[params[0]]


def _new_like(p: torch.Tensor, meta: Any) -> Any:
    """A new tensor to read a saved state entry into: laid out like ``p`` where it has ``p``'s shape
    (a DTensor: each rank reads its own slice), else whole as saved (a step count, an update rule's
    rows state, or a wrong shape that the optimizer's ``load_state_dict`` then names)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    if not isinstance(meta, TensorStorageMetadata):
        return None  # a non-tensor value: DCP puts the saved one here
    if isinstance(p, DTensor) and tuple(meta.size) == tuple(p.shape):
        return torch.empty_like(p, dtype=meta.properties.dtype)
    return torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device)


def _lay_out_scales(p: torch.Tensor, saved: Mapping[str, Any], into: dict[str, Any]) -> list[str]:
    """Where to read the block scales ``K_scale`` of each 8-bit state ``K`` shaped like ``p``.

    As this run's strategy lays them out (``block_state``: ``p``'s placements on the leading dims,
    each rank reading the scales of its own rows) where the checkpoint's blocks are this layout's.
    Where they are not (the last dim was cut another number of ways, or cut where here it is
    whole, or the reverse: FSDP2 on dim 1, tensor parallelism row-wise, any FSDP2 of a 1-D param),
    the codes and scales are read whole on every rank (a transient copy of the whole state at one
    byte per value) and :func:`_recode` codes them again in this layout's blocks after the read:
    returns those keys."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    whole = []
    for key, meta in saved.items():
        codes = saved.get(key[: -len(SCALE_SUFFIX)]) if key.endswith(SCALE_SUFFIX) else None
        if not (isinstance(meta, TensorStorageMetadata) and isinstance(codes, TensorStorageMetadata)):
            continue
        if tuple(codes.size) != tuple(p.shape) or codes.properties.dtype != CODE_DTYPE:
            continue
        laid = _block_scales(p, meta.properties.dtype)
        if tuple(meta.size) == tuple(laid.shape):
            into[key] = laid
        else:  # read whole, coded again after the read
            into[key] = torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device)
            into[key[: -len(SCALE_SUFFIX)]] = torch.empty(codes.size, dtype=CODE_DTYPE, device=p.device)
            whole.append(key[: -len(SCALE_SUFFIX)])
    return whole


def _block_scales(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from muonkit.distributed.dtensor_placement import block_state

        return cast(torch.Tensor, block_state(p, dtype, BLOCK))
    return torch.zeros(block_shape(tuple(p.shape), BLOCK), dtype=dtype, device=p.device)


def _recode(
    params: Mapping[str, torch.Tensor], state: dict[str, dict[str, Any]], keys: list[tuple[str, str]], *, where: str
) -> None:
    """Code the states read whole (:func:`_lay_out_scales`) again in this layout's blocks: each rank
    decodes the whole tensor with the blocks that saved it and codes its own part. Not bit for bit
    (other blocks, other rounding), as close as one more round of the code. ``ValueError`` naming
    the entry where the saved codes do not fit their scales (nothing is loaded)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from muonkit.state_checks import NONNEGATIVE
    from muonkit.state_precision import decode_saved, local_scales

    for fqn, key in keys:
        p, own = params[fqn], state[fqn]
        codes, scales = own[key], own[key + SCALE_SUFFIX]
        try:
            values = decode_saved(codes, scales, unsigned=key in NONNEGATIVE)
        except ValueError as e:
            raise ValueError(
                f"Cannot load the 8-bit optimizer state {fqn}.{key} of the checkpoint at {where}: {e}"
            ) from None
        new_codes = torch.zeros_like(p, dtype=CODE_DTYPE) if isinstance(p, DTensor) else torch.zeros_like(codes)
        new_scales = _block_scales(p, torch.float32)
        local_codes = new_codes.to_local() if isinstance(new_codes, DTensor) else new_codes
        if isinstance(p, DTensor):
            values = distribute_tensor(values, p.device_mesh, p.placements, src_data_rank=None).to_local()
        if local_codes.numel():
            held = new_scales.to_local() if isinstance(new_scales, DTensor) else new_scales
            quantize_into(
                local_codes,
                local_scales(local_codes, held),
                values.reshape(local_codes.shape),
                signed=key not in NONNEGATIVE,
            )
        own[key], own[key + SCALE_SUFFIX] = new_codes, new_scales


def _new(value: Any) -> Any:
    """A new tensor like ``value`` (a DTensor stays one), so reading never writes into a live tensor."""
    return torch.empty_like(value) if isinstance(value, torch.Tensor) else value


def _load_optimizer(
    optimizer: torch.optim.Optimizer, loaded: dict[str, Any], names: list[list[str]], *, where: str
) -> None:
    """Give ``optimizer.load_state_dict`` what was read, each group's params named in this optimizer's
    order, and check that every entry landed; all ranks or none (collective).

    ``load_state_dict`` checks the part of a sharded state each rank holds, so a corrupted value in
    one shard is seen by one rank only: a rank that took its state while another refused goes back
    to what it held before, and every rank raises.
    """
    for i, (group, mine) in enumerate(zip(loaded["param_groups"], names, strict=True)):
        theirs = list(group.get("params", []))
        if set(theirs) != set(mine) or len(theirs) != len(mine):
            raise ValueError(
                f"Param group {i} of the checkpoint at {where} holds other params than this optimizer's: only "
                f"there {_some(sorted(set(theirs) - set(mine)))}, only here {_some(sorted(set(mine) - set(theirs)))}"
            )
        group["params"] = mine  # states are keyed by name: the saved order does not matter
    backup, changed, error = optimizer.state_dict(), False, None
    try:
        optimizer.load_state_dict(loaded)
        changed = True
        held = dict(zip((n for group in names for n in group), _params(optimizer), strict=True))
        lost = [
            f"{n}.{k}" for n, keys in loaded["state"].items() for k in keys if k not in _state_of(optimizer, held[n])
        ]
        if lost:
            raise ValueError(
                f"{type(optimizer).__name__}.load_state_dict dropped {len(lost)} state entries of the checkpoint "
                f"at {where}: {_some(lost)}"
            )
    except Exception as e:  # every rank must learn of it before anyone raises
        error = e
    refused = _refusals(error)
    if refused:
        if changed:
            optimizer.load_state_dict(backup)
        if error is not None:
            raise error
        raise ValueError(f"The checkpoint at {where} was refused, nothing loaded: {'; '.join(refused)}")


def _refusals(error: Exception | None) -> list[str]:
    """Every rank's error, as ``"rank R: message"`` (collective when torch.distributed is initialized)."""
    mine = None if error is None else f"rank {_rank()}: {type(error).__name__}: {error}"
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine] if mine is not None else []
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [m for m in gathered if m is not None]


def _state_of(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> Mapping[str, Any]:
    return optimizer.state.get(p, {})  # not optimizer.state[p]: that adds an entry


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _some(names: list[str]) -> str:
    return f"{names[:5]}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
