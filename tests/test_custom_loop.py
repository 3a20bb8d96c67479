"""Custom training loops under a strategy follow TensorFlow's semantics (issue 10), on real gloo workers.

The seed's custom loop (tests/scripts/custom_loop.py) runs under ``meshfit launch``: replicas stay
identical, equal one process on the same global batch, report the same global accuracy, and a job
killed with SIGKILL at a random step resumes from its ``CheckpointManager`` bitwise equal.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from _procs import child_env, finish, free_ports, start, tf_config
from _script_outputs import assert_ranks_saved, read_weights
from torch import nn

import meshfit as mf

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "custom_loop.py")
# 3 epochs of 7 steps: 21 steps; per-worker batch 16, global batch 32.
COMMON = ["--epochs", "3", "--steps-per-epoch", "7", "--learning-rate", "0.01"]


def _launch(out: str, workers: int, *extra: str, restarts: int = 0, preload: bool = False) -> str:
    proc = start(["-m", "meshfit._cli", "launch", "--workers", str(workers), "--max-restarts", str(restarts),
                  *(["--preload"] if preload else []), SCRIPT, "--out", out, *COMMON, *extra], child_env())
    code, output = finish(proc, timeout=240)
    assert code == 0, output
    return output


def _log(out: str, rank: int) -> list[dict]:
    with open(os.path.join(out, f"log-{rank}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("two"))
    _launch(out, 2)
    return out


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("one"))
    _launch(out, 1, "--workers-batch", "2")  # one worker on the two workers' global batch (2 x 16)
    return out


def test_seed_custom_loop_on_two_workers_equals_one_process(two_workers, one_worker):
    single = one_worker
    w0, w1, ref = read_weights(two_workers, 0), read_weights(two_workers, 1), read_weights(single, 0)
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)  # the replicas' weights stay identical
    for a, b in zip(w0, ref, strict=True):
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel <= 1e-5, rel  # 21 steps: N replicas == 1 process on the global batch
    log0, log1, log_single = _log(two_workers, 0), _log(two_workers, 1), _log(single, 0)
    # train_accuracy.result() is global: the same on every worker, and the one process's value ...
    assert [e["accuracy"] for e in log0] == [e["accuracy"] for e in log1]
    np.testing.assert_allclose([e["accuracy"] for e in log0], [e["accuracy"] for e in log_single], atol=1e-12)
    # ... while each worker's own share differs (so result() really combined them).
    assert [e["local_accuracy"] for e in log0] != [e["local_accuracy"] for e in log1]
    # strategy.reduce(SUM, compute_average_loss(...)) is the global batch's mean loss.
    np.testing.assert_allclose([e["loss"] for e in log0], [e["loss"] for e in log_single], rtol=1e-5)


def test_seed_custom_loop_runs_as_a_plain_process_like_one_launched_worker(one_worker, tmp_path):
    # `python custom_loop.py` with no TF_CONFIG: the tutorial's single-worker case. Its
    # `strategy.cluster_resolver.task_type` is None, which its _is_chief counts as the chief.
    out = str(tmp_path / "plain")
    os.makedirs(out)
    code, output = finish(start([SCRIPT, "--out", out, *COMMON, "--workers-batch", "2"], child_env()), timeout=120)
    assert code == 0, output
    assert "Epoch: 2, accuracy:" in output, output  # printed by the chief only
    assert_ranks_saved(out, [0], read_weights(one_worker, 0))


def test_seed_custom_loop_killed_at_a_random_step_resumes_bitwise(two_workers, tmp_path):
    step = random.Random().randint(2, 20)
    out = str(tmp_path / "killed")
    output = _launch(out, 2, "--kill-at", str(step), "--kill-rank", str(step % 2), restarts=1, preload=True)
    assert "restarting the group" in output, output
    assert ("resuming from" in output) == (step > 7), (step, output)  # a checkpoint after each epoch
    assert_ranks_saved(out, (0, 1), read_weights(two_workers, 0), err_msg=f"killed at step {step}")
    assert _log(out, 0)[-1] == _log(two_workers, 0)[-1]


def test_a_dead_peer_in_the_custom_loop_is_named(tmp_path):
    # Item 10: strategy.run / reduce / metric results run inside the strategy's guard, so the
    # survivor reports which worker stopped instead of a raw gloo "Connection closed by peer".
    ports = free_ports(2)
    args = [SCRIPT, "--out", str(tmp_path), *COMMON, "--kill-at", "5", "--kill-rank", "1"]
    survivor = start(args, child_env(TF_CONFIG=tf_config(ports, 0)))
    victim = start(args, child_env(TF_CONFIG=tf_config(ports, 1)))
    try:
        code, output = finish(survivor, timeout=120)
    finally:
        finish(victim, timeout=30)
    assert code != 0, output
    assert "PeerFailureError: Worker 1 stopped" in output, output


# ---- the contract, piece by piece, on 2 gloo processes -------------------------------------------
def _grads_are_summed(rank: int, world: int):
    torch.manual_seed(rank)  # different seeds: the scope must still start the replicas equal
    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        module = nn.Linear(3, 1)
        optimizer = mf.optimizers.SGD(learning_rate=1.0)
    start_weight = module.weight.detach().clone()
    optimizer.build(module.parameters())
    x = torch.full((2, 3), float(rank + 1))
    # inside strategy.run the default global batch is 2 examples x 2 replicas
    loss = strategy.run(lambda: mf.nn.compute_average_loss(module(x).squeeze(1)))
    strategy.experimental_local_results(loss)[0].backward()
    local = module.weight.grad.clone()
    optimizer.step()
    summed = module.weight.grad.clone()
    # apply_gradients: TF's form, with gradients from autograd.grad
    grads = torch.autograd.grad(mf.nn.compute_average_loss(module(x).squeeze(1), global_batch_size=4),
                                list(module.parameters()))
    optimizer.apply_gradients(zip(grads, module.parameters(), strict=True))
    return [t.numpy() for t in (start_weight, local, summed, module.weight.detach().clone())] + [optimizer.iterations]


def test_optimizer_sums_gradients_of_parameters_created_in_the_scope():
    (s0, l0, g0, w0, it0), (s1, l1, g1, w1, it1) = run_distributed(_grads_are_summed, timeout=120)
    np.testing.assert_array_equal(s0, s1)  # rank 0's initial weights were broadcast
    np.testing.assert_allclose(l0, np.full((1, 3), 0.5))  # sum(x)/global batch: 2*1/4
    np.testing.assert_allclose(l1, np.full((1, 3), 1.0))
    np.testing.assert_allclose(g0, l0 + l1)  # SUM, not mean
    np.testing.assert_allclose(g1, l0 + l1)
    np.testing.assert_array_equal(w0, w1)
    assert it0 == it1 == 2


def _per_replica_values(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        metric = mf.metrics.SparseCategoricalAccuracy()

    def step_fn(v):
        metric.update_state(torch.tensor([rank, 0]), torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
        return v * (rank + 1), {"n": torch.tensor(float(rank))}

    value, extra = strategy.run(step_fn, args=(torch.tensor([1.0, 2.0]),))
    local = strategy.experimental_local_results(value)
    total = strategy.reduce(mf.ReduceOp.SUM, value, axis=None)
    mean = strategy.reduce("MEAN", value, axis=0)
    n = strategy.reduce("SUM", extra["n"], axis=None)
    average = mf.nn.compute_average_loss(torch.ones(3))  # default: 3 per replica x 2 replicas
    with strategy.scope():
        inside = strategy.run(lambda: mf.nn.compute_average_loss(torch.ones(3)))
    return (type(value).__name__, [t.tolist() for t in local], total.tolist(), float(mean), float(n),
            float(metric.result()), float(metric.local_result()), float(average),
            float(strategy.reduce("SUM", inside)))


def test_run_returns_per_replica_values_that_reduce_combines():
    r0, r1 = run_distributed(_per_replica_values, timeout=120)
    assert r0[0] == "PerReplica"
    assert r0[1] == [[1.0, 2.0]] and r1[1] == [[2.0, 4.0]]  # this process's values
    assert r0[2] == r1[2] == [3.0, 6.0]
    assert r0[3] == r1[3] == pytest.approx(9.0 / 4)  # MEAN over axis 0 of every replica's values
    assert r0[4] == r1[4] == 1.0
    # accuracy: rank 0 gets 2/2 right, rank 1 gets 1/2: global 3/4 on both, local differs
    assert r0[5] == r1[5] == 0.75
    assert (r0[6], r1[6]) == (1.0, 0.5)
    assert r0[7] == 1.0  # outside run/scope: the default strategy, 1 replica
    assert r0[8] == r1[8] == pytest.approx(1.0)  # 3/6 per replica, summed over 2


def _model_outside_scope(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    errors = []
    model = mf.Model(nn.Linear(2, 1))  # outside the scope
    model.compile("sgd", "mse")
    try:
        model.fit(np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"), verbose=0)
    except ValueError as error:
        errors.append(str(error))
    module = nn.Linear(2, 1)
    with strategy.scope():
        optimizer = mf.optimizers.SGD(0.1)
    module(torch.ones(1, 2)).sum().backward()
    try:
        optimizer.apply_gradients((p.grad, p) for p in module.parameters())
    except ValueError as error:
        errors.append(str(error))
    with strategy.scope():  # the fix the message names
        model = mf.Model(nn.Linear(2, 1))
        model.compile("sgd", "mse")
    model.fit(np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"), verbose=0)
    return errors


def test_a_model_created_outside_the_scope_does_not_train_silently():
    errors, _ = run_distributed(_model_outside_scope, timeout=120)
    assert len(errors) == 2, errors
    for message in errors:
        assert "outside `strategy.scope()`" in message and "with strategy.scope():" in message
        assert "in this process" not in message  # the replicas are processes


def test_compile_under_another_strategys_scope_is_an_error():
    model = mf.Model(nn.Linear(2, 1))
    with mf.OneDeviceStrategy("cpu").scope(), pytest.raises(ValueError, match="with strategy.scope"):
        model.compile("sgd", "mse")
    model.compile("sgd", "mse")  # outside every scope, under the strategy it was made in: fine


def _fit_is_not_reduced_twice(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = mf.Model(nn.Linear(2, 1, bias=False))
        model.compile(mf.optimizers.SGD(learning_rate=1.0), "mse")
    start_weight = model.module.weight.detach().clone()
    x = np.ones((4, 2), "float32")
    model.fit(x, np.zeros((4, 1), "float32"), batch_size=4, shuffle=False, verbose=0)
    return start_weight.numpy(), model.module.weight.detach().numpy().copy()


def test_fit_gradients_are_reduced_once():
    (s0, w0), (s1, w1) = run_distributed(_fit_is_not_reduced_twice, timeout=120)
    # mse of w.x on ones: grad = 2 * (w.1) * 1 per example; the mean over the global batch.
    expected = s0 - 2.0 * s0.sum()
    np.testing.assert_allclose(w0, expected, rtol=1e-6)
    np.testing.assert_allclose(w1, expected, rtol=1e-6)


# ---- one process ---------------------------------------------------------------------------------
def test_compute_average_loss_and_scale_regularization_loss():
    per_example = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert float(mf.nn.compute_average_loss(per_example)) == 3.0
    assert float(mf.nn.compute_average_loss(per_example, global_batch_size=8)) == 1.5
    weighted = mf.nn.compute_average_loss(per_example, sample_weight=torch.tensor([1.0, 0.0, 0.0, 0.5]),
                                          global_batch_size=4)
    assert float(weighted) == 1.0
    assert float(mf.nn.scale_regularization_loss([torch.tensor(1.0), torch.tensor(2.0)])) == 3.0
    with pytest.raises(ValueError, match="global_batch_size=0"):
        mf.nn.compute_average_loss(per_example, global_batch_size=0)


def test_per_replica_is_not_a_tensor():
    value = mf.distribute.PerReplica((torch.tensor(1.0),))
    with pytest.raises(TypeError, match="strategy.reduce"):
        bool(value)
    strategy = mf.OneDeviceStrategy("cpu")
    assert float(strategy.reduce("SUM", value)) == 1.0
    assert strategy.experimental_local_results(value) == value.values
    assert strategy.run(lambda: 5) == 5  # one replica: the value itself, as in TF


def test_optimizer_closure_and_iterations_without_a_strategy():
    module = nn.Linear(2, 1)
    optimizer = mf.optimizers.SGD(0.1)
    optimizer.build(module.parameters())

    def closure():
        optimizer.zero_grad()
        loss = module(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    assert isinstance(optimizer.step(closure), torch.Tensor)
    assert optimizer.iterations == 1
    other = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="not optimised by this SGD"):
        optimizer.apply_gradients([(torch.zeros(1, 2), other.weight)])


def _dtensor_gradients(rank: int, world: int):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    strategy = mf.MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        module = nn.Linear(3, 1, bias=False)
    mesh = strategy.mesh
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()]))
    from meshfit.distribute._replication import adopt

    adopt(module, strategy)  # layouts that replace parameters record the new ones
    optimizer = mf.optimizers.SGD(learning_rate=1.0)
    optimizer.build(module.parameters())
    local_x = torch.full((2, 3), float(rank + 1))
    # each replica's own batch stamped Replicate: the gradient is summed over the batch axis
    x = DTensor.from_local(local_x, mesh, [Replicate()])
    module(x).sum().backward()
    optimizer.step()
    replicate_grad = module.weight.grad.to_local().clone()
    # the global batch sharded over the batch axis: DTensor reduces it itself (Partial), once
    optimizer.zero_grad()
    sharded = DTensor.from_local(local_x, mesh, [Shard(0)])
    module(sharded).sum().backward()
    optimizer.step()
    return replicate_grad.numpy(), module.weight.grad.full_tensor().numpy(), type(module.weight.grad).__name__


def test_dtensor_parameters_are_synchronised_by_their_layout():
    (r0, s0, kind), (r1, s1, _) = run_distributed(_dtensor_gradients, timeout=120)
    assert kind == "DTensor"
    np.testing.assert_allclose(r0, np.full((1, 3), 6.0))  # 2*1 + 2*2, summed over the 2 replicas
    np.testing.assert_array_equal(r0, r1)
    np.testing.assert_allclose(s0, np.full((1, 3), 6.0))  # the sharded batch's gradient, not doubled
    np.testing.assert_array_equal(s0, s1)
