"""Where `meshfit.data.Dataset` silently differed from ``tf.data``; each test here failed before the fix.

TensorFlow's behaviour is quoted from its documentation and kernel tests (see the other files here).
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
import torch
from _tf_port import as_numpy

from meshfit.data import Dataset, Shuffle


def _list(dataset):
    return [as_numpy(e) for e in dataset]


# ---- from_tensor_slices: a Python list is a tensor; tuples, namedtuples and dicts are structure ------------


def test_a_list_of_lists_is_sliced_into_its_rows():
    # TF's documented example: from_tensor_slices([[1, 2], [3, 4]]) yields [1, 2] then [3, 4] (was (1, 3), (2, 4)).
    rows = _list(Dataset.from_tensor_slices([[1, 2], [3, 4]]))
    assert [r.tolist() for r in rows] == [[1, 2], [3, 4]]


def test_a_dict_of_lists_of_lists_is_sliced_by_rows():
    elements = _list(Dataset.from_tensor_slices({"a": [[1, 2], [3, 4]], "b": [5, 6]}))
    assert [e["a"].tolist() for e in elements] == [[1, 2], [3, 4]]
    assert [e["b"].tolist() for e in elements] == [5, 6]


def test_python_floats_are_float32_and_ints_int64():
    assert next(iter(Dataset.from_tensor_slices([1.5, 2.5]))).dtype == torch.float32
    assert next(iter(Dataset.from_tensor_slices([1, 2]))).dtype == torch.int64
    assert next(iter(Dataset.from_tensor_slices([True, False]))).dtype == torch.bool
    # numpy arrays keep their dtype, as in TF
    assert next(iter(Dataset.from_tensor_slices(np.arange(3.0)))).dtype == torch.float64


def test_a_list_of_tensors_is_stacked_and_a_tuple_of_them_is_structure():
    stacked = _list(Dataset.from_tensor_slices([torch.zeros(3), torch.ones(3)]))
    assert [e.tolist() for e in stacked] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match=r"shapes \[\(3,\), \(2,\)\]"):
        Dataset.from_tensor_slices([torch.zeros(3), torch.ones(2)])
    pairs = _list(Dataset.from_tensor_slices((torch.zeros(3), torch.ones(3))))
    assert len(pairs) == 3 and all(isinstance(p, tuple) for p in pairs)


def test_ragged_lists_and_scalars_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="Use a tuple"):
        Dataset.from_tensor_slices([[1, 2], [3]])
    with pytest.raises(ValueError, match="from_tensors"):
        Dataset.from_tensor_slices(5)


def test_a_0_d_numpy_array_keeps_its_shape():
    (element,) = _list(Dataset.from_tensors(np.array(37.0)))
    assert element.shape == ()
    (element,) = _list(Dataset.range(1).map(lambda x: (x, np.array(37.0))))
    assert element[1].shape == ()


# ---- map -----------------------------------------------------------------------------------------------


def test_stop_iteration_in_map_is_an_error_not_the_end():
    def fn(x):
        if int(x) == 2:
            raise StopIteration
        return x

    it = iter(Dataset.range(4).map(fn))
    assert [int(next(it)), int(next(it))] == [0, 1]
    with pytest.raises(RuntimeError, match="StopIteration"):
        next(it)
    assert int(next(it)) == 3


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_loop_that_skips_bad_records_ends(prefetch):
    def fn(x):
        if int(x) % 3 == 1:
            raise ValueError(f"bad record {int(x)}")
        return x

    dataset = Dataset.range(8).map(fn)
    if prefetch:
        dataset = dataset.prefetch(2)
    it, good, bad = iter(dataset), [], 0
    for _ in range(20):  # bounded: the old code raised the same error forever
        try:
            good.append(int(next(it)))
        except ValueError:
            bad += 1
        except StopIteration:
            break
    assert good == [0, 2, 3, 5, 6] and bad == 3


def test_a_namedtuple_is_passed_whole_and_a_tuple_unpacked():
    point = collections.namedtuple("Point", ["x", "y"])
    ds = Dataset.from_tensors(point(torch.tensor(1), torch.tensor(2)))
    assert [int(v) for v in _list(ds.map(lambda p: p.x + 10 * p.y))] == [21]
    assert [int(v) for v in _list(Dataset.from_tensors((1, 2)).map(lambda x, y: x + 10 * y))] == [21]
    (element,) = list(ds)
    assert type(element) is point


def test_map_returns_lists_as_tuples_and_numbers_as_float32_tensors():
    (element,) = list(Dataset.range(1).map(lambda x: [x, 0.5]))
    assert isinstance(element, tuple) and element[1].dtype == torch.float32


# ---- repeat, batch --------------------------------------------------------------------------------------


def test_repeat_zero_is_empty_and_negative_is_forever():
    assert _list(Dataset.range(3).repeat(0)) == []
    for count in (-1, -2, None):
        ds = Dataset.range(3).repeat(count)
        assert ds.cardinality() == -1
        it = iter(ds)
        assert [int(next(it)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert _list(Dataset.range(0).repeat()) == []


def test_batch_accepts_num_parallel_calls_and_deterministic():
    ds = Dataset.range(5).batch(2, num_parallel_calls=2, deterministic=False)
    assert [b.tolist() for b in _list(ds)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="num_parallel_calls=0"):
        Dataset.range(5).batch(2, num_parallel_calls=0)


def test_none_components_are_batched_as_none():
    # TF (batch_test.testNoneComponent): range(10).map(lambda x: (x, None)).batch(10) batches x, keeps None.
    (batch,) = list(Dataset.range(4).map(lambda x: (x, None)).batch(4))
    assert batch[0].tolist() == [0, 1, 2, 3] and batch[1] is None


# ---- shuffle without a seed -----------------------------------------------------------------------------


def test_unseeded_shuffle_is_reproducible_after_manual_seed_in_one_process():
    torch.manual_seed(7)
    first = [int(v) for v in Dataset.range(20).shuffle(20)]
    torch.manual_seed(7)
    again = [int(v) for v in Dataset.range(20).shuffle(20)]
    other = [int(v) for v in Dataset.range(20).shuffle(20)]
    assert first == again  # the same program after the same seed
    assert first != other  # a second shuffle in the program has its own order
    assert sorted(first) == list(range(20))


def test_unseeded_shuffle_resumes_exactly_on_its_saved_seed():
    # What a backup does: save the position and the shuffle seeds; a new process (another torch seed)
    # rebuilds the pipeline, reseeds it with the saved seeds and continues at the very next element.
    torch.manual_seed(3)
    dataset = Dataset.range(30).shuffle(10).batch(4).repeat(2)
    it = iter(dataset)
    for _ in range(5):
        next(it)
    state, seeds = it.state_dict(), [n.seed for n in dataset.node.nodes() if isinstance(n, Shuffle)]
    rest = [b.tolist() for b in it]

    torch.manual_seed(99)
    rebuilt = Dataset.range(30).shuffle(10).batch(4).repeat(2)
    for node, seed in zip([n for n in rebuilt.node.nodes() if isinstance(n, Shuffle)], seeds, strict=True):
        node.reseed(seed)
    resumed = iter(rebuilt)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest


# ---- as_numpy_iterator, threads, prefetch ----------------------------------------------------------------


def test_as_numpy_iterator_yields_numpy_structures():
    ds = Dataset.from_tensor_slices(({"a": [1, 2]}, np.array([0.5, 1.5], np.float32)))
    elements = list(ds.as_numpy_iterator())
    assert isinstance(elements[0], tuple) and isinstance(elements[0][0]["a"], np.ndarray)
    assert [(e[0]["a"].item(), e[1].item()) for e in elements] == [(1, 0.5), (2, 1.5)]
    assert elements[0][1].dtype == np.float32


def test_next_from_several_threads_yields_each_element_once():
    it = iter(Dataset.range(2000).map(lambda x: x + 0))
    seen: list[int] = []

    def read():
        for element in it:
            seen.append(int(element))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(seen) == list(range(2000))


def test_prefetch_computes_at_most_buffer_size_elements_ahead():
    computed: list[int] = []
    event = threading.Event()

    def fn(x):
        computed.append(int(x))
        if len(computed) >= 4:
            event.set()
        return x

    it = iter(Dataset.range(100).map(fn).prefetch(3))
    assert int(next(it)) == 0
    event.wait(timeout=10)
    assert not _grows_beyond(computed, 4)  # 0 taken, 1..3 buffered: nothing more until a slot frees
    it.close()


def _grows_beyond(values, n, seconds=0.3):
    event = threading.Event()
    event.wait(seconds)
    return len(values) > n


def test_batching_python_objects_names_the_type_and_the_fix():
    class Record:
        pass

    with pytest.raises(TypeError, match="Record objects.*Convert them to tensors in a map"):
        next(iter(Dataset.range(2).map(lambda x: Record()).batch(2)))


def test_zip_exposes_its_shuffles_and_refuses_a_per_replica_rewrite_by_name():
    # The zipped pipelines' shuffles are found like any other (distribution agrees on their seeds, backups
    # save them); rewriting below a zip per replica is refused with the fix instead of a bare LookupError.
    zipped = Dataset.zip((Dataset.range(4).shuffle(4), Dataset.range(4).batch(2)))
    assert sum(isinstance(n, Shuffle) for n in zipped.node.nodes()) == 1
    with pytest.raises(ValueError, match="Batch after the zip"):
        zipped.node.transform_chain(lambda node: None)
