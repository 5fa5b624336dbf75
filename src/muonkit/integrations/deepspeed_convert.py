"""Rewrite a DeepSpeed ZeRO checkpoint of a muonkit run for another data-parallel world size.

``muonkit convert-deepspeed CKPT_DIR --world-size N --output NEW_DIR [--tag TAG]``
(or ``python -m muonkit.integrations.deepspeed_convert ...``).

Every rank's checkpoint file holds its flat partition of the fp32 master weights and of each
optimizer state (Muon ``momentum_buffer``; AdamW ``exp_avg``, ``exp_avg_sq``). All of these are
elementwise, so re-partitioning is exact: concatenate the W partitions back into the flat group
(or, at ZeRO-3, into each parameter), cut it again the way DeepSpeed cuts it for N ranks, and
write N files. Scalars (AdamW ``step``, lr, loss scaler, scheduler) and an update rule's ``"rows"`` states
(whole on every rank, one value per matrix row of the group) are copied. The model-state
files are copied with ``dp_world_size`` set to N.

A Hugging Face Trainer ``checkpoint-N`` directory converts the same way into one the Trainer
resumes from (``trainer.train(resume_from_checkpoint=OUTPUT)``): every other file at the top of
the checkpoint (``trainer_state.json``, ``scheduler.pt``, ``training_args.bin``, the model's
weights and config, a tokenizer's files) is copied, and the RNG states are mapped to the new
ranks (``rng_state_R.pth`` of rank R; ``rng_state.pth`` at one rank): a rank beyond the saved
ones gets none, and the Trainer warns that its RNG is not restored and trains on. Only the
``global_step*`` tag converted is written (older tags are left out)::

    muonkit convert-deepspeed out/checkpoint-500 --world-size 1 --output out_w1/checkpoint-500
    trainer.train(resume_from_checkpoint="out_w1/checkpoint-500")   # in a 1-rank run

Under the Trainer, HybridMuon comes in through
:func:`muonkit.integrations.deepspeed.trainer_setup`; without it a user meets two errors:
``make_optimizer`` / ``MuonTrainer`` refuse ``TrainingArguments(deepspeed=...)`` ("TrainingArguments
has deepspeed set: the Trainer then builds the optimizer itself and would discard this one"), and
resuming a checkpoint at another world size without this conversion fails in DeepSpeed ("The
checkpoint being loaded used a DP world size of W but the current world size is N. Automatic
adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported.").

Supported: ZeRO-1/2 (``DeepSpeedZeroOptimizer``, also with bf16), DeepSpeed's BF16 optimizer
(ZeRO-1 with fp32 gradient accumulation) and ZeRO-3, without ``round_robin_gradients`` (its
parameter order depends on the world size). Example::

    muonkit convert-deepspeed ckpt --world-size 1 --output ckpt_w1
    engine.load_checkpoint("ckpt_w1")   # in a 1-rank run

Safety: the tag (``--tag`` or the checkpoint's ``latest`` file) must name a directory inside the
checkpoint directory, and nothing is written outside ``--output`` (which must not overlap the
checkpoint). The files are read with ``torch.load(weights_only=True)``, allowing besides tensors
and plain containers only the DeepSpeed classes its checkpoints hold (:data:`SAFE_CLASSES`); a
file holding anything else is refused, not unpickled, unless ``trusted=True`` (``--trusted``),
which unpickles it with ``pickle`` as DeepSpeed does. (DeepSpeed's own ``engine.load_checkpoint``
reads with ``weights_only=False``; muonkit's guard of it scans the files first:
:mod:`muonkit.integrations.deepspeed_checkpoint`.)
``output/TAG`` is written aside and renamed into place, so a crash never leaves a half-written
conversion over a previous one.
"""

from __future__ import annotations

import argparse
import functools
import glob
import math
import os
import pickle
import re
import shutil
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

import torch
from torch import Tensor

from muonkit.atomic import check_replaceable, prepare_dir, publish_dir, replace_file
from muonkit.functional.quantize import CODE_DTYPE, SCALE_SUFFIX, quantize_blockwise
from muonkit.functional.rules import WHOLE_STATES
from muonkit.integrations.deepspeed_checkpoint import SAFE_CLASSES, latest_tag
from muonkit.state_checks import NONNEGATIVE
from muonkit.state_precision import decode_saved

__all__ = ["SAFE_CLASSES", "convert", "copy_trainer_files", "main"]

_OPTIM = re.compile(r"^(?P<prefix>.*)zero_pp_rank_(?P<rank>\d+)_mp_rank_00_optim_states\.pt$")


def convert(
    src: str | os.PathLike[str],
    *,
    world_size: int,
    output: str | os.PathLike[str],
    tag: str | None = None,
    trusted: bool = False,
) -> str:
    """Write ``output/TAG`` (and ``output/latest``) for ``world_size`` ranks; returns the tag.

    ``trusted=True`` unpickles files holding other objects than :data:`SAFE_CLASSES` (see above)."""
    src, output = os.fspath(src), os.fspath(output)
    if world_size < 1:
        raise ValueError(f"Invalid world_size={world_size}: must be >= 1")
    if tag is None:
        tag = latest_tag(src)
        if tag is None:
            raise ValueError(f"No tag given and no 'latest' file in {src}")
        _check_tag(src, tag, f"the tag in {os.path.join(src, 'latest')}")
    else:
        _check_tag(src, tag, "--tag")
    out_dir = os.path.join(output, tag)
    if _overlap(out_dir, src):
        raise ValueError(
            f"Invalid output {output!r}: {out_dir} overlaps the checkpoint directory {src}; write to a directory outside it"
        )
    files, prefix = _optim_files(os.path.join(src, tag))
    states = [_load(f, trusted=trusted) for f in files]
    osd = [s["optimizer_state_dict"] for s in states]
    model_files = sorted(glob.glob(os.path.join(src, tag, "*model_states.pt")))
    model0 = _load(model_files[0], trusted=trusted)
    ds_config = model0.get("ds_config") or {}
    if (ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        raise ValueError("round_robin_gradients orders parameters by world size: its checkpoints cannot be converted")
    shapes = [list(group.values()) for group in model0["param_shapes"]]
    if "fp32_flat_groups" in osd[0]:
        new = _zero3(osd, shapes, world_size)
    else:
        new = _contiguous(osd, shapes, model0, world_size, bf16_optimizer="zero_stage" not in osd[0])
    os.makedirs(output, exist_ok=True)
    check_replaceable(out_dir, owned=lambda name: name.endswith(".pt"), what="convert-deepspeed")
    tmp = prepare_dir(out_dir)
    os.makedirs(tmp)
    for rank, sd in enumerate(new):
        torch.save(
            {**states[0], "optimizer_state_dict": sd},
            os.path.join(tmp, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
        )
    _write_model_states(model0, model_files, tmp, world_size)
    publish_dir(tmp, out_dir)
    copy_trainer_files(src, output, world_size=world_size)
    replace_file(os.path.join(output, "latest"), lambda f: f.write(tag.encode()))
    return tag


_RNG = re.compile(r"^rng_state(?:_(?P<rank>\d+))?\.pth$")


def copy_trainer_files(src: str, output: str, *, world_size: int) -> list[str]:
    """Copy the files at the top of ``src`` besides DeepSpeed's (``latest``, the tag directories)
    into ``output``: what a Hugging Face Trainer ``checkpoint-N`` needs to resume (its state,
    scheduler, arguments, weights, config); returns their names.

    RNG states are per rank: ``rng_state_R.pth`` (or ``rng_state.pth``, saved by one rank) goes
    to rank R of the new world size, named as the Trainer reads it there (``rng_state.pth`` at one
    rank); ranks beyond the saved ones get none (the Trainer warns and trains on).
    """
    rng: dict[int, str] = {}
    copies: dict[str, str] = {}
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name == "latest" or not os.path.isfile(path) or os.path.islink(path):
            continue
        match = _RNG.match(name)
        if match is None:
            copies[name] = path
        else:
            rng.setdefault(int(match.group("rank") or 0), path)
    for rank in range(world_size):
        if rank in rng:
            copies["rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"] = rng[rank]
    for name, path in copies.items():
        replace_file(os.path.join(output, name), functools.partial(_copy_into, path))
    return sorted(copies)


def _copy_into(path: str, f: BinaryIO) -> None:
    with open(path, "rb") as source:
        shutil.copyfileobj(source, f)


def _check_tag(src: str, tag: str, origin: str) -> None:
    """A tag names one directory inside the checkpoint directory: never a path out of it."""
    parts = tag.replace("\\", "/").split("/")
    if os.path.isabs(tag) or len(parts) != 1 or tag in ("", ".", ".."):
        raise ValueError(
            f"Invalid tag {tag!r} ({origin}): must be the name of a directory inside {src}, without '/', '..' "
            "or an absolute path"
        )
    if os.path.dirname(os.path.realpath(os.path.join(src, tag))) != os.path.realpath(src):
        raise ValueError(
            f"Invalid tag {tag!r} ({origin}): {os.path.join(src, tag)} resolves to "
            f"{os.path.realpath(os.path.join(src, tag))}, outside {src}"
        )


def _overlap(a: str, b: str) -> bool:
    """Whether two paths (after resolving links) are the same or one lies inside the other."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep)


def _load(path: str, *, trusted: bool) -> Any:
    """``torch.load(weights_only=True)`` allowing :data:`SAFE_CLASSES`, whose unpickling only sets
    numbers (loss scale, ZeRO stage, fragment offsets); anything else is refused unexecuted, unless
    ``trusted``."""
    import importlib

    if trusted:
        return torch.load(path, map_location="cpu", weights_only=False)
    allowed = [getattr(importlib.import_module(m), n) for m, _, n in (c.rpartition(".") for c in SAFE_CLASSES)]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            found = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in SAFE_CLASSES]
        except Exception:
            found = []
        raise ValueError(
            f"{path} holds objects convert-deepspeed does not unpickle{f' ({found})' if found else ''}: it loads "
            f"with torch.load(weights_only=True), allowing tensors, plain containers and {list(SAFE_CLASSES)} "
            f"({str(e).splitlines()[-1] if str(e) else type(e).__name__}). Unpickling can run any code; if you "
            "trust this checkpoint (you or your own code wrote it), pass trusted=True (--trusted) to unpickle it."
        ) from None


def _optim_files(folder: str) -> tuple[list[str], str]:
    found = {}
    prefixes = set()
    for path in glob.glob(os.path.join(folder, "*_optim_states.pt")):
        match = _OPTIM.match(os.path.basename(path))
        if match:
            found[int(match["rank"])] = path
            prefixes.add(match["prefix"])
    if not found or sorted(found) != list(range(len(found))) or len(prefixes) != 1:
        raise ValueError(f"{folder} does not hold one ZeRO optimizer-state file per rank 0..W-1")
    return [found[r] for r in range(len(found))], prefixes.pop()


def _write_model_states(model: dict[str, Any], model_files: list[str], out_dir: str, world_size: int) -> None:
    zero3 = any(os.path.basename(f).startswith("zero_pp_rank_") for f in model_files)
    model = {**model, "dp_world_size": world_size}
    if not zero3:
        torch.save(model, os.path.join(out_dir, os.path.basename(model_files[0])))
        return
    # ZeRO-3 model files hold only empty placeholders (the weights are in the optimizer files).
    for rank in range(world_size):
        torch.save(model, os.path.join(out_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))


def _split(full: Tensor, size: int, world_size: int) -> list[Tensor]:
    """``full`` zero-padded to ``size * world_size`` and cut into ``world_size`` pieces of ``size``."""
    padded = full.new_zeros(size * world_size)
    padded[: full.numel()] = full
    return list(padded.split(size))


def _contiguous(
    osd: list[dict[str, Any]], shapes: list[list[Any]], model: dict[str, Any], world: int, *, bf16_optimizer: bool
) -> list[dict[str, Any]]:
    """ZeRO-1/2 and BF16 optimizer: one flat buffer per group, cut into equal partitions."""
    align_pad = osd[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
    new = [dict(osd[0]) for _ in range(world)]
    base = osd[0]["base_optimizer_state"]
    for sd in new:
        sd["base_optimizer_state"] = {"state": {}, "param_groups": base["param_groups"]}
        sd["single_partition_of_fp32_groups"], sd["group_paddings"], sd["param_slice_mappings"] = [], [], []
        sd["partition_count"] = [world] * len(shapes)
    names = [list(g) for g in model["param_shapes"]]
    for gi, group_shapes in enumerate(shapes):
        numels = [math.prod(s) for s in group_shapes]
        offsets = [sum(n + p for n, p in zip(numels[:j], align_pad[gi][:j], strict=True)) for j in range(len(numels))]
        length = offsets[-1] + numels[-1]
        old_size = _partition_size(length, len(osd))
        merged = _merge([sd["single_partition_of_fp32_groups"][gi] for sd in osd], old_size, length)
        size = _partition_size(length, world)
        parts = _split(merged, size, world)
        pid = base["param_groups"][gi]["params"][0]
        saved = [sd["base_optimizer_state"]["state"].get(pid, {}) for sd in osd]
        coded, states = _decoded(saved, same=world == len(osd))
        _check_states(states, [sd["single_partition_of_fp32_groups"][gi] for sd in osd], f"param group {gi}")
        merged_state = {
            k: _merge([state[k] for state in states], old_size, length)
            for k, v in states[0].items()
            if _partitioned(k, v)
        }
        for rank, sd in enumerate(new):
            padding = size if length <= rank * size else max(0, (rank + 1) * size - length)
            keep = size if bf16_optimizer else size - padding
            sd["single_partition_of_fp32_groups"].append(parts[rank][:keep].clone())
            sd["group_paddings"].append(padding if not bf16_optimizer or rank == world - 1 else 0)
            state = {k: _split(t, size, world)[rank].clone() for k, t in merged_state.items()}
            state |= {k: v for k, v in states[0].items() if not _partitioned(k, v)}
            sd["base_optimizer_state"]["state"][pid] = _coded(state, coded, saved[rank] if world == len(osd) else None)
            sd["param_slice_mappings"].append(_slices(names[gi], numels, offsets, rank * size, size))
    return new


def _partition_size(length: int, world: int) -> int:
    """DeepSpeed pads a flat group to a multiple of 2*W elements (4-byte alignment) and cuts it in W."""
    return math.ceil(length / (2 * world)) * 2


def _merge(parts: Sequence[Tensor], size: int, length: int) -> Tensor:
    """The flat group from per-rank partitions (each zero-padded to ``size``), first ``length`` elements."""
    return torch.cat([torch.cat([p.reshape(-1), p.new_zeros(size - p.numel())]) for p in parts])[:length]


def _slices(names: list[str], numels: list[int], offsets: list[int], start: int, size: int) -> dict[str, Any]:
    from collections import OrderedDict

    from deepspeed.utils.tensor_fragment import fragment_address

    out: OrderedDict[str, Any] = OrderedDict()
    for name, numel, offset in zip(names, numels, offsets, strict=True):
        lo, hi = max(offset, start), min(offset + numel, start + size)
        if lo < hi:
            out[name] = fragment_address(numel=hi - lo, start=lo - start)
    return out


def _zero3(osd: list[dict[str, Any]], shapes: list[list[Any]], world: int) -> list[dict[str, Any]]:
    """ZeRO-3: each param cut into ``ceil(numel/W)`` pieces; a rank's sub-group is its pieces in order."""
    old = len(osd)
    new = [dict(osd[0]) for _ in range(world)]
    base = osd[0]["optimizer_state_dict"]
    pids = [pid for g in base["param_groups"] for pid in g["params"]]
    if len(pids) != len(shapes):
        raise ValueError(f"{len(pids)} ZeRO-3 sub-group states but {len(shapes)} parameter groups in param_shapes")
    for sd in new:
        sd["partition_count"] = world
        sd["fp32_flat_groups"] = []
        sd["optimizer_state_dict"] = {"state": {}, "param_groups": base["param_groups"]}
    for si, (pid, group_shapes) in enumerate(zip(pids, shapes, strict=True)):
        numels = [math.prod(s) for s in group_shapes]
        tensors = {"fp32": [sd["fp32_flat_groups"][si] for sd in osd]}
        saved = [sd["optimizer_state_dict"]["state"].get(pid, {}) for sd in osd]
        coded, states = _decoded(saved, same=world == old)
        _check_states(states, tensors["fp32"], f"sub-group {si}")
        for k, v in states[0].items():
            if _partitioned(k, v):
                tensors[k] = [state[k] for state in states]
        redone = {k: _repartition_params(parts, numels, old, world) for k, parts in tensors.items()}
        for rank, sd in enumerate(new):
            sd["fp32_flat_groups"].append(redone["fp32"][rank])
            state = {k: v[rank] for k, v in redone.items() if k != "fp32"}
            state |= {k: v for k, v in states[0].items() if not _partitioned(k, v)}
            sd["optimizer_state_dict"]["state"][pid] = _coded(state, coded, saved[rank] if world == old else None)
    return new


def _decoded(saved: list[dict[str, Any]], *, same: bool) -> tuple[list[str], list[dict[str, Any]]]:
    """The 8-bit state keys of a partition (``state_dtype="8bit"``) and every rank's state with them
    decoded to fp32, scales dropped: an 8-bit state's blocks of 256 run along each rank's flat
    partition, so they cannot be cut and joined as bytes. ``same`` (the same world size: the same
    partitions): the codes stand in as their uint8 bytes (no scale is read), to be put back as saved.
    bf16 states need nothing: their values do not depend on the partition."""
    coded = sorted(k for k, v in saved[0].items() if torch.is_tensor(v) and v.dtype == CODE_DTYPE) if saved else []
    if not coded:
        return coded, saved
    out = []
    for rank, state in enumerate(saved):
        missing = [k + SCALE_SUFFIX for k in coded if not torch.is_tensor(state.get(k + SCALE_SUFFIX))]
        if missing:
            raise ValueError(f"Rank {rank}'s file lacks the block scales {missing} of its 8-bit states: corrupted")
        plain = {k: v for k, v in state.items() if not (k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] in coded)}
        for k in coded:
            if same:
                plain[k] = state[k].view(torch.uint8)
                continue
            try:
                plain[k] = decode_saved(state[k], state[k + SCALE_SUFFIX], unsigned=k in NONNEGATIVE)
            except ValueError as e:
                raise ValueError(f"The 8-bit state {k} in rank {rank}'s file: {e}") from None
        out.append(plain)
    return coded, out


def _coded(state: dict[str, Any], coded: list[str], saved: dict[str, Any] | None) -> dict[str, Any]:
    """``state`` (a new rank's, 8-bit states decoded by :func:`_decoded`) with them coded again in the
    new partition's blocks, or (``saved``: the same partition) as they were saved, bytes and scales."""
    for k in coded:
        if saved is not None:
            state[k], state[k + SCALE_SUFFIX] = saved[k], saved[k + SCALE_SUFFIX]
        else:
            state[k], state[k + SCALE_SUFFIX] = quantize_blockwise(state[k], signed=k not in NONNEGATIVE)
    return state


def _check_states(states: list[dict[str, Any]], partitions: list[Tensor], what: str) -> None:
    """Every rank's file holds the same state entries for ``what``, each partitioned entry laid out
    like that rank's fp32 partition: else the checkpoint is incomplete or corrupted, and a converted
    one would silently lose an entry (or fail later without saying why)."""
    first = sorted(states[0])
    for rank, (state, partition) in enumerate(zip(states, partitions, strict=True)):
        if sorted(state) != first:
            raise ValueError(
                f"The optimizer state of {what} differs between rank files: rank {rank} holds {sorted(state)}, "
                f"rank 0 {first}; the checkpoint is incomplete or corrupted"
            )
        for key, value in state.items():
            if _partitioned(key, value) and value.numel() != partition.numel():
                raise ValueError(
                    f"The {key} of {what} in rank {rank}'s file has {value.numel()} elements, its fp32 partition "
                    f"{partition.numel()}; the checkpoint is corrupted"
                )


def _partitioned(key: str, value: Any) -> bool:
    """Whether a state entry is laid out like the flat partition (else it is copied as it is)."""
    return torch.is_tensor(value) and value.ndim > 0 and key not in WHOLE_STATES


def _repartition_params(parts: list[Tensor], numels: list[int], old: int, world: int) -> list[Tensor]:
    old_sizes = [math.ceil(n / old) for n in numels]
    new_sizes = [math.ceil(n / world) for n in numels]
    per_rank_old = [list(p.split(old_sizes)) for p in parts]
    out: list[list[Tensor]] = [[] for _ in range(world)]
    for j, numel in enumerate(numels):
        whole = torch.cat([per_rank_old[r][j] for r in range(old)])[:numel]
        for rank, piece in enumerate(_split(whole, new_sizes[j], world)):
            out[rank].append(piece)
    return [torch.cat(pieces).clone() for pieces in out]


HELP = "rewrite a DeepSpeed ZeRO checkpoint of a muonkit run for another world size"
DESCRIPTION = (
    "Rewrite a DeepSpeed ZeRO checkpoint of a muonkit run for another data-parallel world size. "
    "Files are read with torch.load(weights_only=True): tensors, plain containers and the few "
    "DeepSpeed classes its checkpoints hold (loss scaler, ZeRO stage, fragment addresses); a "
    "file holding any other object is refused, never unpickled (--trusted unpickles it, for "
    "checkpoints you trust). OUTPUT/TAG is written aside and renamed into place; nothing is written "
    "outside OUTPUT. Note: DeepSpeed's own engine.load_checkpoint unpickles with weights_only=False "
    "(muonkit's guard scans the files first, but not under the Hugging Face Trainer). "
    "A Hugging Face Trainer checkpoint-N converts into one the Trainer resumes from: the other files "
    "at its top (trainer_state.json, scheduler.pt, weights, config...) are copied and the RNG states "
    "mapped to the new ranks; the Trainer takes HybridMuon through "
    "muonkit.integrations.deepspeed.trainer_setup (without it, make_optimizer and MuonTrainer refuse "
    "TrainingArguments(deepspeed=...), and a checkpoint resumed at another world size without this "
    "conversion fails in DeepSpeed with 'The checkpoint being loaded used a DP world size of W but the "
    "current world size is N')."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``muonkit convert-deepspeed`` (also ``python -m`` this module)."""
    parser.add_argument("checkpoint", help="the directory given to engine.save_checkpoint")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks that will load it")
    parser.add_argument(
        "--output", required=True, help="directory to write the converted checkpoint to (outside CHECKPOINT)"
    )
    parser.add_argument(
        "--tag", default=None,
        help="checkpoint tag, a directory name inside CHECKPOINT (default: the one in CHECKPOINT/latest)",
    )  # fmt: skip
    parser.add_argument(
        "--trusted", action="store_true",
        help="unpickle files holding objects besides tensors and DeepSpeed's plain classes (only your own checkpoints)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        tag = convert(
            args.checkpoint, world_size=args.world_size, output=args.output, tag=args.tag, trusted=args.trusted
        )
    except ValueError as e:
        raise SystemExit(f"muonkit convert-deepspeed: {e}") from None
    print(f"wrote {os.path.join(args.output, tag)} for {args.world_size} data-parallel ranks")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="muonkit convert-deepspeed", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
