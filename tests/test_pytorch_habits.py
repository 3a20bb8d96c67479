"""PyTorch habits in ported Keras programs: chief-only calls, seeded DataLoaders, new batch sizes, file names.

Each test here failed on the code before these behaviours existed (checked when they were added):
a chief-only ``save``/``evaluate``/``predict`` hung ~17 s and died of a raw gloo error; a seeded
shuffling DataLoader trained in an order that was neither torch's nor the 2-worker one; a backup at
an epoch boundary refused a new batch size; ``save("model.h5")`` made a folder; ``load_model`` of a
``.keras`` file named a temporary folder; ``BackupAndRestore`` warned for every DataLoader.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zipfile

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepBegin
from _multiproc import run_distributed
from _procs import child_env, finish, free_ports, start, tf_config
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import meshfit as mf
from meshfit._storage import StateMismatchError

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "chief_only.py")


def _two_workers(out: str, *args: str) -> tuple[list[tuple[int, str]], float]:
    """Run the chief-only script on 2 TF_CONFIG workers; (exit code, output) each, and the seconds taken."""
    ports = free_ports(2)
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    procs = [start([SCRIPT, "--out", out, *args], child_env(TF_CONFIG=tf_config(ports, i))) for i in range(2)]
    results = [finish(proc, timeout=240) for proc in procs]
    return results, time.monotonic() - started


def _script_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 3, size=40)


# ---- 1. chief-only calls ---------------------------------------------------------------------------
def test_chief_only_save_evaluate_predict_of_a_replicated_model_work_without_the_others(tmp_path):
    out = str(tmp_path / "out")
    (code0, out0), (code1, out1) = _two_workers(out, "--calls", "save,save_keras,save_weights,evaluate,predict",
                                                "--all-save")[0]
    assert code0 == 0, out0
    assert code1 == 0, out1
    record = json.load(open(os.path.join(out, "chief.json")))
    assert "error" not in record, record
    # No collective inside: each call takes the time of its own work, not a peer's timeout.
    assert max(record["seconds"].values()) < 10, record["seconds"]
    with np.load(os.path.join(out, "chief.npz")) as f:
        weights = [f[f"w{i}"] for i in range(4)]
        predictions = f["predictions"]
    x, y = _script_data()
    local = mf.Model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    local.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    local.set_weights(weights)
    # The chief alone evaluated and predicted all of the data, as one process does.
    expected = local.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert record["logs"]["accuracy"] == pytest.approx(expected["accuracy"])
    assert record["logs"]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    np.testing.assert_allclose(predictions, local.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    # The files are what every worker's save gives: complete, loadable, the chief's weights.
    for name in ("model", "model.keras", "shared"):
        restored = mf.load_model(os.path.join(out, name))
        for a, b in zip(restored.get_weights(), weights, strict=True):
            np.testing.assert_array_equal(a, b)
    local.load_weights(os.path.join(out, "weights.safetensors"))
    assert not [p for p in os.listdir(out) if ".tmp" in p or ".old" in p]


def test_a_chief_only_save_of_sharded_weights_fails_at_once_naming_the_fix(tmp_path):
    out = str(tmp_path / "out")
    ((code0, out0), (code1, out1)), _ = _two_workers(out, "--calls", "save", "--sharded")
    assert code1 == 0, out1  # the other worker went on and ended; it is not blamed
    assert code0 == 3, out0  # the chief got meshfit's error, not a collective's
    record = json.load(open(os.path.join(out, "chief.json")))
    assert record["error"].startswith("EveryWorkerCallError: model.save needs every worker"), record
    assert "Call model.save on every worker" in record["error"], record
    assert "gloo" not in record["error"] and "Connection closed" not in record["error"]
    assert record["seconds"]["save"] < 10, record  # at once, not after a collective's timeout
    assert not os.path.exists(os.path.join(out, "model"))


def test_every_worker_saving_sharded_weights_on_one_path_still_writes_one_copy(tmp_path):
    out = str(tmp_path / "out")
    ((code0, out0), (code1, out1)), _ = _two_workers(out, "--all-save", "--sharded")
    assert code0 == 0, out0
    assert code1 == 0, out1
    assert sorted(os.listdir(os.path.join(out, "shared"))) == ["config.json", "model.safetensors",
                                                               "optimizer.safetensors"]
    assert mf.load_model(os.path.join(out, "shared")).count_params() == 6 * 8 + 8 + 8 * 3 + 3


def _predict_then_fit(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    x, y = _script_data()
    with strategy.scope():
        torch.manual_seed(rank)  # other initial weights per worker: fit must start from the chief's
        model = mf.Model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.predict(x[: 8 + 8 * rank], verbose=0)  # on this worker alone, each its own length
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return before.shape, model.get_weights()


def test_a_local_predict_before_fit_leaves_fit_its_distributed_placement():
    (shape0, w0), (shape1, w1) = run_distributed(_predict_then_fit, world_size=2, timeout=180)
    assert shape0 == (8, 3) and shape1 == (16, 3)
    x, y = _script_data()
    torch.manual_seed(0)  # the chief's initial weights, which the scope gave every worker
    single = mf.Model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    single.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    single.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for a, b, c in zip(w0, w1, single.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)  # fit ran with its data-parallel placement


# ---- 2. a seeded shuffling DataLoader ----------------------------------------------------------------
EXAMPLES = 48


def _examples() -> TensorDataset:
    ids = torch.arange(EXAMPLES, dtype=torch.float32)
    return TensorDataset(torch.stack([ids, torch.sin(ids)], dim=1), torch.arange(EXAMPLES) % 3)


def _seeded_loader() -> DataLoader:
    return DataLoader(_examples(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))


class _Recorder(nn.Module):
    """Remembers the example ids (column 0) of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(1, 3)
        self.batches: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.batches.append([int(i) for i in x[:, 0].tolist()])
        return self.linear(x[:, 1:])


def _fit_seeded(strategy=None, callbacks=(), epochs: int = 2):
    with strategy.scope() if strategy is not None else mf.OneDeviceStrategy("cpu").scope():
        recorder = _Recorder()
        model = mf.Model(recorder)
        model.compile(mf.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(_seeded_loader(), epochs=epochs, verbose=0, callbacks=list(callbacks))
    return model.get_weights(), recorder.batches


def _seeded_worker(rank: int, world: int):
    torch.manual_seed(100 + rank)  # each process's own global stream differs, as in a real job
    return _fit_seeded(mf.MultiWorkerMirroredStrategy())


def test_a_seeded_dataloader_trains_in_torchs_order_and_two_workers_match_one_process():
    weights, batches = _fit_seeded()
    loader = _seeded_loader()
    torch_order = [[int(i) for i in x[:, 0].tolist()] for _ in range(2) for x, _ in loader]
    assert batches == torch_order  # exactly what list(loader) gives, pass after pass
    (w0, b0), (w1, b1) = run_distributed(_seeded_worker, world_size=2, timeout=180)
    # each worker trained on its half of each of torch's global batches
    assert b0 == [batch[:4] for batch in torch_order] and b1 == [batch[4:] for batch in torch_order]
    for a, b, single in zip(w0, w1, weights, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, single, rtol=1e-5, atol=1e-6)


def test_a_seeded_dataloader_resumes_exactly_in_a_later_pass(tmp_path):
    uninterrupted, batches = _fit_seeded(epochs=3)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):  # a backup at step 9: pass 1, batch 3
        _fit_seeded(epochs=3, callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=9, async_save=False),
                                         InterruptAtStepBegin(11)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a map-style DataLoader resumes exactly: no warning
        resumed, resumed_batches = _fit_seeded(epochs=3, callbacks=[mf.callbacks.BackupAndRestore(backup)])
    assert resumed_batches == batches[9:]  # a fresh loader (its generator at pass 0) read pass 1 as saved
    for a, b in zip(resumed, uninterrupted, strict=True):
        np.testing.assert_array_equal(a, b)


# ---- 3. a new batch size at a pass boundary -------------------------------------------------------
def _digits_model() -> mf.Model:
    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10)))
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _digits(batch: int):
    (x, y), _ = mf.datasets.load_digits()
    return mf.data.Dataset.from_tensor_slices((x[:256], y[:256])).shuffle(256, seed=2).batch(batch)


def test_a_new_batch_size_at_an_epoch_boundary_continues_with_it(tmp_path, capfd):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):  # epoch 1 backed up (4 steps of 64), then stopped
        _digits_model().fit(_digits(64), epochs=3, verbose=0,
                            callbacks=[mf.callbacks.BackupAndRestore(backup, async_save=False), InterruptAtStepBegin(6)])
    capfd.readouterr()
    model = _digits_model()
    model.fit(_digits(32), epochs=3, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup)])
    assert model.loop_state.iterations == 4 + 2 * 8  # epochs 2 and 3 at 8 steps of 32
    lines = [line for line in capfd.readouterr().err.splitlines() if "new batching" in line]
    assert len(lines) == 1 and "global batch size: saved 64, now 32" in lines[0], lines


def test_a_new_batch_size_inside_a_pass_is_refused_with_the_fix(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="Interruption"):  # backed up at step 3 of the 4 in the pass
        _digits_model().fit(_digits(64), epochs=2, verbose=0,
                            callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=3, async_save=False),
                                       InterruptAtStepBegin(3)])
    with pytest.raises(StateMismatchError) as refused:
        _digits_model().fit(_digits(32), epochs=2, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup)])
    message = str(refused.value)
    assert "global batch size: saved 64, now 32" in message
    assert "the batch size may change at the start of a pass" in message, message


# ---- 4. smaller habits ------------------------------------------------------------------------------
def _tiny_model() -> mf.Model:
    model = mf.Model(nn.Linear(3, 2))
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 3), "float32"), np.zeros((4, 2), "float32"), verbose=0)
    return model


@pytest.mark.parametrize("name", ["model.h5", "model.hdf5"])
def test_save_to_an_h5_name_is_refused_instead_of_making_a_folder(tmp_path, name):
    with pytest.raises(ValueError, match=r"legacy HDF5 format \(\.h5/\.hdf5\). Use a `\.keras` extension"):
        _tiny_model().save(str(tmp_path / name))
    assert os.listdir(tmp_path) == []


def test_load_model_of_a_broken_keras_file_names_the_users_file(tmp_path):
    path = str(tmp_path / "x.keras")
    _tiny_model().save(path)
    with zipfile.ZipFile(path) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    entries["config.json"] = b"{not json"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    with pytest.raises(ValueError) as refused:
        mf.load_model(path)
    message = str(refused.value)
    assert f"{path!r} is not a complete meshfit model" in message, message
    assert "meshfit-keras-" not in message and "config.json" in message, message


class _Stream(IterableDataset):
    def __iter__(self):
        for i in range(16):
            yield torch.tensor([float(i), 0.5]), torch.tensor(i % 3)


def _backed_up_fit(loader, backup: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mf.Model(nn.Sequential(nn.Linear(2, 3)))
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(loader, epochs=1, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup)])
    return [str(w.message) for w in caught if "BackupAndRestore" in str(w.message)]


def test_backup_and_restore_warns_only_where_a_loader_resume_is_not_exact(tmp_path):
    data = TensorDataset(torch.rand(16, 2), torch.arange(16) % 3)
    for i, loader in enumerate([DataLoader(data, batch_size=4), DataLoader(data, batch_size=4, shuffle=True),
                                _seeded_loader()]):
        assert _backed_up_fit(loader, str(tmp_path / f"map-{i}")) == []
    warned = _backed_up_fit(DataLoader(_Stream(), batch_size=4), str(tmp_path / "stream"))
    assert len(warned) == 1 and "exact only if it yields the same order again" in warned[0], warned
