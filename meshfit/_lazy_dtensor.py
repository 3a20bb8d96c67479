"""`is_dtensor`: ``isinstance(value, DTensor)`` without importing DTensor; `whole`, `local_part` and
`placed_like`, the three conversions between a DTensor and a plain tensor meshfit makes in many places.

``import torch.distributed.tensor`` costs ~0.6-0.9 s (it pulls in sympy), most of ``import meshfit``'s
budget. A DTensor can exist only once that module has been imported (by `meshfit.dtensor` or the user),
so modules on the import path of ``import meshfit`` ask this function instead of importing it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local_part", "placed_like", "whole"]


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """True when ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def whole(value: Any) -> Any:
    """A DTensor's whole value (gathered from its shards, or its pending sum reduced: collective over its
    mesh), else ``value`` itself."""
    return value.full_tensor() if is_dtensor(value) else value


def local_part(value: Any) -> Any:
    """This process's part of a DTensor (its shard, no communication), else ``value`` itself."""
    return value.to_local() if is_dtensor(value) else value


def placed_like(value: torch.Tensor, current: Any) -> torch.Tensor:
    """A whole tensor ``value`` placed as ``current`` is: this process's shard when ``current`` is a DTensor
    (``value`` a plain tensor every process holds alike), else ``value`` itself."""
    if not is_dtensor(current) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(current.dtype), current.device_mesh, current.placements, src_data_rank=None)
