"""Losses and metrics keyed by output, as Keras 3 compiles them for a model with several outputs.

A module may return one tensor, a tuple/list of them, or a mapping: a dict, or a Hugging Face
``ModelOutput`` (an ``OrderedDict`` subclass with ``logits``, ``past_key_values``, ...; its ``None``
fields are absent). ``compile(loss={"logits": ...})`` computes the loss on that output alone;
``compile(loss=[a, b], loss_weights=[0.1, 0.2])`` one loss per position. The targets ``y`` are a
mapping with the same names, a list in the losses' order, or one tensor when one output has a loss.

Names, as in Keras 3: a mapping's outputs by their keys, a tuple's by ``output_0``, ``output_1``, ...
With more than one loss, each output's unweighted loss is logged as ``<output>_loss``; a metric of
one output as ``<output>_<metric>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as _pytree

from meshfit.data import batch_size_of
from meshfit.losses import Loss
from meshfit.losses import get as get_loss
from meshfit.losses import serialize as serialize_loss
from meshfit.metrics import Mean, Metric
from meshfit.metrics import get as get_metric

Key = str | int | None  # an output's name, its position in a tuple, or None (the one output)


def is_structured(value: Any) -> bool:
    """Whether a module's output is several outputs (a mapping, a tuple or a list), not one tensor."""
    if value.__class__ is torch.Tensor:  # the usual one output: no isinstance calls
        return False
    return not isinstance(value, torch.Tensor) and isinstance(value, (Mapping, list, tuple))


def output_name(key: Key) -> str:
    return key if isinstance(key, str) else f"output_{key}"


def _describe(y_pred: Any) -> str:
    if isinstance(y_pred, Mapping):
        return f"a {type(y_pred).__name__} with outputs {list(y_pred)}"
    if isinstance(y_pred, (list, tuple)):
        return f"a {type(y_pred).__name__} of {len(y_pred)} outputs (named output_0 ... output_{len(y_pred) - 1})"
    return f"one {type(y_pred).__name__}"


def is_serialized_loss(value: Any) -> bool:
    """A dict from `meshfit.losses.serialize` (``{"class_name": ..., "config": ...}``), not a dict of losses."""
    return isinstance(value, Mapping) and "class_name" in value


def _check_weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Invalid `loss_weights`: expected numbers, received {where}={value!r}. Pass a float, "
                        "or a dict / list of floats with one entry per loss.")
    return float(value)


class CompileLoss(Loss):
    """The total loss of a model with several outputs: ``sum(weight * loss(y_true[o], y_pred[o]))``.

    Args:
        loss: one loss (anything `meshfit.losses.get` accepts), a dict ``{output name: loss or None}``
            or a list / tuple with one loss (or None) per output position.
        loss_weights: None, a float (one loss), a dict with the loss dict's keys, or a list with one
            weight per loss.
    """

    def __init__(self, loss: Any, loss_weights: Any = None) -> None:
        super().__init__("loss")
        self._user_loss, self._user_loss_weights = loss, loss_weights  # compile's arguments, for get_config
        if isinstance(loss, Mapping) and not is_serialized_loss(loss):
            if not loss:
                raise ValueError("Invalid `loss`: received an empty dict. Pass {output name: loss}, e.g. "
                                 "loss={'logits': ...}.")
            keys: list[Key] = list(loss)
            for key in keys:
                if not isinstance(key, str):
                    raise TypeError(f"Invalid `loss`: a dict of losses is keyed by output name (str), received key "
                                    f"{key!r} in loss={loss!r}.")
            identifiers = [loss[k] for k in keys]
        elif isinstance(loss, (list, tuple)):
            keys, identifiers = list(range(len(loss))), list(loss)
        else:
            keys, identifiers = [None], [loss]
        weights = self._weights(keys, loss, loss_weights)
        self.entries: list[tuple[Key, Loss, float | None]] = [
            (key, get_loss(ident), weight) for key, ident, weight in zip(keys, identifiers, weights, strict=True)
            if ident is not None]
        if not self.entries:
            raise ValueError(f"Invalid `loss`: every entry is None, received loss={loss!r}; name at least one loss.")
        self.keyed = keys != [None]
        #: Keras 3: with several losses, each output's unweighted loss is tracked as ``<output>_loss``.
        self.trackers: list[Mean | None] = [Mean(name=f"{output_name(key)}_loss") if len(self.entries) > 1
                                            else None for key, _, _ in self.entries]
        self.reduction = "sum" if any(entry.reduction == "sum" for _, entry, _ in self.entries) \
            else "sum_over_batch_size"

    @staticmethod
    def _weights(keys: list[Key], loss: Any, loss_weights: Any) -> list[float | None]:
        if loss_weights is None:
            return [None] * len(keys)
        if isinstance(loss_weights, Mapping):
            if keys == [None] or not isinstance(keys[0], str) or set(loss_weights) != set(keys):
                names = [output_name(k) for k in keys] if keys != [None] else "one loss (no output names)"
                raise ValueError(f"Invalid `loss_weights`: its keys {list(loss_weights)} must be the loss dict's "
                                 f"output names {names}, received loss_weights={loss_weights!r} for "
                                 f"loss={loss!r}. Give one weight per output, keyed as `loss` is.")
            return [_check_weight(loss_weights[k], f"loss_weights[{k!r}]") for k in keys]
        if isinstance(loss_weights, (list, tuple)):
            if len(loss_weights) != len(keys):
                raise ValueError(f"Invalid `loss_weights`: expected {len(keys)} weight(s), one per loss "
                                 f"(outputs {[output_name(k) for k in keys]}), received {len(loss_weights)}: "
                                 f"loss_weights={list(loss_weights)!r}. Give one weight per loss, in its order.")
            return [_check_weight(w, f"loss_weights[{i}]") for i, w in enumerate(loss_weights)]
        weight = _check_weight(loss_weights, "loss_weights")
        if len(keys) != 1:
            raise ValueError(f"Invalid `loss_weights`: one number for {len(keys)} losses (outputs "
                             f"{[output_name(k) for k in keys]}), received loss_weights={loss_weights!r}. "
                             "Pass a dict or list with one weight per loss.")
        return [weight]

    def get_config(self) -> dict[str, Any] | None:  # type: ignore[override]
        """compile's ``loss`` and ``loss_weights`` as plain JSON, in the shapes compile took them (Keras 3's
        ``CompileLoss.get_config``): each loss as `meshfit.losses.serialize` describes it, the weights as
        floats. None when a loss is a function, a torch module or a class of the user's (not rebuildable
        without running code)."""
        def describe(ident: Any) -> Any:
            return None if ident is None else serialize_loss(ident)

        user = self._user_loss
        loss: Any
        if isinstance(user, Mapping) and not is_serialized_loss(user):
            loss = {k: describe(v) for k, v in user.items()}
            described, given = list(loss.values()), list(user.values())
        elif isinstance(user, (list, tuple)):
            loss = [describe(v) for v in user]
            described, given = loss, list(user)
        else:
            loss = describe(user)
            described, given = [loss], [user]
        if any(d is None and g is not None for d, g in zip(described, given, strict=True)):
            return None
        weights = self._user_loss_weights
        if isinstance(weights, Mapping):
            weights = {k: float(v) for k, v in weights.items()}
        elif isinstance(weights, (list, tuple)):
            weights = [float(v) for v in weights]
        elif weights is not None:
            weights = float(weights)
        return {"loss": loss, "loss_weights": weights}

    @property
    def keys(self) -> list[Key]:
        """The outputs that have a loss, in the loss's order."""
        return [key for key, _, _ in self.entries]

    @property
    def metrics(self) -> list[Metric]:
        """The per-output loss trackers (Keras 3's ``<output>_loss``), empty for a single loss."""
        return [t for t in self.trackers if t is not None]

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        values = []
        for (key, loss, weight), tracker in zip(self.entries, self.trackers, strict=True):
            target, output, weights = self.pick(key, y_true, y_pred, sample_weight)
            value = loss(target, output, sample_weight=weights)
            if tracker is not None:  # unweighted, as Keras records it
                tracker.update_state(value.detach(), sample_weight=batch_size_of(output))
            values.append(value if weight is None else value * weight)
        total = values[0]  # __init__ refuses a loss without entries
        for value in values[1:]:
            total = total + value
        return total

    def pick(self, key: Key, y_true: Any, y_pred: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        """``(y_true, y_pred, sample_weight)`` of output ``key``; refuses a missing output by name."""
        output = self._output(key, y_pred)  # a missing output is named first: the loss is what is wrong
        return (self._target(key, y_true, y_pred), output, self._target(key, sample_weight, y_pred, required=False))

    def _output(self, key: Key, y_pred: Any) -> Any:
        if key is None:
            if is_structured(y_pred) and not self.keyed:
                raise ValueError(
                    f"Invalid `loss`: one loss for a model that returns {_describe(y_pred)}. Name the output(s) "
                    f"the loss reads, e.g. loss={{{output_name(_first_key(y_pred))!r}: ...}} (and a dict or list "
                    "of targets to match).")
            return y_pred
        if isinstance(key, str):
            if not isinstance(y_pred, Mapping) or key not in y_pred:
                fix = ("Key the losses by those names (loss={name: ...})" if isinstance(y_pred, Mapping)
                       else "Pass one loss, or a list with one loss (or None) per output")
                raise ValueError(f"Invalid `loss`: it names output {key!r}, which the model does not produce: it "
                                 f"returns {_describe(y_pred)}. {fix}.")
            return y_pred[key]
        if key == 0 and not is_structured(y_pred) and len(self._all_positions()) == 1:
            return y_pred  # Keras: a list of one loss for the one output
        if not isinstance(y_pred, (list, tuple)) or key >= len(y_pred):
            raise ValueError(
                f"Invalid `loss`: a list of {len(self._all_positions())} losses, but the model returns "
                f"{_describe(y_pred)}. Pass one loss (or None) per output position"
                + (", or a dict keyed by output name." if isinstance(y_pred, Mapping) else "."))
        return y_pred[key]

    def _all_positions(self) -> list[Key]:
        return [key for key, _, _ in self.entries]

    def _target(self, key: Key, y: Any, y_pred: Any, required: bool = True) -> Any:
        """Output ``key``'s part of ``y`` (targets or sample weights): by name, by position, or all of it."""
        if key is None or y is None or isinstance(y, torch.Tensor) and not is_structured(y):
            if key is not None and required and len(self.entries) > 1:
                raise ValueError(
                    f"Invalid `y`: one target tensor for {len(self.entries)} losses (outputs "
                    f"{[output_name(k) for k in self.keys]}). Pass a dict keyed by those names or a list in "
                    "that order.")
            return y
        if isinstance(y, Mapping):
            name = output_name(key)
            if name not in y:
                if not required:
                    return None
                raise ValueError(f"Invalid `y`: no target for output {name!r}; the targets are named {list(y)}. "
                                 f"Key the targets as the losses are ({[output_name(k) for k in self.keys]}).")
            return y[name]
        if isinstance(y, (list, tuple)):
            if len(y) == len(self.entries):  # one target per loss, in the losses' order
                return y[self.keys.index(key)]
            if isinstance(key, int) and isinstance(y_pred, (list, tuple)) and len(y) == len(y_pred):
                return y[key]
            if not required:
                return y
            raise ValueError(f"Invalid `y`: {len(y)} targets for {len(self.entries)} losses (outputs "
                             f"{[output_name(k) for k in self.keys]}). Give one target per loss, in its order, or "
                             "a dict keyed by output name.")
        return y

    def __repr__(self) -> str:
        return f"CompileLoss({[(output_name(k) if k is not None else None, fn, w) for k, fn, w in self.entries]!r})"


def loss_config(loss: Any) -> dict[str, Any]:
    """compile's resolved loss as the saved compile config's ``loss`` and ``loss_weights`` (None for
    either when there is none, or when the loss cannot be rebuilt from JSON)."""
    if isinstance(loss, CompileLoss):
        return loss.get_config() or {"loss": None, "loss_weights": None}
    return {"loss": serialize_loss(loss) if loss is not None else None, "loss_weights": None}


def _first_key(y_pred: Any) -> Key:
    if isinstance(y_pred, Mapping):
        return next(iter(y_pred), "logits")
    return 0


class OutputMetric(Metric):
    """A metric of one output: reads ``y_true[o]`` and ``y_pred[o]`` and logs as ``<output>_<metric>``.

    Its state is the wrapped metric's own (the same tensors: reset, saved and reduced as one).
    """

    def __init__(self, key: Key, metric: Metric, pick: Callable[[Key, Any, Any, Any], tuple[Any, Any, Any]]) -> None:
        super().__init__(f"{output_name(key)}_{metric.name}")
        self.key, self.metric, self._pick = key, metric, pick
        self._states = metric._states

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        target, output, weights = self._pick(self.key, y_true, y_pred, sample_weight)
        self.metric.update_state(target, output, sample_weight=weights)

    def _live_states(self) -> dict[str, torch.Tensor]:
        return self.metric._live_states()

    def _assign_states(self, states: dict[str, torch.Tensor]) -> None:
        self.metric._assign_states(states)

    def result_from(self, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.metric.result_from(states)

    def reset_state(self) -> None:
        self.metric.reset_state()


def compile_metrics(metrics: Any, loss: Any, compiled_loss: CompileLoss | None) -> list[Metric]:
    """compile's ``metrics``: a flat list (the model's one output, or the one output with a loss), a dict
    ``{output name: metric or list}``, or a list with one metric (or list) per loss of a list of losses."""
    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        if compiled_loss is None or not compiled_loss.keyed or not all(isinstance(k, str) for k in compiled_loss.keys):
            raise ValueError(f"Invalid `metrics`: a dict keyed by output name needs a dict of losses keyed the same "
                             f"way, received metrics={metrics!r} and loss={loss!r}. Pass loss={{name: ...}}, or a "
                             "list of metrics.")
        unknown = [k for k in metrics if k not in compiled_loss.keys]
        if unknown:
            raise ValueError(f"Invalid `metrics`: it names output(s) {unknown} that have no loss; the outputs with a "
                             f"loss are {compiled_loss.keys}. Key the metrics by those names.")
        return [OutputMetric(key, get_metric(m, loss=_loss_of(loss, key)), compiled_loss.pick)
                for key, value in metrics.items() for m in _as_list(value)]
    if not isinstance(metrics, (list, tuple)):
        raise TypeError(f"Invalid `metrics`: expected a list such as ['accuracy'] or a dict keyed by output name, "
                        f"received metrics={metrics!r}.")
    if (compiled_loss is not None and compiled_loss.keyed and isinstance(loss, (list, tuple))
            and len(metrics) == len(loss) and len(loss) > 1):  # one list of metrics per loss
        return [OutputMetric(i, get_metric(m, loss=_loss_of(loss, i)), compiled_loss.pick)
                for i, value in enumerate(metrics) for m in _as_list(value)]
    return [get_metric(m, loss=loss if not isinstance(loss, (Mapping, list, tuple)) else _sole_loss(loss))
            for m in metrics]


def _as_list(value: Any) -> Sequence[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _loss_of(loss: Any, key: Key) -> Any:
    if isinstance(loss, Mapping) and key in loss:
        return loss[key]
    if isinstance(loss, (list, tuple)) and isinstance(key, int):
        return loss[key]
    return loss


def _sole_loss(loss: Any) -> Any:
    values = [v for v in (loss.values() if isinstance(loss, Mapping) else loss) if v is not None]
    return values[0] if len(values) == 1 else None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an output structure (a mapping's values, a tuple's items, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []  # None, or an object such as a Hugging Face cache


def zero_of(y_pred: Any) -> torch.Tensor:
    """0 times the sum of every output that carries a gradient: an empty replica's share still joins
    the gradient all-reduce with zeros, whatever the outputs' structure."""
    tensors = [t for t in _tensors(y_pred) if t.requires_grad] or _tensors(y_pred)
    return sum((t.sum() * 0.0 for t in tensors[1:]), tensors[0].sum() * 0.0)


def detached(y_pred: Any) -> Any:
    """The outputs without their graph (a mapping becomes a dict; other leaves stay as they are)."""
    if y_pred.__class__ is torch.Tensor or isinstance(y_pred, torch.Tensor):
        return y_pred.detach()
    if isinstance(y_pred, Mapping):
        return {k: detached(v) for k, v in y_pred.items()}
    if isinstance(y_pred, (list, tuple)) and type(y_pred) in (list, tuple):
        return type(y_pred)(detached(v) for v in y_pred)
    return y_pred


def host_outputs(out: Any) -> Any:
    """One batch's outputs for ``predict``: tensors as numpy arrays, in the outputs' structure (a
    mapping such as a ``ModelOutput`` as a dict of its tensor fields; an object that holds no tensor,
    such as a cache, is left out of a mapping and is None in a tuple)."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu().numpy()
    if isinstance(out, Mapping):
        return {k: host_outputs(v) for k, v in out.items() if _tensors(v)}
    if isinstance(out, (list, tuple)):
        items = [host_outputs(v) if _tensors(v) else None for v in out]
        if isinstance(out, list):
            return items
        return tuple(items) if type(out) is tuple else type(out)(*items)  # type: ignore[arg-type]  # a namedtuple
    return out


def register_output_type(module: Any, inputs: Any, output: Any) -> None:
    """A forward hook: make a mapping type the module returns (a ``ModelOutput`` of another library, a
    user's own dict subclass or read-only ``Mapping``) a node of torch's pytree before DDP reads the output.

    DDP runs meshfit's first step with ``static_graph=True``, and there it passes the output's tensors
    through its sink to launch the gradient all-reduce; an output type pytree does not know is one
    opaque leaf, so that step's gradients would stay unreduced and the replicas silently differ from
    then on. transformers registers its own ``ModelOutput`` types for the same reason.
    """
    kind = type(output)
    if kind is torch.Tensor:  # the usual output, at every step: no ABC check
        return
    if isinstance(output, Mapping) and kind not in _pytree.SUPPORTED_NODES and not torch.compiler.is_compiling():
        _pytree.register_pytree_node(kind, _pytree._dict_flatten, functools.partial(_rebuild_mapping, kind),
                                     serialized_type_name=f"{kind.__module__}.{kind.__qualname__}")


def _rebuild_mapping(kind: type, values: Any, keys: Any) -> Any:
    fields = dict(zip(keys, values, strict=True))
    try:
        return kind(**fields)
    except TypeError:
        return kind(fields)
