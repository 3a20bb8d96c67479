"""`is_dtensor`: ``isinstance(value, DTensor)`` without importing DTensor.

``import torch.distributed.tensor`` costs ~0.6-0.9 s (it pulls in sympy), most of ``import meshfit``'s
budget. A DTensor can exist only once that module has been imported (by `meshfit.dtensor` or the user),
so modules on the import path of ``import meshfit`` ask this function instead of importing it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor"]


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """True when ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
