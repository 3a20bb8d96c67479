"""One copy is not a replica; roll-backs are bounded; a divergence names every differing tensor.

Under ``LayoutMap.fully_sharded`` each parameter shard, its gradient and its optimizer state live on one
process: comparing replicas compares nothing. `VerifyReplicas` says so when ``fit`` starts and checks
those tensors at rest (a bit flipped in one process's shard between two steps is found before the
next step uses it) and after gathering (one rank's bad gather is found). A fault that comes back at the
same step after ``max_rollbacks`` roll-backs stops every worker. On 2 gloo processes.
"""

from __future__ import annotations

import contextlib
import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from tests._multiproc import run_distributed

BATCH, EXAMPLES = 8, 96  # 12 steps an epoch


def _data():
    rng = np.random.default_rng(5)
    return rng.normal(size=(EXAMPLES, 8)).astype("float32"), rng.integers(0, 4, size=(EXAMPLES,)).astype("int64")


def _model(mf, world):
    torch.manual_seed(0)
    mesh = mf.dtensor.create_mesh([("batch", world)])
    with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():
        model = mf.Model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _flip_local(parameter, index=1, bit=22):
    """One bit of this process's shard (its local tensor), as a faulty memory cell would."""
    with torch.no_grad():
        parameter.to_local().view(-1).view(torch.int32)[index] ^= 1 << bit


def _callbacks(mf):
    class FlipBetweenSteps(mf.callbacks.Callback):
        """Rank 1 flips a bit of its shard of ``0.weight`` before step ``at`` + 1 runs, ``times`` times."""

        reads_batch_logs = False

        def __init__(self, at, times):
            super().__init__()
            self.at, self.left = at, times

        def on_train_batch_begin(self, batch, logs=None):
            model = self.model
            if self.left and model.optimizer.iterations == self.at and mf.distribute.current_world().rank == 1:
                _flip_local(model.module[0].weight)
                self.left -= 1

    return FlipBetweenSteps


def _one_copy(rank, world, backup_dir):
    import meshfit as mf

    x, y = _data()
    flip = _callbacks(mf)
    out = {}
    reference = _model(mf, world)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    out["reference"] = [w.copy() for w in reference.get_weights()]

    # found at rest before the next step uses the shard; with "stop" every worker raises
    stop = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")
    printed = io.StringIO()
    with pytest.raises(mf.ReplicaDivergenceError) as stopped, contextlib.redirect_stdout(printed):
        _model(mf, world).fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                              callbacks=[flip(5, 1), stop])
    out["announced"] = printed.getvalue()
    out["stop"] = (stopped.value.step, stopped.value.path, stopped.value.ranks, str(stopped.value))
    out["coverage"] = (stop.coverage.compared, stop.coverage.one_copy, stop.coverage.gathered)

    # rolled back to the last backup: the run ends bitwise equal to the undisturbed one
    verify = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="restore")
    model = _model(mf, world)
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[flip(7, 1), verify, mf.callbacks.BackupAndRestore(f"{backup_dir}/a", save_freq=2)])
    out["restored"] = [w.copy() for w in model.get_weights()]
    out["rollbacks"] = [(e.step, e.path, path.rsplit("/", 1)[1]) for e, path in verify.rollbacks]

    # the same fault at the same step, every time: rolled back max_rollbacks times, then every worker stops
    bounded = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="restore", max_rollbacks=2)
    with pytest.raises(mf.ReplicaDivergenceError) as repeated:
        _model(mf, world).fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                              callbacks=[flip(7, 100), bounded,
                                         mf.callbacks.BackupAndRestore(f"{backup_dir}/b", save_freq=2)])
    out["bounded"] = (len(bounded.rollbacks), repeated.value.step, str(repeated.value))

    # one rank's gather gives another value than the shards hold: found by the gathered check
    from torch.distributed.tensor import DTensor

    model = _model(mf, world)
    model.fit(x[:16], y[:16], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    real = DTensor.full_tensor

    def bad_gather(self, *args, **kwargs):
        full = real(self, *args, **kwargs)
        if rank == 0 and tuple(full.shape) == (4, 16):
            full = full.clone()
            full.view(-1).view(torch.int32)[3] ^= 1 << 5
        return full

    DTensor.full_tensor = bad_gather
    try:
        with pytest.raises(mf.ReplicaDivergenceError) as gathered:
            model.strategy.verify_replicas(model)
    finally:
        DTensor.full_tensor = real
    out["gathered"] = (gathered.value.path, gathered.value.ranks)
    digest = model.strategy.verify_replicas(model)
    out["digest"] = (digest.compared, digest.one_copy)
    return out


def test_one_copy_tensors_are_named_checked_at_rest_and_after_gathering(tmp_path):
    results = run_distributed(_one_copy, world_size=2, args=(str(tmp_path),), timeout=400)
    chief, other = results[0]["announced"], results[1]["announced"]
    assert "4 of 5 tensors of the training state are held in one copy" in chief, chief
    assert "no replica to compare them with" in chief and other == ""  # said once, by the chief
    for result in results:
        compared, one_copy, gathered = result["coverage"]
        assert set(one_copy) >= {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert set(gathered) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert "optimizer/iterations" in compared and "0.weight" not in compared
        step, path, ranks, message = result["stop"]
        assert (step, path, ranks) == (5, "0.weight", [1])
        assert "at rest" in message and "one copy" in message
        assert result["rollbacks"] == [(7, "0.weight", "ckpt-3")]  # the backup of step 6
        for got, want in zip(result["restored"], result["reference"], strict=True):
            np.testing.assert_array_equal(got, want)
        rollbacks, step, message = result["bounded"]
        assert rollbacks == 2 and step == 7
        assert "again after 2 roll-back(s)" in message and "max_rollbacks=2" in message
        assert result["gathered"] == ("2.weight (gathered)", [0])
        compared, one_copy = result["digest"]
        assert "0.weight" in one_copy and "0.weight" not in compared and "optimizer/iterations" in compared


def test_a_divergence_names_every_differing_tensor_and_when_each_was_last_seen_equal():
    import meshfit as mf
    from meshfit.distribute._proof._verify import ReplicaHistory, find_divergences

    whole = [[]] * 3
    found = find_divergences(["a", "b", "c"], [([1, 5, 7], whole), ([2, 5, 8], whole)])
    assert [(p, r) for p, r, _ in found] == [("a", [0, 1]), ("c", [0, 1])]
    history = ReplicaHistory()
    history.passed(4, ["a", "b"])
    history.passed(6, ["b", "c"])
    error = mf.ReplicaDivergenceError(9, "a", [0, 1], differing=[("a", [0, 1]), ("c", [1])],
                                      last_equal={"a": 4, "c": 6})
    text = str(error)
    assert "'a' differs on rank(s) 0, 1 (last seen equal at step 4)" in text
    assert "1 more tensor(s) differ: 'c' on rank(s) 1 (last seen equal at step 6)" in text
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == text and again.differing == error.differing


def test_max_rollbacks_below_one_is_refused():
    import meshfit as mf

    for bad in (0, -1):
        with pytest.raises(ValueError, match=rf"Invalid `max_rollbacks`.*max_rollbacks={bad}"):
            mf.callbacks.VerifyReplicas(max_rollbacks=bad)


def _two_d(rank, world):
    import meshfit as mf
    from tests.dtensor import _two_d_model as lm

    x, y = lm.data(lm.BATCH * 6)
    flip = _callbacks(mf)

    def fresh():
        with lm.scope(mf, (2, 2)):
            model = mf.Model(lm.module())
            model.compile(optimizer=lm.optimizer(mf, "adamw"),
                          loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    healthy = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")
    fresh().fit(x, y, batch_size=lm.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[healthy])
    covered = healthy.coverage
    out = {"checks": healthy.checks, "compared": covered.compared, "one_copy": covered.one_copy}

    class FlipQkv(flip):
        def on_train_batch_begin(self, batch, logs=None):
            model = self.model
            if self.left and model.optimizer.iterations == self.at and mf.distribute.current_world().rank == 3:
                _flip_local(model.module.layers[0].attn.qkv.weight)
                self.left -= 1

    stop = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")
    with pytest.raises(mf.ReplicaDivergenceError) as stopped:
        fresh().fit(x, y, batch_size=lm.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[FlipQkv(3, 1), stop])
    out["stop"] = (stopped.value.step, stopped.value.path, stopped.value.ranks)
    return out


def test_on_a_2d_mesh_copies_along_batch_are_compared_and_two_d_shards_checked_at_rest():
    """``(batch 2, model 2)``, the guide's map: weights split over both axes are held in one copy
    (checked at rest and after gathering); the others, fully sharded over ``batch`` alone, have a copy
    along ``model`` and are compared, as are the step counts; a healthy run raises no false alarm in 6 checks (at rest,
    gathered and compared); a bit flipped at rest in rank 3's shard is found."""
    results = run_distributed(_two_d, world_size=4, timeout=600)
    for result in results:
        assert result["checks"] == 6
        assert "layers.0.attn.qkv.weight" in result["one_copy"]
        assert "layers.0.norm1.weight" in result["compared"]  # fully sharded over `batch`: a copy along `model`
        assert "optimizer/iterations" in result["compared"]
        assert result["stop"] == (3, "layers.0.attn.qkv.weight", [3])


def test_weights_changed_at_an_epoch_end_are_not_a_divergence():
    """A callback that changes the weights on purpose at an epoch's end (here: halves them) is no fault:
    the at-rest record is not carried across the epoch end. One process, every step checked."""
    import meshfit as mf

    class Halve(mf.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            with torch.no_grad():
                for parameter in self.model.module.parameters():
                    parameter.mul_(0.5)

    torch.manual_seed(0)
    model = mf.Model(nn.Sequential(nn.Linear(8, 4)))
    model.compile(optimizer=mf.optimizers.SGD(0.1), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    verify = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[Halve(), verify])
    assert verify.checks == 3 * EXAMPLES // BATCH


def _gathered_in_groups(rank, world):
    import meshfit as mf
    from meshfit.distribute._proof import _one_copy

    model = _model(mf, world)
    params = [p for _, p in model.module.named_parameters()]
    whole = _one_copy.gathered_digests(params)
    _one_copy.GATHER_BYTES = 1  # every tensor gathered, digested and freed alone
    alone = _one_copy.gathered_digests(params)
    model.strategy.verify_replicas(model)  # the gathered check still agrees with the shards
    return whole, alone


def test_gathered_values_are_digested_in_bounded_groups():
    """The gathered check never holds the whole unsharded model: groups of at most GATHER_BYTES give the
    same digests as one group."""
    for whole, alone in run_distributed(_gathered_in_groups, world_size=2, timeout=300):
        assert whole == alone and len(whole) == 4
