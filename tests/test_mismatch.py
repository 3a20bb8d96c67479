"""Settings that differ between workers fail on both, within seconds, naming the setting and each
worker's value (issue 26): the model's shapes (when the scope exits, or when fit sets a lazy module up)
and ``BackupAndRestore(async_save=...)``; before, gloo aborted one worker (SIGABRT) or both waited out
the collective timeout. Two real processes on gloo with a 20 s collective timeout (tests/scripts/mismatch.py).
"""

from __future__ import annotations

import os
import re

import pytest
from _procs import child_env, finish, free_ports, start, tf_config

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "mismatch.py")


def _run_pair(case: str, tmp_path) -> list[tuple[int, str, float]]:
    ports = free_ports(2)
    procs = [start([SCRIPT, "--case", case, "--backup-dir", str(tmp_path / "backup")],
                   child_env(TF_CONFIG=tf_config(ports, rank))) for rank in (0, 1)]
    results = []
    for proc in procs:
        code, output = finish(proc, timeout=120)
        found = re.search(r"failed after ([\d.]+) s", output)
        results.append((code, output, float(found.group(1)) if found else float("inf")))
    return results


@pytest.mark.parametrize("case, expected", [
    ("model", "different models in strategy.scope(), which must be the same on every worker: parameter "
              "'0.weight': worker 0 has shape (32, 8) float32, worker 1 has shape (48, 8) float32"),
    ("lazy_model", "different models, which must be the same on every worker: parameter '0.weight': worker 0 has shape (32, 8) float32, worker 1 has shape (48, 8) float32"),
    ("async_save", "BackupAndRestore's async_save: worker 0 has False, worker 1 has True"),
])
def test_a_setting_that_differs_fails_on_both_workers_within_15_s_naming_it(case, expected, tmp_path):
    for code, output, seconds in _run_pair(case, tmp_path):
        assert code != 0, output
        assert "ClusterMismatchError" in output and expected in output, output
        assert seconds < 15, output  # the collective timeout is 20 s: not a timeout
        assert "Build the same model" in output or "Pass the same values everywhere" in output, output


def test_the_first_difference_is_named_when_a_worker_has_another_layer_or_dtype():
    from torch import nn

    from meshfit.distribute._liveness._rendezvous import ClusterMismatchError
    from meshfit.distribute._proof._model_agreement import agree_on_tensors, module_entries

    def gather_with(other):
        return lambda mine: [mine, other(mine)]

    small = module_entries(nn.Sequential(nn.Linear(4, 2)))
    bigger = module_entries(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)))
    halved = module_entries(nn.Sequential(nn.Linear(4, 2)).half())
    agree_on_tensors(lambda mine: [mine, mine], small, "models", "Fix it.")  # equal: no error
    with pytest.raises(ClusterMismatchError, match=re.escape(
            "tensor #3: worker 0 has none, worker 1 has parameter '1.weight' of shape (2,) float32. Fix it.")):
        agree_on_tensors(gather_with(lambda m: bigger if isinstance(m, list) else "other digest"), small,
                         "models", "Fix it.")
    with pytest.raises(ClusterMismatchError, match=re.escape(
            "parameter '0.weight': worker 0 has shape (2, 4) float32, worker 1 has shape (2, 4) float16")):
        agree_on_tensors(gather_with(lambda m: halved if isinstance(m, list) else "other digest"), small,
                         "models", "Fix it.")
