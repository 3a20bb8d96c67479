"""``model.save("model.keras")``: the saved-model directory zipped into one file, as Keras does.

The archive holds exactly what `meshfit._saving._save` writes into a directory, plus a small metadata
file, never a pickle::

    model.keras (a zip, entries stored uncompressed)
      metadata.json            {"format": "meshfit.keras/1", "meshfit_version": ..., "date_saved": ...}
      config.json              architecture, compile config, optimizer state layout (the directory's)
      model.safetensors        the module's state_dict
      optimizer.safetensors    the optimizer's tensors (when it was built)

`meshfit._saving._save` stages the directory beside the target (``<name>.tmp/``, a scratch name readers skip; removed afterwards)
and `pack` zips it into ``<name>.tmp-<pid>``, fsynced and renamed over ``<name>``: a reader sees the
old archive or the new one, never a partial one. `unpack` copies only these entry names (no path in
the zip reaches the file system) into a directory, which the directory loader then reads.
"""

from __future__ import annotations

import datetime
import json
import os
import zipfile

from meshfit._storage import fsync_directory
from meshfit._version import __version__

ARCHIVE_FORMAT = "meshfit.keras/1"
SUFFIX = ".keras"
_METADATA = "metadata.json"
_ENTRIES = ("config.json", "model.safetensors", "optimizer.safetensors")


def is_archive_path(filepath: str | os.PathLike) -> bool:
    """Whether ``filepath`` names a ``.keras`` archive (by its suffix, as Keras decides)."""
    return os.fspath(filepath).endswith(SUFFIX)


def pack(directory: str, path: str) -> None:
    """Zip the saved-model ``directory`` into the archive ``path``, atomically."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    metadata = {"format": ARCHIVE_FORMAT, "meshfit_version": __version__,
                "date_saved": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as raw:
            with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED) as archive:
                archive.writestr(_METADATA, json.dumps(metadata, indent=2) + "\n")
                for name in _ENTRIES:
                    source = os.path.join(directory, name)
                    if os.path.exists(source):
                        archive.write(source, arcname=name)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_directory(os.path.dirname(path))


def _open_archive(path: str) -> zipfile.ZipFile:
    if not os.path.isfile(path):
        parent = os.path.dirname(path) or "."
        nearby = sorted(os.listdir(parent))[:10] if os.path.isdir(parent) else []
        raise FileNotFoundError(f"No saved model at {path!r} (its folder holds: {nearby}). Check the path, "
                                "or save one first with model.save(path).")
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as error:
        raise ValueError(f"{path!r} is not a meshfit .keras archive: it is not a zip file ({error}). "
                         "Save it again with model.save(path).") from error
    try:
        metadata = json.loads(archive.read(_METADATA))
    except (KeyError, ValueError) as error:
        archive.close()
        raise ValueError(f"{path!r} is not a meshfit .keras archive: {_METADATA} is missing or corrupt "
                         f"({error}). Save it again with model.save(path).") from error
    if not isinstance(metadata, dict) or metadata.get("format") != ARCHIVE_FORMAT:
        archive.close()
        received = metadata.get("format") if isinstance(metadata, dict) else metadata
        raise ValueError(f"{path!r} is not a meshfit .keras archive (format {received!r}, expected "
                         f"{ARCHIVE_FORMAT!r}).")
    return archive


def unpack(path: str, directory: str) -> None:
    """Copy the archive's known entries into ``directory`` (names fixed here, never from the zip)."""
    with _open_archive(path) as archive:
        present = set(archive.namelist())
        missing = [name for name in _ENTRIES[:2] if name not in present]
        if missing:
            raise ValueError(f"{path!r} is an incomplete .keras archive: {missing} missing. Save it again with "
                             "model.save(path).")
        for name in _ENTRIES:
            if name in present:
                with archive.open(name) as source, open(os.path.join(directory, name), "wb") as target:
                    while chunk := source.read(1 << 20):
                        target.write(chunk)
