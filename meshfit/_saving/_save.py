"""``Model.save`` / ``load_model``: safetensors weights and JSON, never pickle.

A saved model is a directory, written atomically by `meshfit._storage._atomic.AtomicDirectory` (a scratch
sibling ``<path>.tmp-<pid>`` renamed into place; a crash mid-swap is recovered by the next reader
or writer)::

    <path>/
      config.json              format, module class, architecture (when rebuildable), compile config
                               (optimizer, loss, loss_weights, metrics: names or {"class_name",
                               "config"}; losses and metrics keyed by output keep compile's shape),
                               optimizer state layout
      model.safetensors        the module's state_dict; header: CRC-32C of every tensor
      optimizer.safetensors    the optimizer's tensors (when it was built); header: CRC-32Cs

A replicated model (every worker holds every weight) is saved by the chief alone, with no collective:
``if task_id == 0: model.save(path)`` works. When every worker calls ``save`` (TensorFlow's habit, on
the same path or each on its own as TensorFlow's tutorial does), the others write nothing and return
once the chief's matching save is complete (`meshfit._saving._save_barrier`, through the rendezvous
store), so ``load_model(path)`` right after works on every worker. A sharded model (DTensor weights)
needs every worker to gather its shards: each checks first that the others came
(`require_every_worker`, raising at once naming the fix otherwise); then the chief writes and the
others wait for its outcome (`meshfit._storage._chief.chief_writes`), raising if the chief's write
failed. Either way exactly one complete copy results and nobody reads a half-written one
(`AtomicDirectory`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any

from torch import nn

from meshfit._lazy_dtensor import placed_like
from meshfit._saving._architecture import module_to_config, plain_type
from meshfit._saving._every_worker import require_every_worker, split_across_workers
from meshfit._saving._keras_archive import is_archive_path, pack, unpack
from meshfit._saving._save_barrier import save_barrier
from meshfit._saving._weights import (
    flatten_optimizer_state,
    load_state_dict_file,
    save_state_dict,
)
from meshfit._storage import atomic_directory, atomic_write_json, chief_writes, recover
from meshfit.metrics import CLASSES as METRIC_CLASSES
from meshfit.metrics import builtin_config as builtin_metric_config

FORMAT = "meshfit.model/1"


_SHARDED = "the model's weights are split across the workers (mf.dtensor layouts), so saving gathers each one's shards"


def _chief_writes(model: Any, write: Any, what: str = "save the model") -> None:
    """The chief runs ``write``: alone for a replicated model; for a sharded one, every worker learns its outcome."""
    strategy = model.strategy
    if not split_across_workers(model):
        if strategy.is_chief:
            write()
        return
    with strategy.guard():
        chief_writes(write, is_chief=strategy.is_chief, gather=strategy.all_gather_object, what=what)


def _every_worker_if_sharded(model: Any, call: str) -> None:
    if split_across_workers(model):
        with model.strategy.guard():
            require_every_worker(model.strategy, call, _SHARDED)


def _named_os_error(error: OSError, path: str) -> OSError:
    """``error`` (disk full, read-only...) with the path being saved in its message."""
    if error.errno is None:
        return error
    return type(error)(error.errno, f"Cannot save to {path!r}: {error.strerror or error}")


def _metric_config(identifier: Any) -> Any:
    """A compiled metric as JSON: a string as is, a built-in metric object as {"class_name", "config"};
    metrics keyed by output (a dict, or one list per output) keep their shape."""
    if isinstance(identifier, str):
        return identifier
    if isinstance(identifier, dict):
        return {key: _metric_config(value) for key, value in identifier.items()}
    if isinstance(identifier, (list, tuple)):
        return [_metric_config(value) for value in identifier]
    cls = type(identifier)
    if METRIC_CLASSES.get(cls.__name__) is not cls:
        return {"class_name": cls.__name__, "config": None}  # not rebuildable without running code
    return {"class_name": cls.__name__, "config": builtin_metric_config(identifier)}


def _gathered(value: Any) -> Any:
    """``value`` with every DTensor in it replaced by its full tensor (collective; others unchanged)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        gathered = type(value)((k, _gathered(v)) for k, v in value.items()) if type(value) is not dict \
            else {k: _gathered(v) for k, v in value.items()}
        if hasattr(value, "_metadata"):
            gathered._metadata = value._metadata  # type: ignore[attr-defined]
        return gathered
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v) for v in value)
    return value


def _after_the_chief(model: Any, call: str, what: str) -> contextlib.AbstractContextManager[None]:
    """A replicated model's save: every worker's call returns once the chief's is complete (`save_barrier`).

    A sharded model's save is collective already (`chief_writes`): nothing more to wait for.
    """
    if split_across_workers(model):
        return contextlib.nullcontext()
    return save_barrier(model.strategy, call, what)


def save_model(model: Any, filepath: str | os.PathLike) -> None:
    path = os.path.abspath(os.fspath(filepath))
    if path.endswith((".h5", ".hdf5")):  # Keras 3 writes its legacy HDF5 here; meshfit has no such format
        raise ValueError("Invalid filepath extension for saving: meshfit does not write Keras's legacy HDF5 "
                         "format (.h5/.hdf5). Use a `.keras` extension (one file, recommended) or a folder "
                         f"path without an extension. Received: filepath={os.fspath(filepath)}")
    _every_worker_if_sharded(model, "model.save")
    with _after_the_chief(model, "model.save", f"save the model to {path!r}"):
        _save_model(model, path)


def _save_model(model: Any, path: str) -> None:
    if is_archive_path(path):  # one zip file holding this directory's files (meshfit._saving._keras_archive)
        # Beside the target, at a path every worker computes alike, under a scratch name that readers
        # (latest_checkpoint, SidecarEvaluator) skip as incomplete.
        staged = f"{path}.tmp"
        try:
            _save_model(model, staged)  # the chief writes (with a sharded model every worker waits)
            _chief_writes(model, lambda: pack(staged, path), f"save the model to {path!r}")
        finally:
            if model.strategy.is_chief:
                shutil.rmtree(staged, ignore_errors=True)
        return
    module = model.module
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
        raise ValueError(f"Cannot save {path!r}: the module still has lazy, uninitialised parameters. "
                         "Call fit, evaluate or predict (or model.build(sample_x)) first.")

    # Sharded (DTensor) weights and optimizer state are gathered to full tensors on every process
    # (a collective) before the chief writes them: the files hold plain, full tensors.
    parts = model.saveable_parts()  # a state held in parts (pipeline stages) completed from its holders
    weights = _gathered(parts["module"].state_dict())
    optimizer = model.optimizer
    optimizer_state = _gathered(parts["optimizer"].state_dict()) if optimizer is not None and optimizer.built \
        else None

    def write() -> None:
        compile_config = dict(model._compile_config) if model._compile_config else None
        if compile_config is not None:
            compile_config["metrics"] = _metric_config(model._metric_identifiers)
        config: dict[str, Any] = {
            "format": FORMAT,
            "name": model.name,
            "module_class": f"{plain_type(module).__module__}.{plain_type(module).__qualname__}",
            "architecture": module_to_config(module),
            "compile": compile_config,
            "optimizer_state": None,
        }
        try:
            with atomic_directory(path) as tmp:
                save_state_dict(os.path.join(tmp, "model.safetensors"), weights)
                if optimizer_state is not None:
                    tensors, meta = flatten_optimizer_state(optimizer_state)
                    save_state_dict(os.path.join(tmp, "optimizer.safetensors"), tensors)
                    config["optimizer_state"] = meta
                atomic_write_json(os.path.join(tmp, "config.json"), config)
        except OSError as error:
            raise _named_os_error(error, path) from error

    _chief_writes(model, write, f"save the model to {path!r}")


def save_weights(model: Any, filepath: str | os.PathLike) -> None:
    path = os.path.abspath(os.fspath(filepath))
    _every_worker_if_sharded(model, "model.save_weights")
    with _after_the_chief(model, "model.save_weights", f"save the weights to {path!r}"):
        _save_weights(model, path)


def _save_weights(model: Any, path: str) -> None:
    parent = os.path.dirname(path)
    weights = _gathered(model.saveable_parts()["module"].state_dict())

    def write() -> None:
        try:
            os.makedirs(parent, exist_ok=True)
            save_state_dict(path, weights)
        except OSError as error:
            raise _named_os_error(error, path) from error

    _chief_writes(model, write, f"save the weights to {path!r}")


def load_weights(model: Any, filepath: str | os.PathLike) -> None:
    path = os.fspath(filepath)
    if is_archive_path(path) and not os.path.isdir(path):  # a directory saved before .keras meant a zip
        with tempfile.TemporaryDirectory(prefix="meshfit-keras-") as directory:
            unpack(path, directory)
            return load_weights(model, directory)
    recover(path)
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    state = load_state_dict_file(path)
    current = model.module.state_dict()
    laid_out = {k: placed_like(v, current[k]) if k in current else v for k, v in state.items()}
    model.saveable_parts()["module"].load_state_dict(laid_out)  # a pipeline's: this rank's stages


def read_config(path: str) -> dict[str, Any]:
    recover(path)  # a save that crashed between its two renames left the previous copy aside
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path)) or "."
        nearby = sorted(os.listdir(parent))[:10] if os.path.isdir(parent) else []
        raise FileNotFoundError(f"No saved model at {path!r} (its folder holds: {nearby}). Check the path, "
                                "or save one first with model.save(path).")
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path!r} is not a complete meshfit model: {config_path!r} is missing or corrupt "
                         f"({error}). Save it again with model.save(path).") from error
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a meshfit model (format {config.get('format')!r}, expected {FORMAT!r}).")
    return config
