"""`ReleasedParameter`: a parameter another process holds, kept here as its shape alone.

A pipeline stage trains some of the module's parameters; the others belong to other stages'
processes. Keeping full copies of them would cost every process the whole model. Instead the module
keeps, at each of those paths, a `ReleasedParameter`: the same shape, dtype, device and
``requires_grad``, backed by one element (an expanded scalar). Reading a shape, a dtype or a
parameter count works as before; the values live with the holders, and what reads values (a
checkpoint, ``get_weights``, ``model.save``) takes them from there (`meshfit.distribute._resident_state`).
Writing into one is refused by torch; meshfit's own writers (loading a checkpoint, the optimizer's
moving averages) skip released parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ReleasedParameter(nn.Parameter):
    """A parameter held by another process (a pipeline's other stage): its shape, dtype and device, without
    its values. On a pipeline stage's process, ``isinstance(p, mf.dtensor.ReleasedParameter)`` tells the
    user's module's parameters this process does not train.

    Example:
        >>> import torch
        >>> import meshfit as mf
        >>> weight = torch.nn.Linear(4, 2).weight
        >>> released = mf.dtensor.ReleasedParameter.like(weight)
        >>> released.shape, released.dtype, released.untyped_storage().nbytes()
        (torch.Size([2, 4]), torch.float32, 4)
        >>> isinstance(released, mf.dtensor.ReleasedParameter), isinstance(weight, mf.dtensor.ReleasedParameter)
        (True, False)
    """

    @classmethod
    def like(cls, param: torch.Tensor) -> ReleasedParameter:
        """A `ReleasedParameter` standing for ``param`` (its shape, dtype, device and ``requires_grad``)."""
        placeholder = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
        return cls(placeholder, requires_grad=param.requires_grad)


def is_released(tensor: object) -> bool:
    """Whether ``tensor`` is a `ReleasedParameter` (another process holds its values)."""
    return isinstance(tensor, ReleasedParameter)


def release_unheld(module: nn.Module, holds: Callable[[str], bool]) -> list[str]:
    """Replace each parameter of ``module`` whose path ``holds(path)`` denies by a `ReleasedParameter`
    (tied paths stay tied); returns the released paths."""
    released: dict[int, ReleasedParameter] = {}
    paths = []
    for path, param in list(module.named_parameters(remove_duplicate=False)):
        if holds(path) or is_released(param):
            continue
        owner, _, name = path.rpartition(".")
        replacement = released.get(id(param))
        if replacement is None:
            replacement = released[id(param)] = ReleasedParameter.like(param)
        module.get_submodule(owner)._parameters[name] = replacement
        paths.append(path)
    return paths
