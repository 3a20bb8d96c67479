"""What one process's ``fit`` step spends outside the user's work, counted per piece (the whole step's count
is `tests/test_step_overhead.py`'s): the batch's rows, the batch's unpacking, the output checks and the
Keras-style loss make no Python call they can spare, and give what the general paths give (the same
tensors, the same errors, the same warning).

Counts are ``sys.setprofile`` events (Python functions and C functions called from Python): the
interpreter's work, the same on a loaded machine.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from _python_calls import calls_made
from torch import nn

import meshfit as mf
from meshfit._engine._outputs import detached, is_structured
from meshfit.data import Dataset, batch_size_of, unpack_batch
from meshfit.data._structure import copy_rows, map_structure
from meshfit.losses import SparseCategoricalCrossentropy


def test_the_rows_of_an_x_y_batch_are_one_kernel_a_tensor_and_no_structure_walk():
    x, y = torch.randn(10, 3), torch.arange(10)
    events = calls_made(lambda: copy_rows((x, y), 2, 6))
    assert events.count("narrow_copy") == 2
    assert len(events) <= 4, events  # copy_rows, its list, two narrow_copy (the structure walk made 21)


@pytest.mark.parametrize("value", [
    (torch.randn(10, 3), torch.arange(10)),
    (torch.randn(10, 3), torch.arange(10), torch.ones(10)),
    (np.arange(30.0).reshape(10, 3), torch.arange(10)),
    (torch.randn(10, 3), None),
    ({"a": torch.randn(10, 2), "b": (torch.arange(10),)}, torch.arange(10)),
    (nn.Parameter(torch.randn(10, 2), requires_grad=False), torch.arange(10)),
    ((torch.randn(10, 2), np.arange(10)), torch.arange(10)),
    [torch.randn(10, 3), torch.arange(10)],
    {"x": torch.randn(10, 3)},
])
def test_the_rows_of_any_batch_are_those_of_the_structure_walk(value):
    def walked(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return torch.narrow_copy(leaf, 0, 3, 4)
        return leaf[np.arange(3, 7, dtype=np.int64)]

    got, want = copy_rows(value, 3, 7), map_structure(walked, value)
    assert type(got) is type(want)
    got_leaves, want_leaves = _flat(got), _flat(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert type(g) is type(w)
        if w is None:
            continue
        assert np.array_equal(np.asarray(g), np.asarray(w))
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.is_contiguous()


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for k in value for leaf in _flat(value[k])]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _flat(v)]
    return [value]


def test_the_copied_rows_do_not_share_the_data():
    x = torch.zeros(6, 2)
    rows = copy_rows((x, torch.arange(6)), 0, 2)
    rows[0].add_(1.0)
    assert float(x.sum()) == 0.0


def test_a_batch_reads_its_input_length_once_and_keeps_its_bounds():
    x, y = np.arange(20.0, dtype=np.float32).reshape(10, 2), np.arange(10)
    dataset = Dataset.from_tensor_slices((x, y)).batch(4)
    node = dataset._node
    events = calls_made(lambda: node.get(0, 0))
    assert events.count("_length") == 1, events  # was read twice (the batch count, then the rows)
    last = node.get(2, 0)
    assert last[1].tolist() == [8, 9]  # the partial last batch
    with pytest.raises(IndexError):
        node.get(3, 0)
    dropped = Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True)._node
    assert dropped.get(1, 0)[1].tolist() == [4, 5, 6, 7]
    with pytest.raises(IndexError):
        dropped.get(2, 0)
    assert [b[1].tolist() for b in Dataset.from_tensor_slices((x, y)).batch(3)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_the_size_and_unpacking_of_an_x_y_batch_make_no_call():
    x, y = torch.randn(5, 3), torch.arange(5)
    assert calls_made(lambda: batch_size_of((x, y))) == ["batch_size_of"]
    assert calls_made(lambda: unpack_batch((x, y))) == ["unpack_batch", "len"]
    assert batch_size_of((x, y)) == 5
    assert batch_size_of(((), x)) == 5 and batch_size_of((None, y)) == 5
    assert batch_size_of((np.zeros((7, 2)), x)) == 7
    assert batch_size_of(torch.tensor(3.0).expand(()).reshape(()).unsqueeze(0)) == 1
    assert unpack_batch((x, y)) == (x, y, None)
    assert unpack_batch([x, y]) == (x, y, None)
    assert unpack_batch((x,)) == (x, None, None)
    assert unpack_batch(x)[0] is x
    with pytest.raises(ValueError, match="tuple of 4 elements"):
        unpack_batch((x, y, y, y))


def test_one_output_is_checked_and_detached_without_isinstance():
    out = torch.randn(3, 2, requires_grad=True) * 2
    assert calls_made(lambda: is_structured(out)) == ["is_structured"]
    assert calls_made(lambda: detached(out)) == ["detached", "detach"]
    assert not is_structured(out) and is_structured((out,)) and is_structured({"a": out})
    assert not is_structured(nn.Parameter(torch.randn(2)))
    assert not detached(out).requires_grad
    assert not detached({"a": out})["a"].requires_grad
    assert not detached(nn.Parameter(torch.randn(2))).requires_grad


def test_the_keras_loss_of_int64_labels_makes_only_its_kernels_calls():
    loss = SparseCategoricalCrossentropy(from_logits=True)
    logits, labels = torch.randn(8, 4), torch.randint(0, 4, (8,))
    loss(labels, logits)
    names = calls_made(lambda: loss(labels, logits))
    for spared in ("as_tensor", "long", "_warn_if_logits", "max"):
        assert spared not in names, names


@pytest.mark.parametrize("labels", [
    torch.tensor([0, 3, 1, 2]),
    torch.tensor([0, 3, 1, 2], dtype=torch.int32),
    torch.tensor([[0], [3], [1], [2]]),
    [0, 3, 1, 2],
    np.array([0, 3, 1, 2]),
])
def test_the_keras_loss_equals_torch_cross_entropy_for_any_labels(labels):
    torch.manual_seed(0)
    logits = torch.randn(4, 4)
    want = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 3, 1, 2]), reduction="none").sum() / 4
    got = SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    assert torch.equal(got, want)


def test_the_keras_loss_of_an_empty_batch_and_its_logits_warning_are_kept():
    loss = SparseCategoricalCrossentropy(from_logits=True)
    empty = loss(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))
    assert empty.item() == 0.0
    probabilities = SparseCategoricalCrossentropy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probabilities(torch.tensor([1, 0]), torch.tensor([[2.0, -1.0], [0.5, 0.5]]))
        probabilities(torch.tensor([1, 0]), torch.tensor([[2.0, -1.0], [0.5, 0.5]]))
    assert sum("from_logits=False" in str(w.message) for w in caught) == 1  # once per loss


def test_whether_the_optimizer_accumulates_is_read_without_getattr_calls():
    from meshfit._engine._executions import accumulates

    class Holder:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer

    class Accumulating:
        def __init__(self, steps: Any) -> None:
            self.gradient_accumulation_steps = steps

    usual = Holder(Accumulating(None))
    assert calls_made(lambda: accumulates(usual)) == ["accumulates"]  # was two getattr calls besides
    assert accumulates(Holder(Accumulating(4))) is True
    assert accumulates(Holder(Accumulating(1))) is False
    assert accumulates(Holder(Accumulating(0))) is False
    assert accumulates(Holder(object())) is False  # an optimizer without the setting
    assert accumulates(Holder(None)) is False
    assert accumulates(object()) is False  # a trainable without an optimizer


def test_the_sparse_accuracy_of_int64_labels_makes_no_label_call():
    from meshfit.metrics._accuracy import _sparse_categorical_hits

    scores, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    events = calls_made(lambda: _sparse_categorical_hits(labels, scores))
    assert "_sparse_labels" not in events, events
    want = scores.argmax(dim=-1) == labels
    for given in (labels, labels.unsqueeze(-1), labels.to(torch.int32), labels.to(torch.int32).unsqueeze(-1)):
        assert torch.equal(_sparse_categorical_hits(given, scores), want)
    metric = mf.metrics.SparseCategoricalAccuracy()
    metric.update_state(labels.unsqueeze(-1).float(), scores)
    assert float(metric.result()) == float(want.double().mean())
