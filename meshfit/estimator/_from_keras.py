"""`model_to_estimator`: an `Estimator` whose ``model_fn`` runs a compiled `meshfit.Model`'s module, loss,
optimizer and metrics (``tf.keras.estimator.model_to_estimator``)."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from meshfit._engine import Model, load_model
from meshfit.estimator._estimator import Estimator
from meshfit.estimator._run_config import RunConfig
from meshfit.estimator._spec import EstimatorSpec, ModeKeys
from meshfit.estimator._train_op import minimize
from meshfit.optimizers import Optimizer
from meshfit.optimizers import deserialize as deserialize_optimizer
from meshfit.optimizers import serialize as serialize_optimizer

_CHECKPOINT_FORMATS = (None, "checkpoint", "saver")


class KerasModelFn:
    """The ``model_fn`` of a converted model: features through the module; the compiled loss (weighted by
    ``features["sample_weights"]`` when ``features`` is ``{"features": ..., "sample_weights": ...}``, as TF);
    the compiled optimizer as ``train_op``; a fresh copy of each compiled metric per evaluation batch.

    Args:
        module: the converted model's copy of the module (trained by the Estimator).
        loss: the compiled loss.
        optimizer: a fresh optimizer of the compiled kind and settings.
        metrics: ``{name in eval results: compiled metric}`` (copied, never updated themselves).
    """

    def __init__(self, module: nn.Module, loss: Any, optimizer: Any, metrics: Mapping[str, Any]) -> None:
        self.module, self.loss, self.optimizer, self.metrics = module, loss, optimizer, dict(metrics)

    def __call__(self, features: Any, labels: Any, mode: str) -> EstimatorSpec:
        sample_weight = None
        if isinstance(features, Mapping) and set(features) == {"features", "sample_weights"}:
            features, sample_weight = features["features"], features["sample_weights"]
        predictions = self.module(features)
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions=predictions)
        if labels is None:
            raise ValueError(f"model_to_estimator's model_fn got no labels in mode {mode!r}: the compiled loss "
                             "needs them. Make input_fn yield (features, labels).")
        loss = self.loss(labels, predictions, sample_weight=sample_weight)
        if mode == ModeKeys.EVAL:
            return EstimatorSpec(mode, loss=loss, eval_metric_ops=self._metric_ops(labels, predictions.detach()))
        return EstimatorSpec(mode, loss=loss, train_op=minimize(self.optimizer, loss))

    def _metric_ops(self, labels: Any, predictions: Any) -> dict[str, Any]:
        """Each metric's state on this batch alone (TF's metrics are not weighted: nor are these)."""
        ops = {}
        for name, metric in self.metrics.items():
            batch_metric = copy.deepcopy(metric)
            batch_metric.reset_state()
            batch_metric.update_state(labels, predictions)
            ops[name] = batch_metric
        return ops


def model_to_estimator(keras_model: Model | None = None, keras_model_path: str | os.PathLike | None = None,
                       custom_objects: Mapping[str, Any] | None = None, model_dir: str | os.PathLike | None = None,
                       config: RunConfig | None = None, checkpoint_format: str | None = None,
                       use_v2_estimator: bool = False, metric_names_map: Mapping[str, str] | None = None,
                       export_outputs: Any = None) -> Estimator:
    """An `Estimator` from a compiled `meshfit.Model` (``tf.keras.estimator.model_to_estimator``).

    The Estimator trains a copy of the model's module, taken now (TF saves the Keras model's weights
    as the Estimator's starting point): the model passed in is not changed by the Estimator. Its
    ``model_fn`` computes the compiled loss on ``module(features)`` (a mean over the replica's batch,
    as in ``fit``), steps a fresh optimizer of the compiled kind and settings, and reports the compiled
    metrics (and ``loss``) from ``evaluate``; ``predict`` yields the module's output per example. Any
    ``RunConfig(train_distribute=...)`` works, with ``train_and_evaluate`` too.

    Args:
        keras_model: a compiled `meshfit.Model`. Give this or ``keras_model_path``.
        keras_model_path: a model saved with ``Model.save`` (loaded with `meshfit.load_model`, compiled).
        custom_objects: TF's custom classes for rebuilding a saved model; meshfit rebuilds only standard
            ``torch.nn`` layers, so it must be None (load a custom module with
            ``mf.load_model(path, module=MyModule())`` and pass it as ``keras_model``).
        model_dir: where checkpoints go (default: ``config.model_dir``, else a temporary folder).
        config: a `RunConfig`.
        checkpoint_format: ``"checkpoint"`` (default) or ``"saver"``: TF's two formats; meshfit writes its
            one checkpoint format either way.
        use_v2_estimator: accepted for TF compatibility (there is one Estimator).
        metric_names_map: ``{compiled metric name: name in evaluate's results}``, covering every compiled metric.
        export_outputs: accepted for TF compatibility and ignored (as `EstimatorSpec`'s).

    Returns:
        The `Estimator`.

    Raises:
        ValueError: neither or both of ``keras_model`` / ``keras_model_path``; the model is not compiled
            or compiled without a loss; a bad ``checkpoint_format`` or ``metric_names_map``; ``custom_objects``.
        TypeError: ``keras_model`` is not a `meshfit.Model`.

    Example:
        >>> import tempfile, torch
        >>> import meshfit as mf
        >>> model = mf.Model(torch.nn.Linear(4, 1))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> estimator = mf.estimator.model_to_estimator(keras_model=model, model_dir=tempfile.mkdtemp())
        >>> type(estimator).__name__
        'Estimator'
    """
    if (keras_model is None) == (keras_model_path is None):
        raise ValueError("Either `keras_model` or `keras_model_path` needs to be provided, but not both: received "
                         f"keras_model={keras_model!r}, keras_model_path={keras_model_path!r}.")
    if checkpoint_format not in _CHECKPOINT_FORMATS:
        raise ValueError(f'Invalid `checkpoint_format`: Checkpoint format must be one of "checkpoint" or "saver", '
                         f"received checkpoint_format={checkpoint_format!r}.")
    if custom_objects:
        raise ValueError(f"Invalid `custom_objects`: meshfit rebuilds a saved model from standard torch.nn layers "
                         f"only, received custom_objects={dict(custom_objects)!r}. Load a custom module with "
                         "mf.load_model(path, module=MyModule()) and pass it as keras_model=.")
    if keras_model is None:
        keras_model = load_model(os.fspath(keras_model_path))  # type: ignore[arg-type]  # checked above
    model = _compiled(keras_model)
    metrics = _metric_names(model, metric_names_map)
    model_fn = KerasModelFn(copy.deepcopy(model.module), model.loss, _fresh_optimizer(model.optimizer), metrics)
    return Estimator(model_fn, model_dir=model_dir, config=config)


def _compiled(keras_model: Any) -> Model:
    if not isinstance(keras_model, Model):
        raise TypeError(f"Invalid `keras_model`: expected a compiled meshfit.Model, received "
                        f"{type(keras_model).__name__}. Wrap a module: mf.Model(module), then compile() it.")
    if not keras_model.compiled:
        raise ValueError("Invalid `keras_model`: The given keras model has not been compiled yet. Please compile "
                         "the model with `model.compile()` before calling `model_to_estimator()`.")
    if keras_model.loss is None:
        raise ValueError("Invalid `keras_model`: it was compiled without a loss, which its Estimator trains and "
                         "evaluates with. Compile it with loss=..., e.g. model.compile(optimizer, loss='mse').")
    return keras_model


def _metric_names(model: Model, names_map: Mapping[str, str] | None) -> dict[str, Any]:
    """The compiled metrics by their name in eval results (TF's rules for ``metric_names_map``)."""
    compiled = model.metrics[1:]  # after the loss tracker
    if not names_map:
        return {m.name: m for m in compiled}
    expected, given = {m.name for m in compiled}, set(names_map)
    if expected - given:
        raise ValueError(f"Invalid `metric_names_map`: the model's metric names {sorted(expected - given)} are "
                         f"missing from it, received metric_names_map={dict(names_map)!r}.")
    if given - expected:
        raise ValueError(f"Invalid `metric_names_map`: it has unexpected keys {sorted(given - expected)}; expected "
                         f"keys: {sorted(expected)}, received metric_names_map={dict(names_map)!r}.")
    return {names_map[m.name]: m for m in compiled}


def _fresh_optimizer(optimizer: Any) -> Any:
    """An optimizer of ``optimizer``'s kind and settings, with no state and bound to nothing (TF clones the
    optimizer from its config)."""
    config = serialize_optimizer(optimizer)
    if config is not None:
        return deserialize_optimizer(config)
    if not (isinstance(optimizer, Optimizer) and optimizer.built):  # a torch optimizer instance: copied as is
        return copy.deepcopy(optimizer)
    raise ValueError(f"Invalid `keras_model`: its optimizer {type(optimizer).__name__} is already built on the "
                     "model's parameters and has no config to build a fresh one from. Compile the model with a "
                     "meshfit optimizer (e.g. mf.optimizers.Adam(...)) or a torch optimizer class "
                     "(optimizer=torch.optim.Adam), not a built instance.")
