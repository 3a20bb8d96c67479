"""Numpy inputs of ``model(x)`` as tensors on the module's device and dtype, as Keras converts them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn.parameter import is_lazy

from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy
from meshfit.data import leaves, map_structure


def _placement(module: torch.nn.Module, strategy: DistributionStrategy) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of the module's first floating parameter or buffer (else the strategy's
    device and torch's default dtype)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point() and not is_lazy(tensor):
            return tensor.device, tensor.dtype
    return strategy.device, torch.get_default_dtype()


def convert_call_inputs(module: torch.nn.Module, strategy: DistributionStrategy, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` with numpy arrays (in any nesting) as tensors: floating ones in the module's
    floating dtype (Keras casts to the layer's input dtype), integer and bool ones keeping theirs; all on
    the module's device. Tensors and other values are passed through unchanged."""
    for arg in args:  # the usual call from a step: tensors only, nothing to convert
        if type(arg) is not torch.Tensor:
            break
    else:
        if not kwargs:
            return args, kwargs
    if not any(isinstance(leaf, np.ndarray) for leaf in leaves((args, kwargs))):
        return args, kwargs
    device, dtype = _placement(module, strategy)

    def convert(leaf: Any) -> Any:
        if not isinstance(leaf, np.ndarray) or leaf.dtype.kind not in "biuf":
            return leaf
        tensor = torch.from_numpy(np.ascontiguousarray(leaf))
        return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)

    return map_structure(convert, args), map_structure(convert, kwargs)



def build_sample(module: torch.nn.Module, args: tuple) -> Any:
    """The batch ``model(*args)`` builds the model on, when its parameters have layouts (given per layer
    or by a ``layout_map.scope()``): the first argument, a packed DTensor as its local rows; else None."""
    if not args or not any(_laid_out(p) for p in module.parameters()):
        return None
    return map_structure(lambda leaf: leaf.to_local() if is_dtensor(leaf) else leaf, args[0])


def _laid_out(param: torch.Tensor) -> bool:
    """Whether a parameter was given a layout (a DTensor, or a meshfit `Layout` as its ``.layout``)."""
    return not is_lazy(param) and (is_dtensor(param) or not isinstance(param.layout, torch.layout))
