"""`AppliesGradients`: TensorFlow's way of handing an optimizer its gradients, ``apply_gradients`` (custom
training loops, Keras 3's ``optimizer.apply_gradients``) and TF1's ``minimize`` (an Estimator's
``model_fn``), on top of the optimizer's own ``build`` and ``step``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class AppliesGradients:
    """The gradient-applying side of `meshfit.optimizers.Optimizer`: needs its build, parameters and step."""

    gradient_accumulation_steps: int | None
    batches: int

    @property
    def built(self) -> bool:
        raise NotImplementedError

    def build(self, params: Iterable[Any]) -> None:
        raise NotImplementedError

    def _params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def step(self, closure: Any = None) -> Any:
        raise NotImplementedError

    def apply_gradients(self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]) -> int:
        """Apply gradients to variables, as Keras's ``optimizer.apply_gradients``.

        Builds the optimizer on the variables the first time. Under a multi-replica strategy the
        gradients are summed across replicas first (TensorFlow's semantics); only the given
        variables are updated. With ``gradient_accumulation_steps`` the gradients add onto the
        window's sum, and the update applies on its last batch (summed across replicas once then).

        Args:
            grads_and_vars: ``(gradient, variable)`` pairs, e.g. ``zip(grads, module.parameters())``;
                a ``None`` gradient leaves its variable unchanged.

        Returns:
            The batches stepped over (Keras 3 returns its ``_iterations``): `iterations` without
            accumulation.

        Raises:
            ValueError: if a variable is not optimised by this (already built) optimizer, or a
                gradient's shape differs from its variable's.
        """
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        if not self.built:
            self.build(variables)
        known = {id(p) for p in self._params()}
        for grad, var in pairs:
            if id(var) not in known:
                raise ValueError(f"Invalid `grads_and_vars`: a variable of shape {tuple(var.shape)} is not "
                                 f"optimised by this {type(self).__name__}; create one optimizer per model.")
            if grad is not None and tuple(grad.shape) != tuple(var.shape):
                raise ValueError(f"Invalid `grads_and_vars`: a gradient of shape {tuple(grad.shape)} was given "
                                 f"for a variable of shape {tuple(var.shape)}.")
        given = {id(v): g for g, v in pairs}
        steps = self.gradient_accumulation_steps
        starts = not steps or self.batches % steps == 0  # else add onto the window's sum
        for p in self._params():
            g = given.get(id(p))
            if starts or p.grad is None:
                p.grad = None if g is None else g.detach().to(p.dtype).clone()
            elif g is not None:
                p.grad.add_(g.detach().to(p.dtype))
        self.step()
        return self.batches

    def minimize(self, loss: torch.Tensor, global_step: Any = None, var_list: Any = None) -> Any:
        """TF1's ``optimizer.minimize(loss, global_step)`` for an Estimator's ``model_fn``.

        Returns the train op (`meshfit.estimator.TrainOp`) that the Estimator runs after
        ``model_fn`` returns: backward, gradients averaged over replicas, this optimizer's step.
        """
        from meshfit.estimator import minimize

        return minimize(self, loss, global_step, var_list)

