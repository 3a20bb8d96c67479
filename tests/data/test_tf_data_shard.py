"""TensorFlow's ``shard`` kernel tests, ported to `meshfit.data.Dataset`.

Source: tensorflow/tensorflow, tensorflow/python/data/kernel_tests/shard_test.py at commit
0304934138cbfabd338ec432a630a9c3c1191564 (the stored version; none is stored at 140b37d4).
Translation rules: tests/data/_tf_port.py.

Cases in the source: 22. Ported: 14. Passing with TF's assertions: 14. Listed as differences: 0.
Skipped as TF-only (8): ShardRandomAccessTest's 6 cases (``tf.data.experimental.random_access``),
ShardGlobalShuffleTest's 1 and ShardGlobalShuffleCheckpointTest's 1 (the private
``global_shuffle_op._global_shuffle``).
"""

from __future__ import annotations

import pytest
from _tf_port import VERIFY_FNS, produces

from meshfit.data import Dataset


def test_simple_case():
    produces(Dataset.range(10).shard(5, 2), [2, 7])


def test_nested_data():
    dataset = Dataset.zip((Dataset.range(10), Dataset.range(10, 0, -1))).shard(5, 2)
    produces(dataset, [(2, 8), (7, 3)])


def test_offset_zero():
    produces(Dataset.range(10).shard(5, 0), [0, 5])


@pytest.mark.parametrize(("num_shards", "index"), [(5, 7), (5, -3), (-3, 1), (0, 1)],
                         ids=["OffsetGreaterNumShards", "NegativeOffset", "NegativeNumShards", "ZeroNumShards"])
def test_invalid_arguments(num_shards, index):
    # Four source cases: testOffsetGreaterNumShards, testNegativeOffset, testNegativeNumShards, testZeroNumShards.
    with pytest.raises(ValueError):
        next(iter(Dataset.range(10).shard(num_shards, index)))


def test_iterator_ends_before_first_elem():
    produces(Dataset.range(1).shard(5, 2), [])


def test_larger_worker_pool():
    produces(Dataset.range(10).shard(7, 5), [5])


def test_index_equals_num_shards():
    produces(Dataset.range(10).shard(5, 4), [4, 9])


def test_index_equals_num_shards2():
    produces(Dataset.range(10).shard(4, 3), [3, 7])


def test_num_shards_larger_than_dataset():
    produces(Dataset.range(10).shard(20, 5), [5])


def test_name():
    produces(Dataset.from_tensors(42).shard(1, 0, name="shard"), [42])


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("num_shards", [2, 5])
@pytest.mark.parametrize("elems", [10, 100])
@pytest.mark.parametrize("verify_fn", list(VERIFY_FNS))
def test_checkpoint(verify_fn, elems, num_shards, index):
    VERIFY_FNS[verify_fn](lambda: Dataset.range(elems).shard(num_shards, index), elems // num_shards)
