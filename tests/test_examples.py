"""Every script in examples/ runs, on tiny settings (``MESHFIT_EXAMPLE_TINY=1``), and the guides show it.

Each test starts the example as a user would (``python examples/x.py``, or under ``meshfit launch
--workers 2``), with ``TMPDIR`` in the test's folder, and checks what the tutorial it ports shows. The
README's quickstart is launched exactly as the README says; the other launched examples add
``--preload`` (the launcher's tasks forked from one process that imported torch once: 4-5 s of CPU
less a worker; tests/test_preload.py shows a preloaded task runs a script as a new interpreter does).
examples/estimator_multiworker.py is run by tests/estimator/test_estimator_multiworker.py.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest
from _procs import ROOT, child_env, finish, start

pytestmark = pytest.mark.slow  # every test here starts processes

EXAMPLES = pathlib.Path(ROOT) / "examples"
TESTED_ELSEWHERE = {"estimator_multiworker.py": "tests/estimator/test_estimator_multiworker.py"}


def _run(tmp_path, script: str, *args: str, launch_workers: int = 0, preload: bool = True,
         timeout: float = 300) -> str:
    env = child_env(MESHFIT_EXAMPLE_TINY="1", TMPDIR=str(tmp_path))
    argv = [str(EXAMPLES / script), *args]
    if launch_workers:
        argv = ["-m", "meshfit._cli", "launch", "--workers", str(launch_workers),
                *(["--preload"] if preload else []), *argv]
    code, out = finish(start(argv, env, cwd=str(tmp_path)), timeout=timeout)
    assert code == 0, out
    return out


def test_every_example_is_tested_and_shown_in_the_docs():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    source = pathlib.Path(__file__).read_text()
    for script in scripts:
        assert f'"{script}"' in source or script in TESTED_ELSEWHERE, f"examples/{script} has no test"
    included = "\n".join(p.read_text() for p in (pathlib.Path(ROOT) / "docs").rglob("*.md"))
    for script in scripts:
        assert f'--8<-- "examples/{script}' in included, (
            f"examples/{script} is included by no page of docs/ (`--8<-- \"examples/{script}\"`)")


def test_multi_worker_fit_main(tmp_path):
    out = _run(tmp_path, "main.py", "--backup-dir", str(tmp_path / "backup"),
               "--checkpoint-dir", str(tmp_path / "ckpt"), launch_workers=2)
    assert "Epoch 2/2" in out and "all workers finished successfully" in out
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-1", "ckpt-2"]


def test_custom_loop_resumes_from_its_checkpoint(tmp_path):
    checkpoints = str(tmp_path / "ckpt")
    out = _run(tmp_path, "custom_loop.py", "--checkpoint-dir", checkpoints, launch_workers=2)
    assert re.search(r"\[worker 0\] Epoch: 1, accuracy: [0-9.]+, train_loss: [0-9.]+\.", out), out
    assert "[worker 1] Epoch" not in out  # only the chief prints
    again = _run(tmp_path, "custom_loop.py", "--checkpoint-dir", checkpoints, launch_workers=2)
    assert "resuming from" in again and "at epoch 2" in again and "Epoch: " not in again


def test_fault_tolerance_four_ways(tmp_path):
    out = _run(tmp_path, "fault_tolerance.py")
    for line in ["1. Estimator interrupted: Interruption", "1. resuming from model.ckpt-5",
                 "1. done at global step 10", "2. fit interrupted: Interruption",
                 "2. fit starts at epoch 4, batch 1", "2. history has 5 epochs", "3. fit interrupted: Interruption",
                 "3. history has 5 epochs", "4. epoch 1: restored ckpt-1", "4. epoch 2: restored ckpt-2",
                 "4. kept ['ckpt-2', 'ckpt-3']"]:
        assert line in out, (line, out)
    assert re.search(r"resuming from \S+backup-3/ckpt-\d+ at epoch 2, batch 11", out), out


def test_keras_distributed_guide(tmp_path):
    out = _run(tmp_path, "keras_distributed.py", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert "Number of devices: 2" in out and "Creating a new model" in out
    assert f"Restoring from {tmp_path / 'ckpt' / 'ckpt-1.keras'}" in out


def test_dtensor_keras(tmp_path):
    out = _run(tmp_path, "dtensor_keras.py")
    assert "feature.weight: sharding_specs:model,unsharded, mesh:|batch=1,model=2|cpu" in out
    assert "feature_2.bias: sharding_specs:model, mesh:|batch=1,model=2|cpu" in out
    assert re.search(r"4/4 - .*loss: [0-9.]+ - accuracy", out), out


def test_fully_sharded(tmp_path):
    out = _run(tmp_path, "fully_sharded.py")
    assert out.count("this process holds 8645 of 17290 parameters") == 2, out  # half each, both processes
    assert (tmp_path / "meshfit-fsdp.keras").is_file()


def test_torch_dataloader(tmp_path):
    out = _run(tmp_path, "torch_dataloader.py", launch_workers=2)
    assert "Epoch 2/2" in out and "all workers finished successfully" in out


def test_mixed_precision(tmp_path):
    out = _run(tmp_path, "mixed_precision.py")
    assert "compute bfloat16, variables float32" in out
    assert "weights: {torch.float32}" in out and "predictions: float32" in out


def test_custom_train_step(tmp_path):
    out = _run(tmp_path, "custom_train_step.py")
    history = re.search(r"\{'loss': \[([0-9., ]+)\], 'mae': \[([0-9., ]+)\]\}", out)
    assert history, out
    losses = [float(v) for v in history.group(1).split(",")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the overridden train_step trains and logs


def test_quickstart(tmp_path):
    # The README's example has no tiny mode (it is the 20 lines a reader copies): a copy of it with 4 steps
    # an epoch instead of 70 runs here, every other character as shipped (210 steps cost 25 CPU-s).
    shipped = (EXAMPLES / "quickstart.py").read_text()
    assert shipped.count("steps_per_epoch=70") == 1
    (tmp_path / "quickstart.py").write_text(shipped.replace("steps_per_epoch=70", "steps_per_epoch=4"))
    out = _run(tmp_path, str(tmp_path / "quickstart.py"), launch_workers=2, preload=False)  # as the README says
    assert "Epoch 3/3" in out and "4/4" in out and "all workers finished successfully" in out
    assert not [name for name in os.listdir(tmp_path) if name.startswith("backup")]  # deleted when fit ended
