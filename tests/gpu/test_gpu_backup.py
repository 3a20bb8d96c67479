"""Backups on a GPU: an async backup staged from CUDA tensors, and kill -9 then resume, bitwise."""

from __future__ import annotations

import os
import signal

import numpy as np
from _gpu import MARKS
from _procs import child_env, finish, start

pytestmark = MARKS

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_train_on_gpu.py")


def _run(tmp_path, name: str, backup: str, kill_at: int, mode: str = "sync") -> tuple[int, str, str]:
    out = str(tmp_path / f"{name}.npz")
    env = child_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")
    code, output = finish(start([SCRIPT, out, backup, str(kill_at), mode], env), timeout=300)
    return code, output, out


def _weights(path: str) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _assert_bitwise(a: str, b: str) -> None:
    for x, y in zip(_weights(a), _weights(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _kill_and_resume(tmp_path, mode: str) -> None:
    code, output, reference = _run(tmp_path, "reference", str(tmp_path / "reference-backup"), -1, mode)
    assert code == 0, output
    backup = str(tmp_path / "backup")
    code, output, _ = _run(tmp_path, "killed", backup, 23, mode)  # 16 steps an epoch: killed in epoch 2
    assert code == -signal.SIGKILL, output
    code, output, resumed = _run(tmp_path, "resumed", backup, -1, mode)
    assert code == 0, output
    assert "resuming from" in output
    _assert_bitwise(resumed, reference)


def test_kill_9_on_a_gpu_and_resume_is_bitwise_with_deterministic_algorithms(tmp_path):
    _kill_and_resume(tmp_path, "sync")


def test_async_backups_from_the_gpu_resume_bitwise(tmp_path):
    _kill_and_resume(tmp_path, "async")


