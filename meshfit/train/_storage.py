"""Files and process groups behind meshfit checkpoints: atomic publishes, checksums, completeness, safe DCP reads."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import pickle
import re
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshfit._storage import (
    AtomicDirectory,
    ChecksumError,
    CorruptFileError,
    clean_directory,
    file_crc32,
    is_scratch_name,
    verify_file,
)

STATE_FILE = "meshfit_state.json"  # written by rank 0, inside each checkpoint directory
DCP_METADATA = ".metadata"  # DCP's commit marker, written last by its coordinator
TMP_SUFFIX = ".tmp"  # the scratch name every rank derives from the path (see meshfit._storage._atomic)
DCP_DATA = ".distcp"
_NUMBERED = re.compile(r"^(?P<name>.+)-(?P<number>\d+)$")


# --- files -------------------------------------------------------------------------------------

def prepare_directory(tmp: str, final: str) -> None:
    """Rank 0: recover ``final`` if a swap was interrupted, then start a save from an empty ``tmp``."""
    AtomicDirectory(final, scratch=tmp).create()


def publish_directory(tmp: str, final: str) -> None:
    """Rename the finished ``tmp`` directory to ``final`` (see `meshfit._storage._atomic.AtomicDirectory.finalize`)."""
    AtomicDirectory(final, scratch=tmp).finalize()


def commit_directory(tmp: str, final: str, document: Any) -> None:
    """Rank 0: record the CRC-32C of every DCP data file, write ``document`` as the JSON state into
    ``tmp``, then publish ``tmp`` as ``final``.

    On failure ``tmp`` is removed and the error re-raised; an older ``final`` is left as it was.
    """
    try:
        document = {**document, "checksums": {name: file_crc32(os.path.join(tmp, name))
                                              for name in sorted(os.listdir(tmp)) if name.endswith(DCP_DATA)}}
        with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(document))  # one C-encoded string: json.dump's chunks are Python code
            f.flush()
            os.fsync(f.fileno())
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify_checksums(path: str, document: dict) -> None:
    """Raise `ChecksumError` naming the first DCP data file of ``path`` that does not match its record."""
    recorded = document.get("checksums")
    if not isinstance(recorded, dict):
        return  # written before checksums were recorded
    for name, expected in sorted(recorded.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ChecksumError(f"Corrupt checkpoint {path!r}: data file {file!r} is missing.")
        verify_file(file, expected)


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a finished checkpoint: final name, DCP ``.metadata`` and the JSON state."""
    path = os.fspath(path)
    if is_scratch_name(path):
        return False
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))
            and os.path.isfile(os.path.join(path, STATE_FILE)))


def checkpoint_number(name: str, checkpoint_name: str | None = None) -> int | None:
    """``N`` for a directory named ``<checkpoint_name>-N`` (any name if None), else None."""
    match = _NUMBERED.match(name)
    if match is None or (checkpoint_name is not None and match["name"] != checkpoint_name):
        return None
    return int(match["number"])


def complete_checkpoints(directory: str | os.PathLike, checkpoint_name: str | None = None) -> list[str]:
    """Complete checkpoint directories in ``directory``, oldest first.

    With ``checkpoint_name``, only ``<checkpoint_name>-N`` directories count, ordered by ``N``.
    Without, every complete directory counts: numbered ones (``<anything>-N``) rank above unnumbered
    ones and by ``N``; ties (and unnumbered ones) are ordered by modification time.
    """
    directory = os.fspath(directory)
    clean_directory(directory)  # put back a copy left aside by a crashed swap; drop dead leftovers
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    ranked = []
    for name in names:
        path = os.path.join(directory, name)
        number = checkpoint_number(name, checkpoint_name)
        if checkpoint_name is not None and number is None:
            continue
        if not is_complete(path):
            continue
        try:
            mtime = os.path.getmtime(os.path.join(path, STATE_FILE))
        except OSError:
            continue
        ranked.append(((number is not None, number or 0, mtime, name), path))
    return [path for _, path in sorted(ranked)]


def verify_everywhere(path: str, document: dict, distributed: bool, group: Any) -> None:
    """Check the data files' CRC-32Cs on every rank; if any rank finds a bad file, every rank raises."""
    problem = ""
    try:
        verify_checksums(path, document)
    except (OSError, ValueError) as error:
        problem = str(error)
    problems = all_gather_text(problem, group) if distributed else [problem]
    bad = next((p for p in problems if p), "")
    if bad:
        raise ChecksumError(bad)


def read_document(path: str, format_name: str, version: int) -> dict:
    """The JSON state of the complete checkpoint at ``path``, with clear errors otherwise."""
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        found = [os.path.basename(p) for p in complete_checkpoints(parent)]
        raise FileNotFoundError(
            f"No checkpoint at {path!r}. Complete checkpoints in {parent!r}: "
            f"{found if found else 'none'}.")
    if not is_complete(path):
        missing = [n for n in (DCP_METADATA, STATE_FILE)
                   if not os.path.isfile(os.path.join(path, n))]
        raise ValueError(
            f"{path!r} is not a complete meshfit checkpoint (missing: {missing or 'a final name'}); it "
            "may be a save interrupted by a crash. Use meshfit.train.latest_checkpoint(directory) "
            "to find the newest complete one.")
    file = os.path.join(path, STATE_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError) as error:
        raise CorruptFileError(f"Checkpoint {path!r} is corrupt: cannot read {file!r}: {error}") from error
    if (not isinstance(document, dict) or document.get("format") != format_name
            or not isinstance(document.get("trackables"), dict)):
        raise CorruptFileError(f"Checkpoint {path!r} is corrupt: {file!r} is not a {format_name} state file.")
    if document.get("version") != version:
        raise ValueError(f"Checkpoint {path!r} has format version {document.get('version')!r}; this "
                         f"meshfit reads version {version}.")
    return document


# --- writing DCP data with errors that say what went wrong -------------------------------------

class DiagnosingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose failures say "No space left on device" / "Read-only file system".

    When a disk fills up, torch's zip writer reports ``enforce fail ... unexpected pos``; the errno is
    lost. On a failed write, this writer looks at the file system (before anything is cleaned up)
    and raises an ``OSError`` with the errno and the path instead.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            with _zip_crc_skipped():
                future = super().write_data(plan, planner)
                future.wait()
        except Exception as error:
            raise disk_error(os.fspath(self.path), error, _planned_bytes(plan)) from error
        return future


_crc_lock = threading.Lock()
_crc_writers = 0  # meshfit writes running now (a backup in its writer thread beside a save in the loop)
_crc_before = True  # torch's setting when the first of them began


@contextlib.contextmanager
def _zip_crc_skipped() -> Iterator[None]:
    """DCP stores each tensor as a ``torch.save`` zip, which computes a CRC-32 of every byte (4.5 of 5.7 ms
    for 11 MB here). A meshfit checkpoint already records a CRC-32C of each data file and checks it at
    every restore, so the zip's own is skipped while meshfit writes (torch's process-wide switch, as
    ``torch.serialization.set_crc32_options``; ``torch.load`` reads such zips). The user's setting is
    put back when the last concurrent write ends (unless it was turned back on meanwhile).
    """
    global _crc_writers, _crc_before
    with _crc_lock:
        if _crc_writers == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0 and not torch.serialization.get_crc32_options():
                torch.serialization.set_crc32_options(_crc_before)


def _planned_bytes(plan: Any) -> int:
    """About how many bytes this rank's DCP plan writes (tensor data only)."""
    total = 0
    for item in getattr(plan, "items", []):
        data = getattr(item, "tensor_data", None)
        if data is not None:
            numel = 1
            for size in data.chunk.sizes:
                numel *= int(size)
            total += numel * data.properties.dtype.itemsize
    return total


def disk_error(path: str, error: BaseException, needed: int) -> BaseException:
    """``error`` explained by the state of the file system holding ``path``, when that explains it."""
    try:
        stat = os.statvfs(path if os.path.exists(path) else os.path.dirname(path))
    except OSError:
        return error
    if stat.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, f"Read-only file system: cannot write checkpoint data into {path!r}")
    free = stat.f_bavail * stat.f_frsize
    if isinstance(error, OSError) and error.errno is not None:
        return type(error)(error.errno, f"{error.strerror}: cannot write checkpoint data into {path!r}")
    if free < needed:
        return OSError(errno.ENOSPC, f"No space left on device: cannot write checkpoint data into {path!r} "
                                     f"({free} bytes free, about {needed} needed)")
    return error


# --- DCP metadata without arbitrary unpickling ---------------------------------------------------

def _allowed_globals() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md

    allowed: dict[tuple[str, str], Any] = {
        (dcp_md.__name__, name): getattr(dcp_md, name) for name in (*dcp_md.__all__, "_MEM_FORMAT_ENCODING")
    }
    allowed[(dcp_fs.__name__, "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` (a pickle) allowing only DCP's plain metadata classes."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        try:
            return _MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"Refusing to load {module}.{name} from checkpoint metadata: only DCP metadata types "
                "are allowed (the file may be corrupt or not written by meshfit).") from None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` never unpickles anything but DCP metadata types.

    DCP keeps its ``.metadata`` as a pickle and reads it with a plain ``pickle.load``; tensor data is
    already read with ``torch.load(weights_only=True)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_metadata: dict[int | None, Metadata] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's DCP metadata, read once per reader: a restore reads it before loading (to name
        a mismatch), and DCP's load then gets the same object instead of opening the file again (a
        checkpoint deleted in between, an evaluator's race with retention, then fails in the data reads)."""
        rank = kwargs.get("rank")
        if rank in self._read_metadata:
            metadata = self._read_metadata[rank]
            if metadata.storage_meta is not None:
                metadata.storage_meta.load_id = self.load_id  # DCP's reset gives each load its own id
            return metadata
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        with open(os.path.join(os.fspath(self.path), name), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CorruptFileError(f"{os.path.join(os.fspath(self.path), name)} does not hold DCP metadata.")
        storage_meta = getattr(metadata, "storage_meta", None)  # files of an older torch have none
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        self._read_metadata[rank] = metadata
        return metadata


# --- process groups ------------------------------------------------------------------------------

_TEXT_CAPACITY = 16384  # bytes a rank's text may take for the one-collective path (a save's digests fit)


def all_gather_text(text: str, group: Any) -> list[str]:
    """Every rank's ``text``, by rank, moved as bytes tensors (no pickling): see `all_gather_bytes`."""
    return [data.decode("utf-8") for data in all_gather_bytes(text.encode("utf-8"), group)]


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Every rank's ``data``, by rank, moved as uint8 tensors (no pickling).

    One all-gather of each rank's length and first ``_TEXT_CAPACITY`` bytes; a second one only when
    some rank's data is longer (a save makes two of these gathers, so on a loaded machine each
    collective counts).
    """
    world = dist.get_world_size(group)
    head = torch.zeros(8 + _TEXT_CAPACITY, dtype=torch.uint8)
    head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    first = data[:_TEXT_CAPACITY]
    if first:
        head[8: 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head, group=group)
    sizes = [int.from_bytes(h[:8].numpy().tobytes(), "little") for h in heads]
    gathered = [h[8: 8 + min(size, _TEXT_CAPACITY)].numpy().tobytes() for h, size in zip(heads, sizes, strict=True)]
    longest = max(sizes)
    if longest > _TEXT_CAPACITY:  # the rest of the long ones, padded to the longest rest
        rest = longest - _TEXT_CAPACITY
        tail = torch.zeros(rest, dtype=torch.uint8)
        mine = data[_TEXT_CAPACITY:]
        if mine:
            tail[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        tails = [torch.empty_like(tail) for _ in range(world)]
        dist.all_gather(tails, tail, group=group)
        gathered = [g + tl[: max(size - _TEXT_CAPACITY, 0)].numpy().tobytes()
                    for g, tl, size in zip(gathered, tails, sizes, strict=True)]
    return gathered
