"""Tests for meshfit.data: sources, transformations, options, prefetch and the saveable position."""

from __future__ import annotations

import doctest
import gc
import threading

import numpy as np
import pytest
import torch
from _procs import wait_until

import meshfit.data
from meshfit.data import (
    INFINITE,
    AutoShardPolicy,
    Dataset,
    DatasetIterator,
    Options,
    _dataset,
    _options,
    _prefetch,
    _sources,
    _structure,
    _transforms,
)


def _ints(ds) -> list[int]:
    return [int(v) for v in ds]


# ---- sources -----------------------------------------------------------------------------------


def test_from_tensor_slices_tuple_of_numpy_and_torch_keeps_shapes_and_dtypes():
    x = np.arange(18, dtype=np.float32).reshape(6, 3)
    y = torch.arange(6)
    ds = Dataset.from_tensor_slices((x, y))
    assert len(ds) == 6 and ds.cardinality() == 6
    elements = list(ds)
    assert len(elements) == 6
    first = elements[2]
    assert isinstance(first, tuple) and len(first) == 2
    assert first[0].shape == (3,) and first[0].dtype == torch.float32
    assert first[1].shape == () and first[1].dtype == torch.int64
    torch.testing.assert_close(first[0], torch.from_numpy(x[2]))
    assert int(first[1]) == 2
    xb, yb = next(iter(ds.batch(4)))
    assert xb.shape == (4, 3) and xb.dtype == torch.float32
    assert yb.shape == (4,) and yb.dtype == torch.int64
    torch.testing.assert_close(xb, torch.from_numpy(x[:4]))


def test_from_tensor_slices_dict_and_single_array():
    ds = Dataset.from_tensor_slices({"image": np.zeros((5, 2, 2), np.float64), "label": np.arange(5)})
    element = next(iter(ds))
    assert set(element) == {"image", "label"}
    assert element["image"].shape == (2, 2) and element["image"].dtype == torch.float64
    assert element["label"].dtype == torch.int64
    batch = next(iter(ds.batch(3)))
    assert batch["image"].shape == (3, 2, 2) and batch["label"].tolist() == [0, 1, 2]

    single = Dataset.from_tensor_slices(torch.ones(4, 7, dtype=torch.float16))
    assert [tuple(e.shape) for e in single] == [(7,)] * 4
    assert next(iter(single)).dtype == torch.float16


def test_from_tensor_slices_mismatched_lengths_echoes_the_shapes():
    with pytest.raises(ValueError, match=r"\(5, 3\).*\(4,\)"):
        Dataset.from_tensor_slices((np.zeros((5, 3)), torch.zeros(4)))
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        Dataset.from_tensor_slices({"a": np.zeros(2), "b": np.zeros(3)})


def test_range_follows_python_range():
    assert _ints(Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert _ints(Dataset.range(2, 10, 3)) == [2, 5, 8]
    assert [b.tolist() for b in Dataset.range(10, 0, -3).batch(2)] == [[10, 7], [4, 1]]
    assert len(Dataset.range(3, 3)) == 0 and list(Dataset.range(3, 3)) == []


# ---- shuffle -----------------------------------------------------------------------------------


def test_shuffle_is_a_seeded_permutation():
    order = _ints(Dataset.range(50).shuffle(50, seed=7))
    assert sorted(order) == list(range(50))
    assert order != list(range(50))
    assert _ints(Dataset.range(50).shuffle(50, seed=7)) == order  # a new pipeline, same seed
    assert _ints(Dataset.range(50).shuffle(50, seed=8)) != order


def test_shuffle_reshuffles_each_pass_unless_told_not_to():
    stream = _ints(Dataset.range(30).shuffle(30, seed=2).repeat(3))
    passes = [stream[:30], stream[30:60], stream[60:]]
    for p in passes:
        assert sorted(p) == list(range(30))
    assert passes[0] != passes[1] and passes[1] != passes[2]
    # the same pass of a new pipeline is the same order: order is a function of (seed, pass)
    assert _ints(Dataset.range(30).shuffle(30, seed=2).repeat(3)) == stream

    fixed = _ints(Dataset.range(30).shuffle(30, seed=2, reshuffle_each_iteration=False).repeat(2))
    assert fixed[:30] == fixed[30:] and sorted(fixed[:30]) == list(range(30))


@pytest.mark.parametrize(("buffer", "seed"), [(1, 0), (4, 0), (10, 1), (10, 2), (64, 3)])
def test_small_shuffle_buffer_moves_elements_a_bounded_amount(buffer, seed):
    n = 200
    order = _ints(Dataset.range(n).shuffle(buffer, seed=seed))
    assert sorted(order) == list(range(n))
    # as tf.data's buffer: output k is drawn from the first k + buffer inputs
    assert all(source < k + buffer for k, source in enumerate(order))
    if buffer == 1:
        assert order == list(range(n))
    else:
        assert order != list(range(n))


def test_shuffle_buffer_bound_also_holds_on_an_infinite_input():
    buffer = 8
    # the first 1000 inputs are 0..999, so an output's value is its input position
    order = _ints(Dataset.range(1000).repeat().shuffle(buffer, seed=5).take(120))
    assert all(source < k + buffer for k, source in enumerate(order))
    assert sorted(order) != order and len(set(order)) == 120
    assert _ints(Dataset.range(1000).repeat().shuffle(buffer, seed=5).take(120)) == order


# ---- repeat, batch, map, cache -----------------------------------------------------------------


def test_repeat_cardinality():
    assert len(Dataset.range(5).repeat(3)) == 15
    assert _ints(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    for forever in (Dataset.range(5).repeat(), Dataset.range(5).repeat(-1)):
        assert forever.cardinality() == INFINITE
        with pytest.raises(TypeError, match="infinite"):
            len(forever)
    assert _ints(Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize(("drop", "sizes"), [(False, [4, 4, 2]), (True, [4, 4])])
def test_batch_sizes_and_drop_remainder(drop, sizes):
    ds = Dataset.range(10).batch(4, drop_remainder=drop)
    batches = list(ds)
    assert [len(b) for b in batches] == sizes
    assert len(ds) == len(sizes)
    assert torch.cat(batches).tolist() == list(range(sum(sizes)))


def test_batch_after_repeat_spans_passes():
    assert [b.tolist() for b in Dataset.range(3).repeat(2).batch(4)] == [[0, 1, 2, 0], [1, 2]]
    assert [b.tolist() for b in Dataset.range(3).batch(2).repeat(2)] == [[0, 1], [2], [0, 1], [2]]


@pytest.mark.parametrize("count", [3, None])
def test_batches_of_a_shuffled_repeat_are_its_elements_in_order(count):
    # A batch within one pass reads its consecutive rows at once; one spanning two passes element by
    # element: the same elements either way, each pass reshuffled.
    data = Dataset.from_tensor_slices((np.arange(10), np.arange(10) * 2)).shuffle(7, seed=1).repeat(count)
    elements = [(int(a), int(b)) for a, b in data.take(30)]
    batches = list(data.batch(4).take(7))
    assert [(int(a), int(b)) for x, y in batches for a, b in zip(x, y, strict=True)] == elements[:28]
    assert [len(x) for x, _ in batches] == [4] * 7
    empty = data.batch(4).node.get_rows(0, 0, 2, 2)  # a replica's empty share of a batch
    assert [tuple(part.shape) for part in empty] == [(0,), (0,)]
    # A mapped pipeline's empty share too: its structure and dtypes, no rows.
    mapped = Dataset.from_tensor_slices((np.arange(10.0), np.arange(10))).map(lambda a, b: (a * 2, b[None]))
    empty = mapped.batch(4).node.get_rows(2, 0, 1, 1)
    assert [(tuple(part.shape), part.dtype) for part in empty] == [((0,), torch.float64), ((0, 1), torch.int64)]


def test_map_unpacks_tuples_into_arguments_and_passes_dicts_whole():
    ds = Dataset.from_tensor_slices((torch.arange(4), torch.arange(4) * 10))
    assert _ints(ds.map(lambda a, b: a + b)) == [0, 11, 22, 33]
    swapped = list(ds.map(lambda a, b: (b, a)))
    assert [(int(b), int(a)) for b, a in swapped] == [(0, 0), (10, 1), (20, 2), (30, 3)]
    dicts = Dataset.from_tensor_slices({"a": torch.arange(3), "b": torch.ones(3)})
    assert [float(v) for v in dicts.map(lambda d: d["a"] + d["b"])] == [1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="callable"):
        ds.map(3)


def test_cache_calls_the_map_function_once_per_element_across_passes():
    calls: list[int] = []

    def record(v):
        calls.append(int(v))
        return v * 2

    ds = Dataset.range(6).map(record).cache()
    repeated = ds.repeat(2)
    assert _ints(repeated) == [0, 2, 4, 6, 8, 10] * 2
    assert sorted(calls) == list(range(6))
    assert _ints(ds) == [0, 2, 4, 6, 8, 10]  # another iterator: still served from the cache
    assert sorted(calls) == list(range(6))
    with pytest.raises(ValueError, match="filename='f.cache'"):
        Dataset.range(3).cache("f.cache")


def test_cache_without_it_the_map_function_runs_each_pass():
    calls: list[int] = []
    ds = Dataset.range(4).map(lambda v: calls.append(int(v)) or v).repeat(2)
    list(ds)
    assert len(calls) == 8


# ---- prefetch ----------------------------------------------------------------------------------


def test_prefetch_yields_the_same_elements_computed_on_a_background_thread():
    threads: set[int] = set()

    def record(a, b):
        threads.add(threading.get_ident())
        return a * 2, b

    def build():
        x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
        return Dataset.from_tensor_slices((x, y)).shuffle(5, seed=4).map(record).batch(3)

    plain = list(build())
    main = threading.get_ident()
    assert threads == {main}
    threads.clear()
    prefetched = list(build().prefetch(2))
    assert len(prefetched) == len(plain) == 4
    for (xa, ya), (xb, yb) in zip(plain, prefetched, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert threads and main not in threads


def test_prefetch_computes_ahead_of_the_consumer():
    calls: list[int] = []
    it = iter(Dataset.range(100).map(lambda v: calls.append(int(v)) or v).prefetch(3))
    assert int(next(it)) == 0
    assert wait_until(lambda: len(calls) >= 3, 5.0, interval=0.01)
    assert len(calls) < 100  # bounded: it does not run to the end
    it.close()


def test_prefetch_reraises_the_map_functions_error_in_order():
    def fail_at_three(v):
        if int(v) == 3:
            raise RuntimeError("bad element 3")
        return v

    it = iter(Dataset.range(10).map(fail_at_three).prefetch(2))
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="bad element 3"):
        next(it)


def test_prefetch_thread_stops_when_an_abandoned_iterator_is_dropped():
    before = set(threading.enumerate())
    it = iter(Dataset.range(10).repeat().batch(2).prefetch(2))  # infinite: the thread never ends by itself
    assert next(it).tolist() == [0, 1]
    assert set(threading.enumerate()) - before
    del it
    gc.collect()
    assert wait_until(lambda: not (set(threading.enumerate()) - before), 5.0, interval=0.01)


def test_prefetch_stops_at_the_end_and_keeps_stopping():
    it = iter(Dataset.range(3).prefetch(2))
    assert _ints(it) == [0, 1, 2]
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)


# ---- shard, take, skip, options ----------------------------------------------------------------


def test_shard_takes_every_nth_element_and_shards_partition_the_data():
    assert _ints(Dataset.range(10).shard(3, 1)) == [1, 4, 7]
    shards = [_ints(Dataset.range(10).shard(3, i)) for i in range(3)]
    assert [len(s) for s in shards] == [4, 3, 3]
    assert sorted(v for s in shards for v in s) == list(range(10))
    assert [len(Dataset.range(10).shard(3, i)) for i in range(3)] == [4, 3, 3]
    assert [b.tolist() for b in Dataset.range(10).shard(2, 0).batch(2)] == [[0, 2], [4, 6], [8]]


def test_take_and_skip():
    ds = Dataset.range(6)
    assert _ints(ds.take(2)) == [0, 1]
    assert _ints(ds.take(-1)) == list(range(6))
    assert _ints(ds.take(0)) == []
    assert _ints(ds.take(99)) == list(range(6))
    assert _ints(ds.skip(4)) == [4, 5]
    assert _ints(ds.skip(0)) == list(range(6))
    assert _ints(ds.skip(10)) == [] and len(ds.skip(10)) == 0
    assert _ints(ds.skip(1).take(2)) == [1, 2]
    assert _ints(ds.repeat().skip(5).take(3)) == [5, 0, 1]


def test_with_options_and_options():
    ds = Dataset.range(8)
    assert ds.options() == Options() and ds.options().auto_shard_policy is AutoShardPolicy.AUTO
    off = Options(auto_shard_policy=AutoShardPolicy.OFF)
    tagged = ds.with_options(off)
    assert tagged.options() == off
    assert tagged.shuffle(4, seed=0).batch(2).prefetch(1).options() == off  # carried downstream
    assert ds.options() == Options()  # the original is untouched
    assert _ints(tagged) == _ints(ds)
    data = Options(auto_shard_policy=AutoShardPolicy.DATA)
    assert tagged.batch(2).with_options(data).options() == data  # the nearest one wins
    with pytest.raises(TypeError, match="Options"):
        ds.with_options({"auto_shard_policy": "off"})
    with pytest.raises(TypeError, match="auto_shard_policy='off'"):
        Options(auto_shard_policy="off")


# ---- files -------------------------------------------------------------------------------------


def _write_npz(tmp_path, sizes):
    paths, start = [], 0
    for i, size in enumerate(sizes):
        x = np.arange(start, start + size, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
        y = np.arange(start, start + size, dtype=np.int64)
        path = tmp_path / f"part-{i:02d}.npz"
        np.savez(path, y=y, x=x)  # the default reader puts x first regardless of the order written
        paths.append(str(path))
        start += size
    return paths


def test_from_files_reads_npz_files_in_order(tmp_path):
    paths = _write_npz(tmp_path, [3, 2, 4])
    ds = Dataset.from_files(paths)
    assert len(ds) == 9
    x, y = next(iter(ds.batch(9)))
    assert x.shape == (9, 2) and x.dtype == torch.float32
    assert y.tolist() == list(range(9)) and x[:, 0].tolist() == [float(v) for v in range(9)]
    single = Dataset.from_files(paths[0])  # one path, not a list
    assert [int(y) for _, y in single] == [0, 1, 2]


def test_list_files_globs_sorted_and_reports_a_pattern_with_no_match(tmp_path):
    paths = _write_npz(tmp_path, [2, 2, 2])
    ds = Dataset.list_files(str(tmp_path / "part-*.npz"))
    assert [int(y) for _, y in ds] == list(range(6))
    assert ds._node.paths == paths  # the Files source node keeps the sorted glob matches
    with pytest.raises(FileNotFoundError, match="nothing-"):
        Dataset.list_files(str(tmp_path / "nothing-*.npz"))
    with pytest.raises(ValueError, match="empty"):
        Dataset.from_files([])


def test_from_files_with_a_reader_returning_a_dict(tmp_path):
    paths = _write_npz(tmp_path, [2, 3])

    def reader(path):
        with np.load(path) as data:
            return {"features": data["x"], "label": data["y"]}

    batches = list(Dataset.from_files(paths, reader=reader).batch(4))
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2, 3], [4]]
    assert batches[0]["features"].shape == (4, 2)


# ---- argument errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "echo"),
    [
        (lambda ds: ds.batch(0), "batch_size=0"),
        (lambda ds: ds.batch(-3), "batch_size=-3"),
        (lambda ds: ds.shuffle(-1), "buffer_size=-1"),
        (lambda ds: ds.shuffle(0, seed=1), "buffer_size=0"),
        (lambda ds: ds.shard(2, 2), "index=2"),
        (lambda ds: ds.shard(2, -1), "index=-1"),
        (lambda ds: ds.shard(0, 0), "num_shards=0"),
        (lambda ds: ds.repeat(1.5), "count=1.5"),
        (lambda ds: ds.take(-2), "count=-2"),
        (lambda ds: ds.skip(-1), "count=-1"),
        (lambda ds: ds.prefetch(-2), "buffer_size=-2"),
    ],
)
def test_bad_arguments_raise_and_echo_the_value(build, echo):
    with pytest.raises(ValueError, match=echo):
        build(Dataset.range(4))


# ---- the saveable position (the requirement) -------------------------------------------


def _pipeline(batch_size: int, count: int | None, buffer: int = 4):
    x = torch.arange(30.0).reshape(10, 3)
    y = torch.arange(10)

    def f(a, b):
        return a * 2 + 1, b + 100

    ds = Dataset.from_tensor_slices((x, y)).shuffle(buffer, seed=1).map(f)
    return ds.repeat(count).batch(batch_size).prefetch(2)


def _assert_same_batches(expected, got):
    assert len(expected) == len(got)
    for (xa, ya), (xb, yb) in zip(expected, got, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("buffer", [4, 10])
@pytest.mark.parametrize(
    ("batch_size", "k"),
    [
        (5, 0), (5, 1),  # inside the first pass
        (5, 2), (5, 4),  # exactly at the end of pass 1 and pass 2 (10 examples, batch 5)
        (3, 3),  # batch 4 spans the boundary: examples 9..11
        (3, 4), (3, 7),  # just past and well past boundaries
    ],
)  # fmt: skip
def test_state_dict_round_trip_on_an_infinite_pipeline(batch_size, k, buffer):
    reference = iter(_pipeline(batch_size, None, buffer))
    for _ in range(k):
        next(reference)
    state = reference.state_dict()
    assert set(state) == {"pass", "index"}
    expected = [next(reference) for _ in range(6)]

    restored = iter(_pipeline(batch_size, None, buffer))  # a new pipeline object, same code
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    _assert_same_batches(expected, [next(restored) for _ in range(6)])
    reference.close()
    restored.close()


def test_round_trip_covers_a_reshuffled_second_pass():
    # the boundary cases above only mean something if the second pass is a different order
    it = iter(_pipeline(5, None))
    labels = torch.cat([next(it)[1] for _ in range(4)]).tolist()
    it.close()
    assert sorted(labels[:10]) == sorted(labels[10:]) == list(range(100, 110))
    assert labels[:10] != labels[10:]


@pytest.mark.parametrize("k", [0, 2, 3, 4, 6, 7])
def test_state_dict_round_trip_on_a_finite_pipeline(k):
    reference = iter(_pipeline(3, 2))  # 20 examples: 7 batches, the 4th spans the two passes
    assert len(_pipeline(3, 2)) == 7
    for _ in range(k):
        next(reference)
    state = reference.state_dict()
    expected = list(reference)

    restored = iter(_pipeline(3, 2))
    restored.load_state_dict(state)
    got = list(restored)
    assert len(got) == 7 - k
    _assert_same_batches(expected, got)


def test_load_state_dict_moves_a_running_prefetching_iterator():
    full = list(_pipeline(3, 2))
    it = iter(_pipeline(3, 2))
    next(it)
    next(it)  # the prefetch thread is running ahead now
    it.load_state_dict({"pass": 0, "index": 5})
    _assert_same_batches(full[5:], list(it))
    it.load_state_dict({"pass": 0, "index": 1})  # and backwards
    _assert_same_batches(full[1:], list(it))


def test_pass_index_selects_the_pass_of_a_finite_pipeline():
    ds = Dataset.range(8).shuffle(8, seed=3).batch(4)
    first = [b.tolist() for b in DatasetIterator(ds, pass_index=0)]
    second = [b.tolist() for b in DatasetIterator(ds, pass_index=1)]
    assert first == [b.tolist() for b in ds]
    assert second != first and sorted(sum(second, [])) == list(range(8))
    it = DatasetIterator(ds)
    it.load_state_dict({"pass": 1, "index": 1})
    assert [b.tolist() for b in it] == second[1:]


# ---- docstring examples ------------------------------------------------------------------------


def test_docstring_examples_pass():
    attempted = 0
    for module in (meshfit.data, _dataset, _options, _prefetch, _sources, _structure, _transforms):
        result = doctest.testmod(module, verbose=False, report=False)
        assert result.failed == 0, f"{module.__name__}: {result.failed} doctest failures"
        attempted += result.attempted
    assert attempted > 0


def test_options_experimental_distribute_spelling():
    # The seed: options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    import meshfit as mf

    options = mf.data.Options()
    options.experimental_distribute.auto_shard_policy = mf.data.experimental.AutoShardPolicy.OFF
    assert options.auto_shard_policy is AutoShardPolicy.OFF
    assert Dataset.range(4).batch(2).with_options(options).options().auto_shard_policy is AutoShardPolicy.OFF
    with pytest.raises(TypeError, match="auto_shard_policy='off'"):
        options.experimental_distribute.auto_shard_policy = "off"
