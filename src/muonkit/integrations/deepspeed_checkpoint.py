"""DeepSpeed checkpoints of muonkit runs: loading at another world size.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` work unchanged at the same data-parallel
world size (each rank saves and loads its own flat partition of master weights and of muonkit's
states). The partitions depend on the world size, so a checkpoint taken at W ranks does not fit
W' ranks. :func:`guard_load_checkpoint` makes ``engine.load_checkpoint`` say so, naming the
command that rewrites the checkpoint for W' ranks::

    muonkit convert-deepspeed CHECKPOINT_DIR --world-size 1 --output NEW_DIR

(see :mod:`muonkit.integrations.deepspeed_convert`).

DeepSpeed reads its checkpoint files with ``torch.load(weights_only=False)``: a full unpickler,
which runs whatever a crafted file names. muonkit cannot change how DeepSpeed reads, so the
guarded ``engine.load_checkpoint`` first scans every ``*.pt`` file of the tag, statically (nothing
is executed), and refuses with :class:`~muonkit.safe_load.UntrustedCheckpointError` a file whose
pickle names anything beyond what ``torch.load(weights_only=True)`` accepts and DeepSpeed's four
plain classes (:data:`SAFE_CLASSES`); ``engine.load_checkpoint(dir, trusted=True)`` skips the
scan. Checkpoints of muonkit runs hold nothing else; a ``client_state`` of your own objects does.
The Hugging Face Trainer calls DeepSpeed's loading before muonkit sees the engine: there nothing
is scanned, so resume only from checkpoints you trust.
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any

from muonkit.safe_load import foreign_globals, refusal

__all__ = ["SAFE_CLASSES", "CheckpointWorldSizeError", "check_pickles", "guard_load_checkpoint", "saved_world_size"]

SAFE_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The classes besides tensors and plain containers that DeepSpeed's checkpoints of muonkit runs
hold; unpickling them only sets numbers (loss scale, ZeRO stage, fragment offsets)."""


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


def check_pickles(folder: str, *, reader: str) -> None:
    """Raise :class:`~muonkit.safe_load.UntrustedCheckpointError` if a ``*.pt`` file in ``folder``
    names anything beyond ``weights_only`` loading and :data:`SAFE_CLASSES` (read statically)."""
    for path in sorted(glob.glob(os.path.join(folder, "*.pt"))):
        with open(path, "rb") as f:
            try:
                found = foreign_globals(f, allowed=SAFE_CLASSES)
            except Exception as e:  # not a torch.save zip, or opcodes torch's scanner does not know
                raise refusal(path, f"is not a torch.save file muonkit can inspect ({e})", reader=reader) from None
        if found:
            raise refusal(path, f"holds a pickle of {found}", reader=reader)


def guard_load_checkpoint(engine: Any) -> None:
    """Wrap ``engine.load_checkpoint`` to refuse files only a full unpickler reads (unless called
    with ``trusted=True``) and to fail clearly (with the conversion command) on a world-size change."""
    original = engine.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(load_dir: str, tag: str | None = None, *args: Any, trusted: bool = False, **kwargs: Any) -> Any:
        loads_state = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        resolved = tag if tag is not None else latest_tag(load_dir)
        if resolved is not None and not trusted:
            check_pickles(os.path.join(load_dir, resolved), reader="muonkit's guard of engine.load_checkpoint")
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
