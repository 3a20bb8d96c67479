"""`Policy` and the global policy: which dtype the steps compute in, with float32 master weights.

As in Keras, a policy has a ``compute_dtype`` and a ``variable_dtype``. meshfit's steps run their
forward pass and loss under ``torch.autocast`` with the compute dtype (the backward pass of those ops
runs in the same dtype); parameters, gradients and optimizer state stay float32 ("master weights").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from meshfit.data import map_structure

_POLICIES = {
    "float32": ("float32", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
    "mixed_float16": ("float16", "float32"),
}


class Policy:
    """A dtype policy, as ``keras.mixed_precision.Policy``.

    Args:
        name: ``"float32"`` (the default: no autocast), ``"mixed_bfloat16"`` (bf16 compute on CPU or
            GPU) or ``"mixed_float16"`` (fp16 compute; ``Model.compile`` then wraps the optimizer in a
            `LossScaleOptimizer`, as Keras does, so that small gradients do not underflow).

    Raises:
        ValueError: ``name`` is not one of the names above.

    Example:
        >>> p = Policy("mixed_bfloat16")
        >>> p.compute_dtype, p.variable_dtype
        ('bfloat16', 'float32')
    """

    def __init__(self, name: str | Policy) -> None:
        if isinstance(name, Policy):
            name = name.name
        if name not in _POLICIES:
            raise ValueError(f"Invalid `name`: expected one of {sorted(_POLICIES)}, received name={name!r}. "
                             "(Pure 'bfloat16'/'float16' policies with low-precision weights are not supported.)")
        self._name = name
        self._compute_dtype, self._variable_dtype = _POLICIES[name]

    @property
    def name(self) -> str:
        """The policy's name, e.g. ``"mixed_bfloat16"``."""
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype of the forward computation: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
        return self._compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype of the parameters (always ``"float32"``: master weights)."""
        return self._variable_dtype

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'


_global = Policy("float32")


def global_policy() -> Policy:
    """The policy the training, evaluation and prediction steps use (default ``"float32"``)."""
    return _global


def set_global_policy(policy: Policy | str | None) -> None:
    """Set the global policy, as ``keras.mixed_precision.set_global_policy``.

    Args:
        policy: a `Policy`, a policy name, or ``None`` for the default ``"float32"``.

    Raises:
        ValueError: an unknown policy name.
        TypeError: ``policy`` is not a `Policy`, a string or ``None``.

    Example:
        >>> set_global_policy("mixed_bfloat16"); global_policy().compute_dtype
        'bfloat16'
        >>> set_global_policy(None); global_policy().name
        'float32'
    """
    global _global
    if policy is None:
        policy = "float32"
    if not isinstance(policy, (Policy, str)):
        raise TypeError(f"Invalid `policy`: expected a Policy, a policy name or None, "
                        f"received policy={policy!r} ({type(policy).__name__}).")
    _global = Policy(policy)


@contextlib.contextmanager
def autocast(device_type: str | torch.device = "cpu") -> Iterator[None]:
    """Run the enclosed forward pass in the global policy's compute dtype (``torch.autocast``).

    ``Model.train_step``, ``test_step`` and ``predict_step`` wrap their forward pass and loss in it;
    use it in your own ``train_step`` the same way. Under ``"float32"`` it does nothing.

    Args:
        device_type: the device type the module runs on (``"cpu"``, ``"cuda"``) or a device.

    Example:
        >>> set_global_policy("mixed_bfloat16")
        >>> with autocast("cpu"):
        ...     out = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> out.dtype
        torch.bfloat16
        >>> set_global_policy("float32")
    """
    policy = _global
    kind = device_type.type if isinstance(device_type, torch.device) else str(device_type)
    if policy.compute_dtype == "float32":
        yield
        return
    with torch.autocast(device_type=kind, dtype=getattr(torch, policy.compute_dtype)):
        yield


def to_variable_dtype(outputs: Any) -> Any:
    """Cast the low-precision floating tensors of ``outputs`` (any nest) back to float32.

    ``predict`` returns numpy arrays, and numpy has no bfloat16: its outputs come back in the
    policy's variable dtype, as the last layer of a Keras mixed-precision model is advised to be.
    """
    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
            return value.float()
        return value

    return outputs if _global.compute_dtype == "float32" else map_structure(cast, outputs)
