"""Which torch each feature needs, in one place: ``requires_torch(feature, version)`` raises
:class:`TorchVersionError` ("X needs torch >= Y") where a feature is chosen, instead of an
``AttributeError`` deep inside a step.

The declared floor (``pyproject.toml``: ``torch>=2.4``) holds for one device and DDP. DTensor
parameters (FSDP2, HSDP, tensor, expert and pipeline meshes) and DCP checkpoints need a newer
torch: on torch 2.4 DTensors live in ``torch.distributed._tensor`` (the step failed with
``module 'torch.distributed.tensor' has no attribute 'DTensor'``) and ``load_checkpoint`` failed
reading DCP's metadata. Each floor is the oldest torch the feature ran on here; ``make compat
TORCH=X`` runs the core checks on another torch (``tools/compat.sh``; results in
docs/versions.md).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

DTENSOR_FEATURE = "HybridMuon on DTensor parameters (FSDP2, HSDP, tensor, expert and pipeline parallel meshes)"
DTENSOR_TORCH = "2.8"
"""The oldest torch muonkit's DTensor path ran on here (``make compat``); 2.6 is the first with the
public ``torch.distributed.tensor`` and ``torch.distributed.fsdp.fully_shard`` it uses, but 2.6 and
2.7 were not run."""

SUBMESH_FEATURE = (
    "HybridMuon on DTensors of several sub-meshes of one root mesh (FSDP2 + TP, HSDP + TP, EP, pipeline stages)"
)
SUBMESH_TORCH = "2.13"
"""The oldest torch the N-D mesh suite ran on here; on 2.8.0 ``DeviceMesh._get_root_mesh``, which
reads the root of a sub-mesh, does not exist yet (2.9-2.12 not run: checked by that method)."""

CHECKPOINT_FEATURE = "muonkit.distributed.checkpoint (save_checkpoint, load_checkpoint)"
CHECKPOINT_TORCH = "2.8"
"""The oldest torch the DCP checkpoints ran on here; on 2.4 the load failed reading DCP's metadata
(``_StorageInfo.transform_descriptors`` is newer)."""


class TorchVersionError(RuntimeError):
    """A feature was asked of a torch older than the one it needs."""


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.4.1+cpu"`` -> ``(2, 4, 1)``; pre-release and local parts are dropped."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def torch_at_least(version: str) -> bool:
    """Whether the running torch is ``version`` or newer."""
    return version_tuple(torch.__version__) >= version_tuple(version)


def requires_torch(feature: str, version: str) -> None:
    """Raise :class:`TorchVersionError` naming ``feature`` when torch is older than ``version``."""
    if not torch_at_least(version):
        raise TorchVersionError(
            f"{feature} needs torch >= {version} (this is torch {torch.__version__}); "
            "one device and DDP work from torch 2.4"
        )


def requires_torch_for_params(params: Iterable[object]) -> None:
    """Refuse DTensor parameters on a torch too old for muonkit's DTensor path (any torch DTensor class)."""
    dtensor_params(params)


def dtensor_params(params: Iterable[T]) -> list[T]:
    """The DTensors among ``params`` (none where ``torch.distributed.tensor`` was never imported: no
    DTensor can exist); on a torch older than :data:`DTENSOR_TORCH`, DTensors of its private
    ``torch.distributed._tensor`` raise :class:`TorchVersionError` instead."""
    if torch_at_least(DTENSOR_TORCH):
        cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        return [] if cls is None else [p for p in params if isinstance(p, cls)]
    classes = tuple(
        cls
        for name in ("torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed._tensor.api")
        if (cls := getattr(sys.modules.get(name), "DTensor", None)) is not None
    )
    if classes and any(isinstance(p, classes) for p in params):
        requires_torch(DTENSOR_FEATURE, DTENSOR_TORCH)
    return []


def requires_torch_for_meshes(meshes: Iterable[Any]) -> None:
    """Refuse params on several sub-meshes (different ranks) where this torch cannot name their root mesh."""
    meshes = list(meshes)
    spans = {frozenset(m.mesh.reshape(-1).tolist()) for m in meshes}
    if len(spans) > 1 and not all(hasattr(m, "_get_root_mesh") for m in meshes):
        requires_torch(SUBMESH_FEATURE, SUBMESH_TORCH)
