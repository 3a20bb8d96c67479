"""Issue 25's points that involve a strategy (1, 2, 7), on 2 gloo workers: Keras 3's behaviour holds
under MultiWorkerMirroredStrategy (the one-process cases are in test_keras_fit_behaviour.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from tests._interrupt import StopAfterBatch
from tests._multiproc import run_distributed


def _data():
    x = np.arange(80, dtype="float32").reshape(40, 2) / 80
    y = (np.arange(40, dtype="float32").reshape(40, 1) / 40)
    return x, y


class _Stream(torch.utils.data.IterableDataset):
    """Finite, no __len__: ``batches`` global batches of 4 rows."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __iter__(self):
        x, y = _data()
        for i in range(self.batches):
            yield torch.from_numpy(x[4 * i:4 * i + 4]), torch.from_numpy(y[4 * i:4 * i + 4])


def _model(steps_per_execution: int = 1) -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Linear(2, 1))
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


class _Hooks(mf.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("train_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("train_end", batch))

    def on_test_begin(self, logs=None):
        self.calls.append("test_begin")

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_batch_end", batch))

    def on_test_end(self, logs=None):
        self.calls.append(("test_end", sorted(logs)))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict_begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_end", batch))


def _run(stream_batches, steps_per_epoch=None, steps_per_execution=1, validation=False, epochs=2):
    """One fit on data of unknown length (or arrays when stream_batches is None): its hooks, history,
    weights, evaluate and predict results, and the "ran out of data" warnings."""
    x, y = _data()
    model = _model(steps_per_execution)
    hooks = _Hooks()
    data = (torch.utils.data.DataLoader(_Stream(stream_batches), batch_size=None)
            if stream_batches is not None else x)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = model.fit(data, None if stream_batches is not None else y,
                            batch_size=None if stream_batches is not None else 4, epochs=epochs,
                            steps_per_epoch=steps_per_epoch, shuffle=False, verbose=0, callbacks=[hooks],
                            validation_data=(x[:16], y[:16]) if validation else None,
                            validation_batch_size=4 if validation else None)
    ran_out = len([w for w in record if "ran out of data" in str(w.message)])
    evaluated = model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[hooks], return_dict=True)
    predicted = model.predict(x, batch_size=4, verbose=0, callbacks=[hooks])
    return {"calls": hooks.calls, "history": history.history, "weights": model.get_weights(),
            "iterations": model.optimizer.iterations, "evaluate": evaluated, "predict": predicted,
            "ran_out": ran_out}


def _worker(rank: int, world: int, case: dict):
    with mf.MultiWorkerMirroredStrategy().scope():
        return _run(**case)


def _worker_uneven_streams(rank: int, world: int):
    """Each worker's own stream, of different lengths: they agree where the epoch ends."""
    with mf.MultiWorkerMirroredStrategy().scope():
        model = _model()
        loader = torch.utils.data.DataLoader(_Stream(5 if rank == 0 else 3), batch_size=None)
        history = model.fit(loader, epochs=2, verbose=0)
        return model.optimizer.iterations, len(history.history["loss"]), model.get_weights()


def _worker_stop(rank: int, world: int):
    x, y = _data()
    infinite = mf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(4)

    with mf.MultiWorkerMirroredStrategy().scope():
        model = _model()
        history = model.fit(infinite, epochs=3, verbose=0, callbacks=[StopAfterBatch(6)])
        return model.optimizer.iterations, history.epoch


def _compare(case: dict) -> list[dict]:
    single = _run(**case)
    results = run_distributed(_worker, world_size=2, args=(case,), timeout=240)
    for result in results:
        assert result["calls"] == single["calls"]
        assert result["iterations"] == single["iterations"] and result["ran_out"] == single["ran_out"]
        assert result["history"].keys() == single["history"].keys()
        for name, values in single["history"].items():
            np.testing.assert_allclose(result["history"][name], values, rtol=1e-5)
        for a, b in zip(result["weights"], single["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert result["evaluate"] == pytest.approx(single["evaluate"], rel=1e-5)
        np.testing.assert_allclose(result["predict"], single["predict"], rtol=1e-5)
    return results


def test_validation_test_hooks_on_two_workers():
    results = _compare({"stream_batches": None, "validation": True})
    once = ["test_begin", ("test_batch_begin", 0), ("test_batch_end", 0), ("test_batch_begin", 1),
            ("test_batch_end", 1), ("test_batch_begin", 2), ("test_batch_end", 2), ("test_batch_begin", 3),
            ("test_batch_end", 3), ("test_end", ["loss", "mae"])]
    calls = results[0]["calls"]
    first_epoch_end = calls.index(("epoch", 1))
    assert calls[first_epoch_end - len(once):first_epoch_end] == once


@pytest.mark.parametrize("steps_per_epoch", [None, 7])
def test_data_of_unknown_length_on_two_workers(steps_per_epoch):
    results = _compare({"stream_batches": 5, "steps_per_epoch": steps_per_epoch})
    assert results[0]["iterations"] == 10  # 5 batches an epoch, each epoch a fresh pass
    assert results[0]["ran_out"] == (1 if steps_per_epoch else 0)
    assert [c for c in results[0]["calls"] if c[0] == "train_end"] == [("train_end", i) for i in range(5)] * 2


def test_workers_with_streams_of_different_lengths_agree_where_the_epoch_ends():
    (it0, epochs0, w0), (it1, epochs1, w1) = run_distributed(_worker_uneven_streams, world_size=2, timeout=240)
    assert it0 == it1 == 6 and epochs0 == epochs1 == 2
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)


def test_infinite_data_stopped_by_a_callback_on_two_workers():
    # A stop asked for in on_train_batch_end reaches the other worker with the next step's reduction
    # (meshfit's loop): both stop together, one step later than one process does.
    assert run_distributed(_worker_stop, world_size=2, timeout=240) == [(8, [0]), (8, [0])]


def test_steps_per_execution_on_two_workers():
    results = _compare({"stream_batches": None, "steps_per_execution": 3, "steps_per_epoch": 9, "epochs": 4})
    calls = results[0]["calls"]
    assert [c for c in calls if c[0] == "train_end"] == [("train_end", i) for i in (2, 5, 8, 2)] * 2
    assert [c for c in calls if c[0] == "test_batch_end"] == [("test_batch_end", i) for i in (2, 5, 8, 11)]
    assert [c for c in calls if c[0] == "predict_end"] == [("predict_end", i) for i in (2, 5, 8, 11)]
