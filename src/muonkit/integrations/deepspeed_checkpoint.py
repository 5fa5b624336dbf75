"""DeepSpeed checkpoints of muonkit runs: loading at another world size.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` work unchanged at the same data-parallel
world size (each rank saves and loads its own flat partition of master weights and of muonkit's
states). The partitions depend on the world size, so a checkpoint taken at W ranks does not fit
W' ranks. :func:`guard_load_checkpoint` makes ``engine.load_checkpoint`` say so, naming the
command that rewrites the checkpoint for W' ranks::

    muonkit convert-deepspeed CHECKPOINT_DIR --world-size 1 --output NEW_DIR

(see :mod:`muonkit.integrations.deepspeed_convert`).
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any

__all__ = ["CheckpointWorldSizeError", "guard_load_checkpoint", "saved_world_size"]


class CheckpointWorldSizeError(RuntimeError):
    """The checkpoint's optimizer state is partitioned for a different number of ranks."""


def saved_world_size(load_dir: str | os.PathLike[str], tag: str) -> int:
    """The data-parallel world size a checkpoint was saved at (its number of ZeRO state files)."""
    files = glob.glob(os.path.join(os.fspath(load_dir), tag, "*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return len(files)


def latest_tag(load_dir: str | os.PathLike[str]) -> str | None:
    path = os.path.join(os.fspath(load_dir), "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def guard_load_checkpoint(engine: Any) -> None:
    """Wrap ``engine.load_checkpoint`` to fail clearly (with the conversion command) on a world-size change."""
    original = engine.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(load_dir: str, tag: str | None = None, *args: Any, **kwargs: Any) -> Any:
        loads_state = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        resolved = tag if tag is not None else latest_tag(load_dir)
        if loads_state and resolved is not None:
            saved = saved_world_size(load_dir, resolved)
            current = getattr(engine, "seq_dp_world_size", engine.dp_world_size)
            if saved and saved != current:
                raise CheckpointWorldSizeError(
                    f"{os.path.join(load_dir, resolved)} holds optimizer state partitioned for {saved} data-parallel "
                    f"ranks and this run has {current}. Rewrite it for {current} ranks with\n"
                    f"    muonkit convert-deepspeed {load_dir} --tag {resolved} --world-size {current} --output NEW_DIR\n"
                    "and load NEW_DIR (or pass load_optimizer_states=False to keep only the model weights)"
                )
        # ZeRO-3 puts its fp32 partitions into the optimizer's groups for the load and takes them
        # out again only when the load succeeds: a refused checkpoint left them there (one more
        # param per group at each try, wrong at the next load or step).
        params = _group_params(engine)
        try:
            return original(load_dir, tag, *args, **kwargs)
        except BaseException:
            for group, held in zip(_groups(engine), params, strict=True):
                group["params"] = held
            raise

    engine.load_checkpoint = load_checkpoint


def _groups(engine: Any) -> list[dict[str, Any]]:
    """The param groups of the optimizer inside DeepSpeed's (HybridMuon's), or none."""
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    return list(getattr(inner, "param_groups", []))


def _group_params(engine: Any) -> list[list[Any]]:
    return [list(group["params"]) for group in _groups(engine)]
