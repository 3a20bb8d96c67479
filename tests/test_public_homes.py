"""Public homes: every public class and function reports the module users import it from, and has an example.

``__module__`` is what ``help()``, ``repr`` of a class, tracebacks and the generated reference show; a
private home (``meshfit._engine._model``) would show a path users cannot rely on. Re-homing must keep
pickling by reference, ``torch.save``, spawned processes, dataclasses, Protocols and enums working.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import io
import multiprocessing
import pickle
import pydoc
import sys
import traceback
import types
import typing

import pytest
import torch

import meshfit as mf
from meshfit import _export

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "hooks"))
import reference  # noqa: E402  (docs/hooks/reference.py: the lists the reference pages are made from)

NAMES = reference.public_names()
API = [n for n in NAMES if n.is_api_object]
OBJECTS = list({id(n.value): n for n in reversed(API)}.values())[::-1]  # each object once, first export


def test_the_public_names_are_found():
    paths = {n.path for n in NAMES}
    assert {"meshfit.Model", "meshfit.callbacks.BackupAndRestore", "meshfit.train.CheckpointManager",
            "meshfit.estimator.Estimator", "meshfit.dtensor.LayoutMap"} <= paths
    assert len(API) >= 140


@pytest.mark.parametrize("name", API, ids=lambda n: n.path)
def test_public_home(name):
    value = name.value
    home = value.__module__
    assert not _export.is_private_module(home), (
        f"{name.path} reports the private module {home!r}: end {name.package}/__init__.py with "
        f"`_publish(__name__)` (from meshfit._export import publish as _publish)")
    exporters = {n.package for n in NAMES if n.value is value}
    assert home in exporters, f"{name.path}: home {home!r} is none of the packages exporting it {exporters}"
    # pickle finds it again through its home, under its own name
    found = importlib.import_module(home)
    for part in value.__qualname__.split("."):
        found = getattr(found, part)
    assert found is value


@pytest.mark.parametrize("name", OBJECTS, ids=lambda n: n.path)
def test_public_example(name):
    assert reference.example_for(name, KEPT) is not None, (
        f"{name.path} has no example: add a `>>>` example to its docstring, or a `## "
        f"{name.value.__qualname__}` section with a ```pycon block to docs/api_examples/{name.home}.md")


KEPT = reference.kept_examples()


def test_kept_examples_name_existing_objects():
    homes = {f"{n.home}.{n.value.__qualname__}" for n in API}
    stale = sorted(set(KEPT) - homes)
    assert not stale, f"docs/api_examples has examples for names that are not public homes: {stale}"


def test_methods_and_properties_share_the_home():
    assert mf.Model.__module__ == "meshfit"
    assert mf.Model.fit.__module__ == "meshfit"
    assert mf.MirroredStrategy.__module__ == "meshfit.distribute"
    assert mf.MirroredStrategy is mf.distribute.MirroredStrategy
    assert mf.callbacks.BackupAndRestore.__module__ == "meshfit.callbacks"
    assert mf.train.Checkpoint.__module__ == "meshfit.train"
    # inherited torch / stdlib members are left alone
    assert mf.nn.SyncBatchNorm.train.__module__.startswith("torch.")
    # an unbound method pickles by reference through the class's home
    assert pickle.loads(pickle.dumps(mf.Model.fit)) is mf.Model.fit


def test_help_and_tracebacks_show_the_public_path():
    assert "in module meshfit.callbacks" in pydoc.render_doc(mf.callbacks.EarlyStopping)
    assert repr(mf.Model) == "<class 'meshfit.Model'>"
    line = traceback.format_exception_only(mf.PeerFailureError, mf.PeerFailureError("worker 1 died"))[-1]
    assert line.startswith("meshfit.distribute.PeerFailureError: worker 1 died")


def test_pickle_and_torch_save_round_trip():
    values = {"enum": mf.ReduceOp.SUM, "shard": mf.data.AutoShardPolicy.DATA,
              "options": mf.CommunicationOptions(timeout_seconds=12.0),
              "loss": mf.losses.Huber(delta=2.0), "error": mf.PeerFailureError("gone"),
              "policy": mf.mixed_precision.Policy("mixed_bfloat16"), "class": mf.callbacks.History,
              "function": mf.losses.get}
    again = pickle.loads(pickle.dumps(values))
    assert again["enum"] is mf.ReduceOp.SUM and again["shard"] is mf.data.AutoShardPolicy.DATA
    assert again["options"] == values["options"]
    assert again["loss"].get_config() == values["loss"].get_config()
    assert type(again["error"]) is mf.PeerFailureError and str(again["error"]) == "gone"
    assert again["policy"].name == "mixed_bfloat16"
    assert again["class"] is mf.callbacks.History and again["function"] is mf.losses.get
    buffer = io.BytesIO()
    torch.save(values, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded["options"] == values["options"] and loaded["enum"] is mf.ReduceOp.SUM


def _round_trip_in_child(value: object) -> str:
    return repr(value)


@pytest.mark.slow  # starts processes
def test_spawned_processes_unpickle_meshfit_objects():
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        # the child imports meshfit through the public homes to unpickle both the value and the function
        future = pool.submit(repr, (mf.ReduceOp.MEAN, mf.CommunicationOptions(timeout_seconds=7.0)))
        got = future.result(timeout=120)
        assert "ReduceOp.MEAN" in got and "timeout_seconds=7.0" in got
        assert pool.submit(mf.losses.get, "mse").result(timeout=120).get_config()["name"] == \
            "mean_squared_error"


def test_dataclass_protocol_and_enum_machinery():
    options = mf.CommunicationOptions(timeout_seconds=3.0)
    assert dataclasses.is_dataclass(options)
    assert dataclasses.replace(options, timeout_seconds=4.0).timeout_seconds == 4.0
    assert {f.name for f in dataclasses.fields(options)} >= {"timeout_seconds"}
    assert mf.ReduceOp["SUM"] is mf.ReduceOp.SUM and list(mf.data.AutoShardPolicy)[0].name == "AUTO"
    assert mf.distribute.GradientSync._is_protocol and mf.train.CheckpointStore._is_protocol

    class Sync(mf.distribute.GradientSync):  # an explicit implementation of a re-homed Protocol
        def in_step(self) -> bool:
            return True

    assert Sync().in_step() and Sync.__mro__[1] is mf.distribute.GradientSync


@pytest.mark.parametrize("name", [n for n in OBJECTS if isinstance(n.value, type)], ids=lambda n: n.path)
def test_type_hints_still_evaluate(name):
    typing.get_type_hints(name.value)  # evaluated in the defining module, kept on the class


def test_publish_refuses_an_alias_that_pickle_cannot_find(monkeypatch):
    def helper() -> None:
        """A private function."""

    helper.__module__ = "meshfit._probe"
    helper.__qualname__ = "helper"
    package = types.ModuleType("meshfit.probe")
    package.__all__ = ["renamed"]
    package.renamed = helper
    monkeypatch.setitem(sys.modules, "meshfit.probe", package)
    with pytest.raises(ValueError, match=r"Invalid public name `meshfit.probe.renamed`.*export it as `helper`"):
        _export.publish("meshfit.probe")
    package.__all__ = ["helper"]
    package.helper = helper
    _export.publish("meshfit.probe")
    assert helper.__module__ == "meshfit.probe"
