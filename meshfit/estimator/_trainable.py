"""`EstimatorModel`: one ``train``/``evaluate``/``predict`` run of an Estimator, as a `Trainable`.

The training loop that runs `Model.fit` drives it: ``build`` calls ``model_fn`` once on the first
batch (that builds and finds the modules and the optimizer), ``train_step`` calls ``model_fn``
and runs its ``train_op``, ``test_step`` accumulates the loss and ``eval_metric_ops``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshfit._protocols import DistributionStrategy, Residency
from meshfit.distribute import EVERYWHERE
from meshfit.estimator._model_fn import ModelFnCaller
from meshfit.estimator._sharding import is_fully_sharded, shard_modules
from meshfit.estimator._spec import ModeKeys
from meshfit.estimator._train_op import run_train_op, trained_parameters


def split_features_labels(element: Any) -> tuple[Any, Any]:
    """An ``input_fn`` element: ``(features, labels)``, or features alone."""
    if isinstance(element, (tuple, list)) and len(element) == 2:
        return element[0], element[1]
    if isinstance(element, (tuple, list)) and len(element) == 1:
        return element[0], None
    return element, None


def broadcast_from_first_replica(tensors: list[torch.Tensor], world: Any) -> None:
    """Give every process of ``world`` (a `World`) rank 0's values (replicas start from the same
    weights, as DDP does)."""
    if not tensors or not world.distributed:
        return
    with torch.no_grad():
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            world.broadcast_tensors([flat])
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class _Accumulator:
    """A metric's additive state: running sums over steps (and, through the loop, replicas).

    ``update_state(values)`` adds a scalar tensor (a mean over steps); ``add(metric)`` takes a
    metric's state for this step and resets the metric, so that ``model_fn`` may build a new metric
    at every call or reuse one. ``last_only`` keeps only the latest step (training's ``loss``).
    """

    def __init__(self, name: str, template: Any = None, last_only: bool = False) -> None:
        self.name, self.template, self.last_only = name, template, last_only
        self._states = self._zeros()

    def _zeros(self) -> tuple[torch.Tensor, ...]:
        if self.template is None:
            return torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        return tuple(torch.zeros_like(t, dtype=torch.float64) for t in self.template.state_tensors())

    def reset_state(self) -> None:
        self._states = self._zeros()

    def update_state(self, value: torch.Tensor) -> None:
        new = (value.detach().to(torch.float64).reshape(()), torch.ones((), dtype=torch.float64))
        self._states = new if self.last_only else tuple(a + b for a, b in zip(self._states, new, strict=True))

    def add(self, metric: Any) -> None:
        states = tuple(t.detach().to(torch.float64) for t in metric.state_tensors())
        self._states = tuple(a + b for a, b in zip(self._states, states, strict=True))
        metric.reset_state()

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        return self._states

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.template is None:
            total, count = states
            return total / count if float(count) else torch.zeros((), dtype=torch.float64)
        return self.template.result_from(tuple(s.to(t.dtype) for s, t in zip(states, self.template.state_tensors(),
                                                                                  strict=True)))

    def result(self) -> torch.Tensor:
        return self.result_from(self._states)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): t.clone() for i, t in enumerate(self._states)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._states = tuple(torch.as_tensor(state[str(i)], dtype=torch.float64) for i in range(len(self._states)))


class ModulesState:
    """The weights of the modules ``model_fn`` uses, by name (a `Stateful`).

    Restoring ignores modules in the checkpoint that this run has not built (a module that only
    TRAIN mode uses, restored for EVAL); a module of this run missing from it is an error.
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self._modules = modules

    def state_dict(self) -> dict[str, Any]:
        return {name: module.state_dict() for name, module in self._modules.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, module in self._modules.items():
            if name not in state:
                raise ValueError(f"The checkpoint has no weights for module {name!r} (it has {sorted(state)}): "
                                 "model_fn must build the same modules as the run that saved it.")
            module.load_state_dict(state[name])


class EstimatorModel:
    """A `Trainable` over ``model_fn`` for one mode on one strategy.

    Args:
        caller: the Estimator's `ModelFnCaller` (its modules persist across runs).
        mode: the `ModeKeys` value of this run.
        strategy: where it runs.
    """

    def __init__(self, caller: ModelFnCaller, mode: str, strategy: DistributionStrategy) -> None:
        self.caller, self.mode, self.strategy = caller, mode, strategy
        self.stop_training = False
        self.stop_evaluating = self.stop_predicting = False  # (the hooks of a run may set them)
        self.steps_per_execution = 1  # the loop runs one step between two hook calls
        self.loss_metric = _Accumulator("loss", last_only=mode == ModeKeys.TRAIN)
        self.eval_metrics: dict[str, _Accumulator] = {}
        self.spec_hooks: list[Any] = []
        self.step_values: dict[str, Any] = {}
        self._params: list[torch.Tensor] = []
        self._module: nn.Module | None = None
        self._sharded = False

    # ---- Trainable ------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The modules ``model_fn`` uses: the one module, or a ``ModuleDict`` of several."""
        if self._module is None:
            raise RuntimeError("The Estimator's modules exist once model_fn has been called (build first).")
        return self._module

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_metric, *self.eval_metrics.values()]

    def logged_metrics(self) -> list[Any]:
        return self.metrics

    def reset_metrics(self) -> None:
        for metric in self.metrics:
            metric.reset_state()

    def finish_training(self) -> None:
        """Nothing to finish: an Estimator's optimizer keeps no moving averages to swap in."""

    def build(self, sample: Any) -> None:
        """Call ``model_fn`` on the first batch: builds (or finds) its modules and optimizer, then places them."""
        sharded = is_fully_sharded(self.strategy)  # refuses a hand LayoutMap before model_fn runs
        features, labels = split_features_labels(sample)
        with torch.no_grad():
            spec = self.caller(features, labels, self.mode)
            if self.caller.calls == 1:
                # A second call before anything trains or saves: a model_fn that builds a fresh
                # module at every call fails here, with nothing written to model_dir.
                spec = self.caller(features, labels, self.mode)
        self.spec_hooks = self._hooks_of(spec)
        modules = self.caller.modules
        if not modules:
            raise ValueError("model_fn called no torch module with parameters: build the model in model_fn (with "
                             "mf.estimator.once) or pass it in params, and call it on the features.")
        for module in modules.values():
            # Placed, not wrapped in DDP: model_fn calls the module itself; the train op averages gradients.
            module.to(self.strategy.device)
        if sharded:  # in place: model_fn calls the same module objects, now fully_shard's (rank 0's weights)
            sync = shard_modules(self.strategy, modules, self.caller.optimizer)
            self.caller.gradient_sync = sync or self.caller.gradient_sync
            self.caller.synchronized = True
        self._sharded = sharded
        if self.strategy.num_replicas_in_sync > 1 and not self.caller.synchronized:
            broadcast_from_first_replica([t for m in modules.values() for t in (*m.parameters(), *m.buffers())],
                                         self.strategy.world)
            self.caller.synchronized = True
        self._module = next(iter(modules.values())) if len(modules) == 1 else nn.ModuleDict(modules)
        if self.mode == ModeKeys.TRAIN:
            params = [p for m in modules.values() for p in m.parameters()]
            self._params = trained_parameters(self.caller.optimizer, params)

    @property
    def residency(self) -> Residency:
        """Every rank holds every module's state (the Estimator places replicated or fully sharded)."""
        return EVERYWHERE

    def saveable_parts(self) -> dict[str, Any]:
        parts: dict[str, Any] = {"model": ModulesState(self.caller.modules)}
        if self.caller.optimizer is not None and self.mode == ModeKeys.TRAIN:
            parts["optimizer"] = self.caller.optimizer
        return parts

    def train_step(self, batch: Any) -> None:
        features, labels = split_features_labels(batch)
        spec = self.caller(features, labels, ModeKeys.TRAIN)
        sync = self.caller.gradient_sync if self._sharded else None
        if sync is None:
            run_train_op(spec.train_op, spec.loss, self._params, self.strategy)
        else:  # FSDP's reduce-scatter averages the replicas' gradients (every share counts 1, as TF's Estimator)
            replicas = self.strategy.num_replicas_in_sync
            with sync.weighting(1, replicas):
                run_train_op(spec.train_op, spec.loss, self._params, self.strategy, reduce=False)
        loss = spec.loss.detach()
        self.loss_metric.update_state(loss)
        values = {"loss": loss}
        if isinstance(spec.predictions, dict):
            values.update(spec.predictions)
        self.step_values = values

    def test_step(self, batch: Any) -> None:
        features, labels = split_features_labels(batch)
        spec = self.caller(features, labels, ModeKeys.EVAL)
        self.loss_metric.update_state(spec.loss)
        for name, value in spec.eval_metric_ops.items():
            self._eval_metric(name, value)

    def predict_step(self, batch: Any) -> Any:
        features, labels = split_features_labels(batch)
        return self.caller(features, labels, ModeKeys.PREDICT).predictions

    # ---- helpers ---------------------------------------------------------------------------
    def _eval_metric(self, name: str, value: Any) -> None:
        accumulator = self.eval_metrics.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            if accumulator is None:
                accumulator = self.eval_metrics[name] = _Accumulator(name)
            accumulator.update_state(value)
            return
        if hasattr(value, "state_tensors") and hasattr(value, "result_from"):
            if accumulator is None:
                accumulator = self.eval_metrics[name] = _Accumulator(name, template=value)
            accumulator.add(value)
            return
        raise TypeError(f"Invalid eval_metric_ops[{name!r}]: expected a meshfit metric (whose update_state model_fn "
                        f"called) or a scalar tensor, received {type(value).__name__}.")

    def _hooks_of(self, spec: Any) -> list[Any]:
        if self.mode == ModeKeys.TRAIN:
            return [*spec.training_hooks, *(spec.training_chief_hooks if self.strategy.is_chief else ())]
        if self.mode == ModeKeys.EVAL:
            return list(spec.evaluation_hooks)
        return list(spec.prediction_hooks)
