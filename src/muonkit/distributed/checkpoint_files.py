"""The files of a muonkit DCP checkpoint, and reading them without running code from them.

A directory written by :func:`muonkit.distributed.checkpoint.save_checkpoint` holds:

========================  ========================================================================
``__R_I.distcp``          tensor data; each tensor piece is its own ``torch.save`` zip, which DCP
                          reads with ``torch.load(weights_only=True)`` (``FileSystemReader.read_data``
                          in torch 2.13)
``.metadata``             DCP's index: each tensor's name, size, dtype and chunks, and where each
                          piece's bytes lie; a pickle of DCP's metadata dataclasses
``muonkit-values.json``   every value that is not a tensor (a param group's ``lr``, ``betas``,
                          ``ns_dtype``, parameter names...) as typed JSON, keyed like DCP's keys
                          (``optimizer.param_groups.0.lr``)
========================  ========================================================================

Plain DCP stores non-tensor values as pickles inside the ``.distcp`` files and loads them with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``), and it reads
``.metadata`` with ``pickle.load``: a crafted file of either kind runs its payload on load.
Unless the caller passes ``trusted=True``, :func:`open_checkpoint` and
:meth:`SavedCheckpoint.load` therefore

1. unpickle ``.metadata`` importing only DCP's metadata dataclasses, ``torch.Size``, torch dtypes,
   layouts and ``pathlib`` paths, then check its structure (every data file a plain ``*.distcp``
   name inside the directory, no stream transforms);
2. refuse a checkpoint that lists any pickled value or has no values file (plain DCP, or muonkit's
   ``save_checkpoint`` before the values file), naming what they refused and ``trusted=True``;
3. scan, statically, the pickle of every tensor piece for names ``weights_only`` refuses, so that
   a crafted piece is refused before any tensor is written (DCP's reader would refuse it too,
   after writing the pieces it read before);
4. parse the values file strictly (below);
5. (in :meth:`SavedCheckpoint.load`) check the values against the state being loaded: every value
   it needs present (as DCP requires every key), a bool where the state holds a bool and a number
   where it holds a number; values the state has no place for are ignored, like DCP's.

Only then does DCP read the tensors (into the state's own tensors, in place). With
``trusted=True`` the metadata is unpickled with ``pickle`` and a checkpoint without a values file
loads the plain DCP way, unpickling its values: checkpoints of muonkit's earlier
``save_checkpoint``, or of ``dcp.save`` called directly.

The values file is ``{"format": "muonkit-checkpoint-values", "version": 1, "values": {KEY: V}}``,
each V JSON null, a bool, an int in [-2**63, 2**63), a finite float, a string, a list of Vs, or an
object with exactly one key: ``"float"`` (``"inf"``, ``"-inf"`` or ``"nan"``), ``"dtype"`` (a
torch dtype's name: ``"bfloat16"``), ``"tuple"`` (a list of Vs) or ``"dict"`` (an object of Vs).
Floats round-trip exactly (shortest repr).

Example::

    save(state, "ckpt.muonkit-tmp", rank=0)         # DCP tensors + the values file
    saved = open_checkpoint("ckpt", trusted=False)  # checks 1-4; raises before anything changes
    saved.load(state)                               # check 5, then DCP reads into state
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import math
import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from muonkit.safe_load import (
    FileSlice,
    RefusedName,
    UntrustedCheckpointError,
    foreign_globals,
    load_allowed,
    refusal,
)

__all__ = ["VALUES_FILE", "SavedCheckpoint", "UntrustedCheckpointError", "open_checkpoint", "owned_file", "save"]

VALUES_FILE = "muonkit-values.json"
_FORMAT, _VERSION = "muonkit-checkpoint-values", 1
_READER = "load_checkpoint"
_DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.distcp")
_MAX_DEPTH = 32  # of nested values; muonkit's deepest (ns_coefficients) is 3
_INT_RANGE = 2**63
_TAGS = ("float", "dtype", "tuple", "dict")

ObjPath = tuple[Any, ...]


def owned_file(name: str) -> bool:
    """Files a checkpoint directory may hold (``save_checkpoint`` replaces no directory holding others)."""
    return name == VALUES_FILE or name.endswith((".distcp", ".metadata", ".metadata.tmp"))


# ---------------------------------------------------------------------------------------------
# Splitting a state into DCP's tensors and the values file


@dataclass
class _Split:
    tensors: dict[str, Any]  # the state's tensors, nested as in the state (lists as dicts by index)
    tensor_keys: set[str]  # their DCP keys
    values: dict[str, tuple[ObjPath, Any]]  # every other leaf by DCP key: (its path, the value)


def _terminal(value: Any) -> bool:
    """DCP's leaf rule (``_traverse.traverse_state_dict``): mappings are walked, and lists are
    walked by index when they hold a tensor, a mapping or such a list; anything else is a leaf."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(x, (torch.Tensor, Mapping)) or (isinstance(x, list) and not _terminal(x)) for x in value)


def split_state(state: Mapping[str, Any]) -> _Split:
    """``state``'s tensors (keeping every tensor's DCP key) apart from its other leaves."""
    split = _Split({}, set(), {})

    def walk(path: ObjPath, value: Any) -> Any:
        if not _terminal(value):
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            return {str(k): sub for k, v in items if (sub := walk((*path, k), v)) is not None}
        key = ".".join(map(str, path))
        if key in split.tensor_keys or key in split.values:
            raise ValueError(f"Two entries of the state have the DCP key {key!r}: rename one")
        if isinstance(value, torch.Tensor):
            split.tensor_keys.add(key)
            return value
        split.values[key] = (path, value)
        return None

    split.tensors = {str(k): sub for k, v in state.items() if (sub := walk((k,), v)) is not None}
    return split


def save(state: Mapping[str, Any], checkpoint_id: str, *, rank: int) -> None:
    """``dcp.save`` of ``state``'s tensors, then (rank 0) the values file beside them (collective).

    Raises ``ValueError`` on every rank, before anything is written, if a value has no JSON form.
    """
    split = split_state(state)
    document = {"format": _FORMAT, "version": _VERSION, "values": {}}
    document["values"] = {key: _encode(value, key) for key, (_, value) in split.values.items()}
    text = json.dumps(document, indent=1, allow_nan=False)
    dcp.save(split.tensors, checkpoint_id=checkpoint_id)
    if rank == 0:  # identical on every rank (param groups agree); published with the rest
        with open(os.path.join(checkpoint_id, VALUES_FILE), "x", encoding="utf-8") as f:
            f.write(text)


def _encode(value: Any, key: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"Cannot save {key}: values nest at most {_MAX_DEPTH} deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value) is int:
        if not -_INT_RANGE <= value < _INT_RANGE:
            raise ValueError(f"Cannot save {key}={value}: integers must fit in 64 bits")
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if type(value) in (list, tuple):
        items = [_encode(v, key, depth + 1) for v in value]
        return items if type(value) is list else {"tuple": items}
    if type(value) is dict and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, key, depth + 1) for k, v in value.items()}}
    raise ValueError(
        f"Cannot save {key}: save_checkpoint stores values that are not tensors as JSON, and "
        f"{type(value).__name__} {value!r:.80} has no JSON form; allowed: None, bool, int, float, str, "
        "torch.dtype, and lists, tuples and str-keyed dicts of them"
    )


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint directory whose metadata (and values file) passed :func:`open_checkpoint`."""

    path: str
    metadata: Metadata
    values: dict[str, Any] | None  # None: plain DCP (values pickled in the .distcp files), trusted only
    trusted: bool

    @property
    def entries(self) -> dict[str, Any]:
        """Every key the checkpoint holds and its DCP metadata: tensors and pickled values (DCP's
        storage metadata), and the values file's (None)."""
        return {**dict.fromkeys(self.values or ()), **self.metadata.state_dict_metadata}

    def load(self, state: dict[str, Any]) -> None:
        """Fill ``state`` (as ``dcp.load`` does: its tensors in place, its other leaves replaced).

        Every check runs before DCP reads the first tensor; what they refuse raises ``ValueError``
        (:class:`UntrustedCheckpointError` for pickles) with ``state`` untouched.
        """
        if self.values is None:  # trusted: the plain DCP way, values unpickled
            dcp.load(state, storage_reader=_Reader(self.path, self.metadata, pickled_values=True))
            return
        split = split_state(state)
        loaded = self._values_for(split.values)
        dcp.load(split.tensors, storage_reader=_Reader(self.path, self.metadata, pickled_values=self.trusted))
        for key, (where, _) in split.values.items():
            _put(state, where, loaded[key])

    def _values_for(self, wanted: dict[str, tuple[ObjPath, Any]]) -> dict[str, Any]:
        assert self.values is not None
        where = os.path.join(self.path, VALUES_FILE)
        missing = sorted(set(wanted) - set(self.values))
        if missing:
            raise ValueError(f"{where} has no value for {missing[:5]} ({len(missing)} missing), which this state holds")
        for key, (_, current) in wanted.items():
            if _kind(current) is not None and _kind(self.values[key]) != _kind(current):
                raise ValueError(
                    f"{where}: {key} is {self.values[key]!r:.60}, and the state being loaded holds a {_kind(current)} there"
                )
        return {key: copy.deepcopy(self.values[key]) for key in wanted}


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, (int, float)) else None


def _put(state: Any, path: ObjPath, value: Any) -> None:
    for k in path[:-1]:
        state = state[k]
    state[path[-1]] = value


def open_checkpoint(path: str, *, trusted: bool) -> SavedCheckpoint:
    """Read and check ``path``'s metadata, tensor pickles and values file (checks 1-4 above)."""
    metadata_file = os.path.join(path, ".metadata")
    values_file = os.path.join(path, VALUES_FILE)
    metadata = _read_metadata(metadata_file, trusted=trusted)
    has_values = os.path.isfile(values_file)
    if not trusted:
        _check_metadata(metadata, metadata_file)
        pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if _is_bytes(v))
        listed = f"{len(pickled)} values pickled in the .distcp files ({pickled[:3]})"
        if not has_values:
            raise refusal(
                path,
                f"has no {VALUES_FILE} (it was written by dcp.save directly, or by muonkit's save_checkpoint before "
                "that file): it stores values that are not tensors (a param group's lr, betas...) as pickles in its "
                f".distcp files{f', {listed}' if pickled else ''}",
                reader=_READER,
            )
        if pickled:
            raise refusal(metadata_file, f"lists {listed}", reader=_READER)
        _scan_tensor_pieces(path, metadata)
    values = _read_values(values_file) if has_values else None
    return SavedCheckpoint(path, metadata, values, trusted)


def _scan_tensor_pieces(path: str, metadata: Metadata) -> None:
    """Refuse any tensor piece whose pickle names what ``weights_only`` refuses (DCP's reader would
    refuse it too, but only after writing the pieces before it)."""
    pieces: dict[str, dict[tuple[int, int], str]] = {}
    for index, info in metadata.storage_data.items():
        pieces.setdefault(info.relative_path, {})[(info.offset, info.length)] = index.fqn
    for name, spans in sorted(pieces.items()):
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            for (offset, length), key in sorted(spans.items()):
                try:
                    found = foreign_globals(FileSlice(f, offset, length))
                except Exception as e:  # not a torch.save zip, or opcodes torch's scanner does not know
                    raise refusal(
                        file, f"holds, for {key}, bytes that are not a torch.save of tensors ({e})", reader=_READER
                    ) from None
                if found:
                    raise refusal(file, f"holds, for {key}, a pickle of {found}", reader=_READER)


def _read_metadata(file: str, *, trusted: bool) -> Metadata:
    with open(file, "rb") as f:
        if trusted:
            return pickle.load(f)
        try:
            return load_allowed(f, _metadata_name)
        except RefusedName as e:
            raise refusal(
                file, f"holds a pickle of {e.name}, not one of DCP's metadata classes", reader=_READER
            ) from None
        except pickle.UnpicklingError as e:
            raise ValueError(f"{file} is not DCP metadata: {e}") from None
        except (EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
            raise ValueError(f"{file} is not DCP metadata: {type(e).__name__}: {e}") from None


_DCP_METADATA = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")  # StorageMeta.checkpoint_id


@functools.cache
def _metadata_names() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` pickles import (torch 2.13), and nothing else."""
    names = [("torch.distributed.checkpoint.metadata", n) for n in _DCP_METADATA]
    names += [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size")]
    names += [("torch.serialization", "_get_layout")]  # torch.layout's reduce: a lookup of str(layout)
    names += [("pathlib", n) for n in _PATHS]
    found = {(m, n): getattr(importlib.import_module(m), n) for m, n in names}
    found |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    return found


def _metadata_name(module: str, name: str) -> Any:
    return _metadata_names().get((module, name))


def _is_bytes(entry: Any) -> bool:
    return isinstance(entry, BytesStorageMetadata)


def _check_metadata(metadata: Metadata, file: str) -> None:
    """DCP's structure, with data files only inside the directory and no stream transforms."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{file} is not DCP metadata muonkit reads: {what}")

    if type(metadata) is not Metadata:
        raise bad(f"it holds a {type(metadata).__name__}")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("its state_dict_metadata and storage_data must be dicts")
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise bad(f"entry {key!r} is a {type(entry).__name__}")
        if isinstance(entry, TensorStorageMetadata) and not (
            isinstance(entry.size, torch.Size) and isinstance(entry.properties.dtype, torch.dtype)
        ):
            raise bad(f"entry {key!r} has size {entry.size!r} and dtype {entry.properties.dtype!r}")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage entry {index!r} -> {info!r}")
        if not isinstance(info.relative_path, str) or not _DATA_FILE.fullmatch(info.relative_path):
            raise bad(f"{index.fqn} lies in {info.relative_path!r}, not a *.distcp file in the checkpoint directory")
        if not all(type(n) is int and n >= 0 for n in (info.offset, info.length)):
            raise bad(f"{index.fqn} lies at offset {info.offset!r}, length {info.length!r}")
        if info.transform_descriptors:
            raise bad(f"{index.fqn} is stored through the transforms {info.transform_descriptors!r}")


def _read_values(file: str) -> dict[str, Any]:
    """The values file, parsed strictly: any departure from the format raises ``ValueError``."""

    def refuse(what: str) -> ValueError:
        return ValueError(f"{file} is not a muonkit values file: {what}")

    def constant(token: str) -> Any:
        raise refuse(f"{token} is not JSON (non-finite floats are written {{'float': 'inf'}})")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise refuse(f"an object repeats a key ({sorted(k for k in set(keys) if keys.count(k) > 1)[:3]})")
        return dict(pairs)

    try:
        with open(file, encoding="utf-8") as f:
            document = json.load(f, parse_constant=constant, object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, ints over 4300 digits
        raise e if str(e).startswith(file) else refuse(f"{type(e).__name__}: {e}") from None
    if not isinstance(document, dict) or set(document) != {"format", "version", "values"}:
        raise refuse(
            f"the top level must be an object with exactly the keys format, version, values ({document!r:.80})"
        )
    if document["format"] != _FORMAT or document["version"] != _VERSION or type(document["version"]) is not int:
        raise refuse(f"format {document['format']!r} version {document['version']!r}; expected {_FORMAT!r} {_VERSION}")
    if not isinstance(document["values"], dict):
        raise refuse("values must be an object")
    return {key: _decode(value, key, refuse) for key, value in document["values"].items()}


def _decode(value: Any, key: str, refuse: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise refuse(f"{key} nests deeper than {_MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -_INT_RANGE <= value < _INT_RANGE:
            raise refuse(f"{key} holds the integer {value:.3g}, outside 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise refuse(f"{key} holds a number too large for a float")
        return value
    if isinstance(value, list):
        return [_decode(v, key, refuse, depth + 1) for v in value]
    if len(value) != 1 or next(iter(value)) not in _TAGS:
        raise refuse(f"{key} holds the object {value!r:.80}; an object has exactly one key of {list(_TAGS)}")
    ((tag, inner),) = value.items()
    if tag == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if tag == "dtype" and isinstance(inner, str) and isinstance(getattr(torch, inner, None), torch.dtype):
        return getattr(torch, inner)
    if tag == "tuple" and isinstance(inner, list):
        return tuple(_decode(v, key, refuse, depth + 1) for v in inner)
    if tag == "dict" and isinstance(inner, dict):
        return {k: _decode(v, key, refuse, depth + 1) for k, v in inner.items()}
    raise refuse(f"{key} holds {{{tag!r}: {inner!r:.60}}}, not a valid {tag}")


class _Reader(FileSystemReader):
    """DCP's file reader, serving the metadata :func:`open_checkpoint` read and checked once, and
    refusing pickled values unless they are allowed."""

    def __init__(self, path: str, metadata: Metadata, *, pickled_values: bool) -> None:
        super().__init__(path)
        self._metadata, self._pickled_values = metadata, pickled_values

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs:  # rank-local metadata: never written by save_checkpoint
            raise ValueError(f"{self.path} has no rank-local metadata")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        pickled = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if pickled and not self._pickled_values:  # open_checkpoint refused these already: the last guard
            raise refusal(str(self.path), f"holds pickled values {pickled[:3]}", reader=_READER)
        return super().read_data(plan, planner)
