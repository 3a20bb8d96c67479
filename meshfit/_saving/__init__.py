"""Saving a model: the `.keras`/directory format (safetensors weights with CRC-32C, JSON architecture
and compile config, never pickle) and weight files.

A private layer package: meshfit's other packages import the names below from here, never its
``_``-modules; users import the public names from `meshfit`.
"""

from meshfit._saving._architecture import module_from_config
from meshfit._saving._every_worker import (
    EveryWorkerCallError,
    is_sharded,
    require_every_worker,
    split_across_workers,
)
from meshfit._saving._keras_archive import is_archive_path, unpack
from meshfit._saving._save import load_weights, read_config, save_model, save_weights
from meshfit._saving._weights import load_state_dict_file, unflatten_optimizer_state

__all__ = [
    "EveryWorkerCallError",
    "is_archive_path",
    "is_sharded",
    "split_across_workers",
    "load_state_dict_file",
    "load_weights",
    "module_from_config",
    "read_config",
    "require_every_worker",
    "save_model",
    "save_weights",
    "unflatten_optimizer_state",
    "unpack",
]
