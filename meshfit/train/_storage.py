"""Files and process groups behind meshfit checkpoints: atomic publishes, completeness, safe DCP reads."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshfit._io import fsync_directory

STATE_FILE = "meshfit_state.json"  # written by rank 0, inside each checkpoint directory
DCP_METADATA = ".metadata"  # DCP's commit marker, written last by its coordinator
TMP_SUFFIX = ".tmp"
_SCRATCH_SUFFIXES = (TMP_SUFFIX, ".old", ".deleting")
_NUMBERED = re.compile(r"^(?P<name>.+)-(?P<number>\d+)$")


# --- files -------------------------------------------------------------------------------------

def remove_tree(path: str, background: bool = False) -> None:
    """Delete a checkpoint directory so that no crash leaves a half-deleted one that looks complete.

    The rename to ``<path>.deleting`` is the commit; with ``background`` the files are then removed
    on a thread, off the training step's critical path (readers ignore ``.deleting`` folders).
    """
    if not os.path.lexists(path):
        return
    doomed = path + ".deleting"
    if os.path.lexists(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    if background:
        threading.Thread(target=shutil.rmtree, args=(doomed, True), name="meshfit-prune").start()
    else:
        shutil.rmtree(doomed, ignore_errors=True)


def publish_directory(tmp: str, final: str) -> None:
    """Rename the finished ``tmp`` directory to ``final``, replacing an older ``final`` if present.

    Replacing keeps the old directory until the new one is in place (``final`` -> ``final.old``,
    ``tmp`` -> ``final``, then ``final.old`` is deleted), so a crash leaves one complete copy.
    """
    parent = os.path.dirname(os.path.abspath(final))
    old = final + ".old"
    if os.path.lexists(final):
        if os.path.lexists(old):
            shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if os.path.lexists(old) and not os.path.lexists(final):
            os.replace(old, final)  # put the previous checkpoint back
        raise
    fsync_directory(parent)
    if os.path.lexists(old):
        shutil.rmtree(old, ignore_errors=True)


def prepare_directory(tmp: str) -> None:
    """Rank 0: start a save from an empty ``tmp`` (a crashed save may have left one)."""
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)


def commit_directory(tmp: str, final: str, document: Any) -> None:
    """Rank 0: write ``document`` as the JSON state into ``tmp``, fsync, then publish ``tmp`` as ``final``.

    On failure ``tmp`` is removed and the error re-raised; an older ``final`` is left as it was.
    """
    try:
        with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(document, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_directory(tmp)
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a finished checkpoint: final name, DCP ``.metadata`` and the JSON state."""
    path = os.fspath(path)
    name = os.path.basename(os.path.normpath(path))
    if name.endswith(_SCRATCH_SUFFIXES):
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        with open(os.path.join(os.fspath(self.path), name), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{os.path.join(os.fspath(self.path), name)} does not hold DCP metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --- process groups ------------------------------------------------------------------------------

_GROUPS: dict[str, tuple[Any, Any]] = {}  # purpose -> (the WORLD group it belongs to, group)


def _cached_gloo_group(purpose: str) -> Any:
    world = dist.group.WORLD
    cached = _GROUPS.get(purpose)
    if cached is not None and cached[0] is world:
        return cached[1]
    group = dist.new_group(backend="gloo")
    _GROUPS[purpose] = (world, group)
    return group


def control_group() -> Any:
    """The group for checkpoint bookkeeping collectives (CPU tensors): the default one if it has gloo.

    Must be called on every rank at the same point (creating a group is collective).
    """
    if "gloo" in str(dist.get_backend()):
        return None
    return _cached_gloo_group("control")


def async_group() -> Any:
    """A dedicated gloo group for background saves, created lazily on every rank.

    An async save runs DCP's collectives from a background thread while the training thread keeps
    issuing its own collectives. Collectives on one group must be issued in the same order on every
    rank; two threads sharing the default group would interleave them differently per rank and
    deadlock or mix up data. A separate group keeps the two streams apart. gloo, because DCP's
    async save requires a CPU-capable group.
    """
    return _cached_gloo_group("async")


def broadcast_status(ok: bool, group: Any) -> bool:
    """Rank 0 tells every rank whether it succeeded; doubles as the barrier that ends a save."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.broadcast(flag, src=0, group=group)  # meshfit groups span the world: rank 0 is global 0
    return bool(flag.item())


def all_gather_text(text: str, group: Any) -> list[str]:
    """Every rank's ``text``, by rank, moved as bytes tensors (no pickling)."""
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(text.encode("utf-8")) or bytearray(b" "), dtype=torch.uint8)
    size = torch.tensor([len(text.encode("utf-8"))], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(max(int(s.item()) for s in sizes), 1)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(g[: int(s.item())].tolist()).decode("utf-8") for g, s in zip(gathered, sizes, strict=True)]
