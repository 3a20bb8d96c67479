"""Every collective names its group: the `World` owns the mesh and the groups, and nothing else talks to
torch's default group implicitly (read from the sources, single-process)."""

from __future__ import annotations

import ast
import os

import pytest

MESHFIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "meshfit")
WORLD_MODULE = os.path.join("distribute", "_world.py")

# torch.distributed's collectives (and point-to-point calls): each must say `group=`.
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "all_gather_coalesced", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "send_object_list", "recv_object_list",
})
# Calls only the World makes: they create groups or meshes, or read the default group.
WORLD_ONLY = frozenset({"new_group", "new_subgroups", "init_device_mesh", "_get_default_store"})
# Read the default group when called without one.
DEFAULT_GROUP_QUERIES = frozenset({"get_rank", "get_world_size", "get_backend"})


def _torch_distributed_names(tree: ast.AST) -> dict[str, str]:
    """Local names bound to ``torch.distributed`` modules or functions, with what they are bound to."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch.distributed") and alias.asname:
                    names[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.distributed"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """The full dotted name a call's target stands for (``dist.all_reduce`` -> ``torch.distributed.all_reduce``)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = names.get(node.id, node.id)
    return ".".join([head, *reversed(parts)])


def default_group_calls(source: str) -> list[str]:
    """``line: call`` for each call in ``source`` that talks to torch's default group implicitly."""
    tree = ast.parse(source)
    names = _torch_distributed_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _dotted(node.func, names)
        if target is None or not target.startswith("torch.distributed"):
            continue
        leaf = target.rpartition(".")[2]
        keywords = {k.arg for k in node.keywords}
        bad = (leaf in COLLECTIVES and "group" not in keywords) or leaf in WORLD_ONLY \
            or (leaf in DEFAULT_GROUP_QUERIES and not node.args and "group" not in keywords)
        if target.startswith("torch.distributed.checkpoint") and leaf in ("save", "load", "async_save"):
            bad = not keywords & {"process_group", "no_dist"}
        if leaf == "DistributedDataParallel":
            bad = "process_group" not in keywords
        if bad:
            found.append(f"{node.lineno}: {target}")
    return found


def _sources() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(MESHFIT):
        for file in files:
            path = os.path.join(folder, file)
            if file.endswith(".py") and os.path.relpath(path, MESHFIT) != WORLD_MODULE:
                found[os.path.relpath(path, MESHFIT)] = open(path).read()
    return found


def _ddp_calls(source: str) -> list[str]:
    tree = ast.parse(source)
    names = _torch_distributed_names(tree)
    names.update({a.asname or a.name: f"torch.nn.parallel.{a.name}" for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module == "torch.nn.parallel" for a in n.names})
    return [f"{n.lineno}: DistributedDataParallel" for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (_dotted(n.func, names) or "").endswith("DistributedDataParallel")
            and "process_group" not in {k.arg for k in n.keywords}]


def test_no_collective_outside_the_world_runs_on_the_default_group_implicitly():
    offenders = {path: calls for path, source in _sources().items()
                 if (calls := default_group_calls(source) + _ddp_calls(source))}
    assert not offenders, ("these call torch.distributed without naming a group; run them through the World "
                           f"(its control group, its data group or a mesh axis's group): {offenders}")


@pytest.mark.parametrize(("source", "flagged"), [
    ("import torch.distributed as dist\ndist.all_reduce(t)\n", True),
    ("import torch.distributed as dist\ndist.all_reduce(t, group=world.group())\n", False),
    ("import torch.distributed as dist\ndist.barrier()\n", True),
    ("import torch.distributed as dist\ndist.broadcast(t, src=0)\n", True),
    ("import torch.distributed as dist\nn = dist.get_world_size()\n", True),
    ("import torch.distributed as dist\nn = dist.get_world_size(group)\n", False),
    ("import torch\ntorch.distributed.all_gather_object(out, x)\n", True),
    ("from torch.distributed import all_gather_object\nall_gather_object(out, x)\n", True),
    ("from torch.distributed.nn.functional import all_reduce\nall_reduce(x)\n", True),
    ("import torch.distributed as dist\ng = dist.new_group(backend='gloo')\n", True),
    ("from torch.distributed.device_mesh import init_device_mesh\ninit_device_mesh('cpu', (2,))\n", True),
    ("import torch.distributed.checkpoint as dcp\ndcp.save(state, storage_writer=w)\n", True),
    ("import torch.distributed.checkpoint as dcp\ndcp.load(state, storage_reader=r, no_dist=True)\n", False),
    ("world.all_reduce(t)\n", False),
])
def test_the_source_check_finds_default_group_calls(source, flagged):
    assert bool(default_group_calls(source)) is flagged


def test_the_source_check_finds_a_data_parallel_wrapper_without_its_group():
    assert _ddp_calls("from torch.nn.parallel import DistributedDataParallel\nDistributedDataParallel(m)\n")
    assert not _ddp_calls("from torch.nn.parallel import DistributedDataParallel\n"
                          "DistributedDataParallel(m, process_group=world.group())\n")
