"""A resume on 4 processes ends bitwise equal to the run never interrupted, on DDP's path.

The path of `MultiWorkerMirroredStrategy` and of a ``batch`` mesh whose `LayoutMap` has no key. With
4 replicas a float sum depends on the order the all-reduce adds the replicas' gradients in, and
gloo's ring (NCCL's too) adds each element in an order set by where it lies in DDP's bucket: bitwise
resume needs the same bucket layout at every step whichever step a run started at. Plain DDP lays
its buckets out again after its first backward (in the order the gradients were ready), and a
resumed run builds a new wrapper, whose first steps would reduce in the other layout: the run would
end a few ulp away (with 2 replicas ``a + b == b + a``: any layout gives the same bits).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _procs import child_env, finish, start
from _script_outputs import assert_ranks_saved, read_weights

from tests._multiproc import run_distributed

STEPS, BATCH, STOP_AT = 8, 16, 6  # steps an epoch; a global batch; where the interrupted run stops
FEATURES, HIDDEN = 12, 2048  # 2048 x 160 float32 weights: more than DDP's 1 MiB first bucket

# 4 gloo processes a run, two or three runs a test, on a shared 2-core machine
pytestmark = pytest.mark.timeout(900)


class _Stop(Exception):
    pass


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, 5, size=(STEPS * BATCH,)).astype("int64")
    return x, y


def _module(unused):
    import torch
    from torch import nn

    class WithUnused(nn.Module):  # a layer no step uses: the wrapper keeps DDP's search for it
        def __init__(self, body):
            super().__init__()
            self.body = body
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 160), nn.Tanh(),
                         nn.Linear(160, 5))
    return WithUnused(body) if unused else body


def _run(rank, world, kind, unused, backup, stop_at, clean):
    """Train 2 epochs with a backup every 2 steps; stop before step ``stop_at`` (by an exception), or
    with ``clean`` after it (by ``stop_training``), or run to the end. Returns the iterations trained,
    the weights and the parameter shapes of each DDP bucket, or None when stopped by the exception."""
    import meshfit as mf

    class Interrupt(mf.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if stop_at is not None and not clean and int(self.model.optimizer.iterations) + 1 == stop_at:
                raise _Stop

        def on_train_batch_end(self, batch, logs=None):
            if stop_at is not None and clean and int(self.model.optimizer.iterations) == stop_at:
                self.model.stop_training = True

    if kind == "mesh":
        scope = mf.dtensor.LayoutMap(mf.dtensor.create_mesh([("batch", 4)])).scope()  # no key: DDP's path
    else:
        scope = mf.MultiWorkerMirroredStrategy().scope()
    with scope:
        model = mf.Model(_module(unused))
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    callbacks = [mf.callbacks.BackupAndRestore(backup, save_freq=2, async_save=False, delete_checkpoint=False),
                 Interrupt()]
    try:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    except _Stop:
        return None
    wrapper = model.placement.module  # the probing DDP wrapper
    assert wrapper.find_unused_parameters == unused  # the unused layer keeps DDP's search on
    buckets = [[tuple(p.shape) for p in bucket.parameters()]  # in the order they are all-reduced
               for bucket in wrapper.wrapped.reducer._get_zeros_like_grad_buckets()]
    return int(model.optimizer.iterations), model.get_weights(), buckets


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights of a run never interrupted, by strategy and model (each run once for the module)."""
    runs: dict[tuple[str, bool], list[np.ndarray]] = {}

    def weights(kind, unused):
        if (kind, unused) not in runs:
            backup = str(tmp_path_factory.mktemp(f"uninterrupted-{kind}"))
            results = run_distributed(_run, world_size=4, args=(kind, unused, backup, None, False), timeout=400)
            # the first 1 MiB bucket holds the last layers (their gradients are ready first) and is
            # all-reduced first, but for a wrapper searching for unused parameters (last)
            last = [(5,), (5, 160), (160,), (160, HIDDEN)]
            layout = [[(4,), (4, 4), *last] if unused else last, [(HIDDEN,), (HIDDEN, FEATURES)]]
            for iterations, got, buckets in results:
                assert iterations == 2 * STEPS
                assert buckets == (layout[::-1] if unused else layout)
                for a, b in zip(got, results[0][1], strict=True):  # the replicas agree
                    np.testing.assert_array_equal(a, b)
            runs[kind, unused] = results[0][1]
        return runs[kind, unused]

    return weights


@pytest.mark.parametrize(("kind", "unused", "clean"), [
    ("mesh", False, False), ("mesh", False, True), ("multiworker", False, False), ("multiworker", False, True),
    ("multiworker", True, False)],
    ids=["mesh-raised", "mesh-stop_training", "multiworker-raised", "multiworker-stop_training",
         "multiworker-unused_layer-raised"])
def test_a_resumed_run_on_four_processes_ends_bitwise_equal_to_one_never_interrupted(uninterrupted, tmp_path,
                                                                                     kind, unused, clean):
    expected = uninterrupted(kind, unused)
    backup = str(tmp_path / "backup")
    stopped = run_distributed(_run, world_size=4, args=(kind, unused, backup, STOP_AT, clean), timeout=400)
    # on several workers a stop_training set at a step's end takes effect one step later (the flag
    # travels with the next step's reduction); the last backup is step 6 (clean) or 4 (raised)
    assert [s[0] if s else None for s in stopped] == [STOP_AT + 1 if clean else None] * 4
    resumed = run_distributed(_run, world_size=4, args=(kind, unused, backup, None, False), timeout=400)
    for iterations, weights, _ in resumed:
        assert iterations == 2 * STEPS
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_array_equal(got, want)


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "dtensor_keras.py")


def test_sigkill_on_a_batch_mesh_without_keys_under_launch_resumes_bitwise(tmp_path):
    """The seed's DTensor script on ``create_mesh([("batch", 4)])`` with a LayoutMap without keys: a
    worker killed with SIGKILL at step 9 under ``meshfit launch --max-restarts``, resumed from the
    backup of step 5, ends bitwise equal to the plain script never killed."""
    reference = str(tmp_path / "reference")
    code, output = finish(start([SCRIPT, "--out", reference, "--devices", "4", "--mesh", "batch=4", "--no-keys"],
                                child_env()), timeout=400)
    assert code == 0, output
    with open(os.path.join(reference, "layouts-0.txt")) as f:  # plain parameters: DDP's path
        assert "feature.weight Parameter sharding_specs:unsharded,unsharded, mesh:|batch=4|cpu" in f.read()
    out = str(tmp_path / "out")
    proc = start(["-m", "meshfit._cli", "launch", "--workers", "4", "--max-restarts", "2", "--preload", SCRIPT,
                  "--out", out, "--mesh", "batch=4", "--no-keys", "--backup-dir", str(tmp_path / "backup"),
                  "--save-freq", "5", "--kill-rank", "1", "--kill-at", "9"], child_env())
    code, output = finish(proc, timeout=500)
    assert code == 0, output
    assert "restarting the group" in output and "resuming from" in output, output
    assert_ranks_saved(out, range(4), read_weights(reference, 0))
