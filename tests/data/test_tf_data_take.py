"""TensorFlow's ``take`` kernel tests, ported to `meshfit.data.Dataset`.

Source: tensorflow/tensorflow, tensorflow/python/data/kernel_tests/take_test.py at commit
0304934138cbfabd338ec432a630a9c3c1191564 (the stored version; none is stored at 140b37d4).
Translation rules: tests/data/_tf_port.py.

Cases in the source: 8. Ported: 3. Passing with TF's assertions: 3. Listed as differences: 0.
Skipped as TF-only (5): TakeRandomAccessTest's 3 cases (``tf.data.experimental.random_access``),
TakeGlobalShuffleTest's 1 and TakeGlobalShuffleCheckpointTest's 1 (the private
``global_shuffle_op._global_shuffle``).
"""

from __future__ import annotations

import numpy as np
import pytest
from _tf_port import VERIFY_FNS, produces

from meshfit.data import Dataset


@pytest.mark.parametrize("count", [-1, 0, 4, 10, 25])
def test_basic(count):
    components = (np.arange(10),)
    dataset = Dataset.from_tensor_slices(components).take(count)
    num_output = min(count, 10) if count != -1 else 10
    produces(dataset, [tuple(components[0][i:i + 1]) for i in range(num_output)])


def test_name():
    produces(Dataset.from_tensors(42).take(1, name="take"), [42])


@pytest.mark.parametrize(("count", "num_outputs"), [(50, 50), (200, 100), (100, 100), (-1, 100), (0, 0)])
@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint(verify_fn, count, num_outputs):
    VERIFY_FNS[verify_fn](lambda: Dataset.range(100).take(count), num_outputs)
