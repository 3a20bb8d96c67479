"""`Estimator`: TF's ``tf.estimator.Estimator`` on PyTorch, trained by the loop behind `Model.fit`."""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from meshfit._engine import TrainingLoop
from meshfit._engine import evaluate as evaluation_loop
from meshfit._protocols import DistributionStrategy
from meshfit._runtime import flush_denormals
from meshfit._validation import invalid_argument
from meshfit.callbacks import CallbackList
from meshfit.distribute import OneDeviceStrategy, get_strategy
from meshfit.estimator._data import input_data, is_finite, restore_for_inference
from meshfit.estimator._hooks import LoggingTensorHook, SessionRunHook, StepCounterHook, StopAtStepHook, log
from meshfit.estimator._model_fn import ModelFnCaller, verify_model_fn
from meshfit.estimator._outputs import Callbacks, examples
from meshfit.estimator._run_config import RunConfig
from meshfit.estimator._run_hooks import HookCallback, RunState
from meshfit.estimator._saver_hook import CHECKPOINT_NAME, CheckpointSaverHook
from meshfit.estimator._spec import ModeKeys
from meshfit.estimator._summaries import EventWriters, SummaryHook, write_eval_summary
from meshfit.estimator._trainable import EstimatorModel
from meshfit.estimator._variables import variable_names, variable_value

_FOREVER = sys.maxsize


def _check_train_steps(steps: Any, max_steps: Any) -> None:
    if steps is not None and max_steps is not None:
        raise ValueError(f"Invalid `steps` and `max_steps`: give one of them, received steps={steps!r}, "
                         f"max_steps={max_steps!r}.")
    for name, value in (("steps", steps), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise invalid_argument(name, "a positive int or None", value)


def _check_hooks(hooks: Any) -> list[SessionRunHook]:
    hooks = list(hooks or [])
    for hook in hooks:
        if not isinstance(hook, SessionRunHook):
            raise TypeError(f"Invalid `hooks`: expected mf.estimator.SessionRunHook instances, received {hook!r}.")
    return hooks


class Estimator:
    """Train, evaluate and predict with a ``model_fn`` (``tf.estimator.Estimator``).

    ``model_fn(features, labels, mode[, params][, config])`` returns an `EstimatorSpec`; the
    Estimator calls it at every step (eager PyTorch), so modules and optimizers that must live
    across steps are built once: ``mf.estimator.once(lambda: ...)``, or passed in ``params``.
    A ``model_fn`` that builds a fresh module on a later call is stopped with an error.

    Training runs on the same `TrainingLoop` as `Model.fit`, under ``config.train_distribute``;
    each worker's ``input_fn`` gets an `InputContext` (when it takes one) and yields that worker's
    batches (TF's Estimator semantics: the batch size in ``input_fn`` is per replica). Checkpoints
    in ``model_dir`` hold the global step, the data position and the random streams, so a new
    Estimator on the same ``model_dir`` continues exactly where the last checkpoint left off.
    With the strategy of ``mf.dtensor.LayoutMap.fully_sharded(mesh)``, ``model_fn``'s modules are
    sharded in place (FSDP), and ``evaluate``/``predict`` run on every process together.

    Args:
        model_fn: the model function.
        model_dir: where checkpoints and summaries go (default: ``config.model_dir``, else a new
            temporary folder).
        config: a `RunConfig` (default: ``RunConfig()``).
        params: passed to ``model_fn`` (and ``input_fn``) as ``params``.

    Raises:
        ValueError: ``model_fn``'s signature is not supported, or ``model_dir`` disagrees with
            ``config.model_dir``.

    Example:
        >>> import tempfile
        >>> def model_fn(features, labels, mode):
        ...     model = once(lambda: torch.nn.Linear(2, 1))
        ...     ...
        >>> estimator = Estimator(model_fn, model_dir=tempfile.mkdtemp())
    """

    def __init__(self, model_fn: Callable[..., Any], model_dir: str | os.PathLike | None = None,
                 config: RunConfig | None = None, params: dict[str, Any] | None = None,
                 warm_start_from: Any = None) -> None:
        if config is None:
            config = RunConfig()
        if not isinstance(config, RunConfig):
            raise TypeError(f"Invalid `config`: expected an mf.estimator.RunConfig, received {config!r}.")
        if warm_start_from is not None:
            raise ValueError(f"Invalid `warm_start_from`: warm starting is not supported yet, received "
                             f"warm_start_from={warm_start_from!r}. Copy the weights into the module instead.")
        args = verify_model_fn(model_fn, params)
        if model_dir is not None:
            model_dir = os.fspath(model_dir)
            if config.model_dir is not None and os.path.abspath(config.model_dir) != os.path.abspath(model_dir):
                raise ValueError(f"Invalid `model_dir`: the Estimator got model_dir={model_dir!r} but its RunConfig "
                                 f"has model_dir={config.model_dir!r}; give one, or the same in both.")
        model_dir = model_dir or config.model_dir
        if model_dir is None:
            model_dir = tempfile.mkdtemp(prefix="meshfit_estimator_")
            log(f"Using temporary folder as model directory: {model_dir}")
        self._config = config.replace(model_dir=os.path.abspath(model_dir)) if config.model_dir != model_dir \
            else config
        self._model_fn, self._params = model_fn, params
        self._caller = ModelFnCaller(model_fn, args, params, self._config)
        self._event_writers = EventWriters()  # one event file per directory (see EventWriters)

    # ---- properties -------------------------------------------------------------------------
    @property
    def model_dir(self) -> str:
        model_dir = self._config.model_dir
        if model_dir is None:  # __init__ always sets one (a temporary folder by default)
            raise RuntimeError("This Estimator has no model_dir.")
        return model_dir

    @property
    def config(self) -> RunConfig:
        return self._config

    @property
    def params(self) -> Any:
        return self._params

    @property
    def model_fn(self) -> Callable[..., Any]:
        return self._model_fn

    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint in ``model_dir``, or None."""
        from meshfit.train import latest_checkpoint

        return latest_checkpoint(self.model_dir, CHECKPOINT_NAME)

    def get_variable_names(self) -> list[str]:
        """The names of the variables in the latest checkpoint: parameter paths and ``global_step``."""
        return variable_names(self._require_checkpoint())

    def get_variable_value(self, name: str) -> np.ndarray:
        """The value of variable ``name`` in the latest checkpoint (see `get_variable_names`)."""
        return variable_value(self._require_checkpoint(), name)

    def _require_checkpoint(self) -> str:
        latest = self.latest_checkpoint()
        if latest is None:
            raise ValueError(f"Could not find trained model in model_dir: {self.model_dir}. Train first.")
        return latest

    # ---- strategies -------------------------------------------------------------------------
    def _train_strategy(self) -> DistributionStrategy:
        return self._config.train_distribute or get_strategy()

    def _eval_strategy(self) -> DistributionStrategy:
        """``eval_distribute``, else this process alone (TF evaluates without a strategy); a fully sharded
        training strategy evaluates on its processes together (the weights are split over them)."""
        if self._config.eval_distribute is not None:
            return self._config.eval_distribute
        if self._shards_weights():
            return self._train_strategy()
        return OneDeviceStrategy(self._train_strategy().device)

    def _shards_weights(self) -> bool:
        """Whether training shards the weights (``LayoutMap.fully_sharded``): evaluate and predict then need every
        process, each holding a part (an ``evaluator`` task, outside the mesh, reads whole weights alone)."""
        if self._config.task_type == "evaluator":
            return False
        layout_map = self._train_strategy().layout_map
        return layout_map is not None and layout_map.is_fully_sharded

    def _seed_before_first_build(self) -> None:
        seed = self._config.tf_random_seed
        if seed is not None and self._caller.calls == 0:
            torch.manual_seed(seed)
            np.random.seed(seed)
            random.seed(seed)

    # ---- train --------------------------------------------------------------------------------
    def train(self, input_fn: Callable[..., Any], hooks: list[SessionRunHook] | None = None,
              steps: int | None = None, max_steps: int | None = None,
              saving_listeners: list[Any] | None = None) -> Estimator:
        """Train from the latest checkpoint in ``model_dir`` (if any) for ``steps`` more steps, or
        until the global step reaches ``max_steps``, or until ``input_fn``'s data ends.

        Returns:
            self.

        Raises:
            ValueError: both ``steps`` and ``max_steps``, or a non-positive one.
        """
        _check_train_steps(steps, max_steps)
        hooks = _check_hooks(hooks)
        strategy = self._train_strategy()
        with strategy.guard(), flush_denormals():
            data = input_data(self, input_fn, ModeKeys.TRAIN, strategy)
            try:
                self._train(data, strategy, hooks, steps, max_steps, saving_listeners)
            finally:
                data.close()
        return self

    def _train(self, data: Any, strategy: DistributionStrategy, hooks: list[SessionRunHook], steps: int | None,
               max_steps: int | None, saving_listeners: list[Any] | None) -> None:
        is_chief = self._config.is_chief
        trainable = EstimatorModel(self._caller, ModeKeys.TRAIN, strategy)
        self._seed_before_first_build()
        trainable.build(data.peek())
        callbacks = CallbackList()
        loop = TrainingLoop(trainable, data, callbacks)
        session = RunState(trainable, loop, is_chief=is_chief)
        self._caller.step_source = lambda: loop.counters.iterations
        restored = self._restore_training_state(loop)
        global_step = loop.counters.iterations
        if max_steps is not None and global_step >= max_steps:
            log(f"Skipping training since max_steps has already saved (global step {global_step} >= "
                f"max_steps {max_steps}).")
            return
        all_hooks = [*hooks, *trainable.spec_hooks]
        user_saver = next((h for h in all_hooks if isinstance(h, CheckpointSaverHook)), None)
        hook_callback = HookCallback([*all_hooks, *self._default_hooks(is_chief)], session)
        callbacks.append(hook_callback)
        saver_hook = user_saver or self._saver_hook(saving_listeners)
        if saver_hook is not None:
            callbacks.append(saver_hook.saver(session))
        callbacks.set_loop(loop)
        if restored and is_chief:
            log(f"Restoring parameters from {restored}")
        until = self._until_step(data, global_step, steps, max_steps)
        for hook in all_hooks:  # TF's max_steps is a StopAtStepHook: stop exactly there on every replica
            if isinstance(hook, StopAtStepHook):
                last = hook.last_step if hook.last_step is not None else global_step + (hook.num_steps or 0)
                until = min(until, last)  # (a StopAtStepHook has exactly one of last_step and num_steps)
        loop.run(until_step=until, initial_epoch=loop.counters.epoch)
        if is_chief and "loss" in trainable.step_values:
            log(f"Loss for final step: {float(self._final_loss(trainable)):.7g}.")

    def _default_hooks(self, is_chief: bool) -> list[SessionRunHook]:
        """The chief's step logs and TensorBoard summaries, as TF's Estimator adds them."""
        if not is_chief:
            return []
        hooks: list[SessionRunHook] = []
        every = self._config.log_step_count_steps
        if every:
            hooks += [LoggingTensorHook({"loss": "loss", "step": "step"}, every_n_iter=every), StepCounterHook(every)]
        if self._config.save_summary_steps:
            hooks.append(SummaryHook(self._event_writers, self.model_dir, self._config.save_summary_steps))
        return hooks

    def _saver_hook(self, listeners: list[Any] | None) -> CheckpointSaverHook | None:
        config = self._config
        if config.save_checkpoints_steps is None and config.save_checkpoints_secs is None:
            if listeners:
                raise ValueError("Invalid `saving_listeners`: the RunConfig saves no checkpoints (both "
                                 "save_checkpoints_steps and save_checkpoints_secs are None).")
            return None
        return CheckpointSaverHook(self.model_dir, save_secs=config.save_checkpoints_secs,
                                   save_steps=config.save_checkpoints_steps, listeners=listeners,
                                   max_to_keep=config.keep_checkpoint_max)

    def _restore_training_state(self, loop: Any) -> str | None:
        """Everything training needs from the latest checkpoint (weights, optimizer, global step,
        data position, random streams); None when there is none."""

        latest = loop.strategy.broadcast_object(self.latest_checkpoint())
        return loop.resume([latest] if latest is not None else [], fall_back=False)

    @staticmethod
    def _until_step(data: Any, global_step: int, steps: int | None, max_steps: int | None) -> int:
        """The global step to stop at: ``steps`` more, ``max_steps``, or where the input ends."""
        until = global_step + steps if steps is not None else max_steps
        if is_finite(data):
            _, index = data._normalized()
            end_of_input = global_step + data.steps - index
            until = end_of_input if until is None else min(until, end_of_input)
        return until if until is not None else _FOREVER

    @staticmethod
    def _final_loss(trainable: EstimatorModel) -> float:
        return float(trainable.loss_metric.result())

    # ---- evaluate --------------------------------------------------------------------------------
    def evaluate(self, input_fn: Callable[..., Any], steps: int | None = None,
                 hooks: list[SessionRunHook] | None = None, checkpoint_path: str | None = None,
                 name: str | None = None) -> dict[str, Any]:
        """Evaluate the latest checkpoint (or ``checkpoint_path``) on ``input_fn``'s data.

        Returns:
            ``{"loss": mean batch loss, "global_step": the checkpoint's step, <eval_metric_ops>...}``.

        Raises:
            ValueError: there is no checkpoint to evaluate, or ``steps`` is not positive.
        """
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"Invalid `steps`: expected a positive int or None, received steps={steps!r}.")
        hooks = _check_hooks(hooks)
        path = checkpoint_path or self._require_checkpoint()
        strategy = self._eval_strategy()
        with strategy.guard(), flush_denormals():
            data = input_data(self, input_fn, ModeKeys.EVAL, strategy, steps=steps)
            trainable = EstimatorModel(self._caller, ModeKeys.EVAL, strategy)
            self._seed_before_first_build()
            trainable.build(data.peek())
            global_step = restore_for_inference(trainable, path)
            self._caller.step_source = lambda: global_step
            writes = self._config.is_chief or self._config.task_type == "evaluator"
            session = RunState(trainable, global_step=global_step, is_chief=writes)
            hook_callback = HookCallback([*hooks, *trainable.spec_hooks], session)
            if writes:
                log(f"Starting evaluation at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
            hook_callback.start()
            try:
                logs = evaluation_loop(trainable, data, Callbacks([hook_callback]))
            finally:
                data.close()
            hook_callback.finish()
        results = {**logs, "global_step": global_step}
        if writes:
            text = ", ".join(f"{k} = {v:.7g}" if isinstance(v, float) else f"{k} = {v}" for k, v in sorted(results.items()))
            log(f"Saving dict for global step {global_step}: {text}")
            write_eval_summary(self._event_writers, self.model_dir, name, results, path)
        return results

    # ---- predict --------------------------------------------------------------------------------
    def predict(self, input_fn: Callable[..., Any], predict_keys: list[str] | None = None,
                hooks: list[SessionRunHook] | None = None, checkpoint_path: str | None = None,
                yield_single_examples: bool = True) -> Iterator[Any]:
        """Yield the predictions for ``input_fn``'s data, one example at a time (or one batch).

        Runs in this process alone, on the latest checkpoint (fresh weights, with a warning, when
        there is none, as TF does). Dict predictions yield ``{key: numpy array}`` per example.
        """
        hooks = _check_hooks(hooks)
        strategy = OneDeviceStrategy(self._train_strategy().device)  # TF's predict is not distributed
        data = input_data(self, input_fn, ModeKeys.PREDICT, strategy)
        # fully sharded weights: every process predicts every example, gathering the weights together
        placing = self._train_strategy() if self._shards_weights() else strategy
        trainable = EstimatorModel(self._caller, ModeKeys.PREDICT, placing)
        self._seed_before_first_build()
        trainable.build(data.peek())
        path = checkpoint_path or self.latest_checkpoint()
        if path is None:
            log(f"Could not find trained model in model_dir: {self.model_dir}, running initialization to predict.")
            global_step = 0
        else:
            global_step = restore_for_inference(trainable, path)
        hook_callback = HookCallback([*hooks, *trainable.spec_hooks], RunState(trainable, global_step=global_step))
        hook_callback.start()
        module = trainable.module
        was_training = module.training
        try:
            module.eval()
            if data.steps is None:  # input_data gives infinite data a bound, finite data its length
                raise RuntimeError("Estimator.predict: the input has no number of steps.")
            for step in range(data.steps):
                hook_callback.on_predict_batch_begin(step)
                batch, _ = data.next_batch()
                with torch.no_grad():
                    out = trainable.predict_step(strategy.distribute_batch(batch))
                hook_callback.on_predict_batch_end(step)
                yield from examples(out, predict_keys, yield_single_examples)
        finally:
            module.train(was_training)
            data.close()
        hook_callback.finish()

