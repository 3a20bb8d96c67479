"""``model.save`` under a strategy both ways: TensorFlow's (every worker calls it) and PyTorch's (the chief alone).

When every worker calls ``save``, each call returns only once the chief's file is complete, so the
tutorial's ``load_model(model_path)`` right after works on every worker; the chief alone saving
still waits for nobody. Before this, the other workers' calls returned at once: in TensorFlow's
tutorial the other worker's ``load_model`` found no file (``FileNotFoundError``: the chief's was
still ``keras-model.keras.tmp.tmp-<pid>``) or the previous save, in about half of the tries.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest
import torch
from _procs import child_env, finish, free_ports, kill_group, start, tf_config
from torch import nn

import meshfit as mf

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "save_dance.py")
SAVES = 24


def _two_workers(out: str, *args: str) -> list[dict]:
    """Run tests/scripts/save_dance.py on 2 TF_CONFIG workers; each worker's record."""
    ports = free_ports(2)
    procs = [start([SCRIPT, "--out", out, *args], child_env(TF_CONFIG=tf_config(ports, i))) for i in range(2)]
    try:
        results = [finish(proc, timeout=300) for proc in procs]
    finally:  # a worker that timed out leaves its peer waiting: end both, by their groups
        for proc in procs:
            kill_group(proc)
    for code, output in results:
        assert code == 0, output
    return [json.load(open(os.path.join(out, f"worker{i}.json"))) for i in range(2)]


@pytest.fixture(scope="module")
def dance(tmp_path_factory):
    """One run: TensorFlow's tutorial saves (24), a save that fails on the chief, then the chief alone."""
    out = str(tmp_path_factory.mktemp("dance"))
    return out, _two_workers(out, "--saves", str(SAVES), "--chief-alone")


def test_tensorflows_tutorial_save_then_load_works_on_every_worker_every_time(dance):
    """Seed 000 (TensorFlow's "Multi-worker training with Keras", "Model saving and loading"):
    ``write_filepath`` per worker, the non-chief's temporary folder deleted, ``load_model(model_path)``
    at once on every worker, here 24 times over a folder, a ``.keras`` file and ``save_weights``."""
    out, records = dance
    for task_id, record in enumerate(records):
        assert record["task"] == ["worker", task_id]
        assert len(record["saves"]) == SAVES
        bad = {i: found for i, found in enumerate(record["saves"]) if found != "ok"}
        assert not bad, f"worker {task_id}: saves whose file did not hold that save's weights: {bad}"
    # The non-chief deleted its temporary folders; nothing half-written is left.
    assert not [p for p in os.listdir(out) if p.startswith("workertemp_") or ".tmp" in p or ".old" in p]


def test_a_failed_save_on_the_chief_raises_on_every_worker(dance):
    _, (chief, other) = dance
    assert chief["failed_save"] is not None and chief["failed_save"].startswith(("NotADirectoryError",
                                                                                  "FileExistsError")), chief
    assert other["failed_save"] is not None, other
    assert other["failed_save"].startswith("ChiefWriteError: Could not save the model to "), other
    assert "the chief's matching model.save failed with" in other["failed_save"], other


def test_the_chief_alone_saving_waits_for_nobody(dance):
    _, (chief, other) = dance
    assert chief["chief_alone_seconds"] < 10, chief  # three saves of a tiny model, no peer's timeout
    assert chief["chief_alone"] == "ok" and other["chief_alone"] == "ok", (chief, other)


def test_another_worker_saving_alone_is_told_at_once_when_the_chief_ends_without_saving(tmp_path):
    # A world timeout of 60 s: were the chief's end missed, the wait would end there, not at 300 s.
    _, other = _two_workers(str(tmp_path), "--saves", "0", "--other-alone", "--timeout", "60")
    assert other["other_alone"] is not None, other
    assert re.match(r"EveryWorkerCallError: model\.save on worker 1 at 127\.0\.0\.1:\d+ returns once the chief's "
                    r"matching save is complete", other["other_alone"]), other
    assert "ended without making its save number 1" in other["other_alone"], other
    assert "Call model.save on every worker" in other["other_alone"], other
    assert other["other_alone_seconds"] < 30, other  # when the chief ended, not at the world's timeout
    assert not os.path.exists(tmp_path / "other-alone")


def _recipes() -> list[str]:
    """The code blocks of the "Saved weights in plain PyTorch" section of docs/fragments/habits.md."""
    text = (ROOT / "docs" / "fragments" / "habits.md").read_text()
    section = text.split("### Saved weights in plain PyTorch", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _new_module() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_model_safetensors_loads_into_the_plain_torch_module_with_the_documented_recipes(tmp_path, monkeypatch):
    """The two-line recipes of docs/fragments/habits.md, run as written, load strictly."""
    recipes = _recipes()
    assert len(recipes) == 2 and all(len(r.strip().splitlines()) == 2 for r in recipes), recipes
    torch.manual_seed(0)
    model = mf.Model(_new_module())
    model.compile("adam", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(torch.randn(32, 4), torch.randint(0, 3, (32,)), batch_size=8, epochs=1, verbose=0)
    monkeypatch.chdir(tmp_path)
    model.save("my_model")
    model.save("model.keras")
    expected = model.module.state_dict()
    x = torch.randn(5, 4)
    for recipe in recipes:
        module = _new_module()
        exec(recipe, {"module": module})  # noqa: S102 - the documentation's own code, run as written
        loaded = module.state_dict()
        assert list(loaded) == list(expected)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value.cpu()), key
        module.eval()
        torch.testing.assert_close(module(x).detach(), torch.from_numpy(model.predict(x.numpy(), verbose=0)))
    # Strict: a module of another shape is refused, naming the keys.
    with pytest.raises(RuntimeError, match="Missing key"):
        exec(recipes[0], {"module": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 3))})  # noqa: S102
