"""`load_model`: a `Model` rebuilt from what ``Model.save`` wrote (a directory or a ``.keras`` file)."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

from torch import nn

from meshfit._engine._model import Model
from meshfit._saving import (
    is_archive_path,
    load_state_dict_file,
    module_from_config,
    read_config,
    unflatten_optimizer_state,
    unpack,
)
from meshfit.losses import deserialize as deserialize_loss
from meshfit.metrics import CLASSES as METRIC_CLASSES
from meshfit.optimizers import deserialize as deserialize_optimizer


def _loss_from_config(config: Any) -> Any:
    """compile's ``loss`` from the saved config: one loss, or a dict / list of them keyed by output."""
    if isinstance(config, dict) and "class_name" not in config:
        return {key: None if value is None else deserialize_loss(value) for key, value in config.items()}
    if isinstance(config, list):
        return [None if value is None else deserialize_loss(value) for value in config]
    return deserialize_loss(config)


def _metrics_from_config(entries: Any, path: str) -> Any:
    """The metrics `_metric_config` described (a dict keyed by output keeps its shape, a list of one list
    per output too); ones that cannot be rebuilt are reported and skipped."""
    if isinstance(entries, dict):
        return {key: _metrics_from_config(value if isinstance(value, list) else [value], path)
                for key, value in entries.items()}
    out: list[Any] = []
    for entry in entries:
        if isinstance(entry, list):
            out.append(_metrics_from_config(entry, path))
        elif isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, dict) and isinstance(entry.get("config"), dict):
            cls = METRIC_CLASSES.get(str(entry.get("class_name")))
            if cls is None:
                raise ValueError(f"unknown metric class_name={entry.get('class_name')!r}; expected one of "
                                 f"{sorted(METRIC_CLASSES)}")
            out.append(cls(**entry["config"]))
        else:
            name = entry.get("class_name") if isinstance(entry, dict) else entry
            warnings.warn(f"load_model({path!r}): metric {name!r} is a custom object and was not restored; "
                          "compile the loaded model again with it.", RuntimeWarning, stacklevel=3)
    return out


def _naming_the_archive(error: BaseException, directory: str, path: str) -> BaseException:
    """``error`` with the archive's own name where it named the folder it was unpacked into."""
    def named(text: str) -> str:
        return text.replace(directory + os.sep, f"{path}:").replace(directory, path)

    if isinstance(error, OSError) and error.errno is not None:
        return type(error)(error.errno, named(error.strerror or ""), named(str(error.filename or "")) or None)
    message = named(str(error))
    try:
        return type(error)(message)
    except TypeError:  # an exception type with other arguments
        return ValueError(message)


def load_model(filepath: str | os.PathLike, module: nn.Module | None = None, compile: bool = True) -> Model:
    """Load a model saved with ``Model.save``, in the current strategy's scope.

    Args:
        filepath: the directory ``Model.save`` wrote, or its ``.keras`` file.
        module: the module to load the weights into. Needed when the module is not made of
            standard ``torch.nn`` layers (its architecture cannot be rebuilt without running code).
        compile: restore the compile config (optimizer, loss, ``loss_weights``, metrics; losses and
            metrics keyed by output as ``compile`` took them) and the optimizer state, when they were
            saved. A loss given as a function cannot be rebuilt: the model then loads uncompiled.

    Returns:
        A `meshfit.Model`.

    Raises:
        FileNotFoundError: nothing at ``filepath``.
        ValueError: an incomplete or corrupt save (the message names the file), or an architecture
            that needs ``module=``.
    """
    path = os.fspath(filepath)
    if is_archive_path(path) and not os.path.isdir(path):  # a directory saved before .keras meant a zip
        with tempfile.TemporaryDirectory(prefix="meshfit-keras-") as directory:
            unpack(path, directory)
            try:
                return load_model(directory, module=module, compile=compile)
            except (ValueError, TypeError, OSError) as error:
                raise _naming_the_archive(error, directory, path) from error
    config = read_config(path)
    config_path = os.path.join(path, "config.json")
    if module is None:
        if config.get("architecture") is None:
            raise ValueError(f"The model at {path!r} is a custom module ({config.get('module_class')}) whose "
                             "architecture meshfit cannot rebuild without running code. Build it yourself and "
                             "pass it: mf.load_model(path, module=MyModule(...)).")
        try:
            module = module_from_config(config["architecture"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"Cannot rebuild the model from {config_path!r}: {error}") from error
    module.load_state_dict(load_state_dict_file(os.path.join(path, "model.safetensors")))
    model = Model(module, name=config.get("name"))
    compile_config = config.get("compile")
    if compile and compile_config and compile_config.get("optimizer") and compile_config.get("loss"):
        try:
            optimizer = deserialize_optimizer(compile_config["optimizer"])
            loss = _loss_from_config(compile_config["loss"])
            metrics = _metrics_from_config(compile_config.get("metrics") or [], path)
        except (TypeError, ValueError) as error:
            raise ValueError(f"Cannot restore the compile config from {config_path!r}: {error}") from error
        model.compile(optimizer=optimizer, loss=loss, loss_weights=compile_config.get("loss_weights"),
                      metrics=metrics or None)
        if config.get("optimizer_state") is not None:
            model.build(None)  # place the module first (a mesh's layouts replace parameters), then the optimizer
            optimizer_file = os.path.join(path, "optimizer.safetensors")
            tensors = load_state_dict_file(optimizer_file)
            try:
                # compile() keeps this very optimizer (a meshfit Optimizer is not wrapped); through the model's
                # parts, a pipeline stage keeps the state of the parameters it trains only
                model.saveable_parts().get("optimizer", optimizer).load_state_dict(
                    unflatten_optimizer_state(tensors, config["optimizer_state"]))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"Cannot restore the optimizer state from {optimizer_file!r} and "
                                 f"{config_path!r}: {error}") from error
    return model
