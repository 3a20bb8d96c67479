"""`StepsMixin`: Keras's step methods on a `Model` (``train_step``, ``test_step``, ``predict_step`` and
the helpers an override calls: ``compute_loss``, ``compute_metrics``, ``get_metrics_result``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from meshfit import mixed_precision
from meshfit._engine._outputs import CompileLoss, OutputMetric, detached, is_structured, zero_of
from meshfit._engine._step_logs import MetricResults
from meshfit._protocols import DistributionStrategy, PlacementLike, Residency, StepOutputs, StepRunner
from meshfit.data import batch_size_of, unpack_batch
from meshfit.distribute import EVERYWHERE
from meshfit.losses import Loss, SparseCategoricalCrossentropy, TorchModuleLoss
from meshfit.metrics import Mean, Metric


class StepsMixin:
    """The step side of `meshfit.Model`: needs its module, loss, optimizer, strategy and metrics."""

    module: nn.Module
    loss: Any
    optimizer: Any
    strategy: DistributionStrategy
    placement: PlacementLike | None
    _compiled_metrics: list[Metric]
    _loss_tracker: Mean
    _step_params: list[nn.Parameter] | None
    _warned_untrainable: bool
    logged_metrics: Callable[[], list[Metric]]
    __call__: Callable[..., Any]

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                     training: bool = True) -> torch.Tensor:
        """The loss of one (per-replica) batch: the mean over its examples (Keras's helper).

        Like Keras 3's, it computes the loss only; the step updates the loss tracker. Losses keyed by
        output (``compile(loss={"logits": ...})``) read their outputs of a dict, tuple or Hugging Face
        ``ModelOutput``; a single built-in loss meeting several outputs says which names to key it by.
        """
        loss = self.loss
        if loss is None:
            raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
        if is_structured(y_pred) and not isinstance(loss, CompileLoss) and type(loss).__call__ in _TENSOR_LOSS_CALLS:
            loss = CompileLoss(loss)  # refuses, naming the outputs and the keyed form
        return loss(y, y_pred, sample_weight=sample_weight)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Mapping[str, Any]:
        """Update the compiled metrics with one batch; returns `get_metrics_result()` (Keras's helper)."""
        self._update_metrics(x, y, y_pred, sample_weight)
        return self.get_metrics_result()

    def _update_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> None:
        """`compute_metrics`'s update of the compiled metrics with one batch."""
        if y is not None:
            if y_pred.__class__ is torch.Tensor:  # the usual one output (`detached`, `is_structured` inline)
                y_pred, structured = y_pred.detach(), False
            else:
                y_pred = detached(y_pred)
                structured = is_structured(y_pred)
            if not structured and y.__class__ is not torch.Tensor and isinstance(y, (list, tuple)) and len(y) == 1:
                y = y[0]  # Keras: a list of one target for the one output
            for metric in self._compiled_metrics:
                if structured and not isinstance(metric, OutputMetric):
                    metric.update_state(*self._sole_output(metric, y, y_pred, sample_weight))
                else:
                    metric.update_state(y, y_pred, sample_weight=sample_weight)

    def _sole_output(self, metric: Metric, y: Any, y_pred: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        """A metric of a flat ``metrics`` list reads the one output that has a loss (Keras: the one output)."""
        loss = self.loss
        if isinstance(loss, CompileLoss) and len(loss.keys) == 1:
            return loss.pick(loss.keys[0], y, y_pred, sample_weight)
        names = list(y_pred) if isinstance(y_pred, Mapping) else [f"output_{i}" for i in range(len(y_pred))]
        raise ValueError(f"Invalid `metrics`: metric {metric.name!r} is not keyed by output, and the model returns "
                         f"several outputs {names}. Pass metrics={{name: [...]}} keyed by those names (or a list "
                         "with one entry per loss of a list of losses).")

    def get_metrics_result(self) -> Mapping[str, Any]:
        """``{name: result}`` of the logged metrics on this replica, computed now (Keras's helper: a result kept
        keeps its values; ``fit`` logs the metrics reduced over all replicas)."""
        return {metric.name: metric.result() for metric in self.logged_metrics()}

    def _step_results(self, batch: tuple[Any, Any, Any, Any] | None = None) -> Mapping[str, Any]:
        """What a built-in step returns, after updating the metrics with ``batch`` (x, y, y_pred, sample_weight).

        Where neither `compute_metrics` nor `get_metrics_result` is overridden: a `MetricResults`, whose
        results are computed only where read (the loop logs them; none a step without a reader of batch
        logs), and which records what an override (``super().train_step(data)``) sets or deletes in it.
        Otherwise ``compute_metrics(...)``, as Keras's steps return.
        """
        cls, own = self.__class__, self.__dict__  # an override on the class, or one set on the instance
        lazy = (cls.compute_metrics is StepsMixin.compute_metrics and cls.get_metrics_result is StepsMixin.get_metrics_result
                and "compute_metrics" not in own and "get_metrics_result" not in own)
        if batch is not None:
            if not lazy:
                return self.compute_metrics(*batch)
            self._update_metrics(*batch)
        return MetricResults(self.logged_metrics) if lazy else self.get_metrics_result()  # (listed when read)

    def train_step(self, data: Any) -> Mapping[str, Any] | None:
        """One optimisation step on this replica's batch; updates the metrics and returns their results.

        Override it as in Keras (``y_pred = self(x)`` runs the strategy-wrapped module while
        training; ``self.compute_loss`` / ``self.compute_metrics`` as Keras's). A returned dict with
        other names than the metrics' is logged as it is.
        """
        x, y, sample_weight = unpack_batch(data)
        if not self._has_trainable_weights():
            return self._forward_only_step(x, y, sample_weight)
        if self.optimizer is None:
            raise RuntimeError("train_step needs an optimizer: call compile(optimizer=...) first.")
        placement = self.placement  # `_step_runner`, inline (every step)
        runner = placement.step if placement is not None else None
        if runner is not None:  # the placement runs forward → loss → backward (a pipeline's schedule)
            self.optimizer.zero_grad(set_to_none=True)
            with _autocast(self.strategy):
                outputs = runner.train(self, x, y, sample_weight)
            self.optimizer.step()
            return self._record(x, y, sample_weight, outputs)
        # Freed, as Keras leaves an unused gradient None; no page faults: meshfit/_runtime/_allocator.py.
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(self.strategy):  # forward + loss in the policy's dtype
            y_pred = self(x)
            size = batch_size_of(y_pred)
            if size == 0:
                # This replica's share of a last, small global batch is empty: it still joins the
                # gradient all-reduce (with zeros), so that every replica takes the same step.
                zero_of(y_pred).backward()
                self.optimizer.step()
                return None
            loss = self.compute_loss(x, y, y_pred, sample_weight)
        self.optimizer.scale_loss(loss).backward()  # scaled under mixed_float16 (LossScaleOptimizer)
        self.optimizer.step()
        self._loss_tracker.update_state(loss.detach(), sample_weight=size)
        return self._step_results((x, y, y_pred, sample_weight))

    def _step_runner(self) -> StepRunner | None:
        """The placement's runner of a step; None: this model's own local step (every SPMD placement)."""
        placement = self.placement
        return placement.step if placement is not None else None

    def _refuse_step_overrides(self) -> None:
        """Under a placement whose runner runs each step (a pipeline's schedule over stages), an override of a
        step cannot call it, and one of the metrics' helpers would gather results on some processes only:
        refused, naming the override."""
        if self._step_runner() is None:
            return
        for name in ("train_step", "test_step", "predict_step"):
            if getattr(type(self), name) is not getattr(StepsMixin, name):
                raise ValueError(f"Invalid `{name}` override on {type(self).__name__}: its placement runs each step "
                                 "as a schedule over stages (a pipeline), which an override cannot call. Remove the "
                                 "override, or train without layout_map.pipeline(...).")
        for name in ("compute_metrics", "get_metrics_result"):
            if getattr(type(self), name) is not getattr(StepsMixin, name):
                raise ValueError(f"Invalid `{name}` override on {type(self).__name__}: under a pipeline only the "
                                 "processes of the last stage hold the outputs, and a metric's result is gathered "
                                 "from them by every process at once, which an override called on those processes "
                                 "alone would wait for forever. Remove the override (a metric class of your own, "
                                 "passed to compile(metrics=...), computes what you need), or train without "
                                 "layout_map.pipeline(...).")

    def _metrics_follow_placement(self) -> None:
        """Under a residency where some processes hold the outputs (pipeline stages), each logged metric's
        `result()` read directly (a callback's) takes its states from those processes."""
        residency = self.residency
        if residency.everywhere or residency.leads_logs is None:
            return
        for metric in self.logged_metrics():
            metric.follow_placement(self.strategy, residency.leads_logs)

    @property
    def residency(self) -> Residency:
        """Which ranks hold which state and the outputs: the placement's (`EVERYWHERE` until placed)."""
        placement = self.placement
        return placement.residency if placement is not None else EVERYWHERE

    def _record(self, x: Any, y: Any, sample_weight: Any, outputs: StepOutputs | None) -> Mapping[str, Any]:
        """Update the loss tracker and the metrics with a runner's outputs (a rank without outputs, a
        pipeline's earlier stage, updates nothing: the log reduction takes the states of those with)."""
        if outputs is not None:  # (`_refuse_step_overrides`: no override of compute_metrics here)
            self._loss_tracker.update_state(outputs.loss.detach(), sample_weight=outputs.size)
            self._update_metrics(x, y, outputs.y_pred, sample_weight)
        return MetricResults(self.logged_metrics)

    def _has_trainable_weights(self) -> bool:
        """Whether a parameter of the module requires a gradient (read at every step: a callback may
        freeze one). The list of parameters is taken once per `build` (each fit, evaluate and predict
        calls it), not walked through the module tree at every step."""
        params = self._step_params
        if params is None:
            params = self._step_params = list(self.module.parameters())
        for param in params:
            if param.requires_grad:
                return True
        return False

    def _forward_only_step(self, x: Any, y: Any, sample_weight: Any) -> Mapping[str, Any]:
        """Keras's step for a model with no trainable weights: forward, loss, metrics, no update."""
        if not self._warned_untrainable:
            self._warned_untrainable = True
            warnings.warn("The model does not have any trainable weights: fit runs the forward pass and logs "
                          "the loss and metrics, without an update.", stacklevel=3)
        with torch.no_grad(), mixed_precision.autocast(self.strategy.device):
            y_pred = self(x)
            loss = self.compute_loss(x, y, y_pred, sample_weight) if batch_size_of(y_pred) else None
        if loss is None:
            return self._step_results()
        self._loss_tracker.update_state(loss.detach(), sample_weight=batch_size_of(y_pred))
        return self._step_results((x, y, y_pred, sample_weight))

    def test_step(self, data: Any) -> Mapping[str, Any] | None:
        """One evaluation step on this replica's batch; updates the metrics and returns their results."""
        x, y, sample_weight = unpack_batch(data)
        runner = self._step_runner()
        if runner is not None:
            with mixed_precision.autocast(self.strategy.device):
                outputs = runner.evaluate(self, x, y, sample_weight)
            return self._record(x, y, sample_weight, outputs)
        with mixed_precision.autocast(self.strategy.device):
            y_pred = self.module(x)
            loss = self._evaluation_loss(x, y, y_pred, sample_weight) if self.loss is not None else None
        if loss is not None:
            self._loss_tracker.update_state(loss.detach(), sample_weight=batch_size_of(y_pred))
        return self._step_results((x, y, y_pred, sample_weight))

    def _evaluation_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> torch.Tensor:
        """``compute_loss(..., training=False)``, as Keras 3's ``test_step`` calls it; an override
        written without ``training`` is called without it (Keras keeps those working too)."""
        if _takes_training(type(self).compute_loss):
            return self.compute_loss(x, y, y_pred, sample_weight, training=False)
        return self.compute_loss(x, y, y_pred, sample_weight)

    def predict_step(self, data: Any) -> Any:
        """The module's output for one batch."""
        x, _, _ = unpack_batch(data)
        runner = self._step_runner()
        with mixed_precision.autocast(self.strategy.device):
            y_pred = self.module(x) if runner is None else runner.predict(self, x)
            return mixed_precision.to_variable_dtype(y_pred)


_NO_AUTOCAST = contextlib.nullcontext()  # reusable: entered by every float32 step, no object made per step


def _autocast(strategy: DistributionStrategy) -> AbstractContextManager[Any]:
    """`mixed_precision.autocast` on the strategy's device, or a shared do-nothing context under
    ``"float32"`` (no generator made and run, and no device read, at each step for a policy that changes
    nothing)."""
    if mixed_precision.global_policy().compute_dtype == "float32":
        return _NO_AUTOCAST
    return mixed_precision.autocast(strategy.device)


@functools.lru_cache(maxsize=64)
def _takes_training(compute_loss: Callable[..., Any]) -> bool:
    parameters = inspect.signature(compute_loss).parameters
    return "training" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


#: The ``__call__`` of the losses that take one tensor (``y_pred.device``): a dict of outputs meets a
#: clear error naming them. A `Loss` subclass with its own ``__call__`` gets the outputs as they are.
_TENSOR_LOSS_CALLS = (Loss.__call__, TorchModuleLoss.__call__, SparseCategoricalCrossentropy.__call__)
