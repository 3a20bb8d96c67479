"""Keras's ``fit`` arguments that reshape the data: ``validation_split``, ``class_weight``,
``validation_freq`` and ``shuffle``, checked and applied as Keras does.

- ``validation_split``: the *last* fraction of the arrays (before any shuffling) is held out.
- ``class_weight``: each training example's weight is multiplied by its class's weight (classes
  absent from the dict weigh 1). Applied to every batch the data yields (arrays, `Dataset`, torch
  data alike), so a Keras-style ``train_step`` override receives them as ``sample_weight``.
- ``validation_freq``: an int N (every N epochs) or a collection of 1-based epochs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

from meshfit._validation import is_int
from meshfit.data import leaves, map_structure, unpack_batch


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
        return tuple(None if value is None else map_structure(lambda leaf: leaf[start:stop], value)
                     for value in (x, y, sample_weight))

    return part(0, split_at), part(split_at, None)


def class_weight_table(class_weight: Any) -> torch.Tensor:
    """A float64 tensor ``table[class] = weight`` (1 for classes the dict does not name)."""
    if not isinstance(class_weight, Mapping) or not class_weight:
        raise ValueError("Invalid `class_weight`: expected a dict from class index to weight such as "
                         f"{{0: 1.0, 1: 5.0}}, received class_weight={class_weight!r}.")
    for key, value in class_weight.items():
        if not is_int(key) or key < 0:
            raise ValueError(f"Invalid `class_weight`: keys must be class indices (ints >= 0), received key "
                             f"{key!r} in class_weight={class_weight!r}.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"Invalid `class_weight`: weights must be finite numbers >= 0, received "
                             f"{key}: {value!r}.")
    table = torch.ones(max(class_weight) + 1, dtype=torch.float64)
    for key, value in class_weight.items():
        table[key] = float(value)
    return table


def _classes(y: torch.Tensor) -> torch.Tensor:
    """Class indices of a batch of targets: sparse labels, one-hot rows (argmax) or ``(n, 1)`` labels."""
    if y.dim() == 2:
        y = y[:, 0] if y.shape[1] == 1 else y.argmax(dim=1)
    elif y.dim() > 2:
        raise ValueError(f"`class_weight` needs targets of shape (n,), (n, 1) or one-hot (n, classes); received "
                         f"targets of shape {tuple(y.shape)}. Pass sample_weight instead.")
    return y.to(torch.int64)


def weigh_batch(batch: Any, table: torch.Tensor) -> Any:
    """``(x, y, sample_weight)`` with each example's weight multiplied by its class's weight."""
    x, y, sample_weight = unpack_batch(batch)
    if not isinstance(y, torch.Tensor):
        raise ValueError("`class_weight` needs the data to yield targets (x, y) as one tensor; received "
                         f"y of type {type(y).__name__}.")
    classes = _classes(y).cpu()
    known = classes < len(table)
    weights = torch.where(known, table[classes.clamp(0, len(table) - 1)], torch.ones((), dtype=table.dtype))
    weights = weights.to(torch.get_default_dtype())
    if sample_weight is not None:  # both: Keras 2 multiplies them
        sample_weight = torch.as_tensor(sample_weight).to(weights.dtype)
        weights = sample_weight * weights.reshape(-1, *[1] * (sample_weight.dim() - 1))
    return x, y, weights


def batch_and_shuffle(dataset: Any, count: int, batch_size: int, shuffle: bool | str,
                      seed: int | None = None) -> Any:
    """``dataset`` batched, shuffled by example (``True``) or by whole batch (``"batch"``) each epoch."""
    if shuffle == "batch":
        return dataset.batch(batch_size).shuffle(math.ceil(count / batch_size), seed=seed)
    return (dataset.shuffle(count, seed=seed) if shuffle else dataset).batch(batch_size)


class ClassWeightedData:
    """A `DataHandler` whose training batches carry class weights; everything else is the handler's."""

    def __init__(self, data: Any, class_weight: Any) -> None:
        self._data = data
        self._table = class_weight_table(class_weight)

    def next_batch(self) -> tuple[Any, int]:
        batch, global_size = self._data.next_batch()
        return weigh_batch(batch, self._table), global_size

    def __getattr__(self, name: str) -> Any:  # steps, peek, end_epoch, close, state_dict, ...
        return getattr(self._data, name)
