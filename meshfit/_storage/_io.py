"""Atomic file and directory writes shared by every meshfit saver.

A reader never sees a half-written file or directory: data goes to a temporary sibling
(``<name>.tmp-<pid>``), is flushed and fsynced, then renamed over the target with ``os.replace``,
and the parent directory is fsynced so the rename itself survives a power loss. The temporary file
records its writer before its name appears (see `meshfit._storage._atomic.mark_writer`), and each successful write removes the
temporary files that dead writers of the same target left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

from meshfit._storage._atomic import AtomicDirectory, clean_siblings, fsync_directory, mark_writer

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_directory",
]


def _parent(path: str) -> str:
    """The directory holding ``path`` ('.' for a bare name)."""
    return os.path.dirname(os.path.abspath(path))


def _remove(path: str) -> None:
    """Removes a file or a directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _create_marked(tmp: str, parent: str) -> int:
    """A new empty file at ``tmp`` open for writing, whose name appears with its writer already recorded.

    The file is made unnamed (``O_TMPFILE``), marked (`mark_writer`), then linked as ``tmp``: a kill at
    any moment leaves either no file or one a later clean-up can tell is a dead writer's. Where the
    file system has no ``O_TMPFILE`` (or no ``/proc``), it is created by name and marked just after.
    """
    flag = getattr(os, "O_TMPFILE", 0)
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)  # our own name: left by a crashed earlier process with this pid
    if flag:
        try:
            fd = os.open(parent, flag | os.O_WRONLY, 0o666)
        except OSError:
            pass
        else:
            try:
                mark_writer(fd)
                _link_open_file(fd, tmp, parent)
                return fd
            except OSError:
                os.close(fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    mark_writer(fd)
    return fd


def _link_open_file(fd: int, name: str, parent: str) -> None:
    """Gives the unnamed file open as ``fd`` the name ``name`` (in ``parent``).

    It must be ``linkat(..., AT_SYMLINK_FOLLOW)`` on ``/proc/self/fd/<fd>``: without a directory
    descriptor Python's `os.link` calls ``link()``, which does not follow that link and fails with
    EXDEV (measured here), and every file was then created by name and marked after.
    """
    directory = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(name), dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically: the file holds either its old or its new content.

    Args:
        path: Destination file. Its parent directory must exist.
        data: The bytes to write.

    Raises:
        TypeError: If ``data`` is not bytes-like.
        FileNotFoundError: If the parent directory of ``path`` does not exist.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"Invalid `data`: expected bytes, received an object of type {type(data).__name__}. "
            "Encode text with atomic_write_text instead."
        )
    path = os.fspath(path)
    parent = _parent(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(
            f"Cannot write {path!r}: its directory {parent!r} does not exist. Create it first."
        )
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with os.fdopen(_create_marked(tmp, parent), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as error:
        _remove(tmp)
        if error.filename is None and error.errno is not None:  # a failed write(): name the file
            raise type(error)(error.errno, error.strerror, path) from error
        raise
    except BaseException:
        _remove(tmp)
        raise
    fsync_directory(parent)
    with contextlib.suppress(OSError):  # housekeeping: the new content is already in place
        clean_siblings(path)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Writes ``text`` to ``path`` atomically (see `atomic_write_bytes`).

    Args:
        path: Destination file. Its parent directory must exist.
        text: The text to write.
        encoding: Text encoding.

    Raises:
        TypeError: If ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"Invalid `text`: expected a str, received an object of type {type(text).__name__}.")
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Writes ``obj`` as indented JSON to ``path`` atomically.

    Args:
        path: Destination file. Its parent directory must exist.
        obj: A JSON-serializable object.

    Raises:
        TypeError: If ``obj`` is not JSON-serializable (nothing is written).
    """
    try:
        text = json.dumps(obj, indent=2)
    except (TypeError, ValueError) as err:
        raise TypeError(f"Cannot write {os.fspath(path)!r} as JSON: {err}.") from err
    atomic_write_text(path, text + "\n")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[str]:
    """Builds a directory in a temporary sibling and moves it into place only on success.

    Yields ``<path>.tmp-<pid>``, an empty directory to fill; see `meshfit._storage._atomic.AtomicDirectory`
    for the swap, the recovery of an interrupted one and the cleanup of dead writers' leftovers.
    If the body raises, the temporary directory is removed and an existing ``path`` is untouched.

    Args:
        path: The final directory. Its parent is created if missing.

    Yields:
        The temporary directory to write into.

    Example:
        >>> import os, tempfile
        >>> root = tempfile.mkdtemp()
        >>> with atomic_directory(os.path.join(root, "ckpt")) as tmp:
        ...     atomic_write_text(os.path.join(tmp, "a.txt"), "hello")
        >>> sorted(os.listdir(os.path.join(root, "ckpt")))
        ['a.txt']
        >>> import shutil; shutil.rmtree(root)
    """
    with AtomicDirectory(path).writing() as tmp:
        yield tmp
