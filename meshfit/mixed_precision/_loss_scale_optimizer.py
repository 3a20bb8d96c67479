"""`LossScaleOptimizer`: dynamic loss scaling for ``mixed_float16``, as Keras's.

float16 gradients of small losses underflow to zero. The loss is multiplied by a large scale before
backward, and the gradients divided by it before the update. The scale adapts (Keras 3's
``keras/src/optimizers/loss_scale_optimizer.py``):

- a step whose gradients hold an inf or NaN is skipped, the scale halved, the counter reset;
- after ``dynamic_growth_steps`` finite steps in a row the scale doubles and the counter resets.

The scale and the counter are tensors on the parameters' device, updated by torch's own AMP kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``), and part of `state_dict`:
a resumed run continues with the same scale, bitwise. Deciding whether to skip the step reads one
flag on the host, once per step, as torch's ``GradScaler`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from meshfit import optimizers as _resolve
from meshfit.distribute import synchronize_gradients
from meshfit.optimizers import Optimizer

_INHERITED = ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema", "ema_momentum",
              "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps")


class LossScaleOptimizer(Optimizer):
    """An optimizer that scales the loss dynamically to keep float16 gradients from underflowing.

    ``Model.compile`` wraps the optimizer in one under the ``"mixed_float16"`` policy (Keras's
    ``auto_scale_loss=True``). In a custom loop, scale the loss before ``backward`` and let the
    optimizer unscale, check and apply the gradients::

        loss = compute_loss(...)
        optimizer.scale_loss(loss).backward()          # Keras 3; get_scaled_loss in Keras 2
        optimizer.step()                               # or apply_gradients(zip(grads, params))

    or unscale them yourself with `get_unscaled_gradients` (Keras 2's loop); the next update then
    only checks them.

    Args:
        inner_optimizer: the optimizer to wrap (anything ``meshfit.optimizers.get`` accepts).
        initial_scale: the first loss scale (default ``2**15``); best high, as halving is fast.
        dynamic_growth_steps: double the scale after this many finite steps in a row (default 2000).
        name: a display name.

    Raises:
        ValueError: a non-positive or non-finite ``initial_scale``, a non-positive
            ``dynamic_growth_steps``, ``dynamic=False`` or another Keras optimizer argument.

    Example:
        >>> import torch, meshfit as mf
        >>> opt = mf.mixed_precision.LossScaleOptimizer(mf.optimizers.SGD(0.1), initial_scale=8.0)
        >>> param = torch.nn.Parameter(torch.ones(2))
        >>> opt.build([param])
        >>> opt.scale_loss(param.sum()).backward()
        >>> _ = opt.step(); param.detach().tolist(), float(opt.dynamic_scale)
        ([0.8999999761581421, 0.8999999761581421], 8.0)
    """

    def __init__(self, inner_optimizer: Any, initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000,
                 name: str | None = None, **kwargs: Any) -> None:
        if not kwargs.pop("dynamic", True):
            raise ValueError("Invalid `dynamic`: LossScaleOptimizer always scales dynamically, received "
                             "dynamic=False. Multiply the loss by a constant yourself for a fixed scale.")
        for key in [k for k in kwargs if k in _INHERITED]:
            raise ValueError(f"Invalid argument `{key}`: LossScaleOptimizer does not take it, received "
                             f"{key}={kwargs[key]!r}. Set it on the inner optimizer.")
        if kwargs:
            raise ValueError(f"Invalid arguments: LossScaleOptimizer does not take {sorted(kwargs)}.")
        if isinstance(initial_scale, bool) or not isinstance(initial_scale, (int, float)) \
                or not math.isfinite(initial_scale) or initial_scale <= 0:
            raise ValueError("Invalid `initial_scale`: expected a positive finite number, received "
                             f"initial_scale={initial_scale!r}.")
        if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, int) \
                or dynamic_growth_steps < 1:
            raise ValueError("Invalid `dynamic_growth_steps`: expected a positive int, received "
                             f"dynamic_growth_steps={dynamic_growth_steps!r}.")
        inner = _resolve.get(inner_optimizer)
        if isinstance(inner, LossScaleOptimizer):
            raise ValueError("Invalid `inner_optimizer`: expected an optimizer that does not scale the loss, "
                             "received a LossScaleOptimizer; wrap its inner_optimizer instead.")
        if getattr(inner, "gradient_accumulation_steps", None) not in (None, 1):
            raise ValueError("Invalid `inner_optimizer`: a LossScaleOptimizer does not accumulate gradients yet, "
                             "received an inner optimizer with gradient_accumulation_steps="
                             f"{inner.gradient_accumulation_steps!r}. Use the 'mixed_bfloat16' policy (no loss "
                             "scale) with gradient accumulation, or accumulate without mixed_float16.")
        self.inner_optimizer = inner
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = dynamic_growth_steps
        self.name = name or "loss_scale_optimizer"
        self._scale: torch.Tensor | None = None  # float32 scalar on the parameters' device
        self._counter: torch.Tensor | None = None  # int32 scalar: finite steps since the last change
        self._unscaled = False  # get_unscaled_gradients ran: the next update checks without unscaling

    # ---- what the inner optimizer answers ------------------------------------------------------
    @property
    def built(self) -> bool:
        return self._scale is not None and self.inner_optimizer.built

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.inner_optimizer.torch_optimizer

    @property
    def iterations(self) -> int:
        """The inner optimizer's updates (a skipped step is not counted, as in Keras)."""
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        self.inner_optimizer.iterations = value

    @property
    def learning_rate(self) -> float:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.inner_optimizer.learning_rate = value

    def __getattr__(self, name: str) -> Any:  # the inner optimizer's other attributes (e.g. _schedule)
        if name in ("inner_optimizer", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner_optimizer, name)

    def _params(self) -> list[torch.Tensor]:
        return self.inner_optimizer._params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    # ---- the scale -----------------------------------------------------------------------------
    def build(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> None:
        """Build the inner optimizer on ``params``, and the scale and counter on their device."""
        self.inner_optimizer.build(list(params))
        if self._scale is None:
            device = self._params()[0].device if self._params() else torch.device("cpu")
            self._scale = torch.full((), self.initial_scale, dtype=torch.float32, device=device)
            self._counter = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def dynamic_scale(self) -> torch.Tensor:
        """The current loss scale (a float32 scalar tensor; ``initial_scale`` before `build`)."""
        return self._scale if self._scale is not None else torch.tensor(self.initial_scale)

    @property
    def step_counter(self) -> torch.Tensor:
        """Finite steps since the scale last changed (an int32 scalar tensor)."""
        return self._counter if self._counter is not None else torch.zeros((), dtype=torch.int32)

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times the current scale (Keras 3's name); backward through it, then `step`."""
        if callable(loss) and not isinstance(loss, torch.Tensor):
            return lambda: self.scale_loss(loss())
        return loss * (self._scale if self._scale is not None else self.initial_scale)

    def get_scaled_loss(self, loss: Any) -> Any:
        """Keras 2's name of `scale_loss` (a callable loss gives a callable)."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Gradients of the scaled loss divided by the scale (Keras 2's loop); ``None`` stays ``None``.

        The next `apply_gradients` / `step` then checks them for inf/NaN without unscaling again.
        """
        scale = self.dynamic_scale
        out = [None if g is None else g / scale.to(g.device, g.dtype) for g in grads]
        self._unscaled = True
        return out

    # ---- the update ----------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale the gradients, then apply them, or skip the update when one is inf/NaN; adapt the scale.

        Under a multi-replica strategy the gradients are summed across replicas first, so every
        replica sees the same inf/NaN and takes the same decision.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.built:
            raise RuntimeError("LossScaleOptimizer.step() needs a built optimizer: call `build(params)` first "
                               "(Model.fit and Model.compile do so).")
        scale, counter = self._scale_state()
        params = self._params()
        synchronize_gradients(params)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        inverse = torch.ones((), dtype=torch.float32, device=scale.device) if self._unscaled \
            else scale.double().reciprocal().float()
        self._unscaled = False
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), group in grads.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inverse.to(device))
            found_inf += flag.to(found_inf.device)
        if not found_inf.item():  # the step's one host read: whether to apply it
            self.inner_optimizer._apply_update()
        torch._amp_update_scale_(scale, counter, found_inf, 2.0, 0.5, self.dynamic_growth_steps)
        return loss

    # ---- saving --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's `state_dict` plus ``"loss_scale"``: the scale and the counter."""
        state = self.inner_optimizer.state_dict()
        scale, counter = self._scale_state()
        state["loss_scale"] = {"scale": scale.detach().clone(), "step_counter": counter.detach().clone()}
        return state

    def _scale_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and the growth counter (made by `build`)."""
        if self._scale is None or self._counter is None:
            raise RuntimeError("LossScaleOptimizer needs a built optimizer: call `build(params)` first "
                               "(Model.fit and Model.compile do so).")
        return self._scale, self._counter

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from `state_dict()`; an inner optimizer's state without a scale keeps the current one."""
        state = dict(state_dict)
        saved = state.pop("loss_scale", None)
        self.inner_optimizer.load_state_dict(state)
        if saved is not None:
            scale, counter = self._scale_state()
            scale.copy_(torch.as_tensor(saved["scale"]))
            counter.copy_(torch.as_tensor(saved["step_counter"]))

    def get_config(self) -> dict[str, Any]:
        """Keras's config: the inner optimizer (serialized), the initial scale and the growth steps."""
        return {"name": self.name, "inner_optimizer": _resolve.serialize(self.inner_optimizer),
                "initial_scale": self.initial_scale, "dynamic_growth_steps": self.dynamic_growth_steps}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleOptimizer:
        """Rebuild from `get_config()`'s output."""
        config = dict(config)
        inner = config.pop("inner_optimizer")
        return cls(_resolve.deserialize(inner) if isinstance(inner, dict) else inner, **config)

    def __repr__(self) -> str:
        return (f"LossScaleOptimizer({self.inner_optimizer!r}, initial_scale={self.initial_scale!r}, "
                f"dynamic_growth_steps={self.dynamic_growth_steps!r})")
