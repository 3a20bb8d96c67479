"""`train_and_evaluate`: TF's driver — locally, evaluate after each checkpoint; on a cluster,
workers train and the ``evaluator`` task evaluates each new checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from meshfit._storage import atomic_write_json
from meshfit.estimator._hooks import log
from meshfit.estimator._saver_hook import CheckpointSaverListener
from meshfit.estimator._spec import EvalSpec, TrainSpec

FINISHED_FILE = "training_finished.json"


class _EvaluateAfterSave(CheckpointSaverListener):
    """Local mode: evaluate each new checkpoint (no sooner than ``throttle_secs`` after the last)."""

    def __init__(self, estimator: Any, eval_spec: EvalSpec) -> None:
        self.estimator, self.eval_spec = estimator, eval_spec
        self.last_result: dict[str, Any] | None = None
        self._last_time: float | None = None
        self._evaluated_step: int | None = None
        self._first = True

    def after_save(self, session: Any, global_step_value: int) -> None:
        if self._first:  # the checkpoint of the starting step: nothing trained since
            self._first = False
            return
        throttle = self.eval_spec.throttle_secs
        if self._last_time is None or time.monotonic() - self._last_time >= throttle:
            self._evaluate(global_step_value)

    def end(self, session: Any, global_step_value: int) -> None:
        if self._evaluated_step != global_step_value:
            self._evaluate(global_step_value)

    def _evaluate(self, step: int) -> None:
        self._last_time = time.monotonic()
        spec = self.eval_spec
        self.last_result = self.estimator.evaluate(spec.input_fn, steps=spec.steps, hooks=list(spec.hooks),
                                                   name=spec.name)
        self._evaluated_step = step


def train_and_evaluate(estimator: Any, train_spec: TrainSpec, eval_spec: EvalSpec) -> tuple[dict | None, list]:
    """Train and evaluate ``estimator`` as ``tf.estimator.train_and_evaluate`` does.

    Locally (one training task and no evaluator task): one ``train`` that evaluates after each checkpoint
    (at most every ``throttle_secs``) and once at the end. On a cluster: the chief and workers
    train (the chief writes the checkpoints); the ``evaluator`` task evaluates each new complete
    checkpoint, waiting ``start_delay_secs`` first and ``throttle_secs`` between evaluations (both cut
    short once training has finished), and writes the results to ``model_dir/eval`` for TensorBoard.
    It stops once it has evaluated the final checkpoint (``max_steps`` reached, or training reported
    finished).

    Returns:
        ``(eval results, [])`` locally and on the evaluator (the last evaluation); ``(None, [])``
        on training workers of a cluster.
    """
    if not isinstance(train_spec, TrainSpec):
        raise TypeError(f"Invalid `train_spec`: expected an mf.estimator.TrainSpec, received {train_spec!r}.")
    if not isinstance(eval_spec, EvalSpec):
        raise TypeError(f"Invalid `eval_spec`: expected an mf.estimator.EvalSpec, received {eval_spec!r}.")
    config = estimator.config
    if config.task_type == "evaluator":
        return _run_evaluator(estimator, train_spec, eval_spec), []
    if config.num_worker_replicas > 1 or "evaluator" in config.cluster_spec:
        _run_worker(estimator, train_spec)  # a cluster: the evaluator task evaluates
        return None, []
    config_text = (f"save_checkpoints_steps {config.save_checkpoints_steps} or save_checkpoints_secs "
                   f"{config.save_checkpoints_secs}")
    if config.save_checkpoints_steps is None and config.save_checkpoints_secs is None:
        raise ValueError("train_and_evaluate evaluates at each checkpoint, but the RunConfig saves none: set "
                         "save_checkpoints_steps or save_checkpoints_secs.")
    log("Running training and evaluation locally (non-distributed).")
    log(f"Start train and evaluate loop. The evaluate will happen after every checkpoint. Checkpoint frequency is "
        f"determined based on RunConfig arguments: {config_text}.")
    listener = _EvaluateAfterSave(estimator, eval_spec)
    estimator.train(train_spec.input_fn, hooks=list(train_spec.hooks), max_steps=train_spec.max_steps,
                    saving_listeners=[listener])
    return listener.last_result, []


def _run_worker(estimator: Any, train_spec: TrainSpec) -> None:
    config = estimator.config
    marker = os.path.join(estimator.model_dir, FINISHED_FILE)
    if config.is_chief and os.path.exists(marker):
        os.remove(marker)  # a previous run's: this one trains on
    estimator.train(train_spec.input_fn, hooks=list(train_spec.hooks), max_steps=train_spec.max_steps)
    if config.is_chief:
        latest = estimator.latest_checkpoint()
        atomic_write_json(marker, {"latest_checkpoint": os.path.basename(latest) if latest else None})
    return None


def _finished_checkpoint(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, FINISHED_FILE)) as file:
            return json.load(file).get("latest_checkpoint")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _run_evaluator(estimator: Any, train_spec: TrainSpec, eval_spec: EvalSpec) -> dict[str, Any] | None:
    """Evaluate each new checkpoint until the final one is evaluated."""
    if eval_spec.start_delay_secs:
        log(f"Waiting {eval_spec.start_delay_secs} secs before starting training.")
        _sleep_while_training(eval_spec.start_delay_secs, estimator.model_dir)
    result: dict[str, Any] | None = None
    evaluated: str | None = None
    said = ""
    while True:
        start = time.monotonic()
        latest = estimator.latest_checkpoint()
        if latest is None or latest == evaluated:
            message = ("Estimator is not trained yet. Will start an evaluation when a checkpoint is ready."
                       if latest is None else "No new checkpoint ready for evaluation.")
            if message != said:  # once, not at every look
                log(message)
                said = message
        else:
            said = ""
            try:
                result = estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps, hooks=list(eval_spec.hooks),
                                            checkpoint_path=latest, name=eval_spec.name)
                evaluated = latest
            except (Exception, CheckpointException) as error:
                if os.path.exists(latest):
                    raise
                # Pruned (keep_checkpoint_max) while it was read: the next look finds a newer one.
                log(f"Checkpoint {latest} was deleted while it was evaluated ({type(error).__name__}); "
                    "looking again.")
                continue
            step = result["global_step"]
            if train_spec.max_steps is not None and step >= train_spec.max_steps:
                log(f"Exiting evaluation, global_step={step} >= train max_steps={train_spec.max_steps}")
                return result
        finished = _finished_checkpoint(estimator.model_dir)
        if finished is not None and evaluated is not None and os.path.basename(evaluated) == finished:
            log("Exiting evaluation: training finished and its last checkpoint is evaluated.")
            return result
        wait = eval_spec.throttle_secs - (time.monotonic() - start)
        _sleep_while_training(max(wait, 0.2), estimator.model_dir)


def _sleep_while_training(seconds: float, model_dir: str) -> None:
    """Sleep ``seconds``, or less once training has finished: the delays (``start_delay_secs``,
    ``throttle_secs``) spare the workers' CPU while they train; the final checkpoint is evaluated at once
    (a launcher stops an evaluator soon after training ends)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if _finished_checkpoint(model_dir) is not None:
            return
        time.sleep(min(left, 0.5))
