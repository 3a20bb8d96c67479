"""TensorFlow's ``from_tensor_slices`` kernel tests, ported to `meshfit.data.Dataset`.

Source: tensorflow/tensorflow, tensorflow/python/data/kernel_tests/from_tensor_slices_test.py at commit
140b37d45b343b0bc3ab2ce7d49a0f3ae369c828. Translation rules: tests/data/_tf_port.py.

Cases in the source: 10. Ported: 3. Passing with TF's assertions: 2. Listed as differences: 1
(testFromTensorSlicesWithDict: Python ints are int64 in meshfit, int32 in TF; docs/fragments/data.md).
Skipped as TF-only (7): testFromTensorSlicesDataset, testFromTensorSlicesDatasetOfOrderedDict,
testFromTensorSlicesDatasetInFunction (datasets as tensor components, flat_map), testFromTensorSlicesSparse,
testFromTensorSlicesMixed (SparseTensor), testFromTensorSlicesRagged, testFromTensorSlicesMixedRagged
(RaggedTensor). ``get_legacy_output_shapes``/``types`` (no element_spec in meshfit) are checked on the
produced elements instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tf_port import assert_same, produces

from meshfit.data import Dataset


def test_from_tensor_slices():
    components = (
        np.tile(np.array([[1], [2], [3], [4]]), 20), np.tile(np.array([[12], [13], [14], [15]]), 22),
        np.array([37.0, 38.0, 39.0, 40.0]),
    )
    dataset = Dataset.from_tensor_slices(components)
    it = iter(dataset)
    for i in range(4):
        results = next(it)
        assert [tuple(r.shape) for r in results] == [c.shape[1:] for c in components]
        for component, result_component in zip(components, results, strict=True):
            assert_same(result_component, component[i])
    with pytest.raises(StopIteration):
        next(it)


def test_from_tensor_slices_with_dict():
    # Listed difference: TF's int32 for Python ints is torch's int64 here (float32 and shapes as in TF).
    components = {"foo": [1, 2, 3], "bar": [[4.0], [5.0], [6.0]]}
    dataset = Dataset.from_tensor_slices(components)
    it = iter(dataset)
    for i in range(3):
        results = next(it)
        assert results["foo"].dtype == torch.int64
        assert results["bar"].dtype == torch.float32
        assert tuple(results["foo"].shape) == () and tuple(results["bar"].shape) == (1,)
        assert components["foo"][i] == results["foo"]
        assert_same(results["bar"], np.array(components["bar"][i], np.float32))
    with pytest.raises(StopIteration):
        next(it)


def test_from_tensor_slices_with_uint_dtypes():
    components = (
        np.tile(np.array([[0], [1]], dtype=np.uint8), 2),
        np.tile(np.array([[2], [256]], dtype=np.uint16), 2),
        np.tile(np.array([[4], [65536]], dtype=np.uint32), 2),
        np.tile(np.array([[8], [4294967296]], dtype=np.uint64), 2),
    )
    expected_types = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
    expected_output = [tuple([c[i] for c in components]) for i in range(2)]
    dataset = Dataset.from_tensor_slices(components)
    assert tuple(t.dtype for t in next(iter(dataset))) == expected_types
    produces(dataset, expected_output)
