"""Keras's ``fit`` arguments that reshape the data: ``validation_split``, ``class_weight``,
``validation_freq`` and ``shuffle``, checked and applied as Keras does.

- ``validation_split``: the *last* fraction of the arrays (before any shuffling) is held out.
- ``class_weight``: each training example's weight is its class's weight (classes absent from the
  dict weigh 1; ``{}`` weighs all 1). Applied to every batch the data yields (arrays, `Dataset`, torch
  data alike), so a Keras-style ``train_step`` override receives them as ``sample_weight``. As in
  Keras 3 it cannot be combined with sample weights (passed or yielded by the data): ValueError.
- ``validation_freq``: an int N (every N epochs) or a collection of 1-based epochs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

from meshfit._validation import is_int
from meshfit.data import leaves, map_structure, unpack_batch


def check_loss_reduction(loss: Any, replicas: int) -> None:
    """Refuse a compiled ``reduction="sum"`` loss under several replicas (it would train silently wrong).

    meshfit averages the replicas' gradients, weighted by their shares of the global batch: the
    gradient of the global batch's *mean* loss. A per-replica sum would give ``1/replicas`` of the
    global sum's gradient, where TF sums the replicas' gradients for a ``SUM`` loss.
    """
    if replicas > 1 and getattr(loss, "reduction", None) == "sum":
        raise ValueError(f"Invalid `loss`: {type(loss).__name__}(reduction='sum') is not supported yet under "
                         f"{replicas} replicas, received loss={loss!r}: replicas average their gradients, so "
                         "training would use 1/replicas of the global sum's gradient. Use "
                         "reduction='sum_over_batch_size' (the default) and scale the learning rate by the "
                         "global batch size instead.")


def check_shuffle(shuffle: Any) -> bool | str:
    """``True``, ``False`` or ``"batch"`` (shuffle whole batches, Keras's HDF5 option)."""
    if isinstance(shuffle, bool) or shuffle == "batch":
        return shuffle
    raise ValueError(f"Invalid `shuffle`: expected True, False or 'batch', received shuffle={shuffle!r}.")


def check_validation_freq(validation_freq: Any) -> int | frozenset[int]:
    """An int >= 1, or the set of 1-based epochs after which to validate."""
    if is_int(validation_freq) and validation_freq >= 1:
        return validation_freq
    if isinstance(validation_freq, Collection) and not isinstance(validation_freq, (str, bytes, Mapping)):
        epochs = list(validation_freq)
        if epochs and all(is_int(e) and e >= 1 for e in epochs):
            return frozenset(epochs)
    raise ValueError("Invalid `validation_freq`: expected an int >= 1 (validate every N epochs) or a list of "
                     f"1-based epochs such as [1, 5, 10], received validation_freq={validation_freq!r}.")


def validates_after(epoch: int, validation_freq: int | frozenset[int]) -> bool:
    """Whether to validate after 0-based ``epoch``."""
    if isinstance(validation_freq, frozenset):
        return epoch + 1 in validation_freq
    return (epoch + 1) % validation_freq == 0


def split_validation(x: Any, y: Any, sample_weight: Any, validation_split: Any,
                     is_array_like: Any) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """``((x, y, w) to train on, (x, y, w) to validate on)``: the last ``validation_split`` is held out.

    Raises:
        ValueError: If the fraction is not in ``(0, 1)``, ``x`` is not arrays, or a part would be empty.
    """
    if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float)) or \
            not 0 < validation_split < 1:
        raise ValueError(f"Invalid `validation_split`: expected a fraction in (0, 1) such as 0.2, received "
                         f"validation_split={validation_split!r}.")
    if not is_array_like(x):
        raise ValueError(f"Invalid `validation_split`: it is supported only when x is arrays or tensors, as in "
                         f"Keras; x is a {type(x).__name__}. Pass validation_data=... instead.")
    count = len(leaves(x)[0])
    split_at = int(math.floor(count * (1.0 - validation_split)))  # Keras's rounding
    if split_at == 0 or split_at == count:
        raise ValueError(f"Invalid `validation_split`: {validation_split} of {count} samples leaves "
                         f"{split_at} to train on and {count - split_at} to validate on; both must be > 0.")

    def part(start: int, stop: int | None) -> tuple[Any, Any, Any]:
        def cut(value: Any) -> Any:
            return None if value is None else map_structure(lambda leaf: leaf[start:stop], value)
        return cut(x), cut(y), cut(sample_weight)

    return part(0, split_at), part(split_at, None)


def _class_index(key: Any, class_weight: Any) -> int:
    """``key`` as a class index: an int, or a value that is one in another type (``"0"``, ``0.0``), as Keras
    converts them with ``int(key)``; a fraction or a negative index is refused rather than truncated."""
    try:
        index = int(key)
        exact = index == float(key)
    except (TypeError, ValueError, OverflowError):
        index, exact = -1, False
    if isinstance(key, bool) or not exact or index < 0:
        raise ValueError("`class_weight` must be a dictionary with integer keys representing class indices. "
                         f"Received an invalid key: {key!r} of type {type(key)}. Invalid `class_weight`: keys must "
                         f"be class indices (ints >= 0, or strings/floats holding one), received key {key!r} in "
                         f"class_weight={class_weight!r}.")
    return index


def class_weight_table(class_weight: Any) -> torch.Tensor:
    """A float64 tensor ``table[class] = weight`` (1 for classes the dict does not name; empty for ``{}``)."""
    if not isinstance(class_weight, Mapping):
        raise ValueError("`class_weight` must be a dict-like mapping of class indices to weights. Received: "
                         f"class_weight={class_weight} of type {type(class_weight)}. Invalid `class_weight`: "
                         "expected a dict from class index to weight such as {0: 1.0, 1: 5.0}, received "
                         f"class_weight={class_weight!r}.")
    weights: dict[int, float] = {}
    for key, value in class_weight.items():
        index = _class_index(key, class_weight)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"Invalid `class_weight`: weights must be finite numbers >= 0, received "
                             f"{key!r}: {value!r}.")
        if index in weights:
            raise ValueError(f"Invalid `class_weight`: keys {index} name the same class twice in "
                             f"class_weight={class_weight!r}.")
        weights[index] = float(value)
    # Keras: a class the dict does not name weighs 1 ({} weighs every example 1, passed as weights)
    table = torch.ones(max(weights, default=-1) + 1, dtype=torch.float64)
    for index, value in weights.items():
        table[index] = value
    return table


def check_class_weight(class_weight: Any, sample_weight: Any) -> torch.Tensor | None:
    """`class_weight_table`, refusing ``sample_weight`` alongside (Keras 3 raises for both)."""
    if class_weight is not None and sample_weight is not None:
        raise ValueError("Invalid `class_weight`: it cannot be combined with `sample_weight`, as in Keras, "
                         f"received class_weight={class_weight!r} and a sample_weight. Multiply the class "
                         "weights into sample_weight yourself, or pass only one of them.")
    return None if class_weight is None else class_weight_table(class_weight)


def _classes(y: torch.Tensor) -> torch.Tensor:
    """Class indices of a batch of targets: sparse labels, one-hot rows (argmax) or ``(n, 1)`` labels."""
    if y.dim() == 2:
        y = y[:, 0] if y.shape[1] == 1 else y.argmax(dim=1)
    elif y.dim() > 2:
        raise ValueError(f"`class_weight` needs targets of shape (n,), (n, 1) or one-hot (n, classes); received "
                         f"targets of shape {tuple(y.shape)}. Pass sample_weight instead.")
    return (y.round() if y.is_floating_point() else y).to(torch.int64)  # Keras rounds float labels


def weigh_batch(batch: Any, table: torch.Tensor) -> Any:
    """``(x, y, sample_weight)`` with each example's weight multiplied by its class's weight."""
    x, y, sample_weight = unpack_batch(batch)
    if not isinstance(y, torch.Tensor):
        raise ValueError("`class_weight` needs the data to yield targets (x, y) as one tensor; received "
                         f"y of type {type(y).__name__}.")
    classes = _classes(y).cpu()
    if len(table) == 0:  # {}: every class unmapped, every example weighs 1 (Keras)
        weights = torch.ones(classes.shape, dtype=table.dtype)
    else:
        known = (classes >= 0) & (classes < len(table))
        weights = torch.where(known, table[classes.clamp(0, len(table) - 1)], torch.ones((), dtype=table.dtype))
    if sample_weight is not None and len(table) == 0:  # {}: Keras's dataset adapter skips it (`if class_weight:`)
        return x, y, sample_weight
    if sample_weight is not None:  # Keras 3's dataset adapter raises too
        raise ValueError("Invalid `class_weight`: the data yields sample weights (x, y, sample_weight), and "
                         "Keras cannot combine class_weight with sample_weight. Multiply the class weights "
                         "into the yielded weights, or drop class_weight.")
    return x, y, weights.to(torch.get_default_dtype())


def batch_and_shuffle(dataset: Any, count: int, batch_size: int, shuffle: bool | str,
                      seed: int | None = None) -> Any:
    """``dataset`` batched, shuffled by example (``True``) or by whole batch (``"batch"``) each epoch."""
    if shuffle == "batch":
        return dataset.batch(batch_size).shuffle(math.ceil(count / batch_size), seed=seed)
    return (dataset.shuffle(count, seed=seed) if shuffle else dataset).batch(batch_size)


class ClassWeightedData:
    """A `DataHandler` whose training batches carry class weights; everything else is the handler's."""

    def __init__(self, data: Any, table: torch.Tensor) -> None:
        self._data = data
        self._table = table

    def next_batch(self) -> tuple[Any, int]:
        batch, global_size = self._data.next_batch()
        return weigh_batch(batch, self._table), global_size

    def __getattr__(self, name: str) -> Any:  # steps, peek, end_epoch, close, state_dict, ...
        return getattr(self._data, name)


def validation_parts(validation_data: Any) -> tuple[Any, Any, Any] | None:
    """``validation_data`` as ``(x, y, sample_weight)`` (a dataset as ``(data, None, None)``)."""
    if validation_data is None:
        return None
    if isinstance(validation_data, tuple):
        if len(validation_data) == 2:
            return validation_data[0], validation_data[1], None
        if len(validation_data) == 3:
            return validation_data
        raise ValueError("Invalid `validation_data`: expected a dataset, (x, y) or (x, y, sample_weight); "
                         f"received a tuple of {len(validation_data)} elements.")
    return validation_data, None, None
