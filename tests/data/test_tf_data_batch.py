"""TensorFlow's ``batch`` kernel tests, ported to `meshfit.data.Dataset`.

Source: tensorflow/tensorflow, tensorflow/python/data/kernel_tests/batch_test.py at commit
0337b19fa6a7801e4156549a1ed56e8e41c4ec8f (the stored version; none is stored at 140b37d4).
Translation rules: tests/data/_tf_port.py.

Cases in the source: 21. Ported: 7. Passing with TF's assertions: 6. Listed as differences: 1
(testDeterminismConfiguration: ``deterministic=False`` still gives the deterministic order).
Skipped as TF-only (14): testDataset (datasets as elements, unbatch, flat_map), testSparse,
testSparseWithDifferentDenseShapes, testSparseNested (SparseTensor), testRagged, testRaggedWithDifferentShapes,
testRaggedNested (RaggedTensor), testCheckpointLargeBatches (TF's 2 GB checkpoint-proto limit),
BatchCheckpointTest.testSparse, .testNestedSparse (SparseTensor), and BatchRandomAccessTest's 4 cases
(``tf.data.experimental.random_access``). testShapeError reads its three rows through ``map`` over a range
instead of ``from_generator`` (which meshfit does not have); its assertion (error and message) is kept.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _tf_port import VERIFY_FNS, assert_same, produces

from meshfit.data import Dataset


@pytest.mark.parametrize("num_parallel_calls", [None, 1, 2, 4])
@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("batch_size", [14, 15])
@pytest.mark.parametrize("count", [0, 28])
def test_basic(count, batch_size, drop_remainder, num_parallel_calls):
    components = (np.arange(7), np.array([[1, 2, 3]]) * np.arange(7)[:, np.newaxis], np.array(37.0) * np.arange(7))

    def _map_fn(x, y, z):
        return x ** 2, y ** 2, z ** 2

    dataset = Dataset.from_tensor_slices(components).map(_map_fn).repeat(count).batch(
        batch_size, drop_remainder, num_parallel_calls)
    it = iter(dataset)
    num_full_batches = (count * 7) // batch_size
    for i in range(num_full_batches):
        result = next(it)
        assert [list(r.shape) for r in result] == [[batch_size] + list(c.shape[1:]) for c in components]
        for component, result_component in zip(components, result, strict=True):
            for j in range(batch_size):
                assert_same(result_component[j], component[(i * batch_size + j) % 7] ** 2)
    if not drop_remainder and (count * 7) % batch_size > 0:
        result = next(it)
        for component, result_component in zip(components, result, strict=True):
            for j in range((count * 7) % batch_size):
                assert_same(result_component[j], component[(num_full_batches * batch_size + j) % 7] ** 2)
    with pytest.raises(StopIteration):
        next(it)


def test_invalid_batch_size():
    with pytest.raises(ValueError):
        Dataset.range(10).batch(0)


def test_shape_error():
    rows = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 10.0]]
    dataset = Dataset.range(3).map(lambda i: np.array(rows[int(i)], np.float32)).batch(3)
    with pytest.raises(ValueError, match=r"Cannot batch tensors with different shapes in component 0. First "
                                         r"element had shape \[3\] and element 2 had shape \[4\]."):
        next(iter(dataset))


def test_none_component():
    dataset = Dataset.range(10).map(lambda x: (x, None)).batch(10).map(lambda x, y: x)
    produces(dataset, [list(range(10))])


@pytest.mark.parametrize("local_determinism", [None, True, False])
def test_determinism_configuration(local_determinism):
    # Listed difference: TF expects an out-of-order result for deterministic=False (under a sleep in the
    # first element); meshfit's order is always the deterministic one, which exact resume relies on.
    # (TF's global ``Options.deterministic`` is TF-only; meshfit has no such option.)
    elements = list(range(100))

    def dataset_fn(delay_ms):
        def map_function(x):
            if int(x) == 0:
                time.sleep(delay_ms / 1000)
            return x

        dataset = Dataset.from_tensor_slices(elements)
        dataset = dataset.map(map_function, num_parallel_calls=2, deterministic=local_determinism)
        return dataset.batch(batch_size=6, num_parallel_calls=2, deterministic=local_determinism)

    for delay_ms in [10, 100]:
        actual = [int(v) for batch in dataset_fn(delay_ms) for v in batch]
        assert actual == elements


@pytest.mark.parametrize("num_parallel_calls", [None, 1])
def test_name(num_parallel_calls):
    dataset = Dataset.range(5).batch(5, num_parallel_calls=num_parallel_calls, name="batch")
    produces(dataset, [list(range(5))])


def _build_dataset(multiplier=15.0, tensor_slice_len=2, batch_size=2):
    components = (np.arange(tensor_slice_len), np.array([[1, 2, 3]]) * np.arange(tensor_slice_len)[:, np.newaxis],
                  np.array(multiplier) * np.arange(tensor_slice_len))
    return Dataset.from_tensor_slices(components).batch(batch_size)


@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint(verify_fn):
    tensor_slice_len = 8
    batch_size = 2
    num_outputs = tensor_slice_len // batch_size
    VERIFY_FNS[verify_fn](lambda: _build_dataset(15.0, tensor_slice_len, batch_size), num_outputs)
