"""`strategy.verify_replicas` and `mf.callbacks.VerifyReplicas`: silent corruption of one replica found at
the next check, named (step, tensor path, ranks), and rolled back in the same processes to a run bitwise
equal to one never disturbed. Fault injection on 2 and 3 gloo workers, several faults per run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from torch import nn

import meshfit as mf

BATCH, EXAMPLES, EPOCHS = 16, 384, 3  # 16 steps an epoch, 48 in all (batch 24 on 3 workers)
SAVE_FREQ, EVERY = 4, 5


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(144, 16), nn.BatchNorm1d(16), nn.ReLU(),       # 4, 5: DDP agrees 5's buffers
                         nn.Linear(16, 16), mf.nn.SyncBatchNorm(16), nn.ReLU(),  # 7, 8: 8's are compared as they are
                         nn.Linear(16, 10))


def _data():
    (x, y), _ = mf.datasets.load_digits()
    return x[:EXAMPLES], y[:EXAMPLES].astype("int64")


def _model(strategy) -> mf.Model:
    with strategy.scope():
        model = mf.Model(_module())
        model.compile(mf.optimizers.Adam(0.01), mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _flip(tensor: torch.Tensor, index: int = 3, bit: int = 20) -> None:
    with torch.no_grad():
        tensor.detach().view(-1).view(torch.int32)[index] ^= 1 << bit


class Inject(mf.callbacks.Callback):
    """Corrupts one replica's state once per fault, at the end of a given step (before any check)."""

    reads_batch_logs = False

    def __init__(self, rank: int, target: int) -> None:
        super().__init__()
        self.rank, self.target = rank, target
        self.done: set[int] = set()

    def on_train_batch_end(self, batch, logs=None):
        step = self.model.optimizer.iterations
        if self.rank != self.target or step in self.done:
            return
        module = self.model.module
        moments = self.model.optimizer.torch_optimizer.state
        faults = {
            9: lambda: _flip(module[4].weight),                       # a weight, checked at step 10
            20: lambda: module[8].running_mean.add_(1e-3),           # a SyncBatchNorm statistic, at a check step
            35: lambda: _flip(moments[module[7].weight]["exp_avg"]),  # an optimizer moment, at a check step
            41: lambda: _flip(module[10].bias, 1),                   # found by the backup at 44, before a check
        }
        if step in faults:
            faults[step]()
            self.done.add(step)


def _fit(model, callbacks, world=2):
    x, y = _data()
    batch = BATCH // 2 * world  # 16 steps an epoch on 2 or 3 workers
    model.fit(x[:16 * batch], y[:16 * batch], batch_size=batch, epochs=EPOCHS, shuffle=True, verbose=0,
              callbacks=callbacks)
    return [w.copy() for w in model.get_weights()]


def _faults_in_fit(rank: int, world: int, backup_dir: str) -> dict:
    strategy = mf.MultiWorkerMirroredStrategy()
    reference = _fit(_model(strategy), [], world)
    verify = mf.callbacks.VerifyReplicas(every_n_steps=EVERY, on_divergence="restore")
    model = _model(strategy)
    weights = _fit(model, [Inject(rank, world - 1), verify,
                           mf.callbacks.BackupAndRestore(f"{backup_dir}/restore", save_freq=SAVE_FREQ)], world)
    found = [(e.step, e.path, e.ranks, path.rsplit("/", 1)[1]) for e, path in verify.rollbacks]
    stop = mf.callbacks.VerifyReplicas(every_n_steps=EVERY, on_divergence="stop")
    with pytest.raises(mf.ReplicaDivergenceError) as stopped:
        _fit(_model(strategy), [Inject(rank, world - 1), stop], world)
    error = stopped.value
    return {"same": all(np.array_equal(a, b) for a, b in zip(weights, reference, strict=True)),
            "found": found, "checks": verify.checks,
            "stop": (error.step, error.path, error.ranks, str(error))}


def _expected(ranks: list[int]) -> list:
    return [(10, "4.weight", ranks, "ckpt-2"),                   # flipped at 9: the backup of step 8
            (20, "8.running_mean", ranks, "ckpt-4"),             # the check at 20 comes before its backup
            (35, "optimizer/7.weight/exp_avg", ranks, "ckpt-8"),  # across an epoch's end: back to step 32
            (44, "module/10.bias", ranks, "ckpt-10")]            # the backup at 44 is refused: back to 40


@pytest.mark.parametrize("world", [2, 3])
def test_faults_are_named_at_the_next_check_and_rolled_back_bitwise(tmp_path, world):
    results = run_distributed(_faults_in_fit, world_size=world, args=(str(tmp_path),), timeout=400)
    minority = [0, 1] if world == 2 else [2]  # 2 replicas: both named; 3: the odd one out
    for result in results:
        assert result["same"], "the rolled-back run must end bitwise equal to the undisturbed one"
        assert result["found"] == _expected(minority)
        assert result["checks"] >= 48 // EVERY
        step, path, ranks, message = result["stop"]
        assert (step, path, ranks) == (10, "4.weight", minority)
        assert "step 10" in message and "'4.weight'" in message and str(minority[-1]) in message


def _healthy(rank: int, world: int) -> dict:
    strategy = mf.MultiWorkerMirroredStrategy()
    verify = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")
    model = _model(strategy)
    x, y = _data()
    model.fit(x[:256], y[:256], batch_size=BATCH, epochs=5, verbose=0, callbacks=[verify])  # 80 checks
    # a custom loop: strategy.run, the optimizer sums the gradients, verify_replicas after every step
    with strategy.scope():
        module = _module()
        optimizer = mf.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    rows = np.arange(rank, 256, world)
    checks = 0
    for step in range(120):  # and 120 here
        batch = rows[(step * 8) % len(rows):][:8]

        def train_step(inputs, labels):
            loss = mf.nn.compute_average_loss(loss_fn(labels, module(inputs)), global_batch_size=8 * world)
            optimizer.apply_gradients(zip(torch.autograd.grad(loss, list(module.parameters())),
                                          module.parameters(), strict=True))

        strategy.run(train_step, args=(torch.as_tensor(x[batch]), torch.as_tensor(y[batch])))
        digest = strategy.verify_replicas(module, optimizer)
        checks += 1
    with torch.no_grad():
        module[8].running_mean[0] += 1e-3 if rank == 1 else 0.0
    with pytest.raises(mf.ReplicaDivergenceError) as nudged:
        strategy.verify_replicas(module, optimizer)
    # workers built with different settings would check at different steps and wait on each other: refused
    steps = []
    counter = mf.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: steps.append(batch))
    uneven = mf.callbacks.VerifyReplicas(every_n_steps=10 + rank, on_divergence="stop")
    with pytest.raises(ValueError, match=r"worker 0: every_n_steps=10.*worker 1: every_n_steps=11") as mismatch:
        model.fit(x[:64], y[:64], batch_size=BATCH, epochs=1, verbose=0, callbacks=[counter, uneven])
    return {"fit": verify.checks, "loop": checks, "total": digest.total,
            "nudged": (nudged.value.path, nudged.value.ranks), "mismatch": (str(mismatch.value), steps)}


def test_no_false_alarm_in_200_checks_of_a_healthy_run_fit_and_custom_loop():
    results = run_distributed(_healthy, world_size=2, timeout=400)
    assert [r["fit"] + r["loop"] for r in results] == [200, 200]
    assert results[0]["total"] == results[1]["total"]
    assert [r["nudged"] for r in results] == [("8.running_mean", [0, 1])] * 2
    for message, steps in (r["mismatch"] for r in results):
        assert steps == [] and "same `every_n_steps`" in message  # refused before the first step, on both


def test_bad_arguments_and_restore_without_a_backup_are_refused_before_the_first_step():
    with pytest.raises(ValueError, match=r"Invalid `every_n_steps`.*every_n_steps=0"):
        mf.callbacks.VerifyReplicas(every_n_steps=0)
    with pytest.raises(ValueError, match=r"Invalid `every_n_steps`.*every_n_steps=-5"):
        mf.callbacks.VerifyReplicas(every_n_steps=-5)
    with pytest.raises(ValueError, match=r"Invalid `on_divergence`.*'restore' or 'stop'.*'rollback'"):
        mf.callbacks.VerifyReplicas(on_divergence="rollback")
    model = _model(mf.get_strategy())
    steps = []
    counter = mf.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: steps.append(batch))
    x, y = _data()
    with pytest.raises(ValueError, match=r"`on_divergence`.*BackupAndRestore.*on_divergence='stop'"):
        model.fit(x[:256], y[:256], batch_size=BATCH, verbose=0, callbacks=[counter, mf.callbacks.VerifyReplicas()])
    assert steps == [] and model.optimizer.iterations == 0
    # one replica: nothing to compare, every check passes
    verify = mf.callbacks.VerifyReplicas(every_n_steps=4, on_divergence="stop")
    model.fit(x[:256], y[:256], batch_size=BATCH, epochs=1, verbose=0, callbacks=[verify])
    assert verify.checks == 256 // BATCH // 4


def test_who_is_named_majority_ties_and_shards_compared_along_batch_only():
    from meshfit.distribute import compare_replicas

    paths = ["a", "b"]
    whole = [[]] * 2
    # 3 replicas: the odd one out; all three differ: all of them; 2 replicas: both
    assert compare_replicas(paths, [([1, 5], whole), ([1, 5], whole), ([1, 6], whole)])[:2] == ("b", [2])
    assert compare_replicas(paths, [([1, 5], whole), ([1, 6], whole), ([1, 7], whole)])[:2] == ("b", [0, 1, 2])
    assert compare_replicas(paths, [([2, 5], whole), ([1, 5], whole)])[:2] == ("a", [0, 1])
    assert compare_replicas(paths, [([1, 5], whole)] * 4) is None
    # a (batch=2, model=2) mesh, tensors sharded along `model`: ranks 0, 2 hold shard 0, ranks 1, 3 shard 1.
    # Different shards differ (not a divergence); copies of one shard must agree.
    shards = [[[0], [0]], [[1], [1]], [[0], [0]], [[1], [1]]]
    healthy = [([10, 20], shards[0]), ([11, 21], shards[1]), ([10, 20], shards[2]), ([11, 21], shards[3])]
    assert compare_replicas(paths, healthy) is None
    broken = [*healthy[:3], ([11, 22], shards[3])]
    assert compare_replicas(paths, broken)[:2] == ("b", [1, 3])
    # fully sharded along `batch`: every rank its own shard, nothing to compare
    assert compare_replicas(paths, [([r, r], [[r], [r]]) for r in range(4)]) is None
    # skipped paths (buffers a save takes from rank 0) are not compared
    assert compare_replicas(paths, [([1, 5], whole), ([2, 5], whole)], frozenset({"a"})) is None
