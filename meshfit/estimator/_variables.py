"""``get_variable_names`` / ``get_variable_value``: read the module weights of a checkpoint directly.

Names are parameter paths (``0.weight``), prefixed by the module's name (``sequential/0.weight``)
when ``model_fn`` uses several modules, plus ``global_step``, as TF lists a checkpoint's variables.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import torch

_MODEL = "model/"


def _metadata(path: str) -> dict:
    from meshfit.train import SafeFileSystemReader

    return SafeFileSystemReader(path).read_metadata().state_dict_metadata


def _names(path: str) -> dict[str, str]:
    """``{variable name: DCP key}`` of the module weights in checkpoint ``path``."""
    keys = [key for key in _metadata(path) if key.startswith(_MODEL)]
    modules = {key[len(_MODEL):].split("/", 1)[0] for key in keys}
    if len(modules) == 1:
        return {key[len(_MODEL):].split("/", 1)[1]: key for key in keys}
    return {key[len(_MODEL):]: key for key in keys}


def _global_step(path: str) -> int:
    with open(os.path.join(path, "meshfit_state.json")) as file:
        document = json.load(file)
    counters = document["trackables"]["loop"]["state"]
    # the loop's state tree: {"dict": [["counters", {"dict": [["epoch", e], ["step", s], ["iterations", n]]}], ...]}
    for key, value in counters["dict"]:
        if key == "counters":
            return int(dict(value["dict"])["iterations"])
    raise ValueError(f"Checkpoint {path!r} has no global step.")


def variable_names(path: str) -> list[str]:
    """The variables of checkpoint ``path``, sorted."""
    return sorted([*_names(path), "global_step"])


def variable_value(path: str, name: str) -> np.ndarray:
    """The value of variable ``name`` in checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp

    from meshfit.train import SafeFileSystemReader

    if name == "global_step":
        return np.asarray(_global_step(path), dtype=np.int64)
    names = _names(path)
    if name not in names:
        raise ValueError(f"Invalid `name`: {name!r} is not a variable of {path!r}; it has {sorted(names)} and "
                         "'global_step'.")
    key = names[name]
    meta = _metadata(path)[key]
    tensor = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: tensor}, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return tensor.numpy()


def load_modules(path: str, modules: dict[str, torch.nn.Module]) -> int:
    """Load ``modules``' weights from checkpoint ``path`` in this process alone; returns its global step.

    Not collective: an evaluator, or one worker evaluating by itself, reads a checkpoint while the
    others do something else.
    """
    import torch.distributed.checkpoint as dcp

    from meshfit.train import SafeFileSystemReader

    stored = _metadata(path)
    destinations: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        for key, value in module.state_dict(keep_vars=False).items():
            dcp_key = f"{_MODEL}{name}/{key}"
            if dcp_key not in stored:
                raise ValueError(f"Checkpoint {path!r} has no {name}/{key}: model_fn must build the same modules as "
                                 "the run that saved it.")
            destinations[dcp_key] = value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(destinations, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return _global_step(path)
