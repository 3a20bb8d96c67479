"""Doctest over meshfit's modules with public homes: each docstring runs in the module that defines it.

``doctest.testmod`` decides where an object belongs by ``__module__``; meshfit re-homes public classes
and functions to their public package (`meshfit._export`), so plain ``testmod`` would run their
examples with the public package's globals (not the defining module's) and skip their methods. This
finder asks where each object is defined instead: every docstring example runs exactly once, with the
globals of the file it is written in, as before the re-homing.
"""

from __future__ import annotations

import doctest
import inspect
import types

from meshfit import _export

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


class DefiningModuleFinder(doctest.DocTestFinder):
    def _from_module(self, module: types.ModuleType | None, object: object) -> bool:  # noqa: A002 - doctest's name
        if module is None:
            return True
        defined = _export.defined_in(object)
        if defined is not None:
            return module.__name__ == defined
        if inspect.isfunction(object):  # a method of a re-homed class: where its code is
            return module.__dict__ is inspect.unwrap(object).__globals__
        return super()._from_module(module, object)  # type: ignore[misc]


def run_module_doctests(module: types.ModuleType) -> doctest.TestResults:
    """``doctest.testmod(module)`` with the defining-module rule above."""
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in DefiningModuleFinder().find(module, module.__name__):
        runner.run(test)
    return runner.summarize(verbose=False)
