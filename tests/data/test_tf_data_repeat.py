"""TensorFlow's ``repeat`` kernel tests, ported to `meshfit.data.Dataset`.

Source: tensorflow/tensorflow, tensorflow/python/data/kernel_tests/repeat_test.py at commit
0304934138cbfabd338ec432a630a9c3c1191564 (the stored version; none is stored at 140b37d4).
Translation rules: tests/data/_tf_port.py.

Cases in the source: 16. Ported: 8. Passing with TF's assertions: 8. Listed as differences: 0.
Skipped as TF-only (8): RepeatRandomAccessTest's 5 cases (``tf.data.experimental.random_access``),
RepeatGlobalShuffleTest's 2 and RepeatGlobalShuffleCheckpointTest's 1 (the private
``global_shuffle_op._global_shuffle``).
"""

from __future__ import annotations

import numpy as np
import pytest
from _tf_port import VERIFY_FNS, assert_same, produces

from meshfit.data import Dataset

COMPONENTS = (np.array(1), np.array([1, 2, 3]), np.array(37.0))


@pytest.mark.parametrize("count", [0, 3, 7])
def test_finite_repeat(count):
    dataset = Dataset.from_tensors(COMPONENTS).repeat(count)
    produces(dataset, [COMPONENTS] * count)


def test_infinite_repeat():
    dataset = Dataset.from_tensors(COMPONENTS).repeat(-1)
    it = iter(dataset)
    for _ in range(17):
        results = next(it)
        assert [tuple(r.shape) for r in results] == [c.shape for c in COMPONENTS]
        for component, result_component in zip(COMPONENTS, results, strict=True):
            assert_same(result_component, component)


def test_repeat_repeat():
    inner_count, outer_count = 7, 14
    dataset = Dataset.from_tensors(COMPONENTS).repeat(inner_count).repeat(outer_count)
    produces(dataset, [COMPONENTS] * (inner_count * outer_count))


def test_name():
    produces(Dataset.from_tensors(42).repeat(1, name="repeat"), [42])


def _build_repeat_dataset(num_elements, num_epochs, num_outputs=None):
    dataset = Dataset.range(num_elements).repeat(num_epochs)
    if num_outputs:
        dataset = Dataset.zip((dataset, Dataset.range(num_outputs)))
    return dataset


@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint_finite_repeat(verify_fn):
    num_elements, num_epochs = 10, 10
    VERIFY_FNS[verify_fn](lambda: _build_repeat_dataset(num_elements, num_epochs), num_elements * num_epochs)


@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint_empty_repeat(verify_fn):
    VERIFY_FNS[verify_fn](lambda: _build_repeat_dataset(10, 0), 0)


@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint_infinite_repeat(verify_fn):
    num_outputs = 100
    VERIFY_FNS[verify_fn](lambda: _build_repeat_dataset(10, -1, num_outputs=num_outputs), num_outputs)


@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint_infinite_empty_repeat(verify_fn):
    VERIFY_FNS[verify_fn](lambda: _build_repeat_dataset(0, -1), 0)
