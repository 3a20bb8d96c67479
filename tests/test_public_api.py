"""Every public name imports; importing meshfit has no side effects; doctests in public modules run."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import meshfit
from tests._doctest_homes import run_module_doctests


def _public_packages() -> list[str]:
    """``meshfit`` and every package under it whose path has no ``_``-prefixed part."""
    root = os.path.dirname(meshfit.__file__)
    found = ["meshfit"]
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("_"))
        if folder != root and "__init__.py" in files:
            found.append("meshfit." + os.path.relpath(folder, root).replace(os.sep, "."))
    return found


PACKAGES = _public_packages()


def test_the_public_packages_are_found():
    assert {"meshfit.callbacks", "meshfit.data", "meshfit.distribute", "meshfit.train", "meshfit.utils",
            "meshfit.optimizers.schedules"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_all_imports(package):
    module = importlib.import_module(package)
    assert module.__all__, package
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)  # noqa: S102 - the star import is what is tested
    missing = set(module.__all__) - set(namespace)
    assert not missing, f"`from {package} import *` misses {sorted(missing)}"


def test_spec_names_exist():
    for name in ["Model", "load_model", "get_strategy", "OneDeviceStrategy", "MirroredStrategy",
                 "MultiWorkerMirroredStrategy", "CommunicationOptions", "CommunicationImplementation",
                 "InputContext"]:
        assert hasattr(meshfit, name), name
    for attr in ["AUTO", "RING", "NCCL"]:
        assert hasattr(meshfit.CommunicationImplementation, attr)
    for attr in ["AUTO", "FILE", "DATA", "OFF"]:
        assert hasattr(meshfit.data.AutoShardPolicy, attr)
    assert meshfit.get_strategy().num_replicas_in_sync == 1


def test_import_has_no_side_effects():
    code = ("import os, logging; before = dict(os.environ); import meshfit, torch.distributed as d; meshfit.Model; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "assert not d.is_initialized(); assert not logging.getLogger().handlers; import sys; "
            # heavy imports stay lazy (torchmetrics alone pulls in matplotlib.pyplot)
            "heavy = {'torchmetrics', 'matplotlib.pyplot', 'torch.distributed.checkpoint'} & set(sys.modules); "
            "assert not heavy, heavy; print('clean')")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


def _modules_with_examples() -> list[str]:
    root = os.path.dirname(meshfit.__file__)
    names = []
    for folder, _, files in os.walk(root):
        for file in files:
            if file.endswith(".py") and file not in ("_demo.py", "__main__.py"):
                rel = os.path.relpath(os.path.join(folder, file), os.path.dirname(root))
                names.append(rel[:-3].replace(os.sep, ".").removesuffix(".__init__"))
    return sorted(names)


@pytest.mark.parametrize("module_name", _modules_with_examples())
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    result = run_module_doctests(module)  # testmod, each docstring in its defining module (public homes)
    assert result.failed == 0, module_name
