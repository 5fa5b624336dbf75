"""Crafted DCP checkpoint files: payloads a full unpickler would run, for the loader's refusal tests.

Used by ``tests/checkpoints/test_checkpoint_files.py`` (one device) and ``tests/distributed/scenario_checkpoint.py``
(2 ranks). Every craft edits a checkpoint directory in place; the payload, when unpickled,
creates the directory ``marker`` (and does nothing else).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from muonkit.distributed.checkpoint_files import VALUES_FILE

TRUSTED_HINT = r"pass trusted=True to unpickle it"
Craft = Callable[[Path, Path], None]


class Payload:
    """Unpickling this creates the directory ``marker``: the proof that a loader ran it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (os.mkdir, (self.marker,))


def previous_format_save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, **group0: Any) -> None:
    """What muonkit's save_checkpoint wrote until now (collective): plain ``dcp.save``, the
    non-tensor values pickled in the ``.distcp`` files; ``group0`` overrides the first group's values."""
    model_state, optim_state = get_state_dict(model, opt)
    optim_state["param_groups"][0].update(group0)  # type: ignore[index]
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def read_metadata(ckpt: Path) -> Any:
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file: the loader under test never does this


def write_metadata(ckpt: Path, metadata: Any) -> None:
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def torch_save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def replace_piece(ckpt: Path, key: str, blob: bytes, *, file: str | None = None) -> None:
    """Put ``blob`` where the (first, or first in ``file``) piece of ``key`` lies, moving the pieces after it."""
    metadata = read_metadata(ckpt)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == key and file in (None, s.relative_path))
    path = ckpt / info.relative_path
    data = path.read_bytes()
    path.write_bytes(data[: info.offset] + blob + data[info.offset + info.length :])
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(blob) - info.length
    info.length = len(blob)
    write_metadata(ckpt, metadata)


def first_tensor_in(ckpt: Path, file: str) -> str:
    """The key of the first tensor piece stored in ``file``."""
    metadata = read_metadata(ckpt)
    pieces = [(s.offset, i.fqn) for i, s in metadata.storage_data.items() if s.relative_path == file]
    return min(pieces)[1]


def metadata_payload(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def metadata_nested_payload(ckpt: Path, marker: Path) -> None:
    metadata = read_metadata(ckpt)
    metadata.storage_meta.modules = [Payload(marker)]
    write_metadata(ckpt, metadata)


def piece_payload(key: str, file: str | None = None) -> Craft:
    """The piece of ``key`` becomes a torch.save of the payload (a zip, as DCP writes tensors)."""
    return lambda ckpt, marker: replace_piece(ckpt, key, torch_save(Payload(marker)), file=file)


def piece_plain_pickle(key: str) -> Craft:
    return lambda ckpt, marker: replace_piece(ckpt, key, pickle.dumps(Payload(marker)))


def tensor_listed_as_pickled_value(key: str) -> Craft:
    """The metadata says ``key`` is a pickled value: plain DCP would torch.load it, weights_only=False."""

    def craft(ckpt: Path, marker: Path) -> None:
        replace_piece(ckpt, key, torch_save(Payload(marker)))
        metadata = read_metadata(ckpt)
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        write_metadata(ckpt, metadata)

    return craft


def data_file_outside(ckpt: Path, marker: Path) -> None:
    metadata = read_metadata(ckpt)
    next(iter(metadata.storage_data.values())).relative_path = "../elsewhere.distcp"
    write_metadata(ckpt, metadata)


def values_payload(ckpt: Path, marker: Path) -> None:
    """A pickle, base64-free, where the values file's JSON should be (and one inside a value)."""
    (ckpt / VALUES_FILE).write_bytes(pickle.dumps(Payload(marker)))


def values_edit(edit: Callable[[dict[str, Any]], Any]) -> Craft:
    """Rewrite the values file as ``edit(document)`` returns it (a str: written as is), or the
    edited document."""

    def craft(ckpt: Path, marker: Path) -> None:
        document = json.loads((ckpt / VALUES_FILE).read_text())
        result = edit(document)
        (ckpt / VALUES_FILE).write_text(result if isinstance(result, str) else json.dumps(document))

    return craft


def truncated_values(ckpt: Path, marker: Path) -> None:
    text = (ckpt / VALUES_FILE).read_text()
    (ckpt / VALUES_FILE).write_text(text[: len(text) // 2])
