"""`load_checkpoint`: read single tensors of a checkpoint without the objects that saved it (TF's reader)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshfit._validation import path_like
from meshfit.train import _storage


class CheckpointReader:
    """Reads the tensors of a complete checkpoint by name, as ``tf.train.load_checkpoint`` does.

    Names are the checkpoint's storage keys, ``<trackable>/<path>`` (``model/weight``,
    ``optimizer/state/0/exp_avg``; ``<trackable>/rank<r>/...`` for a `PerRank` trackable). The data
    files' checksums are verified when the reader is created.

    Args:
        path: a checkpoint directory written by ``Checkpoint.save``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` is not a complete checkpoint, or is corrupt (the message names the file).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.path.abspath(path_like("path", path))
        document = _storage.read_document(self.path, "meshfit.train.Checkpoint", 1)
        _storage.verify_checksums(self.path, document)
        metadata = _storage.SafeFileSystemReader(self.path).read_metadata().state_dict_metadata
        self._tensors = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}

    def get_variable_to_shape_map(self) -> dict[str, list[int]]:
        """``{name: shape}`` for every tensor in the checkpoint."""
        return {name: list(meta.size) for name, meta in sorted(self._tensors.items())}

    def get_variable_to_dtype_map(self) -> dict[str, torch.dtype]:
        """``{name: dtype}`` for every tensor in the checkpoint."""
        return {name: meta.properties.dtype for name, meta in sorted(self._tensors.items())}

    def has_tensor(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor called ``name``."""
        return name in self._tensors

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor called ``name``, on the CPU (``.numpy()`` gives TF's return type).

        Raises:
            KeyError: no such tensor; the message lists the names there are.
        """
        if name not in self._tensors:
            raise KeyError(f"Checkpoint {self.path!r} has no tensor {name!r}; it holds {sorted(self._tensors)}.")
        meta = self._tensors[name]
        out = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(out, storage_reader=_storage.SafeFileSystemReader(self.path), no_dist=True)
        return out[name]


def load_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """A :class:`CheckpointReader` for the checkpoint at ``path`` (TF's ``tf.train.load_checkpoint``).

    Example:
        >>> import tempfile, torch
        >>> from meshfit.train import Checkpoint, load_checkpoint
        >>> path = Checkpoint(step=torch.tensor(7)).save(tempfile.mkdtemp() + "/ckpt-1")
        >>> reader = load_checkpoint(path)
        >>> reader.get_variable_to_shape_map(), int(reader.get_tensor("step"))
        ({'step': []}, 7)
    """
    return CheckpointReader(path)
