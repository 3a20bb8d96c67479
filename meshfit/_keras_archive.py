"""``model.save("model.keras")``: the saved-model directory zipped into one file, as Keras does.

The archive holds exactly what `meshfit._saving` writes into a directory, plus a small metadata
file, never a pickle::

    model.keras (a zip, entries stored uncompressed)
      metadata.json            {"format": "meshfit.keras/1", "meshfit_version": ..., "date_saved": ...}
      config.json              architecture, compile config, optimizer state layout (the directory's)
      model.safetensors        the module's state_dict
      optimizer.safetensors    the optimizer's tensors (when it was built)

Saving stages the directory beside the target (``<name>.staging/``, removed afterwards) and zips it into ``<name>.tmp-<pid>``, fsynced
and renamed over ``<name>``: a reader sees the old archive or the new one, never a partial one.
Loading reads only these entry names (no path in the zip reaches the file system) into a temporary
directory and loads that with the directory loader.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import zipfile
from typing import Any

from torch import nn

from meshfit import _saving
from meshfit._io import fsync_directory

ARCHIVE_FORMAT = "meshfit.keras/1"
SUFFIX = ".keras"
_METADATA = "metadata.json"
_ENTRIES = ("config.json", "model.safetensors", "optimizer.safetensors")


def is_archive_path(filepath: str | os.PathLike) -> bool:
    """Whether ``filepath`` names a ``.keras`` archive (by its suffix, as Keras decides)."""
    return os.fspath(filepath).endswith(SUFFIX)


def save_archive(model: Any, filepath: str | os.PathLike) -> None:
    """Save ``model`` as one ``.keras`` file. Every worker may call it: only the chief writes."""
    path = os.path.abspath(os.fspath(filepath))
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.module.parameters()):
        raise ValueError(f"Cannot save {path!r}: the module still has lazy, uninitialised parameters. "
                         "Call fit, evaluate or predict (or model.build(sample_x)) first.")
    # Staged beside the target, at a path every worker computes alike (only the chief writes there).
    staged = f"{path}.staging"
    try:
        _saving.save_model(model, staged)  # collective: the chief stages, every worker waits
        _saving._chief_writes(model, lambda: _zip_directory(staged, path))
    finally:
        if model.strategy.is_chief:
            shutil.rmtree(staged, ignore_errors=True)


def _zip_directory(directory: str, path: str) -> None:
    from meshfit import __version__

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


def _extract(path: str, directory: str) -> None:
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


def load_archive(filepath: str | os.PathLike, module: nn.Module | None = None, compile: bool = True) -> Any:
    """Load a model saved as ``.keras`` (arguments as `meshfit.load_model`)."""
    path = os.fspath(filepath)
    with tempfile.TemporaryDirectory(prefix="meshfit-keras-") as directory:
        _extract(path, directory)
        return _saving.load_model(directory, module=module, compile=compile)


def load_archive_weights(model: Any, filepath: str | os.PathLike) -> None:
    """Load only the module weights of a ``.keras`` archive into ``model``."""
    path = os.fspath(filepath)
    with tempfile.TemporaryDirectory(prefix="meshfit-keras-") as directory:
        _extract(path, directory)
        _saving.load_weights(model, directory)
