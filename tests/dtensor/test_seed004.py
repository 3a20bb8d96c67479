"""Seed 004's loop as the seed writes it (``tests/scripts/dtensor_seed004.py``): ``mf.Model`` and a plain
module, each with the per-layer layouts and with the ``LayoutMap`` built in ``layout_map.scope()``,
called in the seed's own ``train_step``/``eval_step`` on ``pack``ed inputs; started as a plain
``python`` script (it starts its other process itself) and under ``meshfit launch --workers 2``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _procs import child_env, finish, start

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "dtensor_seed004.py")
COMBOS = ["model/per_layer", "plain/per_layer", "model/layout_map", "plain/layout_map"]


def _results(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"results-{rank}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("one_process"))
    code, output = finish(start([SCRIPT, "--out", out, "--devices", "0"], child_env()), timeout=300)
    assert code == 0, output
    return _results(out, 0)


@pytest.fixture(scope="module", params=["plain_script", "launch"])
def run(request, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp(request.param))
    args = [SCRIPT, "--out", out] if request.param == "plain_script" else \
        ["-m", "meshfit._cli", "launch", "--workers", "2", "--preload", SCRIPT, "--out", out]
    code, output = finish(start(args, child_env()), timeout=500)
    assert code == 0, output
    assert "mixed torch.Tensor and DTensor" not in output
    return request.param, [_results(out, rank) for rank in range(2)]


@pytest.mark.parametrize("combo", COMBOS)
def test_seed_loop_runs_with_each_spelling(run, reference, combo):
    how, ranks = run
    first = ranks[0][combo]
    for record in ranks:  # every process ends with the same full weights
        for a, b in zip(record[combo]["weights"], first["weights"], strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    assert first["kinds"] == ["DTensor"]
    assert len(first["losses"]) == 12 and all(np.isfinite(first["losses"]))
    assert 0.0 <= first["results"]["eval_accuracy"] <= 1.0
    if combo.endswith("per_layer"):  # the seed's replicated layouts: equal to one process
        assert set(first["layouts"].values()) == {"sharding_specs:unsharded,unsharded, mesh:|batch=2|cpu",
                                                  "sharding_specs:unsharded, mesh:|batch=2|cpu"}
        want = reference[combo]
        for a, b in zip(first["weights"], want["weights"], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
        assert first["losses"] == pytest.approx(want["losses"], rel=1e-5)
    else:  # the seed's LayoutMap: 'feature.*kernel' sharded over 'batch', as the seed prints it
        assert first["feature_kernel_layout"] == "sharding_specs:batch,unsharded, mesh:|batch=2|cpu"
        assert first["layouts"]["feature_2.weight"] == "sharding_specs:batch,unsharded, mesh:|batch=2|cpu"
        assert first["layouts"]["feature.bias"] == "sharding_specs:batch, mesh:|batch=2|cpu"
        # a plain module and mf.Model of the same module train alike (dropout included: same seed)
        other = ranks[0]["plain/layout_map" if combo.startswith("model") else "model/layout_map"]
        assert first["losses"] == pytest.approx(other["losses"], rel=1e-6)
