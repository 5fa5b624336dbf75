"""Writing checkpoints so that a crash (``kill -9``, power loss) never destroys the previous one.

Everything is written aside, into a sibling ``PATH.muonkit-tmp``, flushed to disk (``fsync``),
and only then renamed into place. Replacing an existing ``PATH`` is one atomic
``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere (or on file systems without it) it is two
renames, ``PATH -> PATH.muonkit-old`` and ``PATH.muonkit-tmp -> PATH``. A crash between those
two leaves the previous checkpoint whole at ``PATH.muonkit-old``: :func:`readable_dir` returns it
and the next :func:`prepare_dir` moves it back. So at every moment either the previous or the
new checkpoint is readable.

Helpers, in the order a writer calls them::

    check_replaceable(path, owned=...)   # refuse to replace a directory of other files
    tmp = prepare_dir(path)              # clean leftovers of an interrupted write
    ...write every file under tmp...
    publish_dir(tmp, path)               # fsync, swap into place, remove the previous one
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["check_replaceable", "prepare_dir", "publish_dir", "readable_dir", "replace_file"]

TMP_SUFFIX = ".muonkit-tmp"
OLD_SUFFIX = ".muonkit-old"


def check_replaceable(path: str, *, owned: Callable[[str], bool], what: str) -> None:
    """Raise ``ValueError`` if ``path`` (or the previous checkpoint standing in for it) is something
    a writer must not replace whole: not a directory, or one holding files ``owned`` rejects."""
    current = readable_dir(path)
    if not os.path.lexists(current):
        return
    if os.path.islink(current) or not os.path.isdir(current):
        raise ValueError(f"{current} exists and is not a directory: {what} writes a directory there")
    foreign = sorted(n for n in os.listdir(current) if not owned(n) or not os.path.isfile(os.path.join(current, n)))
    if foreign:
        raise ValueError(
            f"{current} holds {foreign[:5]} besides a checkpoint: {what} replaces the whole directory; "
            "move those files or write to another path"
        )


def readable_dir(path: str) -> str:
    """``path``, or the previous checkpoint a crash during :func:`publish_dir` left beside it."""
    old = path + OLD_SUFFIX
    return old if not os.path.lexists(path) and os.path.isdir(old) else path


def prepare_dir(path: str) -> str:
    """Undo what an interrupted write left behind; returns the (absent) temporary path to write into."""
    old, tmp = path + OLD_SUFFIX, path + TMP_SUFFIX
    if os.path.lexists(old):
        if os.path.lexists(path):
            _remove(old)  # the swap had finished
        else:
            os.rename(old, path)  # crashed between the two renames: the previous one comes back
    if os.path.lexists(tmp):
        _remove(tmp)
    return tmp


def publish_dir(tmp: str, path: str) -> None:
    """Make the completely written directory ``tmp`` the new ``path``; the previous ``path`` stays
    whole until the new one is in place, then is removed."""
    for root, _, files in os.walk(tmp):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(tmp, path)
        _fsync(parent)
        return
    if _exchange(tmp, path):
        previous = tmp
    else:
        previous = path + OLD_SUFFIX
        os.rename(path, previous)  # from here to the next rename, readable_dir(path) is the previous one
        os.rename(tmp, path)
    _fsync(parent)
    _remove(previous)


def replace_file(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Write a file through ``write(f)`` into ``path.muonkit-tmp``, fsync it, rename it over ``path``."""
    tmp = path + TMP_SUFFIX
    if os.path.lexists(tmp):
        _remove(tmp)
    with open(tmp, "xb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(os.path.abspath(path)))


def _remove(path: str) -> None:
    """Remove a file, a link (never what it points to) or a directory tree."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _fsync(path: str) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # directories cannot be opened on some platforms (Windows): nothing to flush
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES):  # file systems without fsync
            raise
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if sys.platform != "linux":
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc < 2.28, musl
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # old kernel or file system
        return False
    raise OSError(code, os.strerror(code), a, None, b)
