"""A griffe extension: meshfit's docstrings head their doctests ``Example:``; griffe's Google parser
knows ``Examples:`` as the section that renders ``>>>`` lines as code (``Example:`` would be an
admonition of Markdown text). Renamed before parsing, in the reference only."""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
