"""Tests for DistributedDataset: which rows of each global batch a replica reads, per AutoShardPolicy.

No processes: an InputContext says how many input pipelines there are and which one this is, and one
DistributedDataset per pipeline id is built in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshfit.data import AutoShardPolicy, Dataset, DatasetIterator, Options
from meshfit.distribute import InputContext
from meshfit.distribute._input._distributed_dataset import DistributedDataset


def _context(num_replicas: int, replica_id: int) -> InputContext:
    return InputContext(num_input_pipelines=num_replicas, input_pipeline_id=replica_id,
                        num_replicas_in_sync=num_replicas)


def _replicas(ds, n, options=None):
    return [DistributedDataset(ds, _context(n, r), options) for r in range(n)]


def _options(policy):
    return Options(auto_shard_policy=policy)


def _xy(n=20):
    x = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
    return x, torch.arange(n)


def _assert_equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _assert_equal(u, v)
    else:
        assert torch.equal(a, b), (a, b)


def _concat(parts):
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts)


def _write_files(tmp_path, sizes=(3, 3, 3, 3)):
    """Files whose examples are numbered consecutively: file f holds ``examples[f]``."""
    paths, examples, start = [], [], 0
    for f, size in enumerate(sizes):
        y = np.arange(start, start + size, dtype=np.int64)
        path = tmp_path / f"shard-{f}.npz"
        np.savez(path, x=y[:, None].astype(np.float32) * np.ones((1, 2), np.float32), y=y)
        paths.append(str(path))
        examples.append(y.tolist())
        start += size
    return paths, examples


# ---- DATA --------------------------------------------------------------------------------------


def _shuffled(n=20):
    return Dataset.from_tensor_slices(_xy(n)).shuffle(7, seed=3)


PIPELINES = {
    "batch": lambda: _shuffled().batch(8),
    "repeat-batch-prefetch": lambda: _shuffled().repeat(2).batch(8).prefetch(2),
    "batch-skip-take": lambda: _shuffled().repeat().batch(8).skip(1).take(4),
    "batch-repeat": lambda: _shuffled().batch(8, drop_remainder=True).repeat(2),
    "batch-map": lambda: _shuffled().batch(8).map(lambda x, y: (x * 2, y + 1)),
}


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("pass_index", [0, 1])
def test_data_replicas_together_read_exactly_the_global_batch(pipeline, n, pass_index):
    ds = PIPELINES[pipeline]()
    global_batches = list(DatasetIterator(ds, pass_index=pass_index))
    replicas = _replicas(ds, n, _options(AutoShardPolicy.DATA))
    assert all(r.length() == len(global_batches) for r in replicas)
    for step, expected in enumerate(global_batches):
        parts = [r.replica_batch(step, pass_index) for r in replicas]
        size = len(expected[1])
        assert [global_size for _, global_size in parts] == [size] * n
        assert [len(rows[1]) for rows, _ in parts] == [size // n] * n
        _assert_equal(_concat([rows for rows, _ in parts]), expected)


def test_data_steps_see_the_same_examples_for_any_number_of_replicas():
    ds = _shuffled().repeat(2).batch(8)
    sequences = {}
    for n in (1, 2, 4):
        replicas = _replicas(ds, n, _options(AutoShardPolicy.DATA))
        sequences[n] = [_concat([r.replica_batch(step, 0)[0] for r in replicas]) for step in range(len(ds))]
    assert len(sequences[1]) == 5
    for n in (2, 4):
        for a, b in zip(sequences[1], sequences[n], strict=True):
            _assert_equal(a, b)
    # and iterating a replica (custom loops) yields its replica_batch rows
    replica = _replicas(ds, 4)[3]
    for step, rows in enumerate(replica):
        _assert_equal(rows, replica.replica_batch(step, 0)[0])


@pytest.mark.parametrize("n", [2, 4])
def test_data_uneven_last_batch_is_split_between_replicas(n):
    ds = Dataset.from_tensor_slices(_xy(10)).batch(8)  # batches of 8 and 2
    replicas = _replicas(ds, n)
    parts = [r.replica_batch(1, 0) for r in replicas]
    sizes = [len(rows[1]) for rows, _ in parts]
    assert sum(sizes) == 2 and max(sizes) - min(sizes) <= 1
    assert {global_size for _, global_size in parts} == {2}
    _assert_equal(_concat([rows for rows, _ in parts]), next(iter(ds.skip(1))))

    dropped = _replicas(Dataset.from_tensor_slices(_xy(10)).batch(8, drop_remainder=True), n)
    assert [r.length() for r in dropped] == [1] * n


def test_global_batch_not_divisible_by_replicas_names_both_numbers():
    ds = Dataset.range(20).batch(10)
    with pytest.raises(ValueError, match=r"10.*4"):
        DistributedDataset(ds, _context(4, 0))
    DistributedDataset(ds, _context(5, 0))  # divisible: fine


def test_unbatched_dataset_is_rejected_when_distributed():
    with pytest.raises(ValueError, match="batch"):
        DistributedDataset(Dataset.range(20), _context(2, 0))


def test_rejects_what_is_not_a_plain_dataset():
    ds = Dataset.range(8).batch(4)
    distributed = DistributedDataset(ds, _context(2, 0))
    with pytest.raises(TypeError, match="already distributed"):
        DistributedDataset(distributed, _context(2, 0))
    with pytest.raises(TypeError, match="list"):
        DistributedDataset([1, 2, 3], _context(2, 0))


# ---- OFF ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_off_every_replica_reads_the_same_per_replica_batches(n):
    x, y = _xy(16)
    ds = Dataset.from_tensor_slices((x, y)).batch(8).with_options(_options(AutoShardPolicy.OFF))
    replicas = _replicas(ds, n)
    per_replica = 8 // n
    for r in replicas:
        assert r.policy is AutoShardPolicy.OFF
        assert r.length() == 16 // per_replica
    for step in range(replicas[0].length()):
        parts = [r.replica_batch(step, 0) for r in replicas]
        expected = (x[step * per_replica:(step + 1) * per_replica], y[step * per_replica:(step + 1) * per_replica])
        for rows, global_size in parts:
            _assert_equal(rows, expected)
            assert global_size == 8


# ---- FILE and AUTO -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("policy", [AutoShardPolicy.FILE, AutoShardPolicy.AUTO])
def test_file_replica_reads_exactly_its_files(tmp_path, n, policy):
    paths, examples = _write_files(tmp_path)
    ds = Dataset.from_files(paths).batch(2 * n).with_options(_options(policy))
    for r, replica in enumerate(_replicas(ds, n)):
        assert replica.policy is AutoShardPolicy.FILE
        batches = list(replica)
        assert all(len(y) <= 2 for _, y in batches)
        read = torch.cat([y for _, y in batches]).tolist()
        assert read == [e for f in range(r, len(paths), n) for e in examples[f]]
        _, global_size = replica.replica_batch(0, 0)
        assert global_size == 2 * n


def test_file_policy_given_to_the_constructor_and_with_a_cached_shuffled_pipeline(tmp_path):
    paths, examples = _write_files(tmp_path)
    ds = Dataset.from_files(paths).cache().shuffle(12, seed=0).batch(4)
    seen = torch.cat([y for _, y in ds]).tolist()  # iterate the original first: fills its caches
    assert sorted(seen) == list(range(12))
    for r, replica in enumerate(_replicas(ds, 2, _options(AutoShardPolicy.FILE))):
        read = sorted(torch.cat([y for _, y in replica]).tolist())
        assert read == sorted(examples[r] + examples[r + 2])


def test_file_policy_needs_a_file_source():
    ds = Dataset.from_tensor_slices(_xy(8)).batch(4).with_options(_options(AutoShardPolicy.FILE))
    with pytest.raises(ValueError, match="FILE"):
        DistributedDataset(ds, _context(2, 0))


def test_file_policy_needs_a_file_per_replica(tmp_path):
    paths, _ = _write_files(tmp_path)
    ds = Dataset.from_files(paths).batch(8).with_options(_options(AutoShardPolicy.FILE))
    with pytest.raises(ValueError, match=r"4 files for 8"):
        DistributedDataset(ds, _context(8, 0))


def test_auto_is_data_for_in_memory_sources():
    ds = Dataset.from_tensor_slices(_xy(8)).batch(4)
    replicas = _replicas(ds, 2)
    assert [r.policy for r in replicas] == [AutoShardPolicy.DATA] * 2
    for step, expected in enumerate(ds):
        _assert_equal(_concat([r.replica_batch(step, 0)[0] for r in replicas]), expected)


def test_data_policy_on_files_splits_global_batches(tmp_path):
    paths, _ = _write_files(tmp_path)
    ds = Dataset.from_files(paths).batch(4).with_options(_options(AutoShardPolicy.DATA))
    replicas = _replicas(ds, 2)
    assert [r.policy for r in replicas] == [AutoShardPolicy.DATA] * 2
    for step, expected in enumerate(ds):
        _assert_equal(_concat([r.replica_batch(step, 0)[0] for r in replicas]), expected)
