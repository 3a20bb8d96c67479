"""Keras-style optimizer specs that build the matching `torch.optim` optimizer lazily."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from meshfit.distribute import synchronize_gradients
from meshfit.optimizers._accumulation import check_accumulation_steps
from meshfit.optimizers._apply_gradients import AppliesGradients
from meshfit.optimizers._arguments import POSITIVE, check_number
from meshfit.optimizers._clipping import GradientClipping
from meshfit.optimizers._ema import MovingAverage, check_ema
from meshfit.optimizers._torch_build import (
    accepts_foreach,
    broadcast_lazy_params,
    clears_plainly,
    fusable,
    place_state_like_params,
    profiling,
)
from meshfit.optimizers._weight_decay import WeightDecayExclusion, exempt_groups, split_named
from meshfit.optimizers.schedules import _schedules

_TORCH_NAMES = {"rho": "alpha", "epsilon": "eps"}  # Keras argument -> torch argument


class Optimizer(AppliesGradients):
    """Base of meshfit optimizers: a spec that builds a `torch.optim.Optimizer` on `build(params)`.

    In a custom training loop under a strategy (TensorFlow's contract), `step()` and
    `apply_gradients()` first *sum* the gradients of parameters created inside
    ``strategy.scope()`` across the replicas; divide the per-example loss by the global batch
    (``meshfit.nn.compute_average_loss``) so that the sum is the global batch's gradient. Gradients
    that ``Model.fit``'s DistributedDataParallel already reduced are not reduced again.

    Subclasses set `torch_class` and `config_keys`: their constructor arguments besides
    `learning_rate`, stored as attributes and passed on to `torch_class`.
    `weight_decay` follows the torch class it builds (L2 added to the gradient for SGD, Adam,
    RMSprop and Adagrad; decoupled for AdamW).

    Args:
        learning_rate: Positive step size, or a `meshfit.optimizers.schedules.LearningRateSchedule`:
            then each update uses ``schedule(iterations)``, and the schedule's position is
            `iterations`, part of `state_dict()`. With several torch parameter groups, each
            group keeps its ratio to the first group's rate when the rate changes.
        clipnorm: Clip each gradient to this L2 norm (Keras's argument).
        clipvalue: Clip each gradient element to ``[-clipvalue, clipvalue]``.
        global_clipnorm: Clip all gradients together to this global L2 norm
            (``tf.clip_by_global_norm``). At most one of the three is set. Clipping applies to the
            gradients after they are reduced across replicas, so it sees the global batch's gradient.
        use_ema: Keep an exponential moving average of the weights (Keras 3); it is part of
            `state_dict()`, and ``fit`` overwrites the weights with it when training ends
            (`finalize_variable_values`).
        ema_momentum: ``average = ema_momentum * average + (1 - ema_momentum) * weight``.
        ema_overwrite_frequency: Overwrite the weights with their averages every this many updates.
        gradient_accumulation_steps: None (an update every batch), or N: Keras 3's gradient
            accumulation. Every batch's gradient is added up; the update applies on every N-th batch
            with the mean of the N batches' gradients (clipping and weight decay apply to that mean;
            the moving average folds in the weights at updates only). `iterations` counts the
            updates, as Keras 3's; `batches` counts every batch, and a schedule reads it (Keras 3
            reads its batch counter too). A ``zero_grad`` inside a window keeps the sums. In ``fit``
            under data parallel the replicas all-reduce once per update (DDP's ``no_sync`` on the
            other batches); see the Microbatches guide.

    Raises:
        ValueError: If `learning_rate` is not a positive number or a schedule, or the clipping,
            EMA or accumulation arguments are invalid (two clipping arguments together, a
            ``gradient_accumulation_steps`` below 1).

    Example:
        >>> import torch, meshfit.optimizers as optimizers
        >>> opt = optimizers.SGD(learning_rate=0.1)
        >>> opt.build(torch.nn.Linear(2, 1).parameters())
        >>> opt.torch_optimizer.param_groups[0]["lr"]
        0.1
    """

    torch_class: Callable[..., torch.optim.Optimizer]  # a torch optimizer class taking (params, lr=, ...)
    config_keys: tuple[str, ...] = ()
    fuses: bool = False  # update with torch's fused kernel where it applies (see `build`)

    def __init__(self, learning_rate: float | _schedules.LearningRateSchedule, *, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None, use_ema: bool = False,
                 ema_momentum: float = 0.99, ema_overwrite_frequency: int | None = None,
                 gradient_accumulation_steps: int | None = None) -> None:
        self.gradient_accumulation_steps = check_accumulation_steps(gradient_accumulation_steps)
        self._clipping = GradientClipping(clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm)
        self._clips = self._clipping.active  # the clipping arguments are fixed at construction
        self.use_ema, self.ema_momentum, self.ema_overwrite_frequency = check_ema(
            use_ema, ema_momentum, ema_overwrite_frequency)
        self._moving_average: MovingAverage | None = None
        self._exclusion: WeightDecayExclusion | None = None
        self._lr_ratios: list[float] | None = None  # each group's rate over the first's (torch optimizers)
        self._schedule = learning_rate if isinstance(learning_rate, _schedules.LearningRateSchedule) else None
        if self._schedule is not None:  # a warm-up may start at 0
            self._learning_rate = float(self._schedule(0))
        else:
            self._learning_rate = check_number("learning_rate", learning_rate, POSITIVE)
        self._torch_optimizer: torch.optim.Optimizer | None = None
        self._param_ids: list[int] = []
        self.batches = 0  # every step (Keras 3's ``_iterations``); `iterations` counts the updates

    @property
    def iterations(self) -> int:
        """The updates applied (Keras 3's ``optimizer.iterations``): with ``gradient_accumulation_steps``
        N, the batches stepped over divided by N (rounded down); else every step."""
        return self.batches // (self.gradient_accumulation_steps or 1)

    @iterations.setter
    def iterations(self, value: int) -> None:
        self.batches = int(value) * (self.gradient_accumulation_steps or 1)

    clipnorm = property(lambda self: self._clipping.clipnorm, doc="Keras's per-gradient norm limit, or None.")
    clipvalue = property(lambda self: self._clipping.clipvalue, doc="Keras's per-element limit, or None.")
    global_clipnorm = property(lambda self: self._clipping.global_clipnorm, doc="The global norm limit, or None.")

    def exclude_from_weight_decay(self, var_list: Iterable[torch.Tensor] | None = None,
                                  var_names: Iterable[str] | None = None) -> None:
        """Exempt parameters from weight decay, as Keras's method (call it before the optimizer is built).

        Args:
            var_list: Parameters to exempt.
            var_names: Strings searched (``re.search``) in each parameter's path in its module
                (``Model`` builds the optimizer on ``module.named_parameters()``), e.g. ``["bias", "ln"]``.

        Raises:
            ValueError: If the optimizer is already built.
        """
        if self.built:
            raise ValueError(f"`exclude_from_weight_decay()` can only be configured before the optimizer is built, "
                             f"as in Keras; this {type(self).__name__} is built. Call it right after creating it.")
        self._exclusion = WeightDecayExclusion(var_list, var_names)

    def _torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `torch_class` besides `params` and `lr`."""
        kwargs = {_TORCH_NAMES.get(key, key): getattr(self, key) for key in self.config_keys}
        if "weight_decay" in kwargs and kwargs["weight_decay"] is None:
            kwargs["weight_decay"] = 0.0
        return kwargs

    @property
    def built(self) -> bool:
        """Whether `build` has created the torch optimizer."""
        return self._torch_optimizer is not None

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The built `torch.optim.Optimizer`."""
        return self._require_built("torch_optimizer")

    def _require_built(self, what: str) -> torch.optim.Optimizer:
        if self._torch_optimizer is None:
            raise RuntimeError(
                f"{type(self).__name__}.{what} needs a built optimizer: call `build(params)` first "
                "(Model.fit and Model.compile do so)."
            )
        return self._torch_optimizer

    def build(self, params: Iterable[Any]) -> None:
        """Create the torch optimizer on `params` (tensors, torch param-group dicts, or
        ``(name, tensor)`` pairs from ``named_parameters()``, whose names `exclude_from_weight_decay` reads).

        Args:
            params: The parameters to optimise; lazy modules must be materialised first.

        Raises:
            ValueError: If a parameter is still lazy, or the optimizer was built on other parameters.
        """
        params, names = split_named(list(params))
        flat = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
        if any(is_lazy(p) for p in flat):
            raise ValueError(
                "Invalid `params`: some are uninitialized lazy parameters; run one forward pass "
                "(or Model.build) to materialise them before building the optimizer."
            )
        ids = [id(p) for p in flat]
        if self._torch_optimizer is not None:
            if ids == self._param_ids:
                return
            raise ValueError(
                f"Invalid `params`: this {type(self).__name__} is already built on other parameters; "
                "create a new optimizer for another model."
            )
        kwargs = self._torch_kwargs()
        if self._exclusion is not None and kwargs.get("weight_decay"):
            params = exempt_groups(params, names, self._exclusion)
        plain = all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in flat)
        if plain and self.fuses and fusable(self.torch_class, flat) and "foreach" not in kwargs:
            # One fused kernel per parameter for the whole update (Adam: 0.41 -> ~0.1 ms a step on
            # keras.io's MLP). Deterministic, so resumed runs stay bitwise; it rounds differently
            # from torch's default for-loop/foreach Adam (a few ulp), hence only for Adam-family
            # optimizers, where Keras's own kernels differ from torch's anyway.
            kwargs.setdefault("fused", True)
        elif plain and accepts_foreach(self.torch_class):
            # One kernel per operation over all parameters instead of one per parameter: torch picks
            # this only on GPUs; on CPUs it is bitwise the same update, 1.7x faster on a small MLP.
            kwargs.setdefault("foreach", True)
        self._torch_optimizer = self.torch_class(params, lr=self._learning_rate, **kwargs)
        self._param_ids = ids
        broadcast_lazy_params(flat)
        self._on_built()

    def _on_built(self) -> None:
        """Set up what follows the torch optimizer's parameters: group rate ratios, the moving average."""
        groups = self.torch_optimizer.param_groups
        base = float(groups[0]["lr"])
        self._lr_ratios = [float(g["lr"]) / base if base > 0 else 1.0 for g in groups]
        if self.use_ema:
            self._moving_average = MovingAverage(self._params(), self.ema_momentum, self.ema_overwrite_frequency)

    def _set_rate(self, rate: float) -> None:
        ratios = self._lr_ratios or []
        for i, group in enumerate(self.torch_optimizer.param_groups):
            group["lr"] = rate * ratios[i] if i < len(ratios) else rate

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self._require_built("step()").param_groups for p in group["params"]]

    def step(self, closure: Any = None) -> Any:
        """Apply one update to the parameters and count it in `iterations`.

        Under a multi-replica strategy, the gradients of parameters created in its scope are
        summed across replicas first (not those DDP reduced already). With
        ``gradient_accumulation_steps``, a batch before a window's last only counts (its gradients
        stay in ``.grad``, summed with the next ones, and are not reduced yet).
        """
        optimizer = self._torch_optimizer
        if optimizer is None:
            optimizer = self._require_built("step()")  # raises
        loss = None
        if closure is not None:  # evaluated once here, so that its gradients can be synchronised
            with torch.enable_grad():
                loss = closure()
        steps = self.gradient_accumulation_steps
        if steps and steps > 1 and (self.batches + 1) % steps:  # `defers_update`, inline: asked at every step
            self.batches += 1
            return loss
        # A generator: with one process (no group) synchronize_gradients returns before reading it.
        synchronize_gradients(p for group in optimizer.param_groups for p in group["params"])
        self._apply_update(optimizer)
        return loss

    def _apply_update(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Clip the (already summed) gradients, then the torch optimizer's step at the schedule's rate
        (``optimizer``: the built torch optimizer, when the caller has it at hand)."""
        if optimizer is None:
            optimizer = self._require_built("step()")
        steps = self.gradient_accumulation_steps
        if steps and steps > 1:  # the window's sum -> its mean, before clipping (Keras 3)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(steps)
        if self._clips:  # after the reduction: every replica clips the global gradient
            self._clipping.clip_([p.grad for group in optimizer.param_groups for p in group["params"]
                                  if p.grad is not None])
        if self._schedule is not None:
            self._set_rate(float(self._schedule(self.batches)))
        optimizer.step()
        if self._moving_average is not None:
            self._moving_average.update(self.iterations)
        self.batches += 1

    def scale_loss(self, loss: Any) -> Any:
        """The loss to call ``backward`` on: ``loss`` itself (a `LossScaleOptimizer` scales it), as
        Keras 3's ``optimizer.scale_loss``."""
        return loss

    def finalize_variable_values(self, var_list: Any = None) -> None:
        """Overwrite the weights with their moving averages when `use_ema` (Keras's method; ``fit``
        calls it when training ends). ``var_list`` is accepted for Keras's signature: the optimizer's
        own parameters are the ones averaged."""
        if self._moving_average is not None:
            self._moving_average.finalize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the optimised parameters; inside a gradient accumulation window
        (after its first batch) keep them: they hold the window's sum.

        Where the torch optimizer's ``zero_grad`` is torch's own, the gradients are set to None here, without
        the profiler range and dynamo guard torch's opens (38 Python calls a step, 3 here); under a torch profiler,
        or with ``set_to_none=False``, or where ``zero_grad`` is overridden or patched, the torch optimizer's
        own is called. A standalone ``torch.profiler.ExecutionTraceObserver`` (without a profiler) records
        no ``Optimizer.zero_grad`` node then."""
        optimizer = self._torch_optimizer
        if optimizer is None:
            optimizer = self._require_built("zero_grad()")  # raises
        steps = self.gradient_accumulation_steps
        if steps and self.batches % steps != 0:
            return
        if set_to_none and clears_plainly(optimizer) and not profiling():
            # torch's zero_grad less its profiler range and dynamo guard
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = None
            return
        optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def learning_rate(self) -> float:
        """The current learning rate (read from the torch optimizer once built; a schedule's next value)."""
        if self._schedule is not None:
            return float(self._schedule(self.batches))
        if self._torch_optimizer is not None:
            return float(self._torch_optimizer.param_groups[0]["lr"])
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        if self._schedule is not None:
            raise TypeError("This optimizer was created with a `LearningRateSchedule` object as its `learning_rate` "
                            "constructor argument, hence its learning rate is not settable. "
                            f"This optimizer's learning rate follows {self._schedule!r}, so it cannot be set. "
                            "Create the optimizer with a number as learning_rate to set it by hand or from a "
                            "callback.")
        self._learning_rate = check_number("learning_rate", value, POSITIVE)
        if self._torch_optimizer is not None:
            self._set_rate(self._learning_rate)

    def state_dict(self) -> dict[str, Any]:
        """`{"iterations": int, "optimizer": torch_optimizer.state_dict()}`, and ``"ema"`` (the moving
        averages by parameter index) with `use_ema`. ``"iterations"`` is the batch count `batches`
        (Keras 3 saves its ``_iterations``): `iterations` without accumulation. The gradients summed in
        an accumulation window are not part of it (they differ per replica; see `AccumulatedGradients`)."""
        state = {"iterations": self.batches, "optimizer": self._require_built("state_dict()").state_dict()}
        if self._moving_average is not None:
            state["ema"] = self._moving_average.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from `state_dict()`; a bare torch optimizer state dict is accepted too.

        Raises:
            RuntimeError: If the optimizer is not built.
            ValueError: If `state_dict` has neither form.
        """
        opt = self._require_built("load_state_dict()")
        if "optimizer" in state_dict:
            opt.load_state_dict(state_dict["optimizer"])
            self.batches = int(state_dict.get("iterations", 0))
            if self._moving_average is not None and "ema" in state_dict:
                self._moving_average.load_state_dict(state_dict["ema"])
        elif "param_groups" in state_dict:
            opt.load_state_dict(state_dict)
        else:
            raise ValueError(
                "Invalid `state_dict`: expected the output of Optimizer.state_dict() or a torch optimizer "
                f"state dict, received keys {sorted(state_dict)}."
            )
        place_state_like_params(opt)

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, JSON-serialisable."""
        learning_rate: Any = self.learning_rate
        if self._schedule is not None:
            # A user's own schedule class is named too; loading it back needs that class.
            learning_rate = {"class_name": type(self._schedule).__name__, "config": self._schedule.get_config()}
        ema = {"use_ema": self.use_ema, "ema_momentum": self.ema_momentum,
               "ema_overwrite_frequency": self.ema_overwrite_frequency}
        return {"learning_rate": learning_rate, **{key: getattr(self, key) for key in self.config_keys},
                **self._clipping.config(), **ema, "gradient_accumulation_steps": self.gradient_accumulation_steps}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Optimizer:
        """Build an optimizer from `get_config()`'s output."""
        if isinstance(config.get("learning_rate"), dict):
            config = {**config, "learning_rate": _schedules.deserialize(config["learning_rate"])}
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"
