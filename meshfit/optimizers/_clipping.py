"""Keras's gradient clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``), applied in place to
gradients that were already reduced across replicas, so every replica clips the same global gradient.

The formulas are Keras 3's (``keras/src/optimizers/base_optimizer.py``):
- ``clipnorm``: each gradient ``g * c / max(||g||, c)`` (a zero gradient stays zero);
- ``global_clipnorm``: every gradient times ``c / max(n, c)``, ``n`` the L2 norm over all of them
  (``tf.clip_by_global_norm``); a non-finite ``n`` makes every gradient NaN, as in Keras;
- ``clipvalue``: each element clamped to ``[-c, c]``.
A DTensor gradient's norm is its full tensor's (its shards' squares are summed across the mesh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from meshfit._lazy_dtensor import whole
from meshfit._validation import invalid_argument


def _square_sum(grad: torch.Tensor) -> torch.Tensor:
    return whole(torch.sum(torch.square(grad)))  # a DTensor's: its Partial sum reduced, or its replicated value


def _scale_(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """``grad *= scale`` for a scalar tensor; a DTensor's local shard is scaled (right for any placement)."""
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.mul_(scale.to(device=local.device, dtype=local.dtype))


@dataclass(frozen=True, kw_only=True)
class GradientClipping:
    """One of Keras's three clipping arguments (at most one is set)."""

    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in ("clipnorm", "clipvalue", "global_clipnorm")}
        for name, value in given.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise invalid_argument(name, "a positive number or None", value)
        named = [f"{name}={value!r}" for name, value in given.items() if value is not None]
        if len(named) > 1:
            raise ValueError("Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, as in Keras; "
                             f"received {', '.join(named)}. Keep one of them.")

    @property
    def active(self) -> bool:
        """Whether any clipping is set."""
        return self.clipnorm is not None or self.clipvalue is not None or self.global_clipnorm is not None

    def config(self) -> dict[str, Any]:
        """The arguments, for an optimizer's ``get_config()``."""
        return {"clipnorm": self.clipnorm, "clipvalue": self.clipvalue, "global_clipnorm": self.global_clipnorm}

    @torch.no_grad()
    def clip_(self, grads: list[torch.Tensor]) -> None:
        """Clip ``grads`` in place."""
        if not grads:
            return
        if self.clipnorm is not None:
            limit = self.clipnorm
            for grad in grads:
                norm = torch.sqrt(_square_sum(grad))
                _scale_(grad, limit / torch.clamp(norm, min=limit))
        elif self.global_clipnorm is not None:
            limit = self.global_clipnorm
            total = torch.sqrt(torch.stack([_square_sum(g).to(torch.float32) for g in grads]).sum())
            # c * min(1/n, 1/c) plus (n - n): NaN for a non-finite norm, as Keras's clip_by_global_norm.
            scale = limit * torch.minimum(1.0 / total, torch.tensor(1.0 / limit)) + (total - total)
            for grad in grads:
                _scale_(grad, scale)
        elif self.clipvalue is not None:
            for grad in grads:
                grad.clamp_(-self.clipvalue, self.clipvalue)
