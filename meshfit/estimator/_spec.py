"""`ModeKeys`, `EstimatorSpec` (what ``model_fn`` returns), `TrainSpec` and `EvalSpec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from meshfit._validation import invalid_argument, is_int


class ModeKeys:
    """The mode ``model_fn`` is called in (``tf.estimator.ModeKeys``; the same string values)."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


_MODES = (ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT)


def _hooks(name: str, hooks: Any) -> tuple[Any, ...]:
    from meshfit.estimator._hooks import SessionRunHook

    hooks = tuple(hooks or ())
    for hook in hooks:
        if not isinstance(hook, SessionRunHook):
            raise TypeError(f"Invalid `{name}`: expected mf.estimator.SessionRunHook instances, received "
                            f"{hook!r} of type {type(hook).__name__}.")
    return hooks


class EstimatorSpec:
    """What ``model_fn`` returns: the ops of one mode (``tf.estimator.EstimatorSpec``).

    Args:
        mode: the `ModeKeys` value ``model_fn`` was called with.
        predictions: PREDICT: a tensor or a dict of tensors, one row per example.
        loss: TRAIN and EVAL: a scalar tensor, this replica's loss on its batch.
        train_op: TRAIN: what applies the update: ``optimizer.minimize(loss, global_step)`` with a
            meshfit optimizer, `minimize` for any optimizer, or the optimizer itself (the
            Estimator runs ``backward``, averages gradients over replicas, then ``step``).
        eval_metric_ops: EVAL: ``{name: metric}``, each a meshfit (or torchmetrics) metric whose
            ``update_state`` ``model_fn`` called on this batch, or a scalar tensor (averaged
            over batches).
        training_hooks, evaluation_hooks, prediction_hooks, training_chief_hooks: extra
            `SessionRunHook`s for that mode (from the first call of each ``train``/``evaluate``/
            ``predict``; the chief hooks on the chief only).
        export_outputs, scaffold: accepted for TF compatibility and ignored.

    Raises:
        ValueError: the mode is unknown, or a field the mode needs is missing (TF's
            ``Missing loss.`` / ``Missing train_op.`` / ``Missing predictions.``).
        TypeError: ``loss`` is not a scalar tensor.

    Example:
        >>> spec = EstimatorSpec(ModeKeys.EVAL, loss=torch.tensor(0.5))
        >>> spec.mode, float(spec.loss)
        ('eval', 0.5)
    """

    __slots__ = ("mode", "predictions", "loss", "train_op", "eval_metric_ops", "export_outputs",
                 "training_chief_hooks", "training_hooks", "scaffold", "evaluation_hooks", "prediction_hooks")
    mode: str
    predictions: Any
    loss: Any
    train_op: Any
    eval_metric_ops: dict[str, Any]
    export_outputs: Any
    training_chief_hooks: tuple[Any, ...]
    training_hooks: tuple[Any, ...]
    scaffold: Any
    evaluation_hooks: tuple[Any, ...]
    prediction_hooks: tuple[Any, ...]

    def __init__(self, mode: str | None = None, predictions: Any = None, loss: Any = None, train_op: Any = None,
                 eval_metric_ops: Mapping[str, Any] | None = None, export_outputs: Any = None,
                 training_chief_hooks: Sequence[Any] | None = None, training_hooks: Sequence[Any] | None = None,
                 scaffold: Any = None, evaluation_hooks: Sequence[Any] | None = None,
                 prediction_hooks: Sequence[Any] | None = None, **unexpected: Any) -> None:
        if unexpected:
            names = ", ".join(sorted(unexpected))
            raise TypeError(f"EstimatorSpec got unexpected arguments: {names}. It takes mode, predictions, loss, "
                            "train_op, eval_metric_ops and hooks (TF's EstimatorSpec has no `labels` either); "
                            "e.g. EstimatorSpec(mode, predictions={'logits': logits}).")
        if mode not in _MODES:
            raise ValueError(f"Invalid `mode`: expected one of ModeKeys.TRAIN, EVAL, PREDICT {_MODES}, "
                             f"received mode={mode!r}. Pass the mode model_fn was called with.")
        if mode in (ModeKeys.TRAIN, ModeKeys.EVAL) and loss is None:
            raise ValueError(f"Missing loss: EstimatorSpec in mode {mode!r} needs loss=<scalar tensor>.")
        if mode == ModeKeys.TRAIN and train_op is None:
            raise ValueError("Missing train_op: EstimatorSpec in mode 'train' needs train_op=..., e.g. "
                             "optimizer.minimize(loss, mf.estimator.get_global_step()).")
        if mode == ModeKeys.PREDICT and predictions is None:
            raise ValueError("Missing predictions: EstimatorSpec in mode 'infer' needs predictions=<tensor or "
                             "dict of tensors>.")
        if loss is not None and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"Invalid `loss`: expected a scalar tensor, received {shape}. Reduce the per-example "
                            "loss, e.g. loss.sum() / BATCH_SIZE.")
        if eval_metric_ops is not None and not isinstance(eval_metric_ops, Mapping):
            raise invalid_argument("eval_metric_ops", "a dict {name: metric}", eval_metric_ops, TypeError)
        values = dict(mode=mode, predictions=predictions, loss=loss, train_op=train_op,
                      eval_metric_ops=dict(eval_metric_ops or {}), export_outputs=export_outputs,
                      training_chief_hooks=_hooks("training_chief_hooks", training_chief_hooks),
                      training_hooks=_hooks("training_hooks", training_hooks), scaffold=scaffold,
                      evaluation_hooks=_hooks("evaluation_hooks", evaluation_hooks),
                      prediction_hooks=_hooks("prediction_hooks", prediction_hooks))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("EstimatorSpec is immutable; build a new one (or use _replace).")

    def _replace(self, **changes: Any) -> EstimatorSpec:
        """A copy with ``changes`` (the namedtuple method TF code uses)."""
        values = {name: getattr(self, name) for name in self.__slots__}
        values.update(changes)
        return EstimatorSpec(**values)

    def __repr__(self) -> str:
        shown = [f"mode={self.mode!r}"] + [f"{name}=..." for name in ("predictions", "loss", "train_op")
                                           if getattr(self, name) is not None]
        return f"EstimatorSpec({', '.join(shown)})"


def _input_fn(input_fn: Any) -> Callable[..., Any]:
    if not callable(input_fn):
        raise invalid_argument("input_fn", "a function returning a meshfit.data.Dataset", input_fn, TypeError)
    return input_fn


def _optional_positive(name: str, value: Any) -> None:
    if value is not None and (not is_int(value) or value <= 0):
        raise invalid_argument(name, "None or a positive int", value)


def _non_negative_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise invalid_argument(name, "a number >= 0", value)


@dataclasses.dataclass(frozen=True, kw_only=False)
class TrainSpec:
    """The training half of `train_and_evaluate` (``tf.estimator.TrainSpec``).

    Args:
        input_fn: ``input_fn(mode[, input_context])`` returning the training data.
        max_steps: train until the global step reaches this (None: until the input ends).
        hooks: `SessionRunHook`s for training.

    Example:
        >>> TrainSpec(input_fn=lambda mode: None, max_steps=100).max_steps
        100
    """

    input_fn: Callable[..., Any]
    max_steps: int | None = None
    hooks: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        _input_fn(self.input_fn)
        _optional_positive("max_steps", self.max_steps)
        object.__setattr__(self, "hooks", _hooks("hooks", self.hooks))


@dataclasses.dataclass(frozen=True, kw_only=False)
class EvalSpec:
    """The evaluation half of `train_and_evaluate` (``tf.estimator.EvalSpec``; TF's defaults).

    Args:
        input_fn: ``input_fn(mode[, input_context])`` returning the evaluation data.
        steps: evaluate this many batches (None: until the input ends). TF's default is 100.
        name: a name for this evaluation (results go to ``model_dir/eval_<name>``).
        hooks: `SessionRunHook`s for evaluation.
        start_delay_secs: the evaluator task waits this long before its first evaluation.
        throttle_secs: evaluate a new checkpoint no sooner than this many seconds after the
            previous evaluation started.

    Example:
        >>> EvalSpec(input_fn=lambda mode: None).steps, EvalSpec(input_fn=lambda mode: None).throttle_secs
        (100, 600)
    """

    input_fn: Callable[..., Any]
    steps: int | None = 100
    name: str | None = None
    hooks: tuple[Any, ...] = ()
    exporters: Any = None
    start_delay_secs: float = 120
    throttle_secs: float = 600

    def __post_init__(self) -> None:
        _input_fn(self.input_fn)
        _optional_positive("steps", self.steps)
        if self.name is not None and (not isinstance(self.name, str) or "/" in self.name):
            raise invalid_argument("name", "None or a name without '/'", self.name)
        _non_negative_number("start_delay_secs", self.start_delay_secs)
        _non_negative_number("throttle_secs", self.throttle_secs)
        object.__setattr__(self, "hooks", _hooks("hooks", self.hooks))
