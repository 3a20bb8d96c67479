"""`Checkpoint`: save and restore stateful objects with torch.distributed.checkpoint, atomically."""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any, Literal, overload

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshfit._protocols import ChoosesSavedRank
from meshfit._storage import CorruptFileError, StateMismatchError, chief_writes
from meshfit._storage import tagged_json as _tree
from meshfit._validation import path_like
from meshfit.distribute import current_world
from meshfit.train import _background, _storage
from meshfit.train._chief_alone import with_every_ranks_own
from meshfit.train._compatibility import check_module_fits
from meshfit.train._digest import verify_loaded
from meshfit.train._entries import destination as _destination
from meshfit.train._entries import entry_for as _entry_for
from meshfit.train._own_copies import save_own_copy
from meshfit.train._per_rank import PerRank, is_trackable
from meshfit.train._save_future import SaveFuture
from meshfit.train._snapshot import take_snapshot
from meshfit.train._store import CheckpointStore, FileSystemStore, dcp_error, scratch

_FORMAT = "meshfit.train.Checkpoint"
_VERSION = 1
_pending_lock = threading.Lock()
_pending_save: SaveFuture | None = None  # the async save in flight in this process, if any


def _wait_for_pending_save() -> None:
    """Let the async save in flight finish first: saves and restores must not overlap."""
    with _pending_lock:
        pending = _pending_save
    if pending is not None:
        pending.exception()  # its failure belongs to whoever holds that future


def _silence_single_process_warning() -> None:
    # DCP warns on every call without a process group; meshfit supports that case on purpose.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class Checkpoint:
    """Saves and restores stateful objects (modules, optimizers, data positions, RNG streams...).

    A trackable is anything with ``state_dict()`` / ``load_state_dict()``, or a ``torch.Tensor``
    (restored in place). Wrap a trackable in :class:`PerRank` when its state differs between ranks.
    Saving is collective when torch.distributed is initialized (every rank calls ``save`` with the
    same path, on a file system all ranks share) and also works in a plain process.

    Tensors go through ``torch.distributed.checkpoint`` (DCP): a tensor present on several ranks is
    written once (a module's buffers, e.g. batch-norm statistics, from rank 0: the copy DDP trains
    with; other shared tensors must be equal on every rank, or the save is refused), and DTensor
    shards are written by their owners and resharded on load. Everything else in the state dicts (ints, floats, strings, lists, dicts with int or str keys, bytes, e.g.
    an optimizer's ``param_groups``) is written by rank 0 as JSON. Nothing is pickled: loading reads
    JSON, DCP tensor data (``weights_only``) and DCP metadata restricted to DCP's own types.

    On disk, ``save("run/ckpt-3")`` produces::

        run/
          ckpt-3.tmp/              while writing (ignored by readers; cleared by the next save)
          ckpt-3/                  after rank 0's atomic rename, once every rank has written
            __0_0.distcp           tensor data written by rank 0 (DCP)
            __1_0.distcp           tensor data written by rank 1 (DCP; one file per writing rank:
                                   a small replicated state, 64 MiB or less, is written by rank 0 alone)
            .metadata              DCP's index of every tensor, written last by rank 0
            meshfit_state.json     rank 0: {"format", "version", "world_size", "trackables": {
                                     name: {"kind": "stateful" | "tensor", "per_rank": bool,
                                            "state": <tree>}            (shared state)
                                     name: {..., "ranks": [<tree of rank 0>, <tree of rank 1>]}}}

    A ``<tree>`` is the state dict as tagged JSON (see ``meshfit/_storage/_tagged_json.py``); each tensor in
    it is ``{"tensor": "<DCP key>"}`` with key ``<name>/<path>`` (``optimizer/state/0/exp_avg``), or
    ``<name>/rank<r>/<path>`` for a :class:`PerRank` trackable. A directory is a checkpoint only when
    it has its final name, ``.metadata`` and ``meshfit_state.json``.

    Args:
        **trackables: the objects to save, by name (names may not contain ``/``).

    Raises:
        TypeError: a value is not trackable.
        ValueError: a name is empty or contains ``/``.

    Example:
        >>> import tempfile, torch
        >>> from meshfit.train import Checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> step = torch.tensor(7)
        >>> ckpt = Checkpoint(model=model, step=step)
        >>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt-1")
        >>> _ = step.fill_(0)
        >>> ckpt.restore(path)
        >>> int(step)
        7
    """

    def __init__(self, **trackables: Any) -> None:
        self._trackables: dict[str, tuple[Any, bool]] = {}
        for name, value in trackables.items():
            if not name or "/" in name:
                raise ValueError(f"Invalid trackable name {name!r}: expected a non-empty name without '/'.")
            per_rank = isinstance(value, PerRank)
            target = value.trackable if per_rank else value
            if not is_trackable(target):
                raise TypeError(
                    f"Invalid trackable `{name}`: expected a torch.Tensor or an object with state_dict() "
                    f"and load_state_dict() (module, optimizer, ...), received {type(target).__name__} "
                    f"{target!r:.80}. Wrap plain values in an object that has those two methods.")
            self._trackables[name] = (target, per_rank)
        self._staging = _background.Staging()  # async saves copy into the same buffers each time
        # The `meshfit.distribute.World` saves and restores run in: set by whoever owns the job (a
        # saver sets its strategy's); None: the job's world, found when first needed.
        self.world: Any = None
        # Where snapshots go (the storage seam): DCP on a file system unless someone sets another.
        self.store: CheckpointStore = FileSystemStore(_FORMAT, _VERSION)
        self._save_counter = 0

    @property
    def save_counter(self) -> int:
        """How many times this checkpoint was saved (TF's ``save_counter``): counted by :meth:`save`, written
        into each checkpoint and set back by :meth:`restore` (a checkpoint written before meshfit recorded it
        leaves it as is)."""
        return self._save_counter

    def _job_world(self) -> Any:
        if self.world is None:
            return current_world()
        return self.world

    @property
    def trackables(self) -> Mapping[str, Any]:
        """The tracked objects by name (``PerRank`` wrappers unwrapped), read-only."""
        return MappingProxyType({name: target for name, (target, _) in self._trackables.items()})

    def __repr__(self) -> str:
        names = ", ".join(f"{n}=PerRank(...)" if pr else n for n, (_, pr) in self._trackables.items())
        return f"Checkpoint({names})"

    @overload
    def save(self, path: str | os.PathLike, async_save: Literal[False] = False, *,
             on_commit: Callable[..., None] | None = None) -> str: ...

    @overload
    def save(self, path: str | os.PathLike, async_save: Literal[True], *,
             on_commit: Callable[..., None] | None = None) -> SaveFuture: ...

    @overload
    def save(self, path: str | os.PathLike, async_save: bool, *,
             on_commit: Callable[[str], None] | None = None) -> str | SaveFuture: ...

    def save(self, path: str | os.PathLike, async_save: bool = False, *,
             on_commit: Callable[..., None] | None = None) -> str | SaveFuture:
        """Write a checkpoint directory at ``path``, collectively when a process group exists.

        Data goes into ``<path>.tmp``; once every rank has written and DCP has committed its
        ``.metadata``, rank 0 adds ``meshfit_state.json`` (fsynced) and renames the directory to
        ``path``; a final collective makes every rank return only after that. A crash at any point
        leaves no directory named ``path`` that looks complete, and any older checkpoint untouched.
        An existing ``path`` is replaced (it is moved aside only after the new one is complete).

        Args:
            path: the checkpoint directory to write.
            async_save: return once the tensors are staged (copied into CPU buffers reused from one
                save to the next); the write (DCP's ``save`` on a dedicated gloo group) continues on
                a background thread. The buffers (one CPU copy of the tensors) stay allocated
                for the next save. Only one async save is in flight per process: any later save
                or restore waits for it first.
            on_commit: called with the path on every rank once the checkpoint is complete (and
                ``own_copy=True`` when the ranks saved replicated state to different paths, each a
                whole copy: seed 000's ``write_filepath`` dance; see ``_own_copies.py``) (before
                an async save's future resolves); `CheckpointManager` records its checkpoints so.

        Returns:
            The absolute path written, or with ``async_save=True`` a :class:`SaveFuture` whose
            ``result()`` returns that path once the checkpoint is complete on every rank.

        Raises:
            TypeError: a state dict holds a value that cannot be saved without pickling.
            RuntimeError: writing failed on some rank (the message names each) or rank 0 could not
                publish the directory; the partial ``.tmp`` directory is removed.
        """
        global _pending_save
        path = os.path.abspath(path_like("path", path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise FileExistsError(f"Invalid `path`: expected a checkpoint directory to write, received path={path!r}, "
                                  "an existing file. Choose another path or remove the file.")
        _wait_for_pending_save()
        store = self.store
        world = self._job_world()
        distributed = world.distributed
        if not distributed:
            _silence_single_process_warning()
        group = world.control()
        rank = world.rank
        self._save_counter += 1  # before writing, as TF: the checkpoint records the save that wrote it
        snapshot = take_snapshot(self._trackables, path, lambda: store.prepare(path), world,
                                 {"format": _FORMAT, "version": _VERSION})
        tensors, document, own_paths, alone = snapshot.tensors, snapshot.document, snapshot.own_paths, snapshot.alone
        document["save_counter"] = self._save_counter
        if own_paths is not None:  # TF's write_filepath dance: each rank writes a whole copy (_own_copies.py)
            def write() -> None:
                _silence_single_process_warning()  # DCP without its group: this rank writes everything
                store.prepare(path)
                store.write(tensors, path, None, False, 0)
                store.commit(path, document)
            save_own_copy(write, own_paths, rank, group)
            if on_commit is not None:
                on_commit(path, own_copy=True)
            done: Future[str] = Future()  # written before returning, also with async_save
            done.set_result(path)
            return SaveFuture(path, done) if async_save else path
        if alone is not None:  # small replicated state: the chief writes it all (see _chief_alone.py)
            return self._save_alone(tensors, alone, document, path, async_save, on_commit)
        if not async_save:
            store.write(tensors, path, group, distributed, rank)
            _rank0_step(lambda: store.commit(path, document), distributed, rank, group, f"publish {path!r}")
            if on_commit is not None:
                on_commit(path)
            return path

        save_group = world.async_group() if distributed else None
        try:
            staged = self._staging.stage(tensors)  # the only copy on this thread; training may go on
        except BaseException:
            if rank == 0:
                shutil.rmtree(scratch(path), ignore_errors=True)
            raise

        def write_and_commit() -> str:
            store.write(staged, path, save_group, distributed, rank)
            _rank0_step(lambda: store.commit(path, document), distributed, rank, save_group, f"publish {path!r}")
            if on_commit is not None:
                on_commit(path)
            return path

        future = SaveFuture(path, _background.submit(write_and_commit))
        with _pending_lock:
            _pending_save = future
        return future

    def _save_alone(self, tensors: dict[str, torch.Tensor], per_rank_keys: list[str], document: dict, path: str,
                    async_save: bool, on_commit: Callable[..., None] | None) -> str | SaveFuture:
        """Rank 0 writes the whole checkpoint, every rank's per-rank tensors gathered to it first.

        Only the per-rank tensors leave the other ranks (and only they are staged there); the
        outcome reaches every rank through the commit's gather, as in a split save.
        """
        global _pending_save
        world = self._job_world()
        rank, store = world.rank, self.store
        group = world.async_group() if async_save else world.control()
        own = tensors if rank == 0 else {key: tensors[key] for key in per_rank_keys}
        try:
            staged = self._staging.stage(own) if async_save else own
        except BaseException:
            if rank == 0:
                shutil.rmtree(scratch(path), ignore_errors=True)
            raise

        def write_and_commit() -> str:
            every = with_every_ranks_own(staged, per_rank_keys, group)  # collective

            def write() -> None:
                _silence_single_process_warning()  # DCP without its group: this rank writes everything
                store.write(every, path, None, False, 0)
                store.commit(path, document)

            _rank0_step(write, True, rank, group, f"write and publish {path!r}")
            if on_commit is not None:
                on_commit(path)
            return path

        if not async_save:
            return write_and_commit()
        future = SaveFuture(path, _background.submit(write_and_commit))
        with _pending_lock:
            _pending_save = future
        return future

    def restore(self, path: str | os.PathLike | None) -> None:
        """Load the checkpoint at ``path`` into the tracked objects, in place (collective).

        Tracked names missing from the checkpoint are an error; names in the checkpoint that are
        not tracked here are ignored. A :class:`PerRank` trackable on rank ``r`` gets the state
        saved by rank ``r % saved_world_size`` (so a 1-process restore of a 2-rank checkpoint gets
        rank 0's). Tensors already present in the current state dicts with the saved shape and dtype
        are loaded into in place (DTensors are resharded); missing ones (e.g. a fresh optimizer's
        state) are created on the CPU.

        Args:
            path: a checkpoint directory written by :meth:`save`; None does nothing (TF's
                ``ckpt.restore(latest_checkpoint(d))`` on a first run, when ``d`` is empty).

        Raises:
            FileNotFoundError: nothing at ``path``; the message lists complete checkpoints beside it.
            ValueError: ``path`` is incomplete or corrupt (a data file whose CRC-32C differs from the
                one recorded at save time raises `ChecksumError` naming it, on every rank), or does
                not match the tracked objects (a module's parameter names or shapes differ: a
                ``StateMismatchError`` naming the parameter and both shapes).
            RuntimeError: reading tensor data failed (on any rank; the message names each rank).
        """
        if path is None:  # TF's first-run idiom: ckpt.restore(latest_checkpoint(d)) on an empty d
            return
        path = os.path.abspath(path_like("path", path))
        _wait_for_pending_save()
        store = self.store
        document = store.read_document(path)
        world = self._job_world()
        distributed = world.distributed
        if not distributed:
            _silence_single_process_warning()
        group = world.control()
        rank = world.rank
        store.verify(path, document, distributed, group)
        reader = store.reader(path)
        try:
            stored = reader.read_metadata().state_dict_metadata
        except Exception as error:
            raise CorruptFileError(f"Checkpoint {path!r} has unreadable DCP metadata "
                                   f"{os.path.join(path, _storage.DCP_METADATA)!r}: {error}") from error
        saved = document["trackables"]
        destinations: dict[str, torch.Tensor] = {}
        plans = []
        for name, (target, per_rank) in self._trackables.items():
            entry = _entry_for(saved, name, target, per_rank, path)
            tree = entry["ranks"][_saved_rank(target, entry["ranks"], rank)] if per_rank else entry["state"]
            current = target if isinstance(target, torch.Tensor) else target.state_dict()
            if isinstance(target, torch.nn.Module):  # before reading: name the parameter, not torch's error
                check_module_fits(name, target, _tree.tensor_refs(tree), stored, path)
            for key, sub_path in _tree.tensor_refs(tree):
                destinations[key] = _destination(stored.get(key), _tree.lookup(current, sub_path), key, path)
            plans.append((name, target, tree))
        try:
            dcp.load(destinations, storage_reader=reader, process_group=group, no_dist=not distributed)
        except CheckpointException as error:
            raise dcp_error(error, "read", path) from error
        if "digest" in document:  # what was loaded is what the save recorded, before anything uses it
            verify_loaded(destinations, document["digest"], world, path)

        def load(key: str, as_ndarray: bool) -> Any:
            return destinations[key].numpy() if as_ndarray else destinations[key]

        for name, target, tree in plans:
            state = _tree.decode(tree, load, name)
            if isinstance(target, torch.Tensor):
                if state is not target:
                    with torch.no_grad():
                        target.copy_(state)
            else:
                try:
                    target.load_state_dict(state)
                except StateMismatchError as error:  # e.g. a data position saved on other data
                    raise StateMismatchError(f"Checkpoint {path!r} ({name!r}): {error}") from error
        self._restore_save_counter(document)

    def _restore_save_counter(self, document: dict) -> None:
        """Take the saved ``save_counter`` back (absent from checkpoints of an older meshfit)."""
        counter = document.get("save_counter")
        if isinstance(counter, int) and not isinstance(counter, bool) and counter >= 0:
            self._save_counter = counter


def _rank0_step(step: Callable[[], None], distributed: bool, rank: int, group: Any, what: str) -> None:
    """Run ``step`` on rank 0 and make every rank raise if it failed (`meshfit._storage._chief.chief_writes`)."""
    def gather(text: str) -> list[str]:
        return _storage.all_gather_text(text, group) if distributed else [text]

    chief_writes(step, is_chief=rank == 0, gather=gather, what=f"save the checkpoint: rank 0 could not {what}")


def _saved_rank(target: Any, saved: list[Any], rank: int) -> int:
    """Which saved rank's state a `PerRank` trackable on ``rank`` restores: its own choice by the saved ranks'
    roles (`ChoosesSavedRank`: a pipeline stage restores a rank that held its stages), else ``rank % saved``."""
    if isinstance(target, ChoosesSavedRank):
        return target.choose_saved([_role_of(tree) for tree in saved], rank)
    return rank % len(saved)


def _role_of(tree: Any) -> str | None:
    """The ``"role"`` entry of a saved state's encoded tree (a plain string), or None."""
    items = tree.get("dict") if isinstance(tree, dict) else None
    for item in items or ():
        if isinstance(item, list) and len(item) == 2 and item[0] == "role" and isinstance(item[1], str):
            return item[1]
    return None
