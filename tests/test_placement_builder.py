"""Only the plan builds a placement: no meshfit module but the builder constructs a ``Placement`` or a
``PlacementPlan`` (read from the sources, single-process), as ``tests/test_world_groups.py`` makes every
collective name its group.

A strategy says what it places and asks ``meshfit.distribute._plan_builder`` for the placement; a second
place that builds one is where the next parallelism would be added as a branch instead of a transform.
"""

from __future__ import annotations

import ast
import os

import pytest

MESHFIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "meshfit")
CONSTRUCTORS = frozenset({"Placement", "PlacementPlan"})
ALLOWED = {
    os.path.join("distribute", "_plan_builder.py"),  # the builder
    os.path.join("distribute", "_placement.py"),  # the classes themselves (PlacementPlan.apply)
}


def placement_constructions(source: str) -> list[str]:
    """``line: name`` for each call in ``source`` that constructs a placement or a plan."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in CONSTRUCTORS:
                found.append(f"{node.lineno}: {name}(...)")
    return found


def _sources() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(MESHFIT):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    found[os.path.relpath(path, MESHFIT)] = f.read()
    return found


SOURCES = _sources()


def test_only_the_plan_builder_constructs_placements():
    offenders = [f"meshfit/{rel}:{call}" for rel, source in sorted(SOURCES.items()) if rel not in ALLOWED
                 for call in placement_constructions(source)]
    assert not offenders, ("placements built outside meshfit/distribute/_plan_builder.py (ask the builder: "
                           "place_replicated, place_data_parallel, place_laid_out, place_sharded, place_staged):\n"
                           + "\n".join(offenders))


def test_the_builder_is_where_placements_are_built():
    """The rule above is not vacuous: the builder does construct the plans, and the allowed list names files."""
    assert placement_constructions(SOURCES[os.path.join("distribute", "_plan_builder.py")])
    assert ALLOWED <= set(SOURCES), sorted(ALLOWED - set(SOURCES))


@pytest.mark.parametrize("source, expected", [
    ("Placement(module, source, sync)", ["1: Placement(...)"]),
    ("from meshfit import distribute\nx = distribute.PlacementPlan([], sync).apply(m)", ["2: PlacementPlan(...)"]),
    ("def f():\n    return Placement(\n        m, m, s)", ["2: Placement(...)"]),
    ("placement = strategy.setup_module(module)\nPlacementLike", []),
])
def test_the_reader_finds_constructions(source, expected):
    assert placement_constructions(source) == expected
