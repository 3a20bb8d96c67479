"""Public homes: each public class and function reports the module users import it from.

meshfit defines its names in private modules (``meshfit.callbacks._backup_and_restore``) and re-exports
them from public packages (``meshfit.callbacks``). Without help, ``__module__`` names the private module,
so ``help()``, ``repr``, tracebacks and a generated reference show paths nobody can rely on. Each public
package ends with ``publish(__name__)``: every class and function in its ``__all__`` that still reports
a private meshfit module is re-homed to that package, as Keras's export decorator does. The first public
package to publish a name is its home (``meshfit.distribute.MirroredStrategy``; ``meshfit.MirroredStrategy``
is the same object, re-exported), because a package imports its subpackages before it publishes.

Pickling by reference keeps working: the home re-exports the object under its own name, and
``publish`` refuses a name that is not bound under its ``__qualname__`` there. The methods, properties,
static and class methods a class defines get the same home, so doctest and ``pickle`` of an unbound
method find them through the class. ``typing.get_type_hints`` evaluates a class's string annotations in
the module ``__module__`` names, so a class's own annotations are evaluated in its defining module
first (where that works) and stored as objects: dataclasses, Protocols and enums keep their behaviour.
One thing does move: ``inspect.getsource(cls)`` looks for the class in its home's file and fails
(the source is in the file ``cls.fit.__code__.co_filename`` names).
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

__all__ = ["defined_in", "is_private_module", "publish"]

# "<home>.<qualname>" -> the private module that defines it (doctest and the docs look there for
# the definition's globals and source).
_DEFINED_IN: dict[str, str] = {}


def defined_in(value: Any) -> str | None:
    """The private module that defines a re-homed class or function, else None."""
    return _DEFINED_IN.get(f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}")


def is_private_module(module: str) -> bool:
    """True for a module path with a ``_``-prefixed part (``meshfit._engine._model``)."""
    return any(part.startswith("_") for part in module.split("."))


def _rehome_function(function: types.FunctionType, private: str, home: str) -> None:
    if function.__module__ == private:
        function.__module__ = home


def _rehome_members(cls: type, private: str, home: str) -> None:
    for member in vars(cls).values():
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, types.FunctionType):
            _rehome_function(member, private, home)
        elif isinstance(member, property):
            for accessor in (member.fget, member.fset, member.fdel):
                if isinstance(accessor, types.FunctionType):
                    _rehome_function(accessor, private, home)
        elif isinstance(member, type) and member.__module__ == private:
            _resolve_annotations(member)
            _rehome_members(member, private, home)
            member.__module__ = home
            _DEFINED_IN[f"{home}.{member.__qualname__}"] = private


def _resolve_annotations(cls: type) -> None:
    own = vars(cls).get("__annotations__")
    if not own or not any(isinstance(value, str) for value in own.values()):
        return
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that never evaluated (TYPE_CHECKING imports) stays as it was
        return
    cls.__annotations__ = {key: hints.get(key, value) for key, value in own.items()}


def publish(package: str) -> None:
    """Give every class and function in ``package.__all__`` that reports a private meshfit module this home.

    Called once at the end of each public package's ``__init__``. Names bound to other values
    (constants, modules, names loaded lazily through a module ``__getattr__``) are left alone.

    Raises:
        ValueError: a public class or function is exported under a name other than its own
            (``from ._x import Foo as Bar``): pickle looks objects up by ``__qualname__``, so such an
            alias cannot be its home. Export it under its own name, or define it under the public one.
    """
    module = sys.modules[package]
    namespace = vars(module)
    for name in namespace.get("__all__", ()):
        value: Any = namespace.get(name)
        if not isinstance(value, (type, types.FunctionType)):
            continue
        private = value.__module__
        if not (private.startswith("meshfit.") and is_private_module(private)):
            continue
        if value.__qualname__ != name:
            raise ValueError(f"Invalid public name `{package}.{name}`: expected the object's own name, "
                             f"received {value.__qualname__!r} from {private}. pickle finds objects by "
                             f"`__qualname__`: export it as `{value.__qualname__}` or rename its definition.")
        if isinstance(value, type):
            _resolve_annotations(value)
            _rehome_members(value, private, package)
        value.__module__ = package
        _DEFINED_IN[f"{package}.{value.__qualname__}"] = private
