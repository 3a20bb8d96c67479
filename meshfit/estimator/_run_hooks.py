"""`HookCallback`: runs `SessionRunHook`s from the training loop's callback events; `RunState`.

TF's session-run protocol maps onto the loop's events: ``begin`` and ``after_create_session`` at
train begin (the model is built and restored by then), ``before_run``/``after_run`` around each
step, ``end`` at train end. A hook's ``request_stop`` reaches the other replicas through the loop's
per-step reduction, so every worker stops after the same step (with several replicas, the step after
the request; `StopAtStepHook` and ``max_steps`` stop exactly where they say).
"""

from __future__ import annotations

from typing import Any

from meshfit._protocols import DistributionStrategy
from meshfit.callbacks import Callback
from meshfit.estimator._hooks import SessionRunContext, SessionRunValues, fetch


class RunState:
    """What hooks see as ``session``: the global step, the role, and (for savers) the checkpoint.

    Args:
        trainable: the run's `EstimatorModel`.
        loop: the `TrainingLoop` (training runs), else None.
        global_step: the global step of an evaluation or prediction.
        is_chief: whether this task writes logs and files.
    """

    def __init__(self, trainable: Any, loop: Any = None, global_step: int = 0, is_chief: bool = True) -> None:
        self.trainable, self.loop, self._global_step, self.is_chief = trainable, loop, global_step, is_chief

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (a training run counts them as it goes)."""
        return self.loop.counters.iterations if self.loop is not None else self._global_step

    @property
    def strategy(self) -> DistributionStrategy:
        return self.trainable.strategy


class HookCallback(Callback):
    """Calls ``hooks`` around the loop's training (or evaluation, or prediction) steps.

    Args:
        hooks: the `SessionRunHook`s, in order.
        session: the `RunState` they see.
    """

    def __init__(self, hooks: list[Any], session: RunState) -> None:
        super().__init__()
        self.hooks, self.session = list(hooks), session
        self._context: SessionRunContext | None = None
        self._args: list[Any] = []

    @property
    def reads_batch_logs(self) -> bool:
        """The loop reduces the step's loss over replicas only when a hook may fetch it."""
        return bool(self.hooks)

    # ---- session begin / end ---------------------------------------------------------------
    def start(self) -> None:
        for hook in self.hooks:
            hook.begin()
        for hook in self.hooks:
            hook.after_create_session(self.session, None)

    def finish(self) -> None:
        for hook in self.hooks:
            hook.end(self.session)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.start()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.finish()

    # ---- steps -------------------------------------------------------------------------------
    def _before(self) -> None:
        self._context = SessionRunContext()
        self._args = [hook.before_run(self._context) for hook in self.hooks]

    def _after(self, logs: dict | None) -> bool:
        """Run ``after_run``; returns whether a hook asked to stop."""
        step = self.session.global_step
        values: dict[str, Any] = {"global_step": step, "step": step - 1, **self.session.trainable.step_values}
        if logs and "loss" in logs:
            values["loss"] = logs["loss"]  # averaged over the replicas
        context = self._context
        if context is None:
            raise RuntimeError("HookCallback: after_run without before_run.")
        for hook, args in zip(self.hooks, self._args, strict=True):
            results = fetch(args.fetches, values) if args is not None else None
            hook.after_run(context, SessionRunValues(results=results))
        return context.stop_requested

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.hooks:
            self._before()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.hooks and self._after(logs):
            self.session.trainable.stop_training = True

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._before()

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._after(logs)

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._before()

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._after(None)
