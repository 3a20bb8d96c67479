"""``Model.save`` / ``load_model``: safetensors weights and JSON, never pickle.

A saved model is a directory, written atomically (a temporary sibling renamed into place)::

    <path>/
      config.json              format, module class, architecture (when rebuildable), compile config,
                               optimizer state layout
      model.safetensors        the module's state_dict
      optimizer.safetensors    the optimizer's tensors (when it was built)

Every worker may call ``save`` on the same path: the chief writes, the others wait at a barrier,
so exactly one complete copy results and nobody reads a half-written one.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from meshfit._architecture import module_from_config, module_to_config
from meshfit._io import atomic_directory, atomic_write_json
from meshfit._weights import (
    flatten_optimizer_state,
    load_state_dict_file,
    save_state_dict,
    unflatten_optimizer_state,
)
from meshfit.losses import _resolve as _resolve_loss
from meshfit.optimizers import _optimizers

FORMAT = "meshfit.model/1"


def _chief_writes(model: Any, write: Any) -> None:
    strategy = model.strategy
    with strategy.guard():
        error: BaseException | None = None
        if strategy.is_chief:
            try:
                write()
            except BaseException as caught:  # every worker must reach the barrier, then we re-raise
                error = caught
        strategy.barrier()
        if error is not None:
            raise error


def _laid_out_like(value: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """A full tensor split like ``current`` when that is a DTensor (a mesh's layouts), else itself."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(current, DTensor):
        return value
    return distribute_tensor(value.to(current.dtype), current.device_mesh, current.placements, src_data_rank=None)


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


def save_model(model: Any, filepath: str | os.PathLike) -> None:
    path = os.fspath(filepath)
    if path.endswith(".keras"):  # one zip file holding this directory's files (meshfit._keras_archive)
        from meshfit._keras_archive import save_archive

        return save_archive(model, path)
    module = model.module
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
        raise ValueError(f"Cannot save {path!r}: the module still has lazy, uninitialised parameters. "
                         "Call fit, evaluate or predict (or model.build(sample_x)) first.")

    # Sharded (DTensor) weights and optimizer state are gathered to full tensors on every process
    # (a collective) before the chief writes them: the files hold plain, full tensors.
    weights = _gathered(module.state_dict())
    optimizer = model.optimizer
    optimizer_state = _gathered(optimizer.state_dict()) if optimizer is not None and optimizer.built else None

    def write() -> None:
        config: dict[str, Any] = {
            "format": FORMAT,
            "name": model.name,
            "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
            "architecture": module_to_config(module),
            "compile": model._compile_config,
            "optimizer_state": None,
        }
        with atomic_directory(path) as tmp:
            save_state_dict(os.path.join(tmp, "model.safetensors"), weights)
            if optimizer_state is not None:
                tensors, meta = flatten_optimizer_state(optimizer_state)
                save_state_dict(os.path.join(tmp, "optimizer.safetensors"), tensors)
                config["optimizer_state"] = meta
            atomic_write_json(os.path.join(tmp, "config.json"), config)

    _chief_writes(model, write)


def save_weights(model: Any, filepath: str | os.PathLike) -> None:
    path = os.fspath(filepath)
    parent = os.path.dirname(os.path.abspath(path))

    weights = _gathered(model.module.state_dict())

    def write() -> None:
        os.makedirs(parent, exist_ok=True)
        save_state_dict(path, weights)

    _chief_writes(model, write)


def load_weights(model: Any, filepath: str | os.PathLike) -> None:
    path = os.fspath(filepath)
    if path.endswith(".keras") and not os.path.isdir(path):  # a directory saved before .keras meant a zip
        from meshfit._keras_archive import load_archive_weights

        return load_archive_weights(model, path)
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors")
    state = load_state_dict_file(path)
    current = model.module.state_dict()
    model.module.load_state_dict({k: _laid_out_like(v, current[k]) if k in current else v for k, v in state.items()})


def _read_config(path: str) -> dict[str, Any]:
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


def load_model(filepath: str | os.PathLike, module: nn.Module | None = None, compile: bool = True) -> Any:
    """Load a model saved with ``Model.save``, in the current strategy's scope.

    Args:
        filepath: the directory ``Model.save`` wrote, or its ``.keras`` file.
        module: the module to load the weights into. Needed when the module is not made of
            standard ``torch.nn`` layers (its architecture cannot be rebuilt without running code).
        compile: restore the compile config and the optimizer state, when they were saved.

    Returns:
        A `meshfit.Model`.

    Raises:
        FileNotFoundError: nothing at ``filepath``.
        ValueError: an incomplete or corrupt save, or an architecture that needs ``module=``.
    """
    from meshfit._model import Model

    path = os.fspath(filepath)
    if path.endswith(".keras") and not os.path.isdir(path):  # a directory saved before .keras meant a zip
        from meshfit._keras_archive import load_archive

        return load_archive(path, module=module, compile=compile)
    config = _read_config(path)
    if module is None:
        if config.get("architecture") is None:
            raise ValueError(f"The model at {path!r} is a custom module ({config.get('module_class')}) whose "
                             "architecture meshfit cannot rebuild without running code. Build it yourself and "
                             "pass it: mf.load_model(path, module=MyModule(...)).")
        module = module_from_config(config["architecture"])
    module.load_state_dict(load_state_dict_file(os.path.join(path, "model.safetensors")))
    model = Model(module, name=config.get("name"))
    compile_config = config.get("compile")
    if compile and compile_config and compile_config.get("optimizer") and compile_config.get("loss"):
        model.compile(optimizer=_optimizers.deserialize(compile_config["optimizer"]),
                      loss=_resolve_loss.deserialize(compile_config["loss"]),
                      metrics=compile_config.get("metrics") or None)
        if config.get("optimizer_state") is not None:
            model.build(None)  # place the module first (a mesh's layouts replace parameters), then the optimizer
            tensors = load_state_dict_file(os.path.join(path, "optimizer.safetensors"))
            model.optimizer.load_state_dict(unflatten_optimizer_state(tensors, config["optimizer_state"]))
    return model
