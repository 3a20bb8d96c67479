"""`CheckpointStore`: where a checkpoint's snapshot goes, behind four verbs.

A `Checkpoint` takes a *snapshot* (this rank's tensors for DCP and the JSON document rank 0 writes)
and hands it to a store. `FileSystemStore` is DCP on a shared file system, atomic by a scratch
directory renamed at commit (see `meshfit.train._storage`); a store keeping snapshots in peers'
memory would implement the same verbs.
"""

from __future__ import annotations

import importlib
import logging
import shutil
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from meshfit.train import _storage


def _drop_unseen_dcp_records() -> None:
    """Stop DCP from building log records that nothing can show.

    DCP wraps each step of a save (``save``, its planning, ``write_data``, ``finish``...) in a logger
    that emits two DEBUG records per call, about 40 per save, to a logger torch sets to DEBUG with
    a ``NullHandler`` and no propagation: each record (its caller's frame looked up, a ``LogRecord``
    built) is made and discarded, on the writer thread that shares the cores with training. Only that
    default is changed (its level raised to INFO); a logger someone gave a handler of their own, or
    a level, is left as it is.
    """
    try:
        logger = importlib.import_module("torch.distributed.checkpoint.logger")._dcp_logger
    except (ImportError, AttributeError):  # another torch: its logging is its own
        return
    if (isinstance(logger, logging.Logger) and logger.level == logging.DEBUG and not logger.propagate
            and logger.handlers and all(type(h) is logging.NullHandler for h in logger.handlers)):
        logger.setLevel(logging.INFO)


_drop_unseen_dcp_records()


class CheckpointStore(Protocol):
    """The storage seam of `meshfit.train.Checkpoint` (collective where a method says so)."""

    def prepare(self, path: str) -> None:
        """Rank 0, before a save: an empty place to write ``path``'s snapshot into."""
        ...

    def write(self, tensors: dict[str, torch.Tensor], path: str, group: Any, distributed: bool, rank: int) -> None:
        """Every rank (collective): its tensors of the snapshot of ``path``."""
        ...

    def commit(self, path: str, document: dict) -> None:
        """Rank 0, after every rank wrote: publish ``path`` with its document, atomically."""
        ...

    def read_document(self, path: str) -> dict:
        """The document of the complete checkpoint ``path``."""
        ...

    def verify(self, path: str, document: dict, distributed: bool, group: Any) -> None:
        """Every rank (collective): raise on every rank if ``path``'s data does not match ``document``."""
        ...

    def reader(self, path: str) -> Any:
        """A DCP storage reader of ``path``'s tensors."""
        ...


class FileSystemStore:
    """DCP on a file system: ``<path>.tmp`` written by every rank, renamed to ``path`` by rank 0."""

    def __init__(self, format_name: str, version: int) -> None:
        self.format_name, self.version = format_name, version

    def prepare(self, path: str) -> None:
        _storage.prepare_directory(scratch(path), path)

    def write(self, tensors: dict[str, torch.Tensor], path: str, group: Any, distributed: bool, rank: int) -> None:
        """Every rank writes its DCP shards into the scratch; DCP's coordinator commits ``.metadata`` last.

        DCP's final step gathers every rank's write results on rank 0, which writes ``.metadata`` before
        answering; so when this returns on any rank, all data and the metadata are on disk (the barrier
        before the rename). A write failure on any rank raises on every rank.
        """
        tmp = scratch(path)
        try:
            # DCP caches the last plans in one class-wide slot, compared by content: a save without the
            # group (the chief alone, own copies) must neither read nor overwrite a group save's plans.
            planner = DefaultSavePlanner(enable_plan_caching=distributed)
            dcp.save(tensors, storage_writer=_storage.DiagnosingWriter(tmp), process_group=group,
                     no_dist=not distributed, planner=planner)
        except BaseException as error:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(error, CheckpointException):
                raise dcp_error(error, "write", tmp) from error
            raise

    def commit(self, path: str, document: dict) -> None:
        _storage.commit_directory(scratch(path), path, document)

    def read_document(self, path: str) -> dict:
        return _storage.read_document(path, self.format_name, self.version)

    def verify(self, path: str, document: dict, distributed: bool, group: Any) -> None:
        _storage.verify_everywhere(path, document, distributed, group)

    def reader(self, path: str) -> Any:
        return _storage.SafeFileSystemReader(path)

    def discard(self, path: str) -> None:
        """Rank 0: drop a scratch that will not be committed."""
        shutil.rmtree(scratch(path), ignore_errors=True)


def scratch(path: str) -> str:
    """The scratch name every rank derives from ``path``."""
    return path + _storage.TMP_SUFFIX


def dcp_error(error: CheckpointException, action: str, path: str) -> RuntimeError:
    """DCP's ``CheckpointException`` (a ``BaseException``) as a ``RuntimeError`` naming each failed rank."""
    failures = "; ".join(f"rank {rank}: {type(pair[0]).__name__}: {pair[0]}"
                         for rank, pair in sorted(error.failures.items()))
    return RuntimeError(f"Could not {action} checkpoint {path!r}: {failures}")
