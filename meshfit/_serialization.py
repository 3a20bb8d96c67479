"""Keras-style ``{"class_name": ..., "config": ...}`` descriptions of built-in objects (no pickle)."""

from __future__ import annotations

from typing import Any


def describe(obj: Any, classes: dict[str, Any]) -> dict[str, Any] | None:
    """``obj`` as a JSON-able dict, or ``None`` when it is not one of the built-in ``classes``."""
    if classes.get(type(obj).__name__) is not type(obj):
        return None
    config: dict[str, Any] = obj.get_config()
    return {"class_name": type(obj).__name__, "config": config}


def rebuild(config: Any, classes: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> Any:
    """The object ``describe`` described; ``custom_objects`` adds classes by name."""
    known = {**classes, **(custom_objects or {})}
    if not isinstance(config, dict) or "class_name" not in config:
        raise ValueError(
            f"Invalid `config`: expected {{'class_name': ..., 'config': ...}}, received config={config!r}."
        )
    cls = known.get(config["class_name"])
    if cls is None:
        raise ValueError(
            f"Invalid `class_name`: expected one of {sorted(known)}, received class_name={config['class_name']!r}."
        )
    return cls.from_config(dict(config.get("config") or {}))
