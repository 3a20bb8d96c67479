"""Multi-worker training with real processes (gloo on localhost): equivalence, TF_CONFIG, launch, Mirrored."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import torch
from _interrupt import InterruptAtStepEnd
from _multiproc import run_distributed
from _procs import child_env, finish, free_ports, start, tf_config
from _script_outputs import assert_ranks_saved, read_weights
from _tutorial_paths import is_chief
from torch import nn

import meshfit as mf

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "train_digits.py")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _train_50_steps(strategy: mf.distribute.Strategy) -> list[np.ndarray]:
    (x, y), _ = mf.datasets.load_digits()
    dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=5).repeat().batch(128)
    with strategy.scope():
        model = mf.Model(_mlp())
        model.compile(mf.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(dataset, epochs=5, steps_per_epoch=10, verbose=0)
    return model.get_weights(), history.history


def _worker_50_steps(rank: int, world: int):
    return _train_50_steps(mf.MultiWorkerMirroredStrategy())


def test_two_workers_equal_one_process_on_the_same_global_batch():
    single, single_history = _train_50_steps(mf.OneDeviceStrategy("cpu"))
    results = run_distributed(_worker_50_steps, world_size=2, timeout=180)
    (w0, h0), (w1, h1) = results
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)  # replicas hold identical weights
    for a, b in zip(w0, single, strict=True):
        rel = np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)
        assert rel <= 1e-5, rel
    # Metrics are aggregated over replicas: the same as on one process.
    np.testing.assert_allclose(h0["accuracy"], single_history["accuracy"], atol=1e-6)
    np.testing.assert_allclose(h0["loss"], single_history["loss"], rtol=1e-4)
    assert h0 == h1


def _worker_inputs(rank: int, world: int, tmp: str):
    strategy = mf.MultiWorkerMirroredStrategy()
    seen = []

    def dataset_fn(context: mf.InputContext):
        seen.append(context)
        batch = context.get_per_replica_batch_size(8)
        return mf.data.Dataset.range(16).shard(context.num_input_pipelines, context.input_pipeline_id).batch(batch)

    per_replica = strategy.distribute_datasets_from_function(dataset_fn)
    from_fn = [b.tolist() for b in per_replica]
    global_ds = mf.data.Dataset.range(10).batch(4)
    data_split = [b.tolist() for b in strategy.experimental_distribute_dataset(global_ds)]
    off = global_ds.with_options(mf.data.Options(auto_shard_policy=mf.data.AutoShardPolicy.OFF))
    off_split = [b.tolist() for b in strategy.experimental_distribute_dataset(off)]
    total = strategy.reduce("SUM", torch.tensor(float(rank + 1)))
    mean = strategy.reduce(mf.ReduceOp.MEAN, torch.tensor([float(rank), 2.0 * rank]), axis=0)

    # Evaluate / predict are distributed; predict returns everything, in input order, everywhere.
    (x, y), _ = mf.datasets.load_digits()
    x, y = x[:101], y[:101]
    with strategy.scope():
        model = mf.Model(_mlp())
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    logs = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    predictions = model.predict(x, batch_size=32, verbose=0)
    # Every worker saves to the same path: one complete copy, nobody deadlocks.
    model.save(os.path.join(tmp, "shared-model"))
    model.save_weights(os.path.join(tmp, "weights.safetensors"))
    return {"contexts": [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in seen],
            "from_fn": from_fn, "data": data_split, "off": off_split, "sum": float(total),
            "mean": mean.tolist(), "logs": logs, "predictions": predictions, "chief": strategy.is_chief}


def test_inputs_reductions_evaluate_predict_and_save_across_workers(tmp_path):
    r0, r1 = run_distributed(_worker_inputs, world_size=2, args=(str(tmp_path),), timeout=180)
    assert r0["contexts"] == [(2, 0, 2)] and r1["contexts"] == [(2, 1, 2)]
    assert r0["from_fn"] == [[0, 2, 4, 6], [8, 10, 12, 14]] and r1["from_fn"] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    # DATA: each global batch is cut in two; the last, partial batch too.
    assert r0["data"] == [[0, 1], [4, 5], [8]] and r1["data"] == [[2, 3], [6, 7], [9]]
    # OFF: every replica reads the same per-replica batches.
    assert r0["off"] == r1["off"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert r0["sum"] == r1["sum"] == 3.0
    assert r0["mean"] == pytest.approx(0.75)  # mean of [0, 0] and [1, 2], over the axis and replicas
    (x, y), _ = mf.datasets.load_digits()
    single = mf.Model(_mlp())
    single.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"])
    expected = single.evaluate(x[:101], y[:101], batch_size=32, verbose=0, return_dict=True)
    assert r0["logs"] == r1["logs"]
    assert r0["logs"]["accuracy"] == pytest.approx(expected["accuracy"])
    assert r0["logs"]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    np.testing.assert_allclose(r0["predictions"], single.predict(x[:101], verbose=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(r0["predictions"], r1["predictions"])
    assert r0["chief"] and not r1["chief"]
    assert sorted(os.listdir(tmp_path / "shared-model")) == ["config.json", "model.safetensors", "optimizer.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p or ".old" in p]
    restored = mf.load_model(str(tmp_path / "shared-model"))
    np.testing.assert_allclose(restored.predict(x[:101], verbose=0), r0["predictions"], rtol=1e-6, atol=1e-6)


def _worker_bad_batch(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    with pytest.raises(ValueError, match="global batch size 7 is not divisible by the 2 replicas"):
        strategy.experimental_distribute_dataset(mf.data.Dataset.range(20).batch(7))
    return True


def test_global_batch_not_divisible_is_a_clear_error():
    assert run_distributed(_worker_bad_batch, world_size=2, timeout=120) == [True, True]


def test_tutorial_flow_with_tf_config_two_separate_processes(tmp_path):
    ports = free_ports(2)
    out = str(tmp_path / "out")
    args = [SCRIPT, "--out", out, "--epochs", "2", "--steps", "4"]
    # As in the tutorial: worker 0 in the background, then worker 1 in the foreground.
    background = start(args, child_env(TF_CONFIG=tf_config(ports, 0)))
    try:
        foreground = start(args, child_env(TF_CONFIG=tf_config(ports, 1)))
        code1, out1 = finish(foreground, timeout=180)
    finally:
        code0, out0 = finish(background, timeout=60)
    assert code0 == 0, out0
    assert code1 == 0, out1
    assert "Epoch 2/2" in out0 and "Epoch" not in out1  # progress from the chief only
    assert "rank 0 of 2 done" in out0 and "rank 1 of 2 done" in out1
    assert_ranks_saved(out, [1], read_weights(out, 0))


def test_meshfit_launch_runs_the_same_script(tmp_path):
    out = str(tmp_path / "out")
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", SCRIPT, "--out", out,
                  "--epochs", "1", "--steps", "3"], child_env())
    code, output = finish(proc, timeout=180)
    assert code == 0, output
    assert "[worker 0]" in output and "[worker 1] rank 1 of 2 done (task worker 1, chief False)" in output
    assert_ranks_saved(out, [1], read_weights(out, 0))


def test_mirrored_strategy_from_a_plain_script_starts_its_second_replica(tmp_path):
    out = str(tmp_path / "out")
    proc = start([SCRIPT, "--strategy", "mirrored", "--out", out, "--epochs", "1", "--steps", "3"], child_env())
    code, output = finish(proc, timeout=180)
    assert code == 0, output
    assert "rank 0 of 2 done" in output and "rank 1 of 2 done" in output
    # strategy.cluster_resolver: each replica process is a worker of the job; only replica 0 is chief
    assert "rank 0 of 2 done (task worker 0, chief True)" in output, output
    assert "rank 1 of 2 done (task worker 1, chief False)" in output, output
    # the second replica's output is prefixed, as meshfit launch prefixes its workers'
    # (replica 0 is this process: its own prints are not redirected, so lines may interleave)
    assert output.count("rank 1 of 2 done") == output.count("[replica 1] rank 1 of 2 done") == 1, output
    assert_ranks_saved(out, [1], read_weights(out, 0))


def test_mirrored_strategy_single_device_and_bad_devices():
    assert mf.MirroredStrategy(devices=["cpu:0"]).num_replicas_in_sync == 1
    for strategy in (mf.MirroredStrategy(devices=["cpu:0"]), mf.OneDeviceStrategy("cpu"), mf.get_strategy()):
        resolver = strategy.cluster_resolver  # SPEC: cluster_resolver.task_type/task_id on every strategy
        assert (resolver.task_type, resolver.task_id, resolver.is_chief) == (None, None, True), strategy
    assert mf.MirroredStrategy().num_replicas_in_sync == max(1, torch.cuda.device_count())
    with pytest.raises(ValueError, match="tpu:0"):
        mf.MirroredStrategy(devices=["tpu:0"])
    with pytest.raises(ValueError, match="devices="):
        mf.MirroredStrategy(devices="cpu:0")


def test_nccl_without_gpus_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    from meshfit.distribute._collective import choose_backend

    options = mf.CommunicationOptions(implementation=mf.CommunicationImplementation.NCCL)
    with pytest.raises(ValueError, match="NCCL needs GPUs"):
        choose_backend(options)
    assert choose_backend(mf.CommunicationOptions()) == "gloo"
    with pytest.raises(ValueError, match="timeout_seconds=-1"):
        mf.CommunicationOptions(timeout_seconds=-1)


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout_seconds": float("nan")}, "Invalid `timeout_seconds`: expected a finite number, received timeout_seconds=nan"),
    ({"timeout_seconds": float("inf")}, "Invalid `timeout_seconds`: expected a finite number, received timeout_seconds=inf"),
    ({"heartbeat_timeout_seconds": float("nan")}, "Invalid `heartbeat_timeout_seconds`: expected a finite number"),
    ({"heartbeat_timeout_seconds": float("inf")}, "Invalid `heartbeat_timeout_seconds`: expected a finite number"),
    ({"heartbeat_timeout_seconds": 1}, "Invalid `heartbeat_timeout_seconds`: expected a number >= 2"),
])
def test_communication_options_refuse_non_finite_timeouts(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        mf.CommunicationOptions(**kwargs)


def test_without_a_cluster_the_resolver_is_tensorflows_single_worker(monkeypatch):
    # TF's MultiWorkerMirroredStrategy without TF_CONFIG reports task_type None and task_id None;
    # the tutorial's _is_chief has a case for it ("effectively run with only a single worker").
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS"):
        monkeypatch.delenv(name, raising=False)
    strategy = mf.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    assert isinstance(resolver, mf.cluster.SingleProcessClusterResolver)
    assert (resolver.task_type, resolver.task_id, resolver.rank, resolver.world_size) == (None, None, 0, 1)
    assert resolver.cluster_spec().as_dict() == {} and "chief" not in resolver.cluster_spec().as_dict()
    assert is_chief(resolver.task_type, resolver.task_id) and resolver.is_chief
    config = mf.estimator.RunConfig(train_distribute=strategy)  # TF's RunConfig alone: worker 0, chief
    assert (config.task_type, config.task_id, config.is_chief, config.cluster_spec) == ("worker", 0, True, {})


def _worker_resolver(rank: int, world: int):
    resolver = mf.MultiWorkerMirroredStrategy().cluster_resolver  # a group the harness initialised
    return resolver.task_type, resolver.task_id, resolver.rank, resolver.world_size, resolver.is_chief


def test_a_user_initialised_group_still_has_a_resolver():
    results = run_distributed(_worker_resolver, world_size=2, timeout=120)
    assert results == [("worker", 0, 0, 2, True), ("worker", 1, 1, 2, False)]


def test_malformed_tf_config_fails_before_any_socket(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 3}}')
    with pytest.raises(ValueError, match="index"):
        mf.MultiWorkerMirroredStrategy()
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG"):
        mf.MultiWorkerMirroredStrategy()
    assert sys.modules.get("torch.distributed").is_initialized() is False


def test_the_same_script_under_torchrun(tmp_path):
    out = str(tmp_path / "out")
    (port,) = free_ports(1)
    proc = start(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(port), SCRIPT, "--out", out, "--epochs", "1", "--steps", "3"], child_env())
    code, output = finish(proc, timeout=180)
    assert code == 0, output
    assert "rank 1 of 2 done" in output
    assert_ranks_saved(out, [1], read_weights(out, 0))


def test_launch_with_an_evaluator_task_evaluates_every_checkpoint(tmp_path):
    out, checkpoints = str(tmp_path / "out"), str(tmp_path / "ckpts")
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "2", "--evaluator", "--preload", SCRIPT, "--out", out,
                  "--epochs", "2", "--steps", "3", "--checkpoint-dir", checkpoints], child_env())
    code, output = finish(proc, timeout=180)
    assert code == 0, output
    assert "[evaluator 0] SidecarEvaluator: ckpt-" in output, output
    assert "[evaluator 0] evaluated" in output and "ckpt-2" in output.split("[evaluator 0] evaluated")[1]
    assert sorted(os.listdir(checkpoints)) == ["ckpt-1", "ckpt-2"]  # one copy each, from all workers


class _OwnTrainStep(mf.Model):
    """A Keras-style override that knows nothing of replicas or batch shares."""

    def train_step(self, data):
        xb, yb = data
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self(xb), yb).backward()
        self.optimizer.step()


def _train_uneven(strategy: mf.distribute.Strategy, model_class: type = mf.Model) -> list[np.ndarray]:
    (x, y), _ = mf.datasets.load_digits()
    # 101 examples in global batches of 32: the last batch has 5 rows, split 2 + 3 across 2 replicas.
    dataset = mf.data.Dataset.from_tensor_slices((x[:101], y[:101])).shuffle(101, seed=1).batch(32)
    with strategy.scope():
        model = model_class(_mlp())
        model.compile(mf.optimizers.SGD(learning_rate=0.1),
                      mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(dataset, epochs=3, verbose=0)
    return model.get_weights()


def _worker_uneven(rank: int, world: int, model_class: type = mf.Model):
    return _train_uneven(mf.MultiWorkerMirroredStrategy(), model_class)


@pytest.mark.parametrize("model_class", [mf.Model, _OwnTrainStep], ids=["default_train_step", "user_train_step"])
def test_uneven_last_batch_still_matches_one_process(model_class):
    single = _train_uneven(mf.OneDeviceStrategy("cpu"), model_class)
    w0, w1 = run_distributed(_worker_uneven, world_size=2, args=(model_class,), timeout=180)
    for a, b, c in zip(w0, w1, single, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def _worker_review_cases(rank: int, world: int, tmp: str):
    import time

    strategy = mf.MultiWorkerMirroredStrategy()
    (x, y), _ = mf.datasets.load_digits()

    class Custom(mf.Model):  # Keras-style override: self(x) must still all-reduce gradients
        def train_step(self, data):
            xb, yb = data
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self(xb), yb).backward()
            self.optimizer.step()

    class ChiefStops(mf.callbacks.Callback):  # only the chief asks to stop: nobody may hang
        def on_train_batch_end(self, batch, logs=None):
            if self.model.strategy.is_chief and batch == 1:
                self.model.stop_training = True

    with strategy.scope():
        model = Custom(_mlp())
        model.compile(mf.optimizers.SGD(learning_rate=0.5), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:256], y[:256], batch_size=32, epochs=2, verbose=0, callbacks=[ChiefStops()])
    steps = model.loop_state.iterations
    # Replicas with different numbers of batches (FILE sharding of 3 files) get a clear error.
    for i, n in enumerate((64, 64, 64)):
        np.savez(os.path.join(tmp, f"part{i}.npz"), x=x[i * n:(i + 1) * n], y=y[i * n:(i + 1) * n])
    files = mf.data.Dataset.list_files(os.path.join(tmp, "part*.npz")).batch(32)
    with pytest.raises(ValueError, match="different numbers of batches"):
        model.fit(files, verbose=0)
    # A user error inside fit surfaces at once (not after waiting for a dead-peer verdict).
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        model.fit(x[:64, :4], y[:64], batch_size=32, verbose=0)
    return model.get_weights(), steps, time.monotonic() - started


def test_override_chief_only_stop_uneven_files_and_fast_user_errors(tmp_path):
    (w0, steps0, t0), (w1, steps1, t1) = run_distributed(_worker_review_cases, world_size=2,
                                                         args=(str(tmp_path),), timeout=180)
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)
    assert steps0 == steps1 == 3  # the chief's stop at batch 1 reached the other replica one step later
    assert t0 < 4 and t1 < 4


def _worker_resume_logs(rank: int, world: int, backup_dir: str):
    """An uninterrupted run, then the same run interrupted mid-epoch and resumed in the same process."""
    strategy = mf.MultiWorkerMirroredStrategy()
    (x, y), _ = mf.datasets.load_digits()

    def run(callbacks):
        data = mf.data.Dataset.from_tensor_slices((x[:320], y[:320])).shuffle(320, seed=3).batch(64)
        with strategy.scope():
            model = mf.Model(_mlp())
            model.compile(mf.optimizers.Adam(learning_rate=0.01),
                          mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model, model.fit(data, epochs=3, verbose=0, callbacks=callbacks)

    _, uninterrupted = run([])
    with pytest.raises(RuntimeError, match="Interruption"):  # step 7: inside the second epoch (5 steps each)
        run([InterruptAtStepEnd(7), mf.callbacks.BackupAndRestore(backup_dir, save_freq=1)])
    model, resumed = run([mf.callbacks.BackupAndRestore(backup_dir, save_freq=1)])
    return uninterrupted.history, resumed.history, model.get_weights()


def test_a_mid_epoch_resume_on_two_workers_logs_the_uninterrupted_epoch_metrics(tmp_path):
    # Each replica's metric accumulators are its own share of the epoch: a backup that kept only
    # rank 0's copy would resume the epoch with half the sums and log a different loss.
    (full0, resumed0, w0), (full1, resumed1, w1) = run_distributed(
        _worker_resume_logs, world_size=2, args=(str(tmp_path / "backup"),), timeout=240)
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)
    assert full0 == full1
    # History's own state is in the backup: the resumed fit's history holds all three epochs, the
    # interrupted second one included, with exactly the uninterrupted values.
    assert resumed0 == resumed1
    for name in ("loss", "accuracy"):
        assert len(resumed0[name]) == 3 and resumed0[name] == full0[name], name


def _worker_different_steps(rank: int, world: int, save_freq: int):
    import time

    strategy = mf.MultiWorkerMirroredStrategy()
    (x, y), _ = mf.datasets.load_digits()
    data = mf.data.Dataset.from_tensor_slices((x[:256], y[:256])).repeat().batch(32)
    with strategy.scope():
        model = mf.Model(_mlp())
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    started = time.monotonic()
    try:
        model.fit(data, epochs=1, steps_per_epoch=3 + rank, verbose=0,
                  callbacks=[mf.callbacks.BackupAndRestore(f"/tmp/unused-{os.getpid()}", save_freq=save_freq + rank)])
    except ValueError as error:
        return str(error), time.monotonic() - started
    return None, time.monotonic() - started


def test_settings_that_differ_between_workers_fail_at_once_naming_each_value():
    results = run_distributed(_worker_different_steps, world_size=2, args=(5,), timeout=120)
    for message, seconds in results:
        assert message is not None and seconds < 5, (message, seconds)
        assert "steps_per_epoch: worker 0 has 3, worker 1 has 4" in message, message
        assert "every_steps=5" in message and "every_steps=6" in message, message


def _worker_50_steps_with(rank: int, world: int, options: dict):
    return _train_50_steps(mf.MultiWorkerMirroredStrategy(communication_options=mf.CommunicationOptions(**options)))


def test_small_gradient_packs_are_bitwise_the_default_and_bfloat16_compression_is_close():
    exact = run_distributed(_worker_50_steps, world_size=2, timeout=180)[0][0]
    packed = run_distributed(_worker_50_steps_with, world_size=2, args=({"bytes_per_pack": 1024},), timeout=180)
    for a, b in zip(packed[0][0], exact, strict=True):
        np.testing.assert_array_equal(a, b)  # packing changes when sums start, not what they add
    w0, w1 = (weights for weights, _ in run_distributed(
        _worker_50_steps_with, world_size=2, args=({"gradient_compression": "bfloat16"},), timeout=180))
    differs = False
    for a, b, c in zip(w0, w1, exact, strict=True):
        np.testing.assert_array_equal(a, b)  # the replicas still agree bitwise
        # 50 steps of bfloat16-rounded gradients (momentum 0.9): close as a whole, not element by element
        assert np.linalg.norm(a - c) <= 1e-2 * np.linalg.norm(c), np.linalg.norm(a - c) / np.linalg.norm(c)
        differs = differs or not np.array_equal(a, c)
    assert differs  # the compression really ran: float32 and bfloat16 all-reduces round differently


@pytest.mark.parametrize("kwargs, match", [
    ({"bytes_per_pack": -1}, "Invalid `bytes_per_pack`: expected an int >= 0, received bytes_per_pack=-1"),
    ({"gradient_compression": "int8"},
     "Invalid `gradient_compression`: expected one of None, 'bfloat16', received gradient_compression='int8'"),
])
def test_communication_options_refuse_bad_packs_and_compression(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        mf.CommunicationOptions(**kwargs)
    assert "gradient_compression='bfloat16'" in repr(mf.CommunicationOptions(gradient_compression="bfloat16"))


def _worker_different_compression(rank: int, world: int):
    import time

    options = mf.CommunicationOptions(gradient_compression="bfloat16" if rank else None)
    started = time.monotonic()
    try:
        _train_50_steps(mf.MultiWorkerMirroredStrategy(communication_options=options))
    except ValueError as error:
        return str(error), time.monotonic() - started
    return None, time.monotonic() - started


def test_communication_options_that_differ_between_workers_fail_at_once():
    for message, seconds in run_distributed(_worker_different_compression, world_size=2, timeout=120):
        assert message is not None and seconds < 10, (message, seconds)
        assert "communication_options" in message and "gradient_compression='bfloat16'" in message, message
