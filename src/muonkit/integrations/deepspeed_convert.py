"""Rewrite a DeepSpeed ZeRO checkpoint of a muonkit run for another data-parallel world size.

``muonkit convert-deepspeed CKPT_DIR --world-size N --output NEW_DIR [--tag TAG]``
(or ``python -m muonkit.integrations.deepspeed_convert ...``).

Every rank's checkpoint file holds its flat partition of the fp32 master weights and of each
optimizer state (Muon ``momentum_buffer``; AdamW ``exp_avg``, ``exp_avg_sq``). All of these are
elementwise, so re-partitioning is exact: concatenate the W partitions back into the flat group
(or, at ZeRO-3, into each parameter), cut it again the way DeepSpeed cuts it for N ranks, and
write N files. Scalars (AdamW ``step``, lr, loss scaler, scheduler) are copied. The model-state
files are copied with ``dp_world_size`` set to N.

Supported: ZeRO-1/2 (``DeepSpeedZeroOptimizer``, also with bf16), DeepSpeed's BF16 optimizer
(ZeRO-1 with fp32 gradient accumulation) and ZeRO-3, without ``round_robin_gradients`` (its
parameter order depends on the world size). Example::

    muonkit convert-deepspeed ckpt --world-size 1 --output ckpt_w1
    engine.load_checkpoint("ckpt_w1")   # in a 1-rank run
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from muonkit.integrations.deepspeed_checkpoint import latest_tag

__all__ = ["convert", "main"]

_OPTIM = re.compile(r"^(?P<prefix>.*)zero_pp_rank_(?P<rank>\d+)_mp_rank_00_optim_states\.pt$")


def convert(
    src: str | os.PathLike[str], *, world_size: int, output: str | os.PathLike[str], tag: str | None = None
) -> str:
    """Write ``output/TAG`` (and ``output/latest``) for ``world_size`` ranks; returns the tag."""
    src, output = os.fspath(src), os.fspath(output)
    if world_size < 1:
        raise ValueError(f"Invalid world_size={world_size}: must be >= 1")
    tag = tag or latest_tag(src)
    if tag is None:
        raise ValueError(f"No tag given and no 'latest' file in {src}")
    files, prefix = _optim_files(os.path.join(src, tag))
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    osd = [s["optimizer_state_dict"] for s in states]
    model_files = sorted(glob.glob(os.path.join(src, tag, "*model_states.pt")))
    model0 = torch.load(model_files[0], map_location="cpu", weights_only=False)
    ds_config = model0.get("ds_config") or {}
    if (ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        raise ValueError("round_robin_gradients orders parameters by world size: its checkpoints cannot be converted")
    shapes = [list(group.values()) for group in model0["param_shapes"]]
    if "fp32_flat_groups" in osd[0]:
        new = _zero3(osd, shapes, world_size)
    else:
        new = _contiguous(osd, shapes, model0, world_size, bf16_optimizer="zero_stage" not in osd[0])
    out_dir = os.path.join(output, tag)
    os.makedirs(out_dir, exist_ok=True)
    for rank, sd in enumerate(new):
        torch.save(
            {**states[0], "optimizer_state_dict": sd},
            os.path.join(out_dir, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
        )
    _write_model_states(model_files, out_dir, world_size)
    with open(os.path.join(output, "latest"), "w") as f:
        f.write(tag)
    return tag


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


def _write_model_states(model_files: list[str], out_dir: str, world_size: int) -> None:
    zero3 = any(os.path.basename(f).startswith("zero_pp_rank_") for f in model_files)
    model = torch.load(model_files[0], map_location="cpu", weights_only=False)
    model["dp_world_size"] = world_size
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
        merged_state = {
            k: _merge([sd["base_optimizer_state"]["state"][pid][k] for sd in osd], old_size, length)
            for k, v in base["state"].get(pid, {}).items()
            if torch.is_tensor(v) and v.ndim > 0
        }
        for rank, sd in enumerate(new):
            padding = size if length <= rank * size else max(0, (rank + 1) * size - length)
            keep = size if bf16_optimizer else size - padding
            sd["single_partition_of_fp32_groups"].append(parts[rank][:keep].clone())
            sd["group_paddings"].append(padding if not bf16_optimizer or rank == world - 1 else 0)
            state = {k: _split(t, size, world)[rank].clone() for k, t in merged_state.items()}
            state |= {k: v for k, v in base["state"].get(pid, {}).items() if not (torch.is_tensor(v) and v.ndim > 0)}
            sd["base_optimizer_state"]["state"][pid] = state
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
        for k, v in base["state"].get(pid, {}).items():
            if torch.is_tensor(v) and v.ndim > 0:
                tensors[k] = [sd["optimizer_state_dict"]["state"][pid][k] for sd in osd]
        redone = {k: _repartition_params(parts, numels, old, world) for k, parts in tensors.items()}
        for rank, sd in enumerate(new):
            sd["fp32_flat_groups"].append(redone["fp32"][rank])
            state = {k: v[rank] for k, v in redone.items() if k != "fp32"}
            state |= {k: v for k, v in base["state"].get(pid, {}).items() if not (torch.is_tensor(v) and v.ndim > 0)}
            sd["optimizer_state_dict"]["state"][pid] = state
    return new


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


def run(args: argparse.Namespace) -> int:
    if os.path.abspath(args.output) == os.path.abspath(args.checkpoint):
        raise SystemExit("--output must differ from the checkpoint directory")
    tag = convert(args.checkpoint, world_size=args.world_size, output=args.output, tag=args.tag)
    print(f"wrote {os.path.join(args.output, tag)} for {args.world_size} data-parallel ranks")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from muonkit.cli import main as cli_main

    return cli_main(["convert-deepspeed", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
