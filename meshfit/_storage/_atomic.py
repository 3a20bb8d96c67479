"""`AtomicDirectory`: the one way meshfit publishes a directory (saved models, checkpoints).

A directory is built under a *scratch* name beside its final path and renamed into place only when
complete, so a reader sees either the previous complete copy or the new one::

    parent/
      ckpt/                        the complete copy readers use
      ckpt.tmp-4242/               a save in progress (``Model.save``: ``<name>.tmp-<pid>``;
      ckpt-3.tmp/                    checkpoints: ``<name>.tmp``, a name every rank derives);
                                   extended attribute ``user.meshfit.writer``: {"host", "pid"}
      ckpt.old-4242/               the previous copy, moved aside for the instant of the swap
      ckpt-1.deleting-4242/        a copy being deleted (renamed first: never half-deleted in place)

Replacing an existing directory takes two renames (``path -> path.old-<pid>``, ``scratch -> path``).
A crash between them leaves no ``path``: `recover` (run by every reader and writer of ``path``)
renames the moved-aside copy back. Leftovers of a *dead* writer (same host, pid gone or a zombie) are removed;
a scratch directory whose writer is alive, on another host, or unknown (a file system without
extended attributes) is never touched. The writer is recorded in an extended attribute rather than
a file so that the scratch directory holds exactly what the caller writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator

__all__ = [
    "AtomicDirectory", "clean_directory", "clean_siblings", "is_scratch_name", "mark_writer", "recover",
    "remove_tree",
]

_WRITER_ATTRIBUTE = "user.meshfit.writer"
_SCRATCH = re.compile(r"^(?P<target>.+)\.(?P<kind>tmp|old|deleting)(?:-(?P<pid>\d+))?$")
_SWAP_GRACE_SECONDS = 2.0  # the two renames of a swap take microseconds; a gap this long is a crash


def is_scratch_name(name: str) -> bool:
    """True for a name meshfit uses while writing or deleting (``x.tmp``, ``x.tmp-12``, ``x.old-12``...)."""
    return _SCRATCH.match(os.path.basename(os.path.normpath(name))) is not None


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Fsyncs a directory so renames and new entries inside it are durable."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:  # platforms that cannot open directories: nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Fsyncs every file and directory under ``root`` (bottom-up)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            file_path = os.path.join(dirpath, name)
            if os.path.islink(file_path):
                continue
            with open(file_path, "rb") as f:
                os.fsync(f.fileno())
        fsync_directory(dirpath)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` can still write: running, and not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (or it vanished just now): trust kill()
        return True


def mark_writer(scratch: str | int) -> None:
    """Records this process as ``scratch``'s writer (a scratch file or directory, by path or open file
    descriptor), so that a later `clean_siblings` can tell a dead writer's leftover from a live one's
    work in progress."""
    owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
    with contextlib.suppress(AttributeError, OSError):  # no xattrs here: the scratch stays unowned
        os.setxattr(scratch, _WRITER_ATTRIBUTE, owner)


def _writer_dead(scratch: str) -> bool:
    """True only when ``scratch``'s writer is provably gone (same host, pid not running)."""
    try:
        owner = json.loads(os.getxattr(scratch, _WRITER_ATTRIBUTE))
        host, pid = owner["host"], int(owner["pid"])
    except (AttributeError, OSError, ValueError, KeyError, TypeError):  # unknown writer: keep it
        return False
    if host != socket.gethostname():
        return False
    return pid != os.getpid() and not _pid_alive(pid)


def remove_tree(path: str, background: bool = False) -> None:
    """Deletes ``path`` so that no crash leaves a half-deleted copy under its real name.

    The rename to ``<path>.deleting-<pid>`` is the commit; with ``background`` the files are then
    removed on a thread (readers ignore ``.deleting`` names; the next `clean_directory` finishes).
    """
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        os.remove(path)
        return
    doomed = f"{path}.deleting-{os.getpid()}"
    if os.path.lexists(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    if background:
        _Unlinker(doomed).start()
    else:
        shutil.rmtree(doomed, ignore_errors=True)


class _Unlinker(threading.Thread):
    """Unlinks a renamed-away tree off the caller's thread; while it runs, `clean_siblings` leaves the
    tree to it. Known by the thread and its path, not by the pid in the name: a restarted container
    often runs with its killed predecessor's pid, and that predecessor's leftover must still go."""

    def __init__(self, doomed: str) -> None:
        super().__init__(name="meshfit-prune")  # not a daemon: the interpreter finishes it before exiting
        self.doomed = doomed

    def run(self) -> None:
        shutil.rmtree(self.doomed, ignore_errors=True)


def _in_flight(scratch: str) -> bool:
    return any(isinstance(t, _Unlinker) and t.doomed == scratch and t.is_alive() for t in threading.enumerate())


def _siblings(path: str) -> dict[str, list[str]]:
    """Scratch siblings of ``path`` by kind (``tmp``, ``old``, ``deleting``)."""
    parent, base = os.path.split(path)
    found: dict[str, list[str]] = {"tmp": [], "old": [], "deleting": []}
    try:
        names = os.listdir(parent)
    except OSError:
        return found
    for name in names:
        match = _SCRATCH.match(name)
        if match is not None and match["target"] == base:
            found[match["kind"]].append(os.path.join(parent, name))
    return found


def recover(path: str | os.PathLike) -> bool:
    """Puts back a copy of ``path`` moved aside by a writer that crashed mid-swap; True if it did.

    When ``path`` is missing and ``path.old-<pid>`` exists, the writer was between its two renames.
    A live writer finishes within microseconds, so after a short grace the moved-aside copy is
    renamed back (if the writer finished meanwhile, its rename wins and nothing changes).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        return False
    moved = [p for p in _siblings(path)["old"]  # only pid-marked ones: never a user's x.old
             if (match := _SCRATCH.match(os.path.basename(p))) is not None and match["pid"]]
    if not moved:
        return False
    deadline = time.monotonic() + _SWAP_GRACE_SECONDS
    while time.monotonic() < deadline:
        if os.path.lexists(path):
            return False
        time.sleep(0.02)
    newest = max(moved, key=lambda p: os.lstat(p).st_mtime if os.path.lexists(p) else 0.0)
    try:
        os.rename(newest, path)
    except OSError:  # the writer finished after all, or another reader recovered it first
        return False
    fsync_directory(os.path.dirname(path))
    return True


def _removable(scratch: str, kind: str, pid: str | None, target_exists: bool) -> bool:
    """Whether a scratch sibling is a dead writer's leftover (never a live writer's, never a user's)."""
    if kind == "tmp":
        return _writer_dead(scratch)  # needs the recorded writer: a name alone proves nothing
    if pid is None:  # ``x.old`` / ``x.deleting`` without a pid may be the user's own folder
        return False
    if kind == "deleting":
        return not _in_flight(scratch)  # one this process's thread is still unlinking is left to it
    return target_exists  # an ``.old`` whose replacement is in place


def clean_siblings(path: str | os.PathLike) -> None:
    """Recovers an interrupted swap of ``path`` and removes dead writers' leftovers beside it.

    Removed: ``path.deleting-<pid>`` (except one this process's thread is still unlinking);
    ``path.old-<pid>`` once ``path`` is back in place; scratch directories whose recorded writer is a
    dead process on this host. Kept: anything a live or remote writer may still use, and names meshfit
    did not provably write.
    """
    path = os.path.abspath(os.fspath(path))
    recover(path)
    exists = os.path.lexists(path)
    for kind, found in _siblings(path).items():
        for scratch in found:
            match = _SCRATCH.match(os.path.basename(scratch))
            if match is not None and _removable(scratch, kind, match["pid"], exists):
                with contextlib.suppress(OSError):
                    remove_tree(scratch)


def clean_directory(directory: str | os.PathLike) -> None:
    """`clean_siblings` for every target in ``directory`` that has scratch siblings."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        names = os.listdir(directory)
    except OSError:
        return
    targets = {m["target"] for m in map(_SCRATCH.match, names) if m is not None}
    for target in sorted(targets):
        clean_siblings(os.path.join(directory, target))


class AtomicDirectory:
    """A directory published atomically: `create` a scratch copy, fill it, `finalize` or `discard`.

    Args:
        path: the final directory.
        scratch: the scratch directory's path; default ``<path>.tmp-<pid>``. Collective writers pass
            a name every rank can derive (``<path>.tmp``) since they all write into it.

    Example:
        >>> import os, tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "model")
        >>> directory = AtomicDirectory(target)
        >>> scratch = directory.create()
        >>> with open(os.path.join(scratch, "a.txt"), "w") as f:
        ...     _ = f.write("hello")
        >>> directory.finalize()
        >>> os.listdir(target)
        ['a.txt']
    """

    def __init__(self, path: str | os.PathLike, scratch: str | os.PathLike | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.parent = os.path.dirname(self.path)
        self.scratch = os.path.abspath(os.fspath(scratch)) if scratch else f"{self.path}.tmp-{os.getpid()}"

    def create(self) -> str:
        """Recovers ``path`` if needed, clears a stale scratch of the same name, returns an empty scratch."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise FileExistsError(f"Invalid `path`: expected a directory to write, received path={self.path!r}, "
                                  "an existing file. Choose another path or remove the file.")
        os.makedirs(self.parent, exist_ok=True)
        recover(self.path)
        if os.path.lexists(self.scratch):  # our own name: left over by a crashed earlier attempt
            shutil.rmtree(self.scratch)
        os.makedirs(self.scratch)
        mark_writer(self.scratch)
        return self.scratch

    def finalize(self) -> None:
        """Fsyncs the scratch copy and renames it to ``path`` (replacing an older copy), then cleans up."""
        _fsync_tree(self.scratch)
        old = f"{self.path}.old-{os.getpid()}"
        recover(self.path)
        for attempt in range(3):
            had_old = os.path.lexists(self.path)
            if had_old:
                if os.path.lexists(old):
                    remove_tree(old)
                os.replace(self.path, old)
            try:
                os.replace(self.scratch, self.path)
                break
            except OSError:
                # A reader that saw no ``path`` for the whole grace period (this process stalled
                # between its renames) put the previous copy back: move it aside again and retry.
                if attempt < 2 and os.path.isdir(self.scratch) and os.path.lexists(self.path):
                    continue
                if had_old and not os.path.lexists(self.path):
                    os.replace(old, self.path)  # put the previous copy back rather than leave nothing
                self.discard()
                raise
            except BaseException:
                if had_old and not os.path.lexists(self.path):
                    os.replace(old, self.path)
                self.discard()
                raise
        fsync_directory(self.parent)
        if had_old:
            with contextlib.suppress(OSError):
                remove_tree(old)
        clean_siblings(self.path)

    def discard(self) -> None:
        """Removes the scratch copy (a failed write); ``path`` is left as it was."""
        shutil.rmtree(self.scratch, ignore_errors=True)

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """``create``, yield the scratch path, then ``finalize`` on success or ``discard`` on error."""
        scratch = self.create()
        try:
            yield scratch
        except BaseException:
            self.discard()
            raise
        self.finalize()
