"""TensorFlow's ``prefetch`` kernel tests, ported to `meshfit.data.Dataset`.

Source: tensorflow/tensorflow, tensorflow/python/data/kernel_tests/prefetch_test.py at commit
057091db1ac347fe971c5defbf2fd41ca3a46a1c (the stored version; none is stored at 140b37d4).
Translation rules: tests/data/_tf_port.py.

Cases in the source: 9. Ported: 4. Passing with TF's assertions: 4. Listed as differences: 0.
Skipped as TF-only (5): testPrefetchWithSlack (the internal ``PrefetchDataset(slack_period=...)``),
testPrefetchCancellation (TF1 session cancellation), PrefetchRandomAccessTest's 3 cases
(``tf.data.experimental.random_access``).
"""

from __future__ import annotations

import pytest
from _tf_port import VERIFY_FNS, produces

from meshfit.data import Dataset


@pytest.mark.parametrize("buffer_size", [-1, None, 0, 42])
def test_buffer_size(buffer_size):
    produces(Dataset.range(10).prefetch(buffer_size=buffer_size), range(10))


@pytest.mark.parametrize("buffer_size", [-2, -42])
def test_invalid_buffer_size(buffer_size):
    with pytest.raises(ValueError):
        Dataset.range(10).prefetch(buffer_size=buffer_size)


def test_name():
    produces(Dataset.from_tensors(42).prefetch(1, name="prefetch"), [42])


@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint(verify_fn):
    VERIFY_FNS[verify_fn](lambda: Dataset.range(100).prefetch(10), 100)
