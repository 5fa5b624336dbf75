"""Reading checkpoint files without running code from them.

Unpickling can call any importable function (an object's ``__reduce__`` names one), so a crafted
pickle runs code in the process that loads it. muonkit's checkpoint readers therefore read

- tensors with ``torch.load(weights_only=True)``: torch's restricted unpickler builds tensors,
  plain containers, numbers, strings and dtypes, plus only the classes registered with
  ``torch.serialization.add_safe_globals`` (yours) or named by the reader;
- other pickles (DCP's ``.metadata``) with :func:`load_allowed`, which imports only the names it is
  given and refuses the first other one before calling anything;
- everything else as JSON.

What a reader will not unpickle raises :class:`UntrustedCheckpointError`, which names the file,
what it refused and the opt-out: ``trusted=True`` on the loading call, which unpickles with
``pickle`` as plain DCP and DeepSpeed do (only for checkpoints you or your own code wrote).

Example::

    with open(path, "rb") as f:
        found = foreign_globals(f)   # [] for a plain torch.save of tensors; nothing is executed
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable, Collection
from typing import IO, Any, cast

import torch

__all__ = ["FileSlice", "RefusedName", "UntrustedCheckpointError", "foreign_globals", "load_allowed", "refusal"]


class UntrustedCheckpointError(ValueError):
    """A checkpoint file holds something only a full unpickler could load (it could run code)."""


class RefusedName(pickle.UnpicklingError):
    """:func:`load_allowed` met a name it does not import."""

    def __init__(self, name: str) -> None:
        super().__init__(f"refused {name}")
        self.name = name


def refusal(where: str, what: str, *, reader: str) -> UntrustedCheckpointError:
    """The error every reader raises: the file, what it refused, why, and the opt-out."""
    return UntrustedCheckpointError(
        f"{where} {what}. Unpickling can run any code, so {reader} refuses it (nothing was loaded); if you "
        "trust this checkpoint (you or your own code wrote it), pass trusted=True to unpickle it."
    )


def load_allowed(file: IO[bytes], allowed: Callable[[str, str], Any | None]) -> Any:
    """Unpickle ``file``, importing only what ``allowed(module, name)`` returns (None: refused).

    Raises :class:`RefusedName` at the first other ``module.name``, before anything from it is
    called; persistent ids (a plain pickle has none) raise ``pickle.UnpicklingError``.
    """

    class _AllowList(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed(module, name)
            if found is None:
                raise RefusedName(f"{module}.{name}")
            return found

        def persistent_load(self, pid: Any) -> Any:
            raise pickle.UnpicklingError("a persistent id")

    return _AllowList(file).load()


def foreign_globals(file: IO[bytes] | io.RawIOBase, *, allowed: Collection[str] = ()) -> list[str]:
    """The names a ``torch.save`` file would import beyond what ``torch.load(weights_only=True)``
    and ``allowed`` (``"module.Class"`` strings) accept; read statically, nothing is executed.

    Raises ``ValueError`` (not a ``torch.save`` zip, a TorchScript archive) or
    ``pickle.UnpicklingError`` (a pickle opcode torch's scanner does not know): either way the
    file is not one ``weights_only`` loading accepts.
    """
    found = torch.serialization.get_unsafe_globals_in_checkpoint(cast(IO[bytes], file))
    return sorted(name for name in found if name not in allowed)


class FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open binary file, as a seekable file of their own."""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer)[:count])  # type: ignore[attr-defined]
        self._pos += got
        return got
